"""The runner's hook (patch 0008, ``sparkinfer.vllm.graph_dispatch.replay``) on vLLM's own dispatcher:
a FULL dispatch of a sparkinfer engine stands only on the path and indexer scoring its graph was
captured on, else the step takes the size's piecewise graph (FULL_AND_PIECEWISE) or runs eagerly (FULL_DECODE_ONLY); an
engine without sparkinfer attention is left alone. vLLM on CPU captures no graph, so the dispatcher's
keys are built as a GPU worker builds them (``initialize_cudagraph_keys``)."""

from types import SimpleNamespace

import pytest
import torch


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
    rt.graphs.capture(12, path="selected")
    rt.graphs.choose(path="selected")
    assert graph_dispatch.replay(runner, full, desc) == (full, desc)
    rt.graphs.choose(path="local")  # every record local: no exchange, not the graph's launches
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
    from sparkinfer.decode.graph_paths import GraphChoice
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
        assert b.runtime.graphs.captured == ({12: GraphChoice("selected")} if tells else {})
        assert b.runtime.graphs.step == GraphChoice("local" if tells else None)

    path = StepPath(SparkinferConfig(mode="selected", prefetch_depth=2), dcp=2, record_format=True, rows=4,
                    max_batch=2)
    rt = SimpleNamespace(path=path, rows=4, vllm_config=SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096)))
    assert [SelectedRuntime.capture_path(rt, n) for n in (1, 2, 3)] == ["selected", "selected", "stock"]


def _decode_cm(seq_lens, rows=4):
    """vLLM's metadata of a uniform decode batch: ``rows`` rows per request at ``seq_lens``, each request
    on one block of a cache whose pages hold every position (the indexer's slots stay in the table)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    reqs = len(seq_lens)
    qsl = torch.arange(reqs + 1, dtype=torch.int32) * rows
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(s - rows, s) for s in seq_lens])
    table = torch.arange(reqs, dtype=torch.int32)[:, None]
    return CommonAttentionMetadata(query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(),
                                   num_reqs=reqs, num_actual_tokens=reqs * rows, max_query_len=rows,
                                   max_seq_len=max(seq_lens), block_table_tensor=table,
                                   slot_mapping=table.long().repeat_interleave(rows) * (1 << 20) + positions,
                                   positions=positions, seq_lens_cpu_upper_bound=seq.clone())


@pytest.mark.vllm
def test_the_indexer_builder_records_the_captured_scoring_and_each_steps(monkeypatch):
    """The indexer's builder under ``indexer_scoring = auto`` with a node profile (DCP4, MTP3, 256K
    context): a capture run is scored as the host scores that many requests at the longest context
    (``choose_indexer``: sharded), whatever its own rows' positions (short: the host would score them
    replicated), and recorded beside the attention's path whichever builder runs first; a target step
    records its own scoring, an MTP draft pass none. The runner's hook then replays the FULL graph for a
    step of the captured pair only: a long-context step (sharded) replays, a short one (replicated) and
    one on another path fall back, each reason counted."""
    pytest.importorskip("vllm")
    import vllm.distributed.parallel_state as ps
    from vllm.config import CUDAGraphMode

    from sparkinfer.core import costmodel as cm
    from sparkinfer.core.geometry import GLM52
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.graph_paths import GraphChoice
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.decode.step_plan import Uploads
    from sparkinfer.vllm import graph_dispatch, indexer_scoring
    from sparkinfer.vllm.replicated_indexer import indexer_backend
    from sparkinfer.vllm.sparse_mla_backend import SparseMetadataBuilder
    from test_worker_runtime import register

    profile, max_len = cm.load_profile("rtx_pro_6000_x4"), 262_144
    monkeypatch.setattr(indexer_scoring, "node_profile", lambda cfg: (profile, GLM52))
    monkeypatch.setattr(ps, "get_dcp_group", lambda: SimpleNamespace(rank_in_group=1, device_group=None))
    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=4, cp_kv_cache_interleave_size=1),
        device_config=SimpleNamespace(device_type="cpu"), cache_config=SimpleNamespace(cache_dtype="nvfp4_368"),
        additional_config={"sparkinfer": {"mode": "selected", "indexer_scoring": "auto"}},
        scheduler_config=SimpleNamespace(async_scheduling=False, max_num_seqs=4, max_num_batched_tokens=64),
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        model_config=SimpleNamespace(max_model_len=max_len))
    runtime = WorkerRuntime("cpu")
    cls = indexer_backend().get_builder_cls()
    index = cls.__new__(cls)  # what build reads, not vLLM's state (its constructor needs an engine)
    index.vllm_config, index.runtime, index.kv_cache_spec = cfg, runtime, SimpleNamespace(block_size=1 << 20)
    index.scoring = indexer_scoring.IndexerScoring(cfg)
    index.step, index.workspace, index.merge, index.paged_tile = ForwardStep.of(runtime), None, None, None
    index._uploads, index._pos, index._slots = Uploads("cpu", 128), *(torch.empty(64, dtype=torch.int64)
                                                                       for _ in range(2))
    index._layer_cache = lambda: None
    attn = SparseMetadataBuilder.__new__(SparseMetadataBuilder)
    attn.runtime, attn.kv_cache_spec = runtime, SimpleNamespace(dcp_sharded=True)
    attn.runtime.selected = object()
    attn._build = lambda cm_, may_select, capture=False: SimpleNamespace(path="selected")

    def scoring(seq_lens):  # the host's own choice for a step's rows (row i at context c scores c + i + 1)
        rows = [s - 4 + i + 1 for s in seq_lens for i in range(4)]
        return cm.choose_indexer(profile, sum(rows), len(rows), 4, GLM52)

    short, long = [100, 200, 300], [200_000, 150_000, 262_000]
    assert (scoring(short), scoring([max_len] * 3)) == ("replicated", "sharded")
    # capture: the indexer's builder first, then the attention's (vLLM builds the groups in its order)
    md = index.build_for_cudagraph_capture(_decode_cm(short))
    assert md.sharded is index.scoring._sharded and md.sharded.rank == 1
    attn.build_for_cudagraph_capture(SimpleNamespace(num_actual_tokens=12))
    assert runtime.graphs.captured == {12: GraphChoice("selected", "sharded")}
    # a target step: the attention's builder first this time; a draft pass after it changes nothing
    attn.build(0, SimpleNamespace())
    assert index.build(0, _decode_cm(short)).sharded is None
    index.build_for_drafting(_decode_cm(long), 0)
    assert runtime.graphs.step == GraphChoice("selected", "replicated")

    runner = _runner("FULL_AND_PIECEWISE")
    register(runner.vllm_config, runtime)
    full, desc = runner.cudagraph_dispatcher.dispatch(12, uniform_decode=True)
    assert graph_dispatch.replay(runner, full, desc)[0] == CUDAGraphMode.PIECEWISE  # replicated: not the graph's
    assert index.build(0, _decode_cm(long)).sharded is index.scoring._sharded
    assert scoring(long) == "sharded" and runtime.graphs.step == GraphChoice("selected", "sharded")
    assert graph_dispatch.replay(runner, full, desc) == (full, desc)
    attn._build = lambda cm_, may_select, capture=False: SimpleNamespace(path="stock")
    attn.build(0, SimpleNamespace())
    assert graph_dispatch.replay(runner, full, desc)[0] == CUDAGraphMode.PIECEWISE  # its scoring's, another path
    assert sorted(runtime.graphs.fallbacks.values()) == [1, 1] and len(runtime.graphs.fallbacks) == 2
