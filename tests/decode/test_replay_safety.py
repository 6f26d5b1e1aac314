"""The launch probe (``sparkinfer.testing.launches``) that holds decode steps to CUDA-graph replay:
two forwards of one shape must make the same launches, pointers included; it must see a buffer
made afresh per step, a scalar that changes and a Triton grid that changes. The engine-level check
(every mode, MTP3 at TP2/DCP2) is in tests/vllm/test_vllm_host_reads.py."""

import numpy as np
import torch

from sparkinfer.testing import launches


def _cache_and_arena():
    from sparkinfer.core.attention_workspace import AttentionWorkspace
    from sparkinfer.decode import layer_buffers
    from sparkinfer.formats import get_format

    g = torch.Generator().manual_seed(0)
    fmt = get_format("nvfp4_368")
    backing = torch.zeros(6, 16, 368 + 132, dtype=torch.uint8)
    cache = backing[:, :, :368]  # strided like vLLM's block-outermost layer views
    from sparkinfer.decode.paged_sparse_mla import write_cache_records

    write_cache_records(fmt, cache, torch.arange(16, 56), torch.randn(40, 512, generator=g),
                        torch.randn(40, 64, generator=g))
    arena = layer_buffers.AttentionArena(torch.device("cpu"))
    arena.reserve(AttentionWorkspace(rows=3, heads=2, topk=8, out_bytes=4).segments())
    return cache, torch.tensor([[1, 2, 3, 4]], dtype=torch.int32), arena


def _step(seed, cache, table, token_req, fresh_metadata=False, rows=3, scale=0.1):
    """One layer's attention in the forward's form (``attend``, given the step's ``ForwardStep``) over a
    top-k and queries of ``seed``: the buffers an engine step writes before the forward (top-k,
    queries) are refilled in place."""
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.impls import kernel_backend
    from sparkinfer.decode.paged_sparse_mla import attend
    from sparkinfer.formats import get_format

    g = torch.Generator().manual_seed(seed)
    _step.topk.copy_(torch.randint(-1, 40, (3, 8), generator=g, dtype=torch.int32))
    _step.q[0].copy_(torch.randn(3, 2, 512, generator=g))
    _step.q[1].copy_(torch.randn(3, 2, 64, generator=g))
    if fresh_metadata:  # what a builder that copies its plan into a new tensor each step does
        token_req = token_req.clone()
    step = ForwardStep(kernel_backend(cache.device), _step.checks, _step.arena, token_req=token_req, block_table=table)
    fmt = get_format("nvfp4_368")
    with launches.record() as rec:
        out, lse = attend(step, _step.q[0][:rows], _step.q[1][:rows], cache, fmt, _step.topk[:rows], scale, 0, 2)
        (out * 2).sum()  # a temporary made inside the forward: the graph's pool holds it
    return rec, out.clone()


_step.topk = torch.zeros(3, 8, dtype=torch.int32)
_step.q = (torch.zeros(3, 2, 512), torch.zeros(3, 2, 64))


def test_two_steps_of_one_shape_make_the_same_launches_and_changes_are_seen(monkeypatch):
    from sparkinfer.decode import impls
    from sparkinfer.decode.device_checks import DeviceChecks

    monkeypatch.setenv(impls.FORCE_ENV, "1")  # the GPU code path: Triton kernels, interpreted
    _step.checks = DeviceChecks("cpu")
    cache, table, _step.arena = _cache_and_arena()
    token_req = torch.zeros(3, dtype=torch.int64)
    a, out_a = _step(1, cache, table, token_req)
    b, out_b = _step(2, cache, table, token_req)
    assert not torch.equal(out_a, out_b)  # different steps: different results ...
    assert launches.first_difference([a], [b]) is None  # ... from the same launches
    kinds = {e[1] for e in a.events}
    assert any(k.startswith("triton:") for k in kinds), kinds  # the interpreted kernels are booked
    assert any(e[0].startswith("decode/") for e in a.events)
    assert a.kernels == 2, kinds  # top-k rows, decode (it compacts its indices itself)

    c, _ = _step(3, cache, table, token_req, fresh_metadata=True)
    where = launches.first_difference([a], [c])
    assert where is not None and "outside" in where, where  # a per-step buffer moves the pointer

    d, _ = _step(4, cache, table, token_req, rows=2)
    assert launches.first_difference([a], [d]) is not None  # another row count: another graph
    e, _ = _step(5, cache, table, token_req, scale=0.2)
    where = launches.first_difference([a], [e])  # a scalar the graph would freeze (scale x log2 e)
    assert "triton:_sparse_mla_decode_kernel): 0.144" in where and "against 0.288" in where, where
    assert "1 forwards against 2" in launches.first_difference([a], [a, b])


