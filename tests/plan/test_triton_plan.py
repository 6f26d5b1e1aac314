"""A Full layer's group plan (sparkinfer.decode.group_plan): the union kernel's host build plus the two
Triton kernels (sparkinfer.plan.triton_plan) against the torch twin, which is composed from the
planning core's ``mtp_union_reference`` and ``build_planes`` (each tested against its own reference
in test_union / test_planes).

Cases cross DCP 1, 2, 3 and 4 with interleaves 1 and 4, replicas off and on (a window that cuts
through the context), duplicate-heavy and pad-heavy top-k (MTP rows that overlap), contexts below
and inside the step's rows, fewer requests than the plan holds, a plan reused for a second step
(stale entries past the counts), and a top-k id below -1 (the device flag). Same slots, patch,
counts and first ``count`` plane entries, bit for bit. Given its buffers, a build allocates nothing
in sparkinfer code. Under ``TRITON_INTERPRET=1`` on CPU (conftest), natively on a GPU (``-m gpu``).
"""

import pytest
import torch

from sparkinfer.core.reservations import SelectedSizing
from sparkinfer.core.topology import DcpLayout
from sparkinfer.testing import host_reads
from sparkinfer.decode.device_checks import DeviceChecks
from sparkinfer.decode.group_plan import GroupPlan, plan_reference
from sparkinfer.decode.selected_decode import LocalReplicas

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted only without a GPU")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _step(g, B, R, K, world, overlap: float, pad: float, window):
    """(topk int32 [B*R, K], context, row_start, replicas or None) of a decode step."""
    context = torch.randint(0, 300, (B,), generator=g, dtype=torch.int64)
    topk = torch.empty(B * R, K, dtype=torch.int32)
    for b in range(B):
        pool = int(context[b]) + R  # positions up to the step's own rows
        first = torch.randint(0, pool, (K,), generator=g)
        for r in range(R):  # later rows keep a share of row 0's set (MTP rows overlap)
            keep = torch.rand(K, generator=g) < overlap
            row = torch.where(keep, first, torch.randint(0, pool, (K,), generator=g))
            row = torch.where(torch.rand(K, generator=g) < pad, -1, row)
            topk[b * R + r] = row.to(torch.int32)
    row_start = torch.arange(B, dtype=torch.int64) * R
    replicas = None
    if window is not None:
        lo = torch.clamp(context - torch.randint(0, window + 1, (B,), generator=g), min=0)
        base = torch.arange(B, dtype=torch.int64) * window
        replicas = LocalReplicas(store=[], lo=lo, base=base, window=window)
    return topk, context, row_start, replicas


def _on(dev, replicas):
    if replicas is None:
        return None
    return LocalReplicas(store=[], lo=replicas.lo.to(dev), base=replicas.base.to(dev), window=replicas.window)


