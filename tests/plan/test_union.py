"""MTP union: torch reference vs brute force, host twin vs reference, CUDA vs host twin."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer import native
from sparkinfer.plan import _native, mtp_union, mtp_union_host, mtp_union_reference


def brute_union(topk):
    """Python loops over (b, r, k) with a dict of first occurrences."""
    b, r, k = topk.shape
    tk = topk.tolist()
    union = [[-1] * (r * k) for _ in range(b)]
    remap = [[[-1] * k for _ in range(r)] for _ in range(b)]
    counts = []
    for q in range(b):
        seen = {}
        for i in range(r):
            for j in range(k):
                t = tk[q][i][j]
                if t < 0:
                    continue
                if t not in seen:
                    seen[t] = len(seen)
                    union[q][seen[t]] = t
                remap[q][i][j] = seen[t]
        counts.append(len(seen))
    return union, remap, counts


def assert_contract(topk, out):
    union, remap, counts = out
    b, r, k = topk.shape
    assert union.dtype == remap.dtype == counts.dtype == torch.int32
    assert union.shape == (b, r * k) and remap.shape == (b, r, k) and counts.shape == (b,)
    want = brute_union(topk)
    assert union.tolist() == want[0]
    assert remap.tolist() == want[1]
    assert counts.tolist() == want[2]


def random_topk(gen, b, r, k, vocab, pad_frac):
    t = torch.randint(0, vocab, (b, r, k), generator=gen, dtype=torch.int32)
    pad = torch.rand((b, r, k), generator=gen) < pad_frac
    return torch.where(pad, torch.full_like(t, -1), t)


def adversarial_cases():
    gen = torch.Generator().manual_seed(7)
    row = torch.randperm(1000, generator=gen)[:13].to(torch.int32)
    cases = {
        "all_rows_equal": row.repeat(3, 4, 1),
        "all_disjoint": torch.arange(2 * 4 * 13, dtype=torch.int32).reshape(2, 4, 13),
        "all_pad": torch.full((3, 4, 13), -1, dtype=torch.int32),
        "dups_in_row": torch.tensor([[[5, 5, 5, 2, 2], [2, 9, 9, 5, -1]]], dtype=torch.int32),
        "one_token": torch.zeros((2, 4, 7), dtype=torch.int32),
        "k_not_pow2_b1": random_topk(gen, 1, 4, 37, 60, 0.1),
        "large_ids": torch.tensor([[[2**31 - 1, 2**31 - 2, 0], [2**31 - 1, 7, 2**30]]],
                                  dtype=torch.int32),
        "pads_between": torch.tensor([[[-1, 3, -1], [3, -1, 4], [-1, -1, 4]]], dtype=torch.int32),
        "reversed_rows": torch.stack([torch.arange(20), torch.arange(19, -1, -1)])
        .to(torch.int32)[None],
        "r1": random_topk(gen, 3, 1, 16, 10, 0.2),
        "k1": random_topk(gen, 4, 4, 1, 3, 0.2),
        "empty_b": torch.zeros((0, 4, 8), dtype=torch.int32),
        "empty_k": torch.zeros((2, 4, 0), dtype=torch.int32),
        # ids that collide under a multiplicative hash of a power-of-two table
        "hash_stride": (torch.arange(64, dtype=torch.int32) * 4096).reshape(1, 4, 16),
    }
    return cases


ADV = adversarial_cases()


@pytest.mark.parametrize("name", sorted(ADV))
def test_adversarial(name):
    topk = ADV[name]
    ref = mtp_union_reference(topk)
    assert_contract(topk, ref)
    host = mtp_union_host(topk)
    for a, b in zip(ref, host):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(6))
def test_random_against_brute_and_host(seed):
    gen = torch.Generator().manual_seed(seed)
    b = 1 + seed % 3
    r = (1, 2, 4, 4, 3, 4)[seed]
    k = (5, 64, 100, 257, 33, 128)[seed]
    vocab = (8, 300, 200, 10_000, 2**31 - 1, 400)[seed]
    topk = random_topk(gen, b, r, k, vocab, (0.0, 0.1, 0.3, 0.05, 0.5, 0.0)[seed])
    ref = mtp_union_reference(topk)
    assert_contract(topk, ref)
    for a, h in zip(ref, mtp_union_host(topk)):
        assert torch.equal(a, h)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(1, 5), st.integers(0, 9), st.integers(1, 30),
       st.integers(0, 2**32 - 1))
def test_hypothesis_shapes(b, r, k, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    topk = random_topk(gen, b, r, k, vocab, 0.25)
    ref = mtp_union_reference(topk)
    assert_contract(topk, ref)
    for a, h in zip(ref, mtp_union_host(topk)):
        assert torch.equal(a, h)


def test_glm52_shape_and_invariants():
    """B=2, 4 rows x 2048 with overlapping windows: the production shape."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randperm(20_000, generator=gen)[:2048 + 3 * 500]
    rows = torch.stack([base[500 * i:500 * i + 2048] for i in range(4)])
    topk = torch.stack([rows, rows.flip(-1)]).to(torch.int32)
    union, remap, counts = ref = mtp_union_reference(topk)
    assert counts.tolist() == [2048 + 3 * 500] * 2
    # gather through remap restores topk
    assert torch.equal(union.gather(1, remap.reshape(2, -1).long()).reshape(topk.shape), topk)
    # row 0's tokens are the union's prefix
    assert torch.equal(union[0, :2048], topk[0, 0])
    for a, h in zip(ref, mtp_union_host(topk)):
        assert torch.equal(a, h)