def test_the_probe_compares_steps_of_one_path_and_scoring_only(monkeypatch):
    """Decode steps are keyed by their shape, path and indexer scoring (``_step_choice``: what a FULL
    graph holds fixed, ``graph_paths.GraphChoice``): a step whose records are all local ("local": no
    exchange) is compared only with local steps, a sharded-scoring step only with sharded ones, never
    across, and each kind's first step is warm-up (``launches.WARMUP``)."""
    from types import SimpleNamespace

    sel, loc, shd = ("selected", "replicated"), ("local", "replicated"), ("selected", "sharded")
    choices = iter([sel, loc, shd, sel, loc, shd, sel, loc, loc, shd, shd])
    monkeypatch.setattr(launches, "_step_choice", lambda: next(choices))
    x = torch.zeros(4)

    class Runner:
        def execute_model(self, scheduler_output):
            return self._model_forward()

        def _model_forward(self):
            return x.add(1)

    runner = Runner()
    probe = launches._Probe(runner, spec_rows=4)
    decode = SimpleNamespace(num_scheduled_tokens={"a": 4}, scheduled_new_reqs=[])
    for _ in range(11):
        runner.execute_model(decode)
    results = probe.report()
    assert [(r["paths"], r["scorings"]) for r in results] == [
        (["selected"], ["replicated"]), (["local"], ["replicated"]), (["local"], ["replicated"]),
        (["selected"], ["sharded"]), (["selected"], ["sharded"])]
    assert all(r["differences"] == [{}] for r in results), results


ROWS = 4  # a uniform decode request's rows (MTP3)


