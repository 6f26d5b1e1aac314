"""Launches per layer of the eager stock decode forward, counted from the launches really made (the
probe, ``sparkinfer.testing.launches``) with the GPU implementations forced (Triton interpreted; a
native record call is the one CUDA launch it is on a GPU): what PIECEWISE and mixed batches pay per
layer outside vLLM's graphs (issue 34; docs/design/cuda-graphs.md, "Launches per eager layer").

The forward entries are the ones the backend calls: ``forward_write_records`` (``do_kv_cache_update``;
the replicated indexer writes its keys through it too) and ``attend`` (``forward_mqa``). Issue 34's
bound is 3 launches per layer for both, which a stock layer now meets at either dtype (the
decode's compaction and split merge are inside its kernel, which rounds a bf16 output itself); the
test holds the counts as ceilings, so a change that adds a launch fails."""

import pytest
import torch

from sparkinfer.testing import launches

WRITE_LAUNCHES = 1  # the paged writer: encoder, value and slot checks and the strided store in one kernel
# top-k rows, the decode (compaction, split merge and a bf16 output's rounding in its one kernel)
ATTENTION_LAUNCHES = {torch.float32: 2, torch.bfloat16: 2}
GOAL = 3  # issue 34: the cache write and the attention of one layer
assert WRITE_LAUNCHES + max(ATTENTION_LAUNCHES.values()) <= GOAL


def _layer(dtype, seed=0):
    """One stock layer's inputs at DCP2 (rank 0 of 2) over a strided (block-outermost) cache view."""
    g = torch.Generator().manual_seed(seed)
    backing = torch.zeros(6, 16, 368 + 132, dtype=torch.uint8)
    lat, rope = torch.randn(4, 512, generator=g).to(dtype), torch.randn(4, 1, 64, generator=g).to(dtype)[:, 0]
    q = torch.randn(4, 4, 512, generator=g).to(dtype), torch.randn(4, 4, 64, generator=g).to(dtype)
    topk = torch.randint(-1, 60, (4, 8), generator=g, dtype=torch.int32)
    return backing, torch.tensor([17, 18, -1, 40]), lat, rope, q, topk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stock_layer_launches_at_most_todays_count(monkeypatch, dtype):
    from sparkinfer.decode import impls
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.paged_sparse_mla import attend, forward_write_records, paged_sparse_mla, write_cache_records
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.formats import get_format

    monkeypatch.setenv(impls.FORCE_ENV, "1")
    fmt = get_format("nvfp4_368")
    backing, slots, lat, rope, q, topk = _layer(dtype)
    cache = backing[:, :, :368]
    want = backing.clone()
    write_cache_records(fmt, want[:, :, :368], slots, lat.float(), rope.float())
    table = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    token_req = torch.zeros(4, dtype=torch.int64)
    runtime = WorkerRuntime("cpu")
    # a warm-up step makes the worker's attention arena (zeroing its merge tickets), as vLLM's warm-up
    # runs do before serving; the steps after it find the arena made
    attend(ForwardStep.of(runtime, token_req=token_req, block_table=table), *q, cache, fmt, topk, 0.1, 0, 2)
    step = ForwardStep.of(runtime, token_req=token_req, block_table=table)
    per_layer = []
    for layer in range(2):  # the second layer of a step reuses what the first resolved (its attention plan)
        with launches.record() as write:
            forward_write_records(step, fmt, cache, slots, lat, rope)
        with launches.record() as att:
            out, lse = attend(step, *q, cache, fmt, topk, 0.1, 0, 2)
        per_layer.append((write.breakdown(), att.breakdown()))
    assert torch.equal(backing, want)
    ref = paged_sparse_mla(*q, cache, "nvfp4_368", topk, token_req, table, 0.1, 0, 2)
    assert torch.equal(out, ref[0].to(out.dtype)) and torch.equal(lse, ref[1])
    for w, a in per_layer:
        assert sum(w.values()) == WRITE_LAUNCHES, w
        assert {kernel for _, _, kernel in w} == {"native:write_paged"}
        assert sum(a.values()) <= ATTENTION_LAUNCHES[dtype], a
        assert all(kernel.startswith("triton:") for _, _, kernel in a), a  # kernels only: no torch glue
    print(f"{dtype}: per layer {WRITE_LAUNCHES} + {sum(per_layer[0][1].values())} launches (goal {GOAL})")