def _assert_plan_equal(got, want, B, world):
    slots, patch, planes = got
    ref_slots, ref_patch, ref = want
    assert torch.equal(slots.cpu(), ref_slots)
    for key in ("own", "new_rows", "kept", "store_rows"):
        if ref_patch[key] is None:
            assert patch[key] is None
        else:
            assert torch.equal(patch[key].cpu().to(ref_patch[key].dtype), ref_patch[key]), key
    assert torch.equal(planes.count.cpu(), ref.count)
    assert planes.req.shape == ref.req.shape and not planes.overflow and not ref.overflow
    for src in range(world):
        for dst in range(world):
            n = int(ref.count[src, dst])
            for name in ("req", "local", "slot"):
                assert torch.equal(getattr(planes, name)[src, dst, :n].cpu(), getattr(ref, name)[src, dst, :n]), name


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (3, 1), (4, 1), (4, 4)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("B,R,K,overlap,pad", [(3, 4, 32, 0.7, 0.1), (5, 1, 64, 0.0, 0.0), (2, 4, 300, 0.9, 0.5)])
def test_group_plan_equals_the_torch_twin(monkeypatch, dev, world, interleave, window, B, R, K, overlap, pad):
    monkeypatch.setenv("SPARKINFER_FORCE_GPU_IMPLS", "1")
    g = torch.Generator().manual_seed(B * 1009 + K + world * 7 + interleave)
    dcp = DcpLayout(world, interleave)
    max_batch = B + 2  # fewer requests than the plan holds
    plan = GroupPlan(dcp, max_batch=max_batch, rows=R, topk=K, device=dev, backend="triton")
    checks = DeviceChecks(dev)
    for step in range(2):  # the second step reuses buffers holding the first one's plan
        topk, context, row_start, replicas = _step(g, B - step, R, K, world, overlap, pad, window)
        cap = max_batch * R * K if step == 0 else (B - step) * R * K  # device sizing, then host sizing
        want = plan_reference(topk, context, row_start, replicas, dcp, R, cap, validate=True)
        with host_reads.count_allocations() as made:
            got = plan.build(topk.to(dev), context.to(dev), row_start.to(dev), _on(dev, replicas), cap, checks)
        assert not [k for k in made if "|sparkinfer:" in k and "alloc" in k], made
        _assert_plan_equal(got, want, B - step, world)
    assert not bool(checks.flags.any())


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_topk_id_below_minus_one_sets_the_flag_and_the_torch_backend_equals_the_twin(monkeypatch, backend):
    monkeypatch.setenv("SPARKINFER_FORCE_GPU_IMPLS", "1" if backend == "triton" else "0")
    g = torch.Generator().manual_seed(5)
    dcp = DcpLayout(2, 1)
    topk, context, row_start, replicas = _step(g, 2, 4, 16, 2, 0.5, 0.1, 8)
    plan = GroupPlan(dcp, max_batch=2, rows=4, topk=16, device="cpu", backend=backend)
    checks = DeviceChecks("cpu")
    got = plan.build(topk, context, row_start, replicas, 128, checks)
    _assert_plan_equal(got, plan_reference(topk, context, row_start, replicas, dcp, 4, 128, validate=True), 2, 2)
    assert not bool(checks.word("selected_topk"))
    topk[3, 5] = -7
    plan.build(topk, context, row_start, replicas, 128, checks)
    assert bool(checks.word("selected_topk")) and int(checks.flags.sum()) == 1


def test_capacity_outside_the_plan_is_refused():
    plan = GroupPlan(DcpLayout(2, 1), max_batch=2, rows=1, topk=8, device="cpu", backend="torch")
    topk = torch.zeros(2, 8, dtype=torch.int32)
    ctx = torch.tensor([4, 4])
    with pytest.raises(ValueError, match="capacity 8 outside"):
        plan.build(topk, ctx, ctx, None, 8, DeviceChecks("cpu"))


@pytest.mark.parametrize("dcp,seqs,rows,topk", [(4, 16, 4, 2048), (2, 2, 4, 32), (4, 5, 1, 300)])
def test_the_plan_holds_what_its_reservation_says(dcp, seqs, rows, topk):
    """``GroupPlan``'s tensors against ``SelectedSizing``'s ``group_plan`` row, byte for byte, and the
    union scratch against the native library's own count (csrc/include/sparkinfer/union.h)."""
    from sparkinfer.core.reservations import union_scratch_ints
    from sparkinfer.plan import _native

    sizing = SelectedSizing(dcp=dcp, record_bytes=368, max_num_seqs=seqs, rows=rows, topk=topk, prefetch_depth=3,
                            pool_mb=512, sizing="device")
    plan = GroupPlan(DcpLayout(dcp, 1), max_batch=sizing.max_batch, rows=rows, topk=topk, device="meta",
                     backend="triton")
    assert plan.nbytes == sizing.buffers()["group_plan"]
    assert union_scratch_ints(rows * topk) == _native.workspace_ints(rows * topk)
