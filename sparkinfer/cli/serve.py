"""``sparkinfer serve``: run ``vllm serve`` from a serve profile, checked against the model first.

A serve profile is a TOML file in ``profiles/serve/`` (``--profile NAME``, or a path to one):

* ``description``, ``kv_gb`` (the KV cache budget per GPU, GiB, that ``max_model_len`` is
  checked against; optional);
* ``[vllm]``: ``vllm serve`` arguments, key = flag without ``--`` (underscores for dashes); a table
  is passed as JSON, ``true`` as a bare flag, ``false`` as ``--no-FLAG``;
* ``[sparkinfer]``: the fields of ``sparkinfer.config`` (passed as ``--sparkinfer-*`` flags);
* ``[env]`` (optional): environment variables set for vLLM.

Before anything runs, the profile is checked against MODEL's ``config.json``. First comes what
patched vLLM refuses at start-up, by the functions it calls there
(``sparkinfer.vllm.model_config_check``): ``startup_problems`` (the sparkinfer settings, attention
heads divisible by TP, DCP dividing TP, a record format only for an MLA model, a GLM-5.2
config.json that vLLM 0.32.0 would misread), then, for a record format, ``backend_problem`` (an
attention backend named that cannot read it) and ``worker_problems`` (CUDA
graphs that would capture a sparkinfer op, as vLLM resolves the profile's graph settings, and a
fabric that cannot reach caches on GPUs). Each problem prints as a ``# FAIL:`` line and serve
exits 2 without running vLLM. Then an IndexShare pattern as long as the layer count, CUDA graphs
covering a full decode step (max_num_seqs x (1 + speculative tokens)), MTP only with a checkpoint
that has the layer, ``max_model_len`` within the model's positions and, with ``kv_gb``, within
what the KV budget holds less the replica store patched vLLM reserves out of it
(``sparkinfer.core.capacity``, what ``sparkinfer plan`` prints; ``sparkinfer.vllm.replica_budget``).
A failure names the field and exits 2.

Importing this module and reading profiles are torch-free (``sparkinfer plan --profile`` does);
the replica check loads the record formats.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

from sparkinfer import config as sc
from sparkinfer.core.capacity import GIB, CapacityPlan, CapacityProfile, capacity_plan
from sparkinfer.core.geometry import ModelGeometry
from sparkinfer.core.layouts import MAIN_LAYOUTS, layout
from sparkinfer.core.topology import IndexSharePattern
from sparkinfer.vllm import model_config_check as startup_check
from sparkinfer.vllm.cache_dtypes import is_record_cache_dtype

# `sparkinfer` hands what follows "--" to run() as args.extra.
PASSTHROUGH = True
HELP = "run `vllm serve` from a serve profile (profiles/serve/), checked against the model's config.json"

TOP_KEYS = ("description", "kv_gb", "vllm", "sparkinfer", "env")
TABLES = ("vllm", "sparkinfer", "env")
# Graph modes that capture full CUDA graphs; unset = vLLM 0.32's default (``DEFAULT_GRAPH_MODE``).
FULL_GRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


class ProfileError(ValueError):
    """A profile (or model) field that vLLM or the model would refuse; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# ----------------------------------------------------------------------------- profiles

def profile_dirs() -> list[Path]:
    """Where ``--profile NAME`` is looked up: the checkout this package runs from (an editable
    install), then ``./profiles/serve`` (the image's working directory)."""
    here = Path(__file__).resolve().parents[2] / "profiles" / "serve"
    cwd = Path.cwd() / "profiles" / "serve"
    return [here] if here == cwd.resolve() else [here, cwd]


def profile_names() -> list[str]:
    return sorted({p.stem for d in profile_dirs() if d.is_dir() for p in d.glob("*.toml")})


