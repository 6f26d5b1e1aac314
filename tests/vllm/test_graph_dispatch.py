"""The runner's hook (patch 0008, ``sparkinfer.vllm.graph_dispatch.replay``) on vLLM's own dispatcher:
a FULL dispatch of a sparkinfer engine stands only on the path its graph was captured on, else the
step takes the size's piecewise graph (FULL_AND_PIECEWISE) or runs eagerly (FULL_DECODE_ONLY); an
engine without sparkinfer attention is left alone. vLLM on CPU captures no graph, so the dispatcher's
keys are built as a GPU worker builds them (``initialize_cudagraph_keys``)."""

from types import SimpleNamespace

import pytest


def _runner(mode: str):
    """A runner with vLLM's dispatcher keyed for ``mode`` at MTP3 (4 rows), 4 requests, every decode
    batch a capture size."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode[mode],
                           cudagraph_capture_sizes=[4, 8, 12, 16], max_cudagraph_capture_size=16)
    cc.set_splitting_ops_for_v1("naive")
    cfg = SimpleNamespace(compilation_config=cc, num_speculative_tokens=3, lora_config=None,
                          scheduler_config=SimpleNamespace(max_num_seqs=4))
    d = CudagraphDispatcher(cfg)
    d.initialize_cudagraph_keys(CUDAGraphMode[mode], uniform_decode_query_len=4)
    return SimpleNamespace(vllm_config=cfg, cudagraph_dispatcher=d)


@pytest.mark.vllm
@pytest.mark.parametrize("mode, fallback", [("FULL_AND_PIECEWISE", "PIECEWISE"), ("FULL_DECODE_ONLY", "NONE")])
def test_a_full_graph_replays_only_its_captured_path(mode, fallback):
    pytest.importorskip("vllm")
    from vllm.config import CUDAGraphMode

    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.vllm import graph_dispatch, worker_runtime
    from test_worker_runtime import register

    runner = _runner(mode)
    full, desc = runner.cudagraph_dispatcher.dispatch(12, uniform_decode=True)
    assert full == CUDAGraphMode.FULL and desc.num_reqs == 3  # 3 requests x 4 rows: their own graph
    rt = WorkerRuntime("cpu")
    assert worker_runtime.of_engine(runner.vllm_config) is None
    assert graph_dispatch.replay(runner, full, desc) == (full, desc)  # not a sparkinfer engine: untouched
    register(runner.vllm_config, rt)
    rt.graphs.capture(12, "selected")
    rt.graphs.step_path = "selected"
    assert graph_dispatch.replay(runner, full, desc) == (full, desc)
    rt.graphs.step_path = "local"  # every record local: no exchange, not the graph's launches
    run, ran = graph_dispatch.replay(runner, full, desc)
    assert run == CUDAGraphMode[fallback] and ran.num_tokens == 12
    if fallback == "PIECEWISE":  # the key the dispatcher holds for that size's piecewise graph
        assert ran in runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.PIECEWISE]
    assert sum(rt.graphs.fallbacks.values()) == 1
    piecewise = (CUDAGraphMode.PIECEWISE, desc)
    assert graph_dispatch.replay(runner, *piecewise) == piecewise  # only FULL dispatches are held


@pytest.mark.vllm
def test_the_builder_records_the_captured_path_and_each_steps(monkeypatch):
    """The sparse-MLA builder records what it built: at a capture run the graph's path by its token
    count, at a step the step's path, from the group that plans the selected path (or in an engine
    that never takes it), never from a replicated group of an engine that selects (the drafter's
    layers build stock whatever the step takes). The capture run's path is the host's choice at the
    longest context (``SelectedRuntime.capture_path``)."""
    pytest.importorskip("vllm")
    from sparkinfer.config import SparkinferConfig
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.decode.step_path import StepPath
    from sparkinfer.vllm.selected_runtime import SelectedRuntime
    from sparkinfer.vllm.sparse_mla_backend import SparseMetadataBuilder

    def builder(sharded: bool, selects: bool):
        b = SparseMetadataBuilder.__new__(SparseMetadataBuilder)  # what build reads, not vLLM's state
        b.runtime, b.kv_cache_spec = WorkerRuntime("cpu"), SimpleNamespace(dcp_sharded=sharded)
        b.runtime.selected = object() if selects else None
        b._build = lambda cm, may_select, capture=False: SimpleNamespace(path="selected" if capture else "local")
        return b

    for sharded, selects, tells in ((True, True, True), (False, False, True), (False, True, False)):
        b = builder(sharded, selects)
        b.build_for_cudagraph_capture(SimpleNamespace(num_actual_tokens=12))
        b.build(0, SimpleNamespace())
        assert b.runtime.graphs.captured == ({12: "selected"} if tells else {})
        assert b.runtime.graphs.step_path == ("local" if tells else None)

    path = StepPath(SparkinferConfig(mode="selected", prefetch_depth=2), dcp=2, record_format=True, rows=4,
                    max_batch=2)
    rt = SimpleNamespace(path=path, rows=4, vllm_config=SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096)))
    assert [SelectedRuntime.capture_path(rt, n) for n in (1, 2, 3)] == ["selected", "selected", "stock"]
