"""The worker's start-up refusals (sparkinfer/vllm/engine_start.py, ``model_config_check.worker_problems``)
on vLLM's own compilation config, and ``sparkinfer serve --dry-run`` held to them.

A CUDA graph mode that would replay a sparkinfer op wrongly is refused, with the reason named. The
dry run refuses what the worker refuses, in the worker's words, without an engine: vLLM resolves the
profile's compilation config as a worker does for the sparkinfer builders the engine runs (each
declares what ``decode.graph_paths`` says of its part; vLLM resolves with the least of them, and its
own refusal of a FULL mode is a ValueError there), then ``engine_start.check_worker`` reads the
resolved config, the sparkinfer settings and caches on GPUs.
"""

import os
from types import SimpleNamespace

import pytest
from test_serve_cli import ATTENTION_OP, PROFILE, WORKER, WORKER_STARTS, glm52_config  # tests/cli: the dry run's cases


@pytest.mark.vllm
@pytest.mark.parametrize("mode, splitting, breakable, refused", [
    ("NONE", None, False, None),
    ("PIECEWISE", None, False, None),  # vLLM's default splitting ops take the sparkinfer ops out
    ("PIECEWISE", [], False, None),  # nothing split: vLLM itself then captures nothing (NONE)
    ("PIECEWISE", ["vllm::unified_mla_attention_with_output"], False, "sparse_attn_indexer"),
    ("PIECEWISE", ["vllm::unified_mla_attention_with_output", "vllm::sparse_attn_indexer"], False,
     "unified_mla_kv_cache_update"),
    ("FULL", None, False, "FULL"),
    ("FULL_DECODE_ONLY", None, False, None),
    ("FULL_AND_PIECEWISE", None, False, None),
    ("FULL_AND_PIECEWISE", ["vllm::unified_mla_attention_with_output"], False, "sparse_attn_indexer"),
    ("FULL_DECODE_ONLY", ["vllm::unified_mla_attention_with_output"], False, None),  # no piecewise graphs
    ("PIECEWISE", None, True, "breakable"),
])
def test_graph_modes_that_capture_a_sparkinfer_op_are_refused(mode, splitting, breakable, refused):
    """vLLM's own resolved compilation config at MTP3 (4 rows a request): refused where a piece would
    capture a sparkinfer op, or FULL graphs of mixed batches (the capture sizes are not read: a padded
    decode batch is planned, ``step_plan.batch_rows``)."""
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    from sparkinfer.vllm.engine_start import graphs
    from sparkinfer.vllm.model_config_check import graph_problem

    cfg = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode[mode],
                            splitting_ops=splitting, cudagraph_capture_sizes=[4, 8, 12, 16],
                            max_cudagraph_capture_size=16)
    cfg.set_splitting_ops_for_v1("naive")
    why = graph_problem(graphs(cfg, breakable, ("attention",)))
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why


class _SparkinferImpl:  # an attention layer's impl whose class is sparkinfer's (``engine_start.uses_sparkinfer``)
    __module__ = "sparkinfer.vllm.sparse_mla_backend"


def worker_refusal(profile: str, sets: list[str], env: dict, monkeypatch) -> str | None:
    """What patched vLLM says when a worker on GPUs starts the profile's engine (module docstring):
    its own refusal as ``vLLM: ...``, else ``check_worker``'s message; None if it starts."""
    import torch
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from sparkinfer import config as sc
    from sparkinfer.cli import serve
    from sparkinfer.vllm import engine_start
    from sparkinfer.decode.graph_paths import support
    from sparkinfer.vllm.model_config_check import DEFAULT_GRAPH_MODE, engine_parts

    data = serve.load_profile(profile)
    for s in sets:
        serve.apply_set(data, s)
    for k, v in {**env, **data["env"]}.items():  # vLLM runs in the caller's environment plus [env]
        monkeypatch.setenv(k, v)
    comp = serve._table(data, "compilation_config")
    eager = data["vllm"].get("enforce_eager") is True  # vLLM then compiles nothing and captures nothing
    sizes = comp.get("cudagraph_capture_sizes")  # a profile without them gets vLLM's defaults: not here
    given = {"cudagraph_capture_sizes": sizes, "max_cudagraph_capture_size": max(sizes)} if sizes else {}
    cc = CompilationConfig(mode=CompilationMode.NONE if eager else CompilationMode.VLLM_COMPILE,
                           cudagraph_mode=CUDAGraphMode["NONE" if eager else comp.get("cudagraph_mode", DEFAULT_GRAPH_MODE)],
                           splitting_ops=comp.get("splitting_ops"), **given)
    cc.set_splitting_ops_for_v1("naive")
    vllm_config = serve.engine_config(data, glm52_config(), os.environ)  # the fields sparkinfer reads
    vllm_config.additional_config = {sc.ADDITIONAL_CONFIG_KEY: sc.resolve(data["sparkinfer"]).as_dict()}  # patch 0002
    # vLLM resolves with the least support of the builders the engine runs (the GPU runner's
    # _check_and_update_cudagraph_mode; vLLM's own indexer, where it runs, supports more)
    least = min((AttentionCGSupport[support(p)] for p in engine_parts(vllm_config)), key=lambda s: s.value)
    try:
        cc.resolve_cudagraph_mode_and_sizes(least, "SPARKINFER_SPARSE_MLA",
                                            uniform_decode_query_len=1 + serve.speculative_tokens(data))
    except ValueError as e:
        return f"vLLM: {e}"
    cc.static_forward_context["model.layers.0.self_attn.attn"] = SimpleNamespace(
        impl=_SparkinferImpl(), kv_cache=SimpleNamespace(device=torch.device("cuda")))
    vllm_config.compilation_config = cc
    try:
        engine_start.check_worker(vllm_config)
    except ValueError as e:
        return str(e)
    return None