def find_profile(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise ProfileError("--profile", f"no profile file {name}")
        return path
    for d in profile_dirs():
        if (d / f"{name}.toml").is_file():
            return d / f"{name}.toml"
    hw = Path(__file__).resolve().parents[1] / "hw_profiles" / f"{name}.json"
    if hw.is_file():
        raise ProfileError("--profile", f"{name!r} is a hardware cost profile (sparkinfer/hw_profiles/); "
                                        f"pass it as --hw {name}")
    raise ProfileError("--profile", f"no serve profile {name!r}; known: {', '.join(profile_names()) or 'none'} "
                                    f"(in {', '.join(str(d) for d in profile_dirs())}) or a path to a .toml file")


def _toml_loads(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def load_profile(name: str) -> dict:
    """The profile's data (plain dict), with its structure checked."""
    path = find_profile(name)
    try:
        data = _toml_loads(path.read_text())
    except ValueError as e:  # tomllib.TOMLDecodeError
        raise ProfileError(str(path), f"not valid TOML: {e}") from None
    check_structure(data)
    return data


def check_structure(data: dict) -> None:
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise ProfileError(unknown[0], f"unknown profile key; a profile has {', '.join(TOP_KEYS)}")
    for t in TABLES:
        if not isinstance(data.setdefault(t, {}), dict):
            raise ProfileError(t, "must be a table")
    if "kv_gb" in data and (isinstance(data["kv_gb"], bool) or not isinstance(data["kv_gb"], (int, float))
                            or data["kv_gb"] <= 0):
        raise ProfileError("kv_gb", f"must be a number of GiB > 0, got {data['kv_gb']!r}")
    for key in data["vllm"]:
        if key.startswith("sparkinfer_"):
            raise ProfileError(f"vllm.{key}", f"set it as sparkinfer.{key[len('sparkinfer_'):]}")
    for key, value in data["env"].items():
        if not isinstance(value, str):
            raise ProfileError(f"env.{key}", f"must be a string, got {value!r}")


def parse_value(text: str):
    """A ``--set`` value: a TOML value (number, bool, quoted string, inline table, array), else the
    text itself as a string (``--set vllm.kv_cache_dtype=nvfp4_432``)."""
    try:
        return _toml_loads(f"v = {text}")["v"]
    except ValueError:
        return text


def apply_set(data: dict, assignment: str) -> None:
    """``KEY=VALUE``: KEY is dotted (``vllm.max_model_len``, ``vllm.compilation_config.cudagraph_mode``,
    ``sparkinfer.mode``, ``kv_gb``); a bare key of one table (``max_model_len``) is looked up there."""
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ProfileError("--set", f"expected KEY=VALUE, got {assignment!r}")
    parts = key.split(".")
    if len(parts) == 1 and parts[0] not in TOP_KEYS:
        owners = [t for t in TABLES if parts[0] in data.get(t, {})]
        if len(owners) != 1:
            raise ProfileError(f"--set {key}", "not a key of this profile; say vllm.KEY, sparkinfer.KEY or env.KEY")
        parts = [owners[0], parts[0]]
    if len(parts) > 1 and parts[0] not in TABLES:
        raise ProfileError(f"--set {key}", f"the first part must be one of {', '.join(TABLES)}")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ProfileError(f"--set {key}", f"{p} is not a table")
    node[parts[-1]] = text if parts[0] == "env" else parse_value(text)


# ----------------------------------------------------------------------------- command line

def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def vllm_args(data: dict) -> list[str]:
    """The profile's ``vllm serve`` arguments, then its ``--sparkinfer-*`` flags."""
    out = []
    for key, value in data["vllm"].items():
        if value is True:
            out.append(_flag(key))
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            out += [_flag(key), json.dumps(value)]
        else:
            out += [_flag(key), str(value)]
    for f, value in data["sparkinfer"].items():
        out += [sc.cli_flag(f), str(value)]
    return out


def check_passthrough(data: dict, extra: list[str]) -> None:
    """Extra vLLM arguments must not restate a profile field: validation would not see them."""
    known = {_flag(k) for k in data["vllm"]} | {"--no-" + k.replace("_", "-") for k in data["vllm"]}
    known |= {sc.cli_flag(f) for f in sc.FIELD_NAMES}
    for a in extra:
        flag = a.split("=", 1)[0]
        if flag in known:
            name = flag[2:].replace("-", "_").removeprefix("no_")
            table = "sparkinfer" if name.startswith("sparkinfer_") else "vllm"
            name = name.removeprefix("sparkinfer_")
            raise ProfileError(flag, f"the profile sets it; use --set {table}.{name}=VALUE so it is checked")


def serve_command(model: str, data: dict, extra: list[str] = ()) -> list[str]:
    return ["vllm", "serve", model, *vllm_args(data), *extra]


# ----------------------------------------------------------------------------- checks

@dataclass
class Checked:
    """What validation found: one line per check passed, one per problem patched vLLM refuses at
    start-up (``model_config_check.startup_problems``), and the capacity plan when ``kv_gb`` is set."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # risks the user should know of, which vLLM accepts
    plan: CapacityPlan | None = None


def _int(data: dict, key: str, default=None):
    value = data["vllm"].get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"vllm.{key}", f"must be an integer, got {value!r}")
    if value < 1:
        raise ProfileError(f"vllm.{key}", f"must be >= 1, got {value}")
    return value


def _table(data: dict, key: str) -> dict:
    value = data["vllm"].get(key) or {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ProfileError(f"vllm.{key}", f"not a table or JSON object: {value!r}") from None
    if not isinstance(value, dict):
        raise ProfileError(f"vllm.{key}", f"must be a table, got {value!r}")
    return value


def speculative_tokens(data: dict) -> int:
    spec = _table(data, "speculative_config")
    k = spec.get("num_speculative_tokens", 0) if spec else 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ProfileError("vllm.speculative_config.num_speculative_tokens", f"must be an integer >= 0, got {k!r}")
    return k


def read_model_config(model: str) -> dict:
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ProfileError("MODEL", f"{model} is not a directory with a config.json; sparkinfer serve checks the "
                                    f"profile against a local checkpoint (download it first)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ProfileError(str(path), f"not valid JSON: {e}") from None


def model_geometry(cfg: dict, where: str = "config.json") -> ModelGeometry:
    """The DSA geometry from a Hugging Face config dict, a missing key named."""
    need = ("num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "index_n_heads",
            "index_head_dim", "index_topk")
    for k in need:
        if not isinstance(cfg.get(k), int):
            raise ProfileError(f"{where}: {k}", f"missing or not an integer ({cfg.get(k)!r}); sparkinfer serves "
                                                f"DSA models (GLM-5.2, DeepSeek-V3.2) only")
    try:
        return ModelGeometry.from_hf_config(SimpleNamespace(**cfg))
    except ValueError as e:
        raise ProfileError(f"{where}: index_topk_pattern", str(e)) from None


def check_pattern(cfg: dict, where: str = "config.json") -> str:
    layers = cfg["num_hidden_layers"]
    if cfg.get("index_topk_pattern") is not None:
        try:
            IndexSharePattern.parse(cfg["index_topk_pattern"], layers)
        except ValueError as e:
            raise ProfileError(f"{where}: index_topk_pattern", str(e)) from None
        return f"IndexShare pattern: {layers} characters for {layers} layers"
    types = cfg.get("indexer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            n = len(types) if isinstance(types, list) else types
            raise ProfileError(f"{where}: indexer_types", f"has {n} entries but the model has {layers} layers")
        return f"indexer_types: {layers} entries for {layers} layers"
    return "IndexShare: no pattern in the config (every layer Full)"


def indexer_mode(data: dict) -> str:
    """Replicated or sharded indexer, by the rule patched vLLM applies on CUDA
    (``sparkinfer.vllm.indexer_layout.indexer_replicated``)."""
    from sparkinfer.vllm.indexer_layout import indexer_replicated

    v = data["vllm"]
    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=v.get("decode_context_parallel_size", 1)),
        device_config=SimpleNamespace(device_type="cuda"),
        additional_config={sc.ADDITIONAL_CONFIG_KEY: dict(data["sparkinfer"])},
        cache_config=SimpleNamespace(cache_dtype=v.get("kv_cache_dtype", "auto")))
    return "replicated" if indexer_replicated(cfg) else "sharded"


def capacity_fields(data: dict) -> dict:
    """The profile's ``CapacityProfile`` fields other than the budget and the geometry (what
    ``sparkinfer plan --profile`` sizes)."""
    v = data["vllm"]
    dtype = v.get("kv_cache_dtype", "auto")
    try:
        fmt = layout(str(dtype))
    except (KeyError, ValueError):
        fmt = None
    if fmt not in MAIN_LAYOUTS:
        raise ProfileError("vllm.kv_cache_dtype", f"{dtype!r}: the KV budget check sizes the record formats "
                                                  f"{', '.join(lay.short for lay in MAIN_LAYOUTS)}; "
                                                  f"leave kv_gb unset to skip it")
    return dict(tp=_int(data, "tensor_parallel_size", 1), dcp=_int(data, "decode_context_parallel_size", 1),
                mtp=speculative_tokens(data), record_format=fmt.name, indexer=indexer_mode(data),
                block_size=_int(data, "block_size", 64), interleave=_int(data, "cp_kv_cache_interleave_size", 1))


def capacity_profile(data: dict, geometry: ModelGeometry, kv_gb: float) -> CapacityProfile:
    return CapacityProfile(**capacity_fields(data), kv_bytes=int(kv_gb * GIB), geometry=geometry)


def check_sparkinfer(data: dict) -> None:
    """The [sparkinfer] table names known settings only (there is no ``--sparkinfer-*`` flag for
    another); their values are checked as patched vLLM resolves them (``startup_problems``)."""
    unknown = sorted(set(data["sparkinfer"]) - set(sc.FIELD_NAMES))
    if unknown:
        raise ProfileError(f"sparkinfer.{unknown[0]}", f"not a sparkinfer setting; known: {', '.join(sc.FIELD_NAMES)}")


def startup_problems(data: dict, cfg: dict, environ) -> list[str]:
    """What patched vLLM refuses at start-up for this profile and model, by its own checks
    (``sparkinfer.vllm.model_config_check``) over the profile's arguments, the config.json and the
    caller's environment with the profile's ``[env]`` over it: first what the engine's arguments
    decide (``startup_problems``, patch 0002); when they pass and the sparkinfer backend reads the
    cache (a record format on an MLA model), an attention backend named that cannot read it
    (``backend_problem``: the workers stop building the model), then what the worker refuses at
    engine start (``worker_problems``, patch 0008) for the graphs vLLM resolves from the profile
    (``profile_graphs``) and the caches on GPUs."""
    env = {**environ, **data["env"]}
    dtype = str(data["vllm"].get("kv_cache_dtype", "auto"))
    problems = startup_check.startup_problems(
        data["sparkinfer"], env, cfg, use_mla=startup_check.uses_mla(cfg), cache_dtype=dtype,
        tensor_parallel_size=_int(data, "tensor_parallel_size", 1),
        decode_context_parallel_size=_int(data, "decode_context_parallel_size", 1))
    if problems or not (is_record_cache_dtype(dtype) and startup_check.uses_mla(cfg)):
        return problems  # vLLM stops before its workers start, or they run no sparkinfer op
    backend = data["vllm"].get("attention_backend") or _table(data, "attention_config").get("backend")
    why = startup_check.backend_problem(backend, dtype)
    if why is not None:
        return [why]  # the workers stop building the model
    from sparkinfer.vllm.replica_budget import selected_path_possible

    comp = _table(data, "compilation_config")
    vcfg = engine_config(data, cfg, env)
    graphs = startup_check.profile_graphs(comp.get("cudagraph_mode"), comp.get("splitting_ops"),
                                          eager=data["vllm"].get("enforce_eager") is True,
                                          breakable=startup_check.breakable_graphs(env),
                                          parts=startup_check.engine_parts(vcfg))
    return startup_check.worker_problems(graphs, selected=selected_path_possible(vcfg),
                                         fabric=sc.resolve(data["sparkinfer"], env).fabric, device_type="cuda")


def validate(data: dict, cfg: dict, where: str = "config.json", environ=None) -> Checked:
    """Check a profile against a model's config dict: a field that cannot be read raises
    ProfileError naming it; what patched vLLM refuses at start-up is returned as ``problems``
    (the checks after them are skipped: they size an engine that would not start)."""
    environ = os.environ if environ is None else environ
    out = Checked()
    check_sparkinfer(data)
    tp = _int(data, "tensor_parallel_size", 1)
    dcp = _int(data, "decode_context_parallel_size", 1)
    heads = cfg.get("num_attention_heads")
    if not isinstance(heads, int) or not isinstance(cfg.get("num_hidden_layers"), int):
        raise ProfileError(f"{where}: num_attention_heads", "the config needs num_attention_heads and "
                                                            "num_hidden_layers (integers)")
    out.problems = startup_problems(data, cfg, environ)
    if out.problems:
        return out
    out.lines.append(f"TP{tp}: {heads} heads, {heads // tp} per GPU")
    out.lines.append(f"DCP{dcp} divides TP{tp}")
    out.lines.append(check_pattern(cfg, where))

    k = speculative_tokens(data)
    if k:
        method = _table(data, "speculative_config").get("method")
        if method == "mtp" and not cfg.get("num_nextn_predict_layers"):
            raise ProfileError("vllm.speculative_config", f"method mtp but the checkpoint has no MTP layer "
                                                          f"({where}: num_nextn_predict_layers is "
                                                          f"{cfg.get('num_nextn_predict_layers')!r})")
    comp = _table(data, "compilation_config")
    mode = str(comp.get("cudagraph_mode") or startup_check.DEFAULT_GRAPH_MODE).upper()
    eager = data["vllm"].get("enforce_eager") is True
    max_seqs = _int(data, "max_num_seqs")
    sizes = comp.get("cudagraph_capture_sizes")
    largest = max(sizes) if sizes else comp.get("max_cudagraph_capture_size")
    if not eager and mode != "NONE" and max_seqs is not None and largest is not None:
        need = max_seqs * (1 + k)
        key = "cudagraph_capture_sizes" if sizes else "max_cudagraph_capture_size"
        if largest < need:
            raise ProfileError(f"vllm.compilation_config.{key}",
                               f"largest CUDA graph {largest} tokens < a full decode step of max_num_seqs "
                               f"{max_seqs} x (1 + {k}) rows = {need}; raise it to {need} or lower max_num_seqs")
        out.lines.append(f"CUDA graphs ({mode}) up to {largest} tokens cover {max_seqs} x {1 + k} rows")
    if dcp > 1 and not eager and mode in FULL_GRAPH_MODES:
        out.notes.append(f"{mode} captures full CUDA graphs with DCP{dcp}, which no GPU run has checked yet: upstream "
                         f"reports a hang at the first decode after a ~128K prefill in vLLM's in-graph DCP "
                         f"collectives (vllm-project/vllm#46145); check a 128K prompt on the node, and fall back "
                         f"with --set vllm.compilation_config.cudagraph_mode=PIECEWISE")

    max_len = _int(data, "max_model_len")
    positions = cfg.get("max_position_embeddings")
    long_ok = str({**environ, **data["env"]}.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "")).strip() in ("1", "true")
    # RoPE scaling changes vLLM's derived length (and YaRN configs state it scaled): checked only without.
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    scaled = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in (None, "default")
    if max_len and isinstance(positions, int) and not scaled and not long_ok and max_len > positions:
        raise ProfileError("vllm.max_model_len", f"{max_len} > the model's {positions} positions ({where}: "
                                                 f"max_position_embeddings); vLLM refuses it")
    window = sc.resolve(cli=data["sparkinfer"], environ={}).replica_window
    if window not in (0, "auto") and max_len and window > max_len:
        raise ProfileError("sparkinfer.replica_window", f"{window} positions > max_model_len {max_len}: the "
                                                        f"store would hold positions no request reaches; use auto "
                                                        f"or <= {max_len}")
    kv_gb = data.get("kv_gb")
    if kv_gb is not None:
        geometry = model_geometry(cfg, where)
        try:
            prof = capacity_profile(data, geometry, kv_gb)
        except ProfileError:
            raise
        except ValueError as e:  # CapacityProfile's own checks name the setting
            raise ProfileError("vllm", str(e)) from None
        held, replica_line = reservations(data, cfg, prof.kv_bytes)
        reserved = sum(held.values())
        plan = capacity_plan(replace(prof, kv_bytes=prof.kv_bytes - reserved))
        out.plan = plan
        less = f" less sparkinfer's {reserved / GIB:.2f} GiB (buffers and replica store)" if reserved else ""
        if max_len and plan.kv_tokens < max_len:
            raise ProfileError("vllm.max_model_len",
                               f"{max_len} tokens do not fit kv_gb {kv_gb:g} GiB per GPU{less}: it holds "
                               f"{plan.kv_tokens:,} ({plan.bytes_per_token:,.0f} B per token per GPU, "
                               f"{plan.profile.indexer} indexer); lower max_model_len or raise kv_gb "
                               f"(sparkinfer plan --profile ... --kv-gb G)")
        out.lines.append(f"KV budget {kv_gb:g} GiB/GPU{less} holds {plan.kv_tokens:,} tokens"
                         + (f" >= max_model_len {max_len:,}" if max_len else ""))
        out.lines.append(replica_line)
    return out


# `vllm serve`'s max_num_batched_tokens when a profile leaves it out, on a GPU of >= 70 GiB that is
# no A100 (vLLM 0.32.0, engine/arg_utils.py): the RTX PRO 6000 and H200 nodes of the profiles
SERVE_BATCHED_TOKENS = 8192


def engine_config(data: dict, cfg: dict, environ=None) -> SimpleNamespace:
    """A stand-in for the VllmConfig patched vLLM builds from the profile (the fields sparkinfer's
    memory rules read), for ``cfg`` the model's config.json fields; ``environ``: the
    ``VLLM_SPARKINFER_*`` variables under the profile's settings (default none)."""
    v = data["vllm"]
    k = speculative_tokens(data)
    return SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=v.get("decode_context_parallel_size", 1),
                                        tensor_parallel_size=v.get("tensor_parallel_size", 1)),
        device_config=SimpleNamespace(device_type="cuda"),
        cache_config=SimpleNamespace(cache_dtype=v.get("kv_cache_dtype", "auto")),
        additional_config={sc.ADDITIONAL_CONFIG_KEY: sc.resolve(cli=data["sparkinfer"], environ=environ or {}).as_dict()},
        scheduler_config=SimpleNamespace(max_num_seqs=v.get("max_num_seqs"),
                                         max_num_batched_tokens=v.get("max_num_batched_tokens") or SERVE_BATCHED_TOKENS),
        speculative_config=SimpleNamespace(num_speculative_tokens=k) if k else None,
        model_config=SimpleNamespace(max_model_len=v.get("max_model_len") or 0, hf_config=SimpleNamespace(**cfg),
                                     dtype=v.get("dtype") or cfg.get("torch_dtype") or "bfloat16"))


