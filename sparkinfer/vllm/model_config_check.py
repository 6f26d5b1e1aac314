"""Start-up checks of patched vLLM: every refusal the configuration decides, in one place.
``startup_problems`` (patch 0002): sparkinfer's settings, the heads and the DCP group against TP,
the record format against the model, and the GLM-5.2 config keys vLLM 0.32.0 would misread;
patched vLLM raises them when it builds the engine's config (``check_at_startup``).
``backend_problem``: an attention backend named that cannot read a record format (the workers
refuse it when they build the model's attention). ``worker_problems`` (patch 0008, ``engine_start``): CUDA graphs that would replay a sparkinfer
op wrongly and a fabric that cannot reach the caches; each worker raises them once its KV caches exist.
``sparkinfer serve`` prints both lists before it runs vLLM, so a dry run fails on exactly what
vLLM would refuse (``profile_graphs``: the graphs vLLM resolves from a profile).

vLLM 0.32.0 serves ``model_type: glm_moe_dsa`` with its DeepSeek-V2/V3.2 model code, which reads
some keys with ``getattr(config, key, default)``. transformers' ``GlmMoeDsaConfig`` does not define
these keys (so a checkpoint saved by ``GlmMoeDsaForCausalLM`` lacks them) and its model hard-codes
their meaning, so vLLM falls back to DeepSeek defaults that contradict the model and serves
garbage without a warning. ``glm_config_problems`` lists each such key, comparing what vLLM would
do with what transformers' model does:

  key                          vLLM when missing               GLM-MoE-DSA (transformers)
  scoring_func                 softmax routing                 sigmoid routing
  topk_method                  no e_score_correction_bias      bias-corrected group top-k (noaux_tc)
  indexer_rope_interleave      NeoX (half-split) indexer RoPE  interleaved indexer RoPE
  index_topk_pattern           IndexShare from index_topk_freq/index_skip_topk_offset
                                                               IndexShare from indexer_types
  first_k_dense_replace /      MoE layers: i >= first_k_dense_replace and i % moe_layer_freq == 0
    moe_layer_freq                                             MoE layers: mlp_layer_types
  rope_parameters.rope_type    any non-default type -> DeepSeek YaRN
                                                               the named type
  attention_bias               no biases (checkpoint's dropped) q_a/kv_a/o_proj biases
  llama_4_scaling              applied when present            never applied

Keys transformers' config defines (routed_scaling_factor, norm_topk_prob, n_group, topk_group,
index_topk, ...) reach vLLM with transformers' values, so vLLM reads them right; the main
attention's RoPE is interleaved in both. The check runs on ``hf_config.to_dict()`` (what vLLM
reads); for a raw config.json dict the transformers defaults it needs are filled in here.

Errors are ``SparkinferConfigError``: patched ``vllm serve`` prints the message alone and exits 2.
Torch-free (imported by patched vLLM at start-up).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from sparkinfer import config as sparkinfer_config
from sparkinfer.config import SparkinferConfigError
from sparkinfer.vllm.cache_dtypes import is_sparkinfer_cache_dtype

MODEL_TYPE = "glm_moe_dsa"
# transformers' GlmMoeDsaConfig defaults for the fields used below (a raw config.json may omit them).
_HF_DEFAULTS = {"num_hidden_layers": 78, "first_k_dense_replace": 3, "n_routed_experts": 256}
_VLLM_ROPE_TYPES = ("default", "yarn")  # vLLM turns every other non-default type into DeepSeek YaRN


def _hf_indexer_types(cfg: Mapping, layers: int) -> list:
    """``indexer_types`` as transformers' GlmMoeDsaConfig derives it (its ``__post_init__``)."""
    if cfg.get("indexer_types") is not None:
        return list(cfg["indexer_types"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) \
            else list(pattern)
    freq = max(cfg.get("index_topk_freq", 1), 1)
    offset = cfg.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def _vllm_shared(cfg: Mapping, layers: int) -> list[bool]:
    """Which layers vLLM 0.32.0 builds without an indexer (deepseek_v2.py / deepseek_v32/attention.py)."""
    pattern = cfg.get("index_topk_pattern")
    if pattern is None:
        freq, offset = cfg.get("index_topk_freq", 1), cfg.get("index_skip_topk_offset", 2)
        return [max(i - offset + 1, 0) % freq != 0 for i in range(layers)]
    return [i < len(pattern) and pattern[i] == "S" for i in range(layers)]


def _index_share_problems(cfg: Mapping, layers: int) -> list[str]:
    if not isinstance(layers, int) or layers < 1:
        return [f"num_hidden_layers is {layers!r}: expected a positive integer"]
    hf_types = _hf_indexer_types(cfg, layers)
    if len(hf_types) != layers or set(hf_types) - {"full", "shared"}:
        return [f"indexer_types {hf_types!r}: expected {layers} entries (num_hidden_layers), each "
                f"'full' or 'shared'"]
    want = "".join("S" if t == "shared" else "F" for t in hf_types)
    fix = f'set "index_topk_pattern": "{want}" (from indexer_types)'
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or set(pattern) - {"F", "S"}:
            return [f"index_topk_pattern {pattern!r}: must be a string of F (Full) and S (Shared); {fix}"]
        if len(pattern) != layers:
            return [f"index_topk_pattern has {len(pattern)} characters but num_hidden_layers is {layers} "
                    f"(vLLM runs the indexer on every layer past the pattern); {fix}"]
    if want[0] != "F":
        return [f"indexer_types starts with 'shared': layer 0 has no earlier Full layer whose top-k it "
                f"could reuse; the first layer must be 'full'"]
    vllm_shared = _vllm_shared(cfg, layers)
    if vllm_shared != [c == "S" for c in want]:
        got = "".join("S" if s else "F" for s in vllm_shared)
        source = "index_topk_pattern" if pattern is not None else \
            "index_topk_freq / index_skip_topk_offset (index_topk_pattern missing)"
        return [f"IndexShare: vLLM reads {got} from {source} but the model's indexer_types is {want}; {fix}"]
    return []


def _moe_layout_problems(cfg: Mapping, layers: int) -> list[str]:
    first_dense = cfg.get("first_k_dense_replace", _HF_DEFAULTS["first_k_dense_replace"])
    hf_types = cfg.get("mlp_layer_types")
    if hf_types is None:  # transformers derives it from first_k_dense_replace
        hf_types = ["dense"] * min(first_dense, layers) + ["sparse"] * max(layers - first_dense, 0)
    freq = cfg.get("moe_layer_freq", 1)
    routed = cfg.get("n_routed_experts", _HF_DEFAULTS["n_routed_experts"]) is not None
    vllm_moe = [routed and i >= first_dense and i % freq == 0 for i in range(layers)]
    if vllm_moe == [t == "sparse" for t in list(hf_types)[:layers]] and len(hf_types) == layers:
        return []
    k = next((i for i, t in enumerate(hf_types) if t != "dense"), len(hf_types))
    if len(hf_types) == layers and all(t == "sparse" for t in hf_types[k:]):
        fix = f'set "first_k_dense_replace": {k}' + (' and remove "moe_layer_freq"' if freq != 1 else "")
    else:
        fix = "vLLM 0.32.0 places MoE layers only as 'first k dense, then all sparse'; it cannot serve this layout"
    return [f"mlp_layer_types {list(hf_types)!r} disagree with what vLLM builds from first_k_dense_replace="
            f"{first_dense}, moe_layer_freq={freq}; {fix}"]


def glm_config_problems(cfg: Mapping) -> list[str]:
    """Each GLM-MoE-DSA config key that vLLM 0.32.0 would read differently from transformers' model,
    naming the key and the value to set; empty when vLLM serves the model transformers defines."""
    problems = []
    expect = {
        "scoring_func": ("sigmoid", "vLLM's default is softmax expert routing; GLM-MoE-DSA routes with sigmoid"),
        "topk_method": ("noaux_tc", "without it vLLM drops e_score_correction_bias from expert routing"),
        "indexer_rope_interleave": (True, "vLLM's default is half-split (NeoX) indexer RoPE; GLM-MoE-DSA's "
                                          "indexer RoPE is interleaved"),
    }
    for key, (value, why) in expect.items():
        if key not in cfg or cfg[key] != value:
            have = "missing" if key not in cfg else f"is {cfg[key]!r}"
            problems.append(f"{key} {have} ({why}): set \"{key}\": {_json(value)}")
    layers = cfg.get("num_hidden_layers", _HF_DEFAULTS["num_hidden_layers"])
    problems += _index_share_problems(cfg, layers)
    problems += _moe_layout_problems(cfg, layers)
    rope_type = (cfg.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type not in _VLLM_ROPE_TYPES:
        problems.append(f"rope_parameters.rope_type is {rope_type!r}: vLLM 0.32.0 serves every non-default "
                        f"RoPE type of this model as DeepSeek YaRN; use 'default' or 'yarn'")
    if cfg.get("attention_bias"):
        problems.append("attention_bias is true: vLLM 0.32.0 builds this model's attention without biases "
                        "and drops the checkpoint's; it cannot serve it")
    if cfg.get("llama_4_scaling") is not None:
        problems.append("llama_4_scaling is set: vLLM applies it, GLM-MoE-DSA never does; remove it")
    return problems


def _json(value) -> str:
    return "true" if value is True else f'"{value}"'


def check_hf_config(hf_config) -> None:
    """Refuse a ``glm_moe_dsa`` config vLLM would misread; any other model type is not looked at."""
    if getattr(hf_config, "model_type", None) != MODEL_TYPE:
        return
    problems = glm_config_problems(hf_config.to_dict())
    if problems:
        raise SparkinferConfigError(
            f"config.json of this {MODEL_TYPE} (GLM-5.2) model would be misread by vLLM 0.32.0 "
            f"(see README, 'GLM-5.2 config.json'): " + "; ".join(problems))


def uses_mla(cfg: Mapping) -> bool:
    """vLLM's ``ModelConfig.use_mla`` read off a config.json of the DeepSeek-MLA family it serves
    (DeepSeek-V2/V3/V3.2, GLM-MoE-DSA): the model has a latent (``kv_lora_rank``)."""
    return cfg.get("kv_lora_rank") is not None


def startup_problems(cli: Mapping[str, object], environ: Mapping[str, str], hf_config: Mapping, *,
                     use_mla: bool, cache_dtype: str, tensor_parallel_size: int,
                     decode_context_parallel_size: int) -> list[str]:
    """Every reason patched vLLM refuses an engine at start-up that its arguments and the model's
    config already decide, one line each; empty when it starts. Patched vLLM raises them together
    (``check_at_startup``, patch 0002); ``sparkinfer serve`` prints them before running vLLM.

    * the sparkinfer settings (``sparkinfer.config.resolve``: CLI over ``VLLM_SPARKINFER_*`` in
      ``environ``; an unknown variable or a bad value names itself);
    * the attention heads and the DCP group against the tensor-parallel size (vLLM's own refusals,
      ``ModelConfig.verify_with_parallel_config`` and ``ParallelConfig``, stated here so both
      callers name them alike);
    * a sparkinfer record format for a model without MLA;
    * a GLM-5.2 config.json vLLM 0.32.0 would misread (``glm_config_problems``).

    ``hf_config``: the model's config as a dict (``hf_config.to_dict()`` in vLLM, config.json in
    serve); ``use_mla`` is vLLM's ``ModelConfig.use_mla`` (``uses_mla`` for a config.json).
    """
    problems = []
    try:
        sparkinfer_config.resolve(cli, environ)
    except ValueError as e:  # resolve reports bad settings as ValueErrors naming them
        problems.append(str(e))
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    heads = hf_config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        problems.append(f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads "
                        f"(num_attention_heads)")
    if tp % dcp:
        problems.append(f"decode_context_parallel_size {dcp} must divide tensor_parallel_size {tp} "
                        f"(DCP ranks are TP ranks)")
    if is_sparkinfer_cache_dtype(cache_dtype) and not use_mla:
        problems.append(f"--kv-cache-dtype {cache_dtype}: a sparkinfer record format holds MLA latent records and "
                        f"this model does not use MLA; use --kv-cache-dtype auto (or fp8) for it")
    if hf_config.get("model_type") == MODEL_TYPE:
        problems += [f"{MODEL_TYPE} config.json, misread by vLLM 0.32.0 (README, 'GLM-5.2 config.json'): {p}"
                     for p in glm_config_problems(hf_config)]
    return problems


def check_at_startup(cli: Mapping[str, object], model_config, cache_dtype: str, parallel_config):
    """What patched ``EngineArgs.create_engine_config`` checks once (``startup_problems`` over the
    engine's arguments and ``os.environ``): one ``SparkinferConfigError`` listing every problem.
    Returns the resolved ``SparkinferConfig``."""
    problems = startup_problems(cli, os.environ, model_config.hf_config.to_dict(), use_mla=model_config.use_mla,
                                cache_dtype=cache_dtype,
                                tensor_parallel_size=parallel_config.tensor_parallel_size,
                                decode_context_parallel_size=parallel_config.decode_context_parallel_size)
    if problems:
        raise SparkinferConfigError("; ".join(problems))
    return sparkinfer_config.resolve(cli)


# --- the worker's model (patch 0001, ``cache_dtypes.check_backend_reads``): the attention backend ------

def backend_problem(backend: str | None, cache_dtype: str) -> str | None:
    """Why an attention backend named in the engine's arguments (``attention_backend``, or
    ``attention_config.backend``; None or "auto": vLLM chooses) cannot read ``cache_dtype``: a
    sparkinfer record format is read by sparkinfer's backend alone (``platforms.BACKEND_NAME``;
    vLLM refuses any other when it builds the model's attention, by its own validation or
    ``check_backend_reads``); None if it can."""
    from sparkinfer.vllm.platforms import BACKEND_NAME

    if backend is None or str(backend).lower() == "auto" or not is_sparkinfer_cache_dtype(cache_dtype):
        return None
    if str(backend).upper() == BACKEND_NAME:
        return None
    return (f"kv_cache_dtype={cache_dtype!r} is a sparkinfer record format, but the attention backend {backend} "
            f"named cannot read it (only {BACKEND_NAME} reads these records); leave the attention backend to vLLM "
            f"or use another kv_cache_dtype")


# --- the worker's start-up (patch 0008, ``engine_start.start``): CUDA graphs and the fabric --------

# the ops that must run outside captured graphs (vLLM's names)
SPARKINFER_OPS = ("vllm::unified_mla_attention_with_output", "vllm::sparse_attn_indexer")
KV_UPDATE_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update")
# what vLLM 0.32.0's default ``splitting_ops`` (``set_splitting_ops_for_v1``) holds of the ops read here
VLLM_DEFAULT_SPLITS = (*SPARKINFER_OPS, *KV_UPDATE_OPS)
DEFAULT_GRAPH_MODE = "FULL_AND_PIECEWISE"  # vLLM 0.32.0's cudagraph_mode when none is set


FULL_DECODE_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")  # FULL graphs of uniform decode batches only
PIECEWISE_MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")  # piecewise graphs around the split-out ops


@dataclass(frozen=True)
class Graphs:
    """An engine's CUDA-graph settings as vLLM resolved them, what ``graph_problem`` reads:
    ``mode`` (a ``CUDAGraphMode`` name), ``splitting_ops`` (None: vLLM's default), ``compiled``
    (compilation mode ``VLLM_COMPILE``), ``kv_update_split`` (the KV-cache update is split out:
    ``CompilationConfig.splitting_ops_contain_kv_cache_update``), ``breakable`` (vLLM's breakable
    CUDA graph, ``VLLM_USE_BREAKABLE_CUDAGRAPH=1``), the sparkinfer builders' ``parts`` the engine's
    steps run (``engine_parts``). Not the capture sizes: vLLM pads a decode batch into the next
    captured size, and the builders plan its padding (``step_plan.batch_rows``), so any sizes do."""

    mode: str
    splitting_ops: tuple[str, ...] | None
    compiled: bool
    kv_update_split: bool
    breakable: bool = False
    parts: tuple[str, ...] = ("attention",)


def engine_parts(vllm_config) -> tuple[str, ...]:
    """The sparkinfer builders' parts (``graph_paths.PARTS``) an engine's steps run whose attention is
    sparkinfer's: the attention, and the indexer where sparkinfer serves it (``serves_replicated_indexer``;
    elsewhere vLLM's own indexer runs)."""
    from sparkinfer.vllm.indexer_layout import serves_replicated_indexer

    return ("attention", "indexer") if serves_replicated_indexer(vllm_config) else ("attention",)


def graph_problem(g: Graphs) -> str | None:
    """Why graphs ``g`` would replay a sparkinfer op wrongly; None if they would not. FULL graphs of
    uniform decode batches (``FULL_DECODE_MODES``) are refused exactly while a part the engine runs is
    not replay-safe (``graph_paths.NOT_REPLAY_SAFE``, the reason given), whatever the capture sizes: a
    decode batch vLLM pads into a larger graph is planned with its padding (``step_plan.batch_rows``);
    piecewise graphs while they leave a sparkinfer op inside a piece."""
    from sparkinfer.decode.graph_paths import unsafe

    if g.mode == "NONE":
        return None
    if g.breakable:
        return ("the breakable CUDA graph (VLLM_USE_BREAKABLE_CUDAGRAPH=1) captures the sparkinfer ops between its "
                "break points; unset it")
    if g.mode == "FULL":
        return (f"cudagraph_mode {g.mode} captures mixed prefill/decode steps whole; the sparkinfer builders capture "
                "uniform decode batches only (AttentionCGSupport.UNIFORM_BATCH): use FULL_AND_PIECEWISE, "
                "FULL_DECODE_ONLY or PIECEWISE")
    if g.mode in FULL_DECODE_MODES:
        bad = unsafe(g.parts)
        if bad:
            why = "; ".join(f"the {p}: {reason}" for p, reason in bad.items())
            return f"cudagraph_mode {g.mode} replays whole decode steps, and not every part is replay-safe yet ({why}); use PIECEWISE (or NONE)"
    if g.mode not in PIECEWISE_MODES:
        return None
    split = None if g.splitting_ops is None else list(g.splitting_ops)
    missing = [op for op in SPARKINFER_OPS if split is None or op not in split]
    if split is not None and not g.kv_update_split:
        missing.append("vllm::unified_mla_kv_cache_update")
    if g.compiled and missing:
        return (f"cudagraph_mode {g.mode} with splitting_ops {split} leaves {missing} inside captured pieces; "
                "leave splitting_ops unset (vLLM's default splits them out)")
    return None


def profile_graphs(mode: str | None, splitting_ops, *, eager: bool, breakable: bool,
                   parts: tuple[str, ...] = ("attention",)) -> Graphs:
    """The ``Graphs`` vLLM 0.32.0 resolves from ``vllm serve`` settings (``compilation_config``'s
    ``cudagraph_mode`` and ``splitting_ops``, ``enforce_eager``) for an
    engine whose attention is sparkinfer's and whose steps run ``parts`` (``engine_parts``), by vLLM's
    own steps: ``enforce_eager`` turns graphs off; an empty ``splitting_ops`` leaves PIECEWISE nothing
    to capture (NONE) and makes FULL_AND_PIECEWISE FULL (``set_splitting_ops_for_v1``); then
    ``resolve_cudagraph_mode_and_sizes`` with the builders' least support (``graph_paths.support``).
    With ``NEVER`` a FULL decode mode becomes PIECEWISE where attention is split out
    (``splitting_ops`` unset: vLLM splits out every op of its ``_attention_ops``; a list counts only
    if it names them all, which this does not know, so a list counts as not split), else NONE; FULL
    for every step stays FULL, which vLLM and ``graph_problem`` both refuse. With ``UNIFORM_BATCH``
    FULL becomes FULL_AND_PIECEWISE where attention is split out, else FULL_DECODE_ONLY."""
    from sparkinfer.decode.graph_paths import support

    if eager:
        return Graphs("NONE", None if splitting_ops is None else tuple(splitting_ops), False, False, breakable,
                      tuple(parts))
    mode = str(mode or DEFAULT_GRAPH_MODE).upper()
    uniform = all(support(p) == "UNIFORM_BATCH" for p in parts)
    if splitting_ops is None:  # vLLM's default list
        split = VLLM_DEFAULT_SPLITS
        if uniform:
            mode = "FULL_AND_PIECEWISE" if mode == "FULL" else mode
        else:
            mode = "PIECEWISE" if mode in FULL_DECODE_MODES else mode
    else:
        split = tuple(splitting_ops)
        if not split:
            mode = {"PIECEWISE": "NONE", "FULL_AND_PIECEWISE": "FULL"}.get(mode, mode)
        if uniform:
            mode = "FULL_DECODE_ONLY" if mode == "FULL" else mode
        else:
            mode = "NONE" if mode in FULL_DECODE_MODES else mode
    return Graphs(mode, split, True, all(op in split for op in KV_UPDATE_OPS), breakable, tuple(parts))


def breakable_graphs(environ: Mapping[str, str]) -> bool:
    """vLLM's breakable CUDA graph is on (``VLLM_USE_BREAKABLE_CUDAGRAPH``, read as vLLM's envs.py does)."""
    return environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") == "1"


def worker_problems(graphs: Graphs, *, selected: bool, fabric: str, device_type: str) -> list[str]:
    """Every reason patched vLLM's worker refuses to start an engine whose attention is sparkinfer's
    (``engine_start.start``, after the KV caches exist), one line each; empty when it starts:

    * ``graphs`` would replay a sparkinfer op wrongly (``graph_problem``: a part of the step not yet
      replay-safe in a FULL graph, ``graph_paths.NOT_REPLAY_SAFE``, or an op left inside a piece);
    * with the selected path (``selected``: ``replica_budget.selected_path_possible``), a
      ``fabric`` setting that cannot move caches on ``device_type`` (``impls.fabric_problem``)."""
    from sparkinfer.decode.impls import fabric_problem

    problems = []
    why = graph_problem(graphs)
    if why is not None:
        problems.append(f"sparkinfer: {why}")
    why = fabric_problem(fabric, device_type) if selected else None
    if why is not None:
        problems.append(why)
    return problems