def dry_run_fails(profile: str, sets: list[str], env: dict) -> list[str]:
    """The dry run's FAIL lines for the profile (``serve.validate``'s problems)."""
    from sparkinfer.cli import serve

    data = serve.load_profile(profile)
    for s in sets:
        serve.apply_set(data, s)
    return serve.validate(data, glm52_config(), environ=env).problems


@pytest.mark.vllm
@pytest.mark.parametrize("profile, sets, names", WORKER, ids=[str(i) for i in range(len(WORKER))])
def test_the_dry_run_refuses_what_the_worker_refuses(profile, sets, names, monkeypatch):
    pytest.importorskip("vllm")
    fails = dry_run_fails(profile, sets, {})
    said = worker_refusal(profile, sets, {}, monkeypatch)
    assert fails and said is not None, (fails, said)
    if said.startswith("vLLM: "):  # vLLM refuses it before sparkinfer's check, in its own words
        assert "CUDAGraphMode.FULL is not supported" in said, said
        assert all("cudagraph_mode FULL captures mixed" in f for f in fails), fails
    else:
        assert said == "; ".join(fails)


@pytest.mark.vllm
@pytest.mark.parametrize("profile, sets", WORKER_STARTS, ids=[str(i) for i in range(len(WORKER_STARTS))])
def test_the_worker_starts_what_the_dry_run_passes(profile, sets, monkeypatch):
    pytest.importorskip("vllm")
    assert dry_run_fails(profile, sets, {}) == []
    assert worker_refusal(profile, sets, {}, monkeypatch) is None


SPLITS = [None, [], [ATTENTION_OP], [ATTENTION_OP, "vllm::sparse_attn_indexer"],
          [ATTENTION_OP, "vllm::sparse_attn_indexer", "vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"]]


@pytest.mark.vllm
@pytest.mark.parametrize("mode", [None, "NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_the_dry_runs_graphs_are_what_vllm_resolves(mode, monkeypatch):
    """Every graph mode with every kind of ``splitting_ops`` (unset, empty, some of the sparkinfer
    ops, all of them): the dry run refuses exactly where the worker does (``profile_graphs`` is
    vLLM's resolution for the sparkinfer backend)."""
    pytest.importorskip("vllm")
    for split in SPLITS:
        sets = ([f"vllm.compilation_config.cudagraph_mode={mode}"] if mode else []) + \
            ([f"vllm.compilation_config.splitting_ops={split!r}"] if split is not None else [])
        fails = dry_run_fails("glm52-tp4-dcp1-mtp3-368", sets, {})
        said = worker_refusal("glm52-tp4-dcp1-mtp3-368", sets, {}, monkeypatch)
        assert bool(fails) == (said is not None), (mode, split, fails, said)
        if said is not None and not said.startswith("vLLM: "):
            assert said == "; ".join(fails), (mode, split)


@pytest.mark.vllm
def test_the_dry_run_refuses_a_named_backend_the_worker_refuses():
    """An attention backend named in the profile that is not sparkinfer's: every MLA backend vLLM
    registers (those whose class loads on this CPU) is refused 368-byte records by the check patched
    vLLM runs when it builds the model's attention (``check_backend_reads``), and by the dry run;
    sparkinfer's own backend, or leaving the choice to vLLM, passes both."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from sparkinfer.vllm.cache_dtypes import check_backend_reads
    from sparkinfer.vllm.platforms import BACKEND_NAME, sparkinfer_backend

    sparkinfer_backend()  # registered, as the patched platforms do
    checked = []
    for name in AttentionBackendEnum.__members__:
        if "MLA" not in name:
            continue
        try:
            cls = AttentionBackendEnum[name].get_class()
        except (ImportError, AssertionError):  # a GPU-only build (CUDA / ROCm extensions)
            continue
        fails = dry_run_fails(PROFILE, [f"vllm.attention_backend={name}"], {})
        if name == BACKEND_NAME:
            check_backend_reads(cls.get_name(), cls.supported_kv_cache_dtypes, "nvfp4_368")
            assert fails == []
            continue
        with pytest.raises(ValueError, match="cannot read it"):
            check_backend_reads(cls.get_name(), cls.supported_kv_cache_dtypes, "nvfp4_368")
        assert len(fails) == 1 and f"attention backend {name} named cannot read it" in fails[0], fails
        checked.append(name)
    assert len(checked) >= 3 and BACKEND_NAME not in checked, checked
    assert dry_run_fails(PROFILE, ["vllm.attention_backend=auto"], {}) == []