def reservations(data: dict, cfg: dict, kv_bytes: int) -> tuple[dict[str, int], str]:
    """({buffer: bytes per GPU}, the replica store's line) that patched vLLM reserves out of
    ``kv_bytes`` of KV memory per GPU, by its own rules (``sparkinfer.vllm.reservations``, patch
    0008): the attention arena, the selected path's buffers, then the replica store (``replica_budget``)."""
    from sparkinfer.vllm import replica_budget as rb
    from sparkinfer.vllm import reservations as rs

    vcfg = engine_config(data, cfg)
    if not rb.selected_path_possible(vcfg):
        return rs.reservations(vcfg, kv_bytes), ("replica store: none (replica_window 0, or no selected path: DCP1, "
                                                 "stock mode or a stock format)")
    if vcfg.scheduler_config.max_num_seqs is None:
        raise ProfileError("vllm.max_num_seqs", "the selected path's buffers and the replica store are sized by it; "
                                                "set it (or sparkinfer.mode = stock)")
    try:
        out = rs.reservations(vcfg, kv_bytes)
    except ValueError as e:
        field = "sparkinfer.replica_window" if "replica_window" in str(e) else "sparkinfer.pool_mb"
        raise ProfileError(field, str(e)) from None
    store = out.get("replica_store", 0)
    if not store:
        return out, "replica store: none (replica_window 0)"
    w = rb.window(vcfg, kv_bytes - sum(out.values()))
    return out, (f"replica store: {store / GIB:.2f} GiB per GPU reserved out of the KV budget, "
                 f"{w:,} positions x {vcfg.scheduler_config.max_num_seqs} requests")


