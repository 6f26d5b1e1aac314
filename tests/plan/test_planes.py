"""Transport planes against a brute-force loop, and the reconstruction property."""

import pytest
import torch

from sparkinfer.plan import build_planes, mtp_union
from sparkinfer.core.topology import DcpLayout


def brute_planes(union, counts, lay, cap, held):
    d = lay.world_size
    b, u = union.shape
    un, cn = union.tolist(), counts.tolist()
    count = [[0] * d for _ in range(d)]
    planes = {name: [[[-1] * cap for _ in range(d)] for _ in range(d)]
              for name in ("req", "local", "slot")}
    for src in range(d):
        for dst in range(d):
            n = 0
            for q in range(b):
                for j in range(cn[q]):
                    owner, local = lay.owner_and_local(un[q][j])
                    if owner != src or (held is not None and bool(held[dst, q, j])):
                        continue
                    if n < cap:
                        planes["req"][src][dst][n] = q
                        planes["local"][src][dst][n] = local
                        planes["slot"][src][dst][n] = q * u + j
                    n += 1
            count[src][dst] = n
    return count, planes


def make_union(gen, b, r, k, ctx):
    topk = torch.randint(0, ctx, (b, r, k), generator=gen, dtype=torch.int32)
    topk[torch.rand(topk.shape, generator=gen) < 0.1] = -1
    return mtp_union(topk)


CASES = [(1, 1, 3, 0), (2, 1, 3, 5), (4, 1, 2, 6), (4, 2, 4, 7), (3, 3, 2, 8), (8, 1, 3, 9),
         (5, 4, 1, 10), (4, 16, 3, 11)]


@pytest.mark.parametrize("world,interleave,b,seed", CASES)
@pytest.mark.parametrize("with_held", [False, True])
def test_against_brute_force(world, interleave, b, seed, with_held):
    gen = torch.Generator().manual_seed(seed)
    lay = DcpLayout(world, interleave)
    union, _, counts = make_union(gen, b, 4, 24, 150)
    u = union.shape[1]
    held = torch.rand((world, b, u), generator=gen) < 0.3 if with_held else None
    # a capacity that overflows for the busiest plane, and one that always fits
    for cap in (int(counts.sum()) // max(world, 2), int(counts.sum())):
        p = build_planes(union, counts, lay, cap, held)
        count, want = brute_planes(union, counts, lay, cap, held)
        assert p.count.tolist() == count
        for name in ("req", "local", "slot"):
            t = getattr(p, name)
            assert t.dtype == torch.int32 and t.shape == (world, world, cap)
            assert t.tolist() == want[name], name
        assert p.overflow == any(c > cap for row in count for c in row)
        assert p.capacity == cap


@pytest.mark.parametrize("world,interleave", [(1, 1), (4, 1), (4, 8), (8, 2), (3, 5)])
def test_scatter_reconstructs_union(world, interleave):
    """For every dst, the records of all (src, dst) planes, scattered into their slots,
    are exactly the union minus what dst already holds."""
    gen = torch.Generator().manual_seed(world * 10 + interleave)
    lay = DcpLayout(world, interleave)
    b = 3
    union, _, counts = make_union(gen, b, 4, 40, 500)
    u = union.shape[1]
    held = torch.rand((world, b, u), generator=gen) < 0.25
    for h in (None, held):
        p = build_planes(union, counts, lay, int(counts.sum()), h)
        assert not p.overflow
        for dst in range(world):
            ws = torch.full((b * u,), -1, dtype=torch.long)
            for src in range(world):
                n = int(p.count[src, dst])
                slot = p.slot[src, dst, :n].long()
                assert (ws[slot] == -1).all(), "a slot is written twice"
                ws[slot] = lay.token_of(src, p.local[src, dst, :n].long())
                assert torch.equal(p.req[src, dst, :n], (slot // u).to(torch.int32))
                assert (p.slot[src, dst, n:] == -1).all()
            want = union.reshape(-1).long().clone()
            if h is not None:
                want[h[dst].reshape(-1)] = -1
            assert torch.equal(ws, want)


def test_planes_identical_across_destinations_without_held():
    gen = torch.Generator().manual_seed(1)
    union, _, counts = make_union(gen, 2, 4, 32, 300)
    p = build_planes(union, counts, DcpLayout(4), 200)
    for name in ("count", "req", "local", "slot"):
        t = getattr(p, name)
        assert torch.equal(t, t[:, :1].expand_as(t))


def test_request_major_then_union_order():
    gen = torch.Generator().manual_seed(2)
    union, _, counts = make_union(gen, 3, 4, 16, 100)
    p = build_planes(union, counts, DcpLayout(2), 200)
    for src in range(2):
        n = int(p.count[src, 0])
        slots = p.slot[src, 0, :n]
        assert torch.all(slots[1:] > slots[:-1])


def test_empty_union_and_zero_capacity():
    union = torch.full((2, 8), -1, dtype=torch.int32)
    counts = torch.zeros(2, dtype=torch.int32)
    p = build_planes(union, counts, DcpLayout(4), 5)
    assert p.count.sum() == 0 and not p.overflow and (p.slot == -1).all()
    union, _, counts = mtp_union(torch.tensor([[[1, 2]]], dtype=torch.int32))
    p = build_planes(union, counts, DcpLayout(2), 0)
    assert p.overflow and p.count.tolist() == [[1, 1], [1, 1]] and p.req.shape == (2, 2, 0)


def test_rejects_bad_input():
    union, _, counts = mtp_union(torch.tensor([[[1, 2, 3]]], dtype=torch.int32))
    lay = DcpLayout(2)
    with pytest.raises(ValueError, match="union must be an int32"):
        build_planes(union.long(), counts, lay, 4)
    with pytest.raises(ValueError, match="counts has 2 entries"):
        build_planes(union, torch.zeros(2, dtype=torch.int32), lay, 4)
    with pytest.raises(ValueError, match="capacity"):
        build_planes(union, counts, lay, -1)
    with pytest.raises(ValueError, match="DcpLayout"):
        build_planes(union, counts, 2, 4)
    with pytest.raises(ValueError, match="held must be"):
        build_planes(union, counts, lay, 4, torch.zeros((1, 1, 3), dtype=torch.bool))
    with pytest.raises(ValueError, match="held must be a bool"):
        build_planes(union, counts, lay, 4, torch.zeros((2, 1, 3), dtype=torch.int32))
    with pytest.raises(ValueError, match="mtp_union contract"):
        build_planes(union, counts - 1, lay, 4)
    with pytest.raises(ValueError, match=r"counts must lie in \[0, 3\]"):
        build_planes(union, counts + 1, lay, 4)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(5)
    union, _, counts = make_union(gen, 4, 4, 2048, 100_000)
    held = torch.rand((4, 4, union.shape[1]), generator=gen) < 0.3
    cpu = build_planes(union, counts, DcpLayout(4), 4096, held)
    gpu = build_planes(union.cuda(), counts.cuda(), DcpLayout(4), 4096, held.cuda())
    for name in ("count", "req", "local", "slot"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu())
    assert cpu.overflow == gpu.overflow