class _PaddedLayer:
    """One F layer's forward over a paged record cache and a paged indexer cache, in the forward's
    form (GPU implementations forced, Triton interpreted): the indexer op (key write, paged top-k),
    the cache write and the attention, over a step planned by ``step_plan`` into buffers that persist
    from step to step (the builders' ``Uploads``, positions and slots; the layer's inputs), as a
    captured graph needs. Block 0 is vLLM's null block: a padded request's block-table row."""

    def __init__(self):
        from sparkinfer.decode.forward_step import ForwardStep
        from sparkinfer.decode.runtime import WorkerRuntime
        from sparkinfer.decode.step_plan import Uploads
        from sparkinfer.formats import get_format
        from sparkinfer.indexer import TopkWorkspace

        g = torch.Generator().manual_seed(3)
        self.fmt, self.keys = get_format("nvfp4_368"), get_format("indexer_fp8")
        self.records = torch.zeros(10, 16, 368 + 132, dtype=torch.uint8)[:, :, :368]  # block-outermost views
        self.index = torch.zeros(10, 16, 132 + 368, dtype=torch.uint8)[:, :, :132]
        self.table = torch.zeros(2, 4, dtype=torch.int32)
        self.runtime = WorkerRuntime("cpu")
        self.ws = TopkWorkspace(1 << 20, "cpu")
        self.uploads = Uploads("cpu", 64)
        t = 2 * ROWS
        self.pos, self.slots, self.write = (torch.zeros(t, dtype=torch.int64) for _ in range(3))
        self.topk = torch.zeros(t, 8, dtype=torch.int32)
        self.q = (torch.zeros(t, 2, 512), torch.zeros(t, 2, 64), torch.zeros(t, 2, 128, dtype=torch.float8_e4m3fn),
                  torch.zeros(t, 2), torch.zeros(t, 128), torch.zeros(t, 512), torch.zeros(t, 64))
        self.context = torch.randn(2, 40, 512 + 64 + 128, generator=g)  # each request's earlier tokens
        self.step = ForwardStep.of(self.runtime)

    def run(self, qsl, seq_lens, blocks, seed, record: bool = True):
        """One step: requests ``qsl`` / ``seq_lens`` (vLLM's host copies; a padded request has 0 rows and
        sequence length 0) on ``blocks`` (their block-table rows; [0, ...]: vLLM's null block) over
        ``2 x ROWS`` token rows. Returns (launches, top-k, out, lse, the caches after it)."""
        from sparkinfer.decode import step_plan
        from sparkinfer.decode.forward_step import ForwardStep
        from sparkinfer.decode.paged_sparse_mla import attend, forward_write_records, write_cache_records
        from sparkinfer.vllm.replicated_indexer import ReplicatedIndexerMetadata, quant_q_fp8, run_indexer

        qsl, seq_lens, t = np.array(qsl), np.array(seq_lens), 2 * ROWS
        self.records.zero_(), self.index.zero_()
        self.table.copy_(torch.tensor(blocks, dtype=torch.int32))
        for r in range(2):  # the context each request's earlier steps wrote (a padded request: none)
            before = int(seq_lens[r] - (qsl[r + 1] - qsl[r]))
            if not before:
                continue
            at = torch.arange(before)
            slots = self.table[r].long()[at // 16] * 16 + at % 16
            write_cache_records(self.fmt, self.records, slots, self.context[r, :before, :512],
                                self.context[r, :before, 512:576])
            write_cache_records(self.keys, self.index, slots, self.context[r, :before, 576:])
        token_req, positions = step_plan.token_layout(qsl, seq_lens, t)  # the builders' plan
        tr, = self.uploads(token_req)
        self.pos.copy_(torch.from_numpy(positions))
        real = self.pos >= 0
        slots = self.table.long()[tr, self.pos.clamp(min=0) // 16] * 16 + self.pos % 16
        self.slots.copy_(torch.where(real, slots, -1))
        self.write.copy_(self.slots)  # vLLM's slot mapping: -1 on a padded row
        g = torch.Generator().manual_seed(seed)
        q, scale = quant_q_fp8(torch.randn(2 * t, 128, generator=g), 128, use_ue8m0=True)
        self.q[2].copy_(q.view(t, 2, 128))
        self.q[3].copy_(torch.rand(t, 2, generator=g) * scale.view(t, 2))
        for buf in (self.q[0], self.q[1], self.q[4], self.q[5], self.q[6]):
            buf.copy_(torch.randn(buf.shape, generator=g))
        md = ReplicatedIndexerMetadata(t, 2, torch.from_numpy(token_req), self.pos, torch.from_numpy(seq_lens),
                                       self.table, self.slots, host_qsl=qsl, host_seq_lens=seq_lens, step=self.step,
                                       workspace=self.ws, row_req=tr, paged_tile=64)
        step = ForwardStep.of(self.runtime, token_req=tr, block_table=self.table)
        with launches.record() as rec:
            run_indexer(self.index, md, self.q[2], self.q[4], self.q[3], self.topk, 8)
            forward_write_records(step, self.fmt, self.records, self.write, self.q[5], self.q[6])
            out, lse = attend(step, self.q[0], self.q[1], self.records, self.fmt, self.topk, 0.1, 0, 1)
        return rec, self.topk.clone(), out.clone(), lse.clone(), (self.records.clone(), self.index.clone())


def test_a_padded_decode_step_launches_as_an_unpadded_one_and_its_padding_is_inert(monkeypatch):
    """A decode batch vLLM pads for a FULL graph of a larger size (requests of no rows, sequence length
    0, the null block; token rows past the real ones, slot -1: ``step_plan.batch_rows``) makes exactly
    the launches of an unpadded batch of that size (the graph captured for it), differing only in the
    buffers' bytes; its real rows' top-k, cache writes and attention equal the same request's in an
    unpadded step, and its padded rows select nothing (-1), write nothing and attend nothing (output 0,
    LSE -inf)."""
    from sparkinfer.decode import impls

    monkeypatch.setenv(impls.FORCE_ENV, "1")
    layer = _PaddedLayer()
    two = ([0, ROWS, 2 * ROWS], [30, 17], [[3, 4, 0, 0], [5, 6, 0, 0]])
    layer.run(*two, seed=0)  # warm-up: the arena, the split counters
    unpadded, *_ = layer.run(*two, seed=1)
    padded_rec, topk, out, lse, caches = layer.run([0, ROWS, ROWS], [30, 0], [[3, 4, 0, 0], [0, 0, 0, 0]], seed=1)
    assert launches.first_difference([unpadded], [padded_rec]) is None
    assert padded_rec.kernels == unpadded.kernels > 0

    # the same request (context, blocks, inputs) in an unpadded batch beside another real request
    _, want_topk, want_out, want_lse, want_caches = layer.run([0, ROWS, 2 * ROWS], [30, 30 + ROWS],
                                                              [[3, 4, 0, 0], [7, 8, 0, 0]], seed=1)
    r = slice(0, ROWS)
    assert torch.equal(topk[r], want_topk[r]) and bool((topk[r] >= 0).any())
    assert torch.equal(out[r], want_out[r]) and torch.equal(lse[r], want_lse[r])
    pad = slice(ROWS, 2 * ROWS)
    assert bool((topk[pad] == -1).all())
    assert bool((out[pad] == 0).all()) and bool((lse[pad] == float("-inf")).all())
    for got, want in zip(caches, want_caches):  # the real rows' writes; nothing of the padded rows
        assert torch.equal(got[:7], want[:7]) and bool((got[7:] == 0).all())
    assert layer.runtime.checks.poll() is None  # no slot or value check fired (the null block untouched)