# ----------------------------------------------------------------------------- the subcommand

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True,
                   help=f"serve profile: a name in profiles/serve/ ({', '.join(profile_names())}) or a path to a "
                        f".toml file")
    p.add_argument("model", metavar="MODEL", help="local checkpoint directory (with config.json)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile field (vllm.max_model_len=131072, sparkinfer.mode=stock, kv_gb=12); "
                        "repeatable")
    p.add_argument("--kv-gb", type=float, default=None,
                   help="KV cache budget per GPU in GiB that max_model_len is checked against (the profile's kv_gb)")
    p.add_argument("--dry-run", action="store_true", help="check and print the command, do not run it")
    p.epilog = "Arguments after -- go to `vllm serve` as they are (a field the profile sets must be --set instead)."


def resolve(args: argparse.Namespace) -> tuple[dict, list[str]]:
    data = load_profile(args.profile)
    for s in args.sets:
        apply_set(data, s)
    if args.kv_gb is not None:
        data["kv_gb"] = args.kv_gb
    check_structure(data)
    extra = list(getattr(args, "extra", None) or [])
    check_passthrough(data, extra)
    return data, extra


def render(model: str, data: dict, extra: list[str], checked: Checked, profile: str, environ=None) -> str:
    """What ``--dry-run`` prints: a shell script (comments, exports, the command on one line)."""
    environ = os.environ if environ is None else environ
    about = f" ({data['description']})" if data.get("description") else ""
    lines = [f"# sparkinfer serve: profile {profile}{about}"]
    lines += [f"# ok: {line}" for line in checked.lines]
    lines += [f"# FAIL: {problem}" for problem in checked.problems]
    lines += [f"# NOTE: {note}" for note in checked.notes]
    flags = {sc.env_var(f): sc.cli_flag(f) for f in data["sparkinfer"]}
    for var in sorted(v for v in environ if v in flags):
        lines.append(f"# {var} in the environment is overridden by the profile's {flags[var]}")
    if data["env"]:
        lines += [f"export {k}={shlex.quote(v)}" for k, v in data["env"].items()]
    else:
        lines.append("# environment: the caller's, unchanged (the profile sets no variables)")
    lines.append(shlex.join(serve_command(model, data, extra)))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        data, extra = resolve(args)
        checked = validate(data, read_model_config(args.model), f"{args.model}/config.json")
    except ProfileError as e:
        print(f"sparkinfer serve: {e}", file=sys.stderr)
        return 2
    print(render(args.model, data, extra, checked, args.profile), flush=True)
    if checked.problems:
        print(f"sparkinfer serve: patched vLLM would refuse to start ({len(checked.problems)} problem(s), the "
              f"FAIL lines)", file=sys.stderr)
        return 2
    if args.dry_run:
        return 0
    if shutil.which("vllm") is None:
        print("sparkinfer serve: vllm is not on PATH (install the patched vLLM of docker/Dockerfile, or "
              "use --dry-run)", file=sys.stderr)
        return 2
    cmd = serve_command(args.model, data, extra)
    os.execvpe(cmd[0], cmd, {**os.environ, **data["env"]})
    return 0  # not reached