def test_the_indexer_key_write_is_one_launch(monkeypatch):
    """The replicated indexer writes its keys through the same entry: one launch."""
    from sparkinfer.decode import impls
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.paged_sparse_mla import forward_write_records
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.formats import get_format

    monkeypatch.setenv(impls.FORCE_ENV, "1")
    cache = torch.zeros(6, 16, 368 + 132, dtype=torch.uint8)[:, :, 368:]
    keys, slots = torch.randn(4, 128).bfloat16(), torch.tensor([17, 18, -1, 40])
    step, fmt = ForwardStep.of(WorkerRuntime("cpu")), get_format("indexer_fp8")
    with launches.record() as rec:
        forward_write_records(step, fmt, cache, slots, keys)
    assert rec.kernels == 1, rec.breakdown()
    assert [k for _, _, k in rec.breakdown()] == ["native:write_paged"]


INDEXER_LAUNCHES = 3  # issue 34: an F layer's indexer, the key write, q's quantization and the paged top-k
INDEXER_KERNELS = {"native:write_paged", "triton:_group_quant_kernel", "triton:_paged_topk_kernel"}


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_an_f_layers_indexer_launches_at_most_three(monkeypatch, weights_dtype):
    """An F layer's indexer in the forward's form (the builder's metadata: ``step``, the engine's
    workspace, each row's request on the device, the paged tile): q's quantization and ``run_indexer``
    make 3 launches per layer (the key write, the quantization, the paged top-k, which checks the
    weights and writes the ids with their -1 padding itself), whatever the weights' dtype; the ids
    are the tiled top-k's (``indexer_topk_rows`` over the request's slots, the twin the paged kernel is
    held to), and a NaN weight still sets ``indexer_inputs``."""
    from sparkinfer.core.indexer_tiles import paged_workspace_bytes
    from sparkinfer.decode import impls
    from sparkinfer.decode.device_checks import DeviceCheckError
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.paged_sparse_mla import write_cache_records
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.formats import get_format
    from sparkinfer.indexer import TopkWorkspace, indexer_topk_rows, plan_rows
    from sparkinfer.vllm.replicated_indexer import ReplicatedIndexerMetadata, quant_q_fp8, run_indexer

    monkeypatch.setenv(impls.FORCE_ENV, "1")
    g = torch.Generator().manual_seed(3)
    bs, hi, k, n = 16, 4, 8, 4  # one request's 4 MTP rows at positions 36 .. 39
    backing = torch.zeros(6, bs, 132 + 68, dtype=torch.uint8)  # another layer's bytes interleaved
    cache = backing[:, :, :132]
    table = torch.tensor([[3, 1, 5, 2]], dtype=torch.int32)
    t = torch.arange(40)
    slots = table.long()[0, t // bs] * bs + t % bs
    write_cache_records(get_format("indexer_fp8"), cache, slots[:36], torch.randn(36, 128, generator=g))  # the context
    pos, req = t[36:], torch.zeros(n, dtype=torch.int64)
    step = ForwardStep.of(WorkerRuntime("cpu"))
    md = ReplicatedIndexerMetadata(n, 1, req, pos, torch.tensor([40]), table, slots[36:], step=step,
                                   workspace=TopkWorkspace(paged_workspace_bytes(n, k, 64), "cpu"),
                                   row_req=req.clone(), paged_tile=64, rows_per_req=n)
    x, keys = torch.randn(n * hi, 128, generator=g).bfloat16(), torch.randn(n, 128, generator=g).bfloat16()
    w = torch.rand(n, hi, generator=g)
    out = torch.full((n, k), 99, dtype=torch.int32)

    def layer(weights):  # the indexer's part of an F layer: q's quantization (scales folded into the weights), the op
        q8, scale = quant_q_fp8(x, 128, use_ue8m0=True)
        q8, wq = q8.view(n, hi, 128), (weights * scale.view(n, hi)).to(weights_dtype)
        run_indexer(cache, md, q8, keys, wq, out, k)
        return q8, wq

    layer(w)  # a warm-up step makes the split counters, as vLLM's warm-up runs do
    for _ in range(2):
        with launches.record() as rec:
            q8, wq = layer(w)
        kernels = rec.breakdown()
        assert sum(kernels.values()) <= INDEXER_LAUNCHES, kernels
        assert {kernel for _, _, kernel in kernels} == INDEXER_KERNELS, kernels
    # the tiled top-k over the request's slots in the cache's flat row view (row = slot: pages are
    # block_size records 200 bytes apart)
    rows = cache.as_strided((cache.shape[0] * bs, 132), (cache.stride(1), 1))
    plan = plan_rows([(torch.arange(n), slots, None)], n)
    want = indexer_topk_rows(q8, wq.float(), rows, pos, k, **plan.kwargs(), backend="triton")
    assert torch.equal(out, want) and bool((out >= 0).all())
    step.checks.poll()
    step.checks.poll()  # finite weights: nothing raised
    bad = w.clone()
    bad[2, 1] = float("nan")
    layer(bad)
    step.checks.poll()
    with pytest.raises(DeviceCheckError, match="indexer_inputs"):
        step.checks.poll()
