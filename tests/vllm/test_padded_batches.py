"""Decode batches vLLM pads for a FULL CUDA graph of a larger size, through sparkinfer's metadata
builders: the ``CommonAttentionMetadata`` is vLLM's own class, padded as
``GPUModelRunner._build_attention_metadata`` pads it (requests of no rows: ``query_start_loc``
repeating the real total, sequence length 0, block-table rows ``NULL_BLOCK_ID``; token rows past the
real ones: slot -1, position 0), and the unpadded batch of the same requests is vLLM's
``CommonAttentionMetadata.unpadded``. The real rows' plans and outputs equal the unpadded batch's;
the padded rows score no key, write no record, attend nothing, and the selected path's replica rule
and exchange never see them (``step_plan.batch_rows``)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparkinfer.decode import impls

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

ROWS = 4  # MTP3: a uniform decode request's rows
BLOCK = 16
K = 8  # the indexer's top-k


def _padded_cm(seq_lens, tables, padded: int, qlens=None):
    """vLLM's metadata of a batch of ``len(seq_lens)`` requests of ``qlens`` rows (a uniform decode
    batch's ``ROWS`` each by default; on block-table rows ``tables``) padded with ``padded`` requests
    of ``ROWS`` rows, as its runner pads it."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    real, reqs = len(seq_lens), len(seq_lens) + padded
    qlens = [ROWS] * real if qlens is None else qlens
    total = sum(qlens)
    tokens = total + padded * ROWS
    qsl = torch.full((reqs + 1,), total, dtype=torch.int32)
    qsl[: real + 1] = torch.tensor([0, *np.cumsum(qlens)], dtype=torch.int32)
    seq = torch.zeros(reqs, dtype=torch.int32)
    seq[:real] = torch.tensor(seq_lens, dtype=torch.int32)
    table = torch.full((reqs, 4), NULL_BLOCK_ID, dtype=torch.int32)
    table[:real] = torch.tensor(tables, dtype=torch.int32)
    positions = torch.zeros(tokens, dtype=torch.int64)
    slots = torch.full((tokens,), -1, dtype=torch.int64)
    for r in range(real):
        p, rows = torch.arange(seq_lens[r] - qlens[r], seq_lens[r]), slice(int(qsl[r]), int(qsl[r + 1]))
        positions[rows] = p
        slots[rows] = table[r].long()[p // BLOCK] * BLOCK + p % BLOCK
    return CommonAttentionMetadata(query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(),
                                   num_reqs=reqs, num_actual_tokens=tokens, max_query_len=max(qlens),
                                   max_seq_len=max(seq_lens), block_table_tensor=table, slot_mapping=slots,
                                   positions=positions, seq_lens_cpu_upper_bound=seq.clone())


def _vllm_config():
    return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False, max_num_seqs=4,
                                                            max_num_batched_tokens=64),
                           speculative_config=SimpleNamespace(num_speculative_tokens=ROWS - 1),
                           parallel_config=SimpleNamespace(cp_kv_cache_interleave_size=1),
                           model_config=SimpleNamespace(max_model_len=4096))


def _builders(runtime):
    """The sparse-MLA builder and the indexer's, over ``runtime`` (a ``WorkerRuntime``), with what their
    ``build`` reads of vLLM's state (vLLM's constructors need a whole engine)."""
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.step_plan import Uploads
    from sparkinfer.indexer import TopkWorkspace
    from sparkinfer.vllm.replicated_indexer import indexer_backend
    from sparkinfer.vllm.sparse_mla_backend import SparseMetadataBuilder

    cfg = _vllm_config()
    attn = SparseMetadataBuilder.__new__(SparseMetadataBuilder)
    attn.vllm_config, attn.runtime, attn.kv_cache_spec = cfg, runtime, SimpleNamespace(dcp_sharded=True)
    attn._uploads = Uploads("cpu", 128)
    cls = indexer_backend().get_builder_cls()
    index = cls.__new__(cls)
    index.vllm_config, index.runtime, index.kv_cache_spec = cfg, runtime, SimpleNamespace(block_size=BLOCK)
    index.scoring = SimpleNamespace(for_step=lambda positions: None)  # replicated scoring
    index.step, index.workspace, index.merge = ForwardStep.of(runtime), TopkWorkspace(1 << 20, "cpu"), None
    index.paged_tile = 64 if index.step.backend == "triton" else None
    index._uploads, index._pos, index._slots = Uploads("cpu", 128), torch.empty(64, dtype=torch.int64), \
        torch.empty(64, dtype=torch.int64)
    index._layer_cache = lambda: None
    return attn, index


