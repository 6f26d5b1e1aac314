"""The launch probe (``sparkinfer.testing.launches``) that holds decode steps to CUDA-graph replay:
two forwards of one shape must make the same launches, pointers included; it must see a buffer
made afresh per step, a scalar that changes and a Triton grid that changes. The engine-level check
(every mode, MTP3 at TP2/DCP2) is in tests/vllm/test_vllm_host_reads.py."""

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


def test_the_probe_compares_steps_of_one_path_only(monkeypatch):
    """Decode steps are keyed by their shape and path (``_step_path``): a step whose records are all
    local ("local": no exchange) is compared only with local steps, never with a selected one of the
    same shape, and each path's first step is warm-up (``launches.WARMUP``)."""
    from types import SimpleNamespace

    paths = iter(["selected", "local", "selected", "local", "selected", "local", "local"])
    monkeypatch.setattr(launches, "_step_path", lambda: next(paths))
    x = torch.zeros(4)

    class Runner:
        def execute_model(self, scheduler_output):
            return self._model_forward()

        def _model_forward(self):
            return x.add(1)

    runner = Runner()
    probe = launches._Probe(runner, spec_rows=4)
    decode = SimpleNamespace(num_scheduled_tokens={"a": 4}, scheduled_new_reqs=[])
    for _ in range(7):
        runner.execute_model(decode)
    results = probe.report()
    assert [r["paths"] for r in results] == [["selected"], ["local"], ["local"]]
    assert all(r["differences"] == [{}] for r in results), results