def test_dispatch_on_cpu_is_reference():
    topk = ADV["dups_in_row"]
    for a, b in zip(mtp_union(topk), mtp_union_reference(topk)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fn", [mtp_union, mtp_union_reference, mtp_union_host])
@pytest.mark.parametrize("bad,msg", [
    (torch.zeros((2, 3), dtype=torch.int32), "shape"),
    (torch.zeros((1, 2, 3), dtype=torch.int64), "int32"),
    (torch.zeros((1, 2, 3, 1), dtype=torch.int32), "shape"),
    (torch.tensor([[[0, -2, 3]]], dtype=torch.int32), "-2"),
    ([[[0, 1]]], "torch.Tensor"),
])
def test_rejects_bad_input(fn, bad, msg):
    with pytest.raises(ValueError, match=msg):
        fn(bad)


def test_unvalidated_negative_ids_are_pads():
    topk = torch.tensor([[[4, -7, 4], [-1, 9, -2**31]]], dtype=torch.int32)
    as_pads = torch.where(topk < 0, torch.full_like(topk, -1), topk)
    want = mtp_union_reference(as_pads)
    for got in (mtp_union_reference(topk, validate=False), mtp_union_host(topk, validate=False)):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_native_rejects_too_many_entries():
    huge = torch.zeros((1, 1, 1), dtype=torch.int32).expand(1, 4, 2**25 + 1)  # no storage
    with pytest.raises(ValueError, match="outside the union kernel's range"):
        mtp_union_host(huge, validate=False)


def test_host_twin_rejects_small_workspace():
    lib = _native._host()
    topk = ADV["dups_in_row"]
    out = [torch.empty(s, dtype=torch.int32) for s in ((1, 10), (1, 2, 5), (1,))]
    ws = torch.empty(_native.workspace_ints(10) - 1, dtype=torch.int32)
    status = lib.si_union_host_run(native.ptr(topk), 1, 2, 5, *(native.ptr(t) for t in out),
                                   native.ptr(ws), ws.numel())
    assert status == 1  # SI_ERR_ARG, nothing written past the scratch


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ADV))
def test_cuda_matches_host_twin_adversarial(name):
    topk = ADV[name]
    assert _native.cuda_available(), "CUDA library with si_union_cuda_run not built"
    got = mtp_union(topk.cuda())
    for a, h in zip(got, mtp_union_host(topk)):
        assert torch.equal(a.cpu(), h)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_cuda_matches_host_twin_random(seed):
    assert _native.cuda_available(), "CUDA library with si_union_cuda_run not built"
    gen = torch.Generator().manual_seed(seed)
    topk = random_topk(gen, 8, 4, 2048, (3000, 20_000, 2**31 - 1, 1_000_000)[seed], 0.05)
    got = _native.mtp_union_cuda(topk.cuda())
    for a, h, r in zip(got, mtp_union_host(topk), mtp_union_reference(topk.cuda())):
        assert torch.equal(a.cpu(), h)
        assert torch.equal(r.cpu(), h)