def _forward(cm, seed: int):
    """Both builders' plans of ``cm`` and one F layer's forward over them (the indexer op, the cache write,
    the attention) over caches holding each request's context: (attention md, indexer md, top-k, out,
    lse, caches after the step)."""
    from sparkinfer.decode.paged_sparse_mla import attend, forward_write_records, write_cache_records
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.formats import get_format
    from sparkinfer.vllm.replicated_indexer import quant_q_fp8, run_indexer

    runtime = WorkerRuntime("cpu")
    attn, index = _builders(runtime)
    md, imd = attn._build(cm, may_select=False), index.build(0, cm)
    fmt, keys = get_format("nvfp4_368"), get_format("indexer_fp8")
    records = torch.zeros(12, BLOCK, 368 + 132, dtype=torch.uint8)[:, :, :368]  # block-outermost layer views
    index_cache = torch.zeros(12, BLOCK, 132 + 368, dtype=torch.uint8)[:, :, :132]
    g = torch.Generator().manual_seed(0)
    context = torch.randn(8, 64, 512 + 64 + 128, generator=g)  # request r's earlier tokens
    for r in range(cm.num_reqs):
        before = int(cm.seq_lens_cpu_upper_bound[r]) - int(cm.query_start_loc_cpu[r + 1] - cm.query_start_loc_cpu[r])
        if before > 0:
            at = torch.arange(before)
            slots = cm.block_table_tensor[r].long()[at // BLOCK] * BLOCK + at % BLOCK
            write_cache_records(fmt, records, slots, context[r, :before, :512], context[r, :before, 512:576])
            write_cache_records(keys, index_cache, slots, context[r, :before, 576:])
    n, g = cm.num_actual_tokens, torch.Generator().manual_seed(seed)
    q = [torch.randn(ROWS * 4, *shape, generator=g) for shape in ((2, 512), (2, 64), (2, 128), (2,), (128,), (512,),
                                                                 (64,))]
    q_fp8, scale = quant_q_fp8(q[2][:n].reshape(-1, 128), 128, use_ue8m0=True)  # rows past the batch unused
    topk = torch.full((n, K), 99, dtype=torch.int32)
    run_indexer(index_cache, imd, q_fp8.view(n, 2, 128), q[4][:n], q[3][:n].abs() * scale.view(n, 2), topk, K)
    forward_write_records(md.step, fmt, records, cm.slot_mapping, q[5][:n], q[6][:n])
    out, lse = attend(md.step, q[0][:n], q[1][:n], records, fmt, topk, 0.1, 0, 1)
    assert runtime.checks.poll() is None  # no slot or value check fired
    return md, imd, topk, out.float(), lse, (records.clone(), index_cache.clone())


@pytest.mark.parametrize("forced", ["0", "1"])
def test_builders_plan_vllms_padding_as_inert_rows(monkeypatch, forced):
    """2 real requests padded to 4 (the 16-row graph) against vLLM's unpadding of the same metadata:
    the real rows' plans, top-k, cache writes, outputs and LSEs equal; a padded row belongs to its
    padded request at position -1, its indexer slot is -1, its top-k all -1, it writes nothing and its
    attention is 0 with LSE -inf (finite: nothing non-finite reaches the next layer's checks). On the
    torch backend and with the GPU implementations forced (the paged top-k, interpreted)."""
    monkeypatch.setenv(impls.FORCE_ENV, forced)
    cm = _padded_cm([37, 21], [[3, 4, 5, 0], [6, 7, 0, 0]], padded=2)
    real = 2 * ROWS
    md, imd, topk, out, lse, caches = _forward(cm, seed=1)
    umd, uimd, utopk, uout, ulse, ucaches = _forward(cm.unpadded(real, 2), seed=1)

    assert md.num_actual_tokens == 4 * ROWS and umd.num_actual_tokens == real
    assert torch.equal(md.token_req, torch.arange(4).repeat_interleave(ROWS))  # padded rows: padded requests
    assert torch.equal(md.token_req[:real], umd.token_req)
    assert torch.equal(imd.row_req[:real], uimd.row_req) and torch.equal(imd.positions[:real], uimd.positions)
    assert torch.equal(imd.slot_mapping[:real], uimd.slot_mapping) and bool((uimd.slot_mapping >= BLOCK).all())
    assert bool((imd.positions[real:] == -1).all()) and bool((imd.slot_mapping[real:] == -1).all())

    assert torch.equal(topk[:real], utopk) and bool((utopk >= 0).any())
    assert bool((topk[real:] == -1).all())
    assert torch.equal(out[:real], uout) and torch.equal(lse[:real], ulse)
    assert bool((out[real:] == 0).all()) and bool((lse[real:] == float("-inf")).all())
    for got, want in zip(caches, ucaches):  # the real rows' writes only; vLLM's null block untouched
        assert torch.equal(got, want) and bool((got[0] == 0).all())


def test_a_step_holding_prefill_rows_scores_lists_as_its_pages_would(monkeypatch):
    """The Triton backend (forced, interpreted) scores a step whose longest request holds more rows than
    a decode request's with the tiled scorer over host-planned lists (``core.indexer_tiles.scores_lists``),
    and the same step past LIST_POSITIONS, and a uniform decode step, by pages: the top-k of the lists
    is the pages' bit for bit, and the plan's torch twin's (ties broken alike)."""
    from sparkinfer.core import indexer_tiles

    monkeypatch.setenv(impls.FORCE_ENV, "1")
    cm = _padded_cm([37, 21], [[3, 4, 5, 0], [6, 7, 0, 0]], padded=0, qlens=[10, ROWS])  # a prefill chunk of 10
    _, lists, topk, out, lse, caches = _forward(cm, seed=3)
    assert lists.paged_tile is None and [key[0] for key in lists.key_plans] == ["rows"]
    assert bool((topk >= 0).sum(1).eq(K).all())  # every row has more than K keys before it
    monkeypatch.setattr(indexer_tiles, "LIST_POSITIONS", 37 + 21 - 1)  # one position too many: pages
    _, pages, ptopk, pout, plse, pcaches = _forward(cm, seed=3)
    assert pages.paged_tile == 64 and not pages.key_plans
    assert torch.equal(topk, ptopk) and torch.equal(out, pout) and torch.equal(lse, plse)
    assert all(torch.equal(a, b) for a, b in zip(caches, pcaches))
    monkeypatch.setenv(impls.FORCE_ENV, "0")
    assert torch.equal(_forward(cm, seed=3)[2], topk)
    monkeypatch.setenv(impls.FORCE_ENV, "1")
    monkeypatch.setattr(indexer_tiles, "LIST_POSITIONS", 1 << 30)
    assert _forward(_padded_cm([37, 21], [[3, 4, 5, 0], [6, 7, 0, 0]], padded=0), seed=3)[1].paged_tile == 64


def _selected(max_batch=4, window=64):
    """A ``SelectedRuntime`` in mode selected at DCP2 with a replica window, with what ``choose`` reads
    (its constructor needs an engine)."""
    from sparkinfer.config import SparkinferConfig
    from sparkinfer.core.replicas import ReplicaWindow
    from sparkinfer.decode.step_path import StepPath
    from sparkinfer.vllm.selected_runtime import SelectedRuntime

    rt = SelectedRuntime.__new__(SelectedRuntime)
    rt.config = SparkinferConfig(mode="selected", prefetch_depth=1, replica_window=window)
    rt.vllm_config, rt.checks, rt.rows = _vllm_config(), None, ROWS
    rt.path = StepPath(rt.config, dcp=2, record_format=True, rows=ROWS, max_batch=max_batch)
    rt.replicas, rt.replicas_on = ReplicaWindow(window, 4), True
    rt._replica_store = [torch.zeros(4 * window, 368, dtype=torch.uint8)]
    rt._replica_uploads = rt._taken = rt._step_replicas = None
    return rt


def test_the_selected_path_plans_padded_requests_as_moving_nothing(monkeypatch):
    """The selected path over a padded batch (the sparse-MLA builder's plan, ``SelectedRuntime.choose``,
    a Full layer's group plan): the path is chosen for the batch as the graph runs it (4 requests of
    ``ROWS`` rows; past the workspace's max_batch, stock, as the graph of that size was captured); the
    replica rule sees only the real requests (its state after the step equals the unpadded step's),
    the padded requests hold nothing and their rows write nothing to the store; the group plan's
    union, patch and transport planes of the real requests equal the unpadded step's, and the padded
    requests add no record to any plane."""
    from sparkinfer.core.topology import DcpLayout
    from sparkinfer.decode.group_plan import GroupPlan
    from sparkinfer.decode.device_checks import DeviceChecks
    from sparkinfer.decode.runtime import WorkerRuntime

    monkeypatch.setenv(impls.FORCE_ENV, "1")
    cm = _padded_cm([37, 21], [[3, 4, 5, 0], [6, 7, 0, 0]], padded=2)
    real = 2 * ROWS
    plans = {}
    for name, step_cm in (("padded", cm), ("unpadded", cm.unpadded(real, 2))):
        runtime = WorkerRuntime("cpu")
        runtime.selected = _selected()
        runtime.request_ids = ["a", "b"]  # vLLM's input batch: the real requests only
        attn, _ = _builders(runtime)
        md = attn._build(step_cm, may_select=True)
        plans[name] = (md, runtime.selected)
    (md, rt), (umd, urt) = plans["padded"], plans["unpadded"]
    assert md.path == umd.path == "selected"
    assert md.context.tolist() == [33, 17, 0, 0] and md.query_lens.tolist() == [ROWS] * 4
    assert rt.replicas._slot_of == urt.replicas._slot_of and np.array_equal(rt.replicas._lo, urt.replicas._lo)
    assert np.array_equal(rt.replicas._hi, urt.replicas._hi)
    (dst, src, mask), local = rt._step_replicas
    (udst, usrc, umask), ulocal = urt._step_replicas
    assert torch.equal(dst[:real], udst) and torch.equal(src[:real], usrc) and torch.equal(mask[:real], umask)
    assert set(zip(dst[real:].tolist(), src[real:].tolist())) <= set(zip(udst.tolist(), usrc.tolist()))  # repeats
    assert torch.equal(local.lo[:2], ulocal.lo) and local.lo[2:].tolist() == [0, 0]
    assert local.all_local == ulocal.all_local

    # past the workspace: the padded batch is stock, as its graph was captured (capture_path for 4 requests)
    runtime = WorkerRuntime("cpu")
    runtime.selected, runtime.request_ids = _selected(max_batch=3), ["a", "b"]
    assert _builders(runtime)[0]._build(cm, may_select=True).path == "stock"
    assert runtime.selected.capture_path(4) == "stock"

    # a Full layer's group plan (the forward's kernels): the padded requests' top-k rows are -1
    g = torch.Generator().manual_seed(5)
    topk = torch.randint(-1, 33, (4 * ROWS, K), generator=g, dtype=torch.int32)
    topk[real:] = -1
    flags = DeviceChecks("cpu")
    built = {}
    for name, (plan_md, plan_rt) in plans.items():
        b = plan_md.context.shape[0]
        plan = GroupPlan(DcpLayout(2), max_batch=4, rows=ROWS, topk=K, device="cpu", backend="triton")
        replicas = plan_rt._step_replicas[1]
        slots, patch, planes = plan.build(topk[:b * ROWS].contiguous(), plan_md.context, torch.arange(b) * ROWS,
                                          replicas, 4 * ROWS * K, flags)
        built[name] = (plan, slots.clone(), {k: v.clone() for k, v in patch.items() if v is not None},
                       planes.count.clone())
    assert flags.poll() is None
    (plan, slots, patch, count), (uplan, uslots, upatch, ucount) = built["padded"], built["unpadded"]
    assert torch.equal(count, ucount) and int(count.sum()) > 0  # the real requests' records move, no more
    assert plan.counts[2:].tolist() == [0, 0]  # the padded requests' unions are empty
    assert torch.equal(plan.counts[:2], uplan.counts[:2]) and torch.equal(plan.union[:2], uplan.union[:2])
    assert torch.equal(slots[:real], uslots) and bool((slots[real:] == -1).all())
    e = 2 * ROWS * K
    for key in patch:
        assert torch.equal(patch[key][:e], upatch[key]), key
    assert not bool(patch["own"][e:].any()) and not bool(patch["kept"][e:].any())
