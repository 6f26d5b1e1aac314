"""The one-launch Triton top-k over int64 selection keys (``indexer.triton_topk``, interpreted on CPU)
against ``torch.topk(keys, k, largest=True, sorted=True).values``: bit for bit, INT64_MIN padding
included, with the candidate buffer the output itself (CAP = k: the radix levels run until the
bucket of the k-th key is exact) and twice as wide (the levels stop early); unsorted (a tiled
call's running top-k): the same keys."""

import pytest
import torch
import triton
import triton.language as tl

from sparkinfer.indexer.topk import _NONE, pack_keys
from sparkinfer.indexer.triton_topk import BLOCK, SORT_VEC, sort_desc, topk_keys


def _check(keys: torch.Tensor, k: int) -> None:
    """Sorted, into a candidate buffer of k and of 2k; unsorted (the same keys, any order)."""
    want = torch.topk(keys, k, dim=1, largest=True, sorted=True).values
    for cap in (k, 2 * k):
        cand = torch.full((keys.shape[0], cap), 7, dtype=torch.int64)
        got = topk_keys(keys, k, cand[:, :k], cand)
        assert got.data_ptr() == cand.data_ptr()
        assert torch.equal(got, want), cap
    got = topk_keys(keys, k, torch.full((keys.shape[0], k), 7, dtype=torch.int64), sorted=False)
    assert torch.equal(got.sort(dim=1, descending=True).values, want)


def _distinct(g, m, n, low=-(2 ** 63) + 1, high=2 ** 63 - 1):
    """[M, N] keys distinct within a row, in [low, high)."""
    keys = torch.randint(low, high, (m, 2 * n), generator=g)
    rows = [torch.unique(r)[torch.randperm(torch.unique(r).numel(), generator=g)][:n] for r in keys]
    assert all(r.numel() == n for r in rows)
    return torch.stack(rows)


def test_random_keys_both_signs_and_padding():
    """Full-range keys (both signs), N not a multiple of the scan block; row 1 has fewer than k real
    keys (INT64_MIN elsewhere, as the work buffer's unfilled columns), row 2 none."""
    g = torch.Generator().manual_seed(0)
    n, k = BLOCK + 333, 100
    keys = _distinct(g, 4, n)
    assert (keys < 0).any() and (keys > 0).any()
    keys[1, torch.randperm(n, generator=g)[: n - 37]] = _NONE
    keys[2] = _NONE
    _check(keys, k)


def test_keys_sharing_their_high_bytes():
    """Keys equal above their lowest byte (and a row of negative ones): the radix select goes down to
    the last level; k not a power of two, k = N."""
    g = torch.Generator().manual_seed(1)
    base = torch.tensor([[0x1234_5678_9ABC_DE00], [-0x1234_5678_9ABC_DE00]])
    keys = base + _distinct(g, 2, 200, 0, 256)
    _check(keys, 37)
    _check(keys[:, :53], 53)


def test_keys_next_to_the_padding():
    """Keys just above INT64_MIN (its prefix at every level but the last) among INT64_MIN padding:
    the padding is never taken in their place, with more than k of them and with fewer."""
    g = torch.Generator().manual_seed(4)
    keys = torch.full((2, 300), _NONE)
    keys[0, :60] = _NONE + 1 + _distinct(g, 1, 60, 0, 256)[0]
    keys[1, :20] = keys[0, :20]
    _check(keys[:, torch.randperm(300, generator=g)], 37)


def test_kth_key_ending_a_bucket():
    """The top k are exactly the keys of the higher buckets at one radix level (at the top byte, at
    a middle byte, negative keys): the k-th largest is its bucket's smallest, the count at or above
    it equals k exactly."""
    g = torch.Generator().manual_seed(3)
    n, k = 300, 37
    low = _distinct(g, 3, n, 0, 1 << 24)
    high = torch.tensor([[0x4F, 0x1F], [0x0123_4590, 0x0123_4580], [-0x20, -0x30]]) << torch.tensor([[56], [32], [56]])
    keys = high[:, 1:] + low
    keys[:, :k] += high[:, :1] - high[:, 1:]
    _check(keys[:, torch.randperm(n, generator=g)], k)


def test_packed_scores_with_ties_and_signed_zeros():
    """Keys from ``pack_keys`` of scores with many equal values, -0.0 and +0.0 and -inf: the id part
    breaks the ties, and -0.0 ranks as +0.0."""
    g = torch.Generator().manual_seed(2)
    values = torch.tensor([-0.0, 0.0, 1.5, -2.0, 3.0, float("-inf"), 1e-30, -1e-30])
    scores = values[torch.randint(0, values.numel(), (2, 500), generator=g)]
    ids = torch.randperm(500, generator=g)
    keys = pack_keys(scores, ids)
    assert (scores == 0).sum() > 100
    for k in (64, 200):
        _check(keys, k)


@triton.jit
def _sort_kernel(x_ptr, y_ptr, N: tl.constexpr, THREADS: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, sort_desc(tl.load(x_ptr + i), THREADS))


@pytest.mark.parametrize("threads", [1, 4, 8, 16])
def test_sort_desc_equals_a_descending_sort(threads):
    """``sort_desc`` (its keys read in another order first where the block holds at least two repeats
    of SORT_VEC x THREADS keys: 64 keys at 1 to 8 threads, not at 16) against torch.sort: full-range
    distinct keys and INT64_MIN padding."""
    g = torch.Generator().manual_seed(threads)
    x = _distinct(g, 1, 64)[0]
    x[torch.randperm(64, generator=g)[:9]] = _NONE
    y = torch.empty_like(x)
    _sort_kernel[(1,)](x, y, N=64, THREADS=threads)
    assert (64 >= 2 * SORT_VEC * threads) == (threads < 16)
    assert torch.equal(y, torch.sort(x, descending=True).values)


def test_a_sort_of_2048_candidates():
    """k 1,024 with a candidate buffer of 2k: the sort of 2,048 keys takes ``sort_desc``'s reordered
    form at the kernel's 8 warps (2,048 = 2 x SORT_VEC x 256 threads)."""
    g = torch.Generator().manual_seed(5)
    keys = _distinct(g, 2, 3000)
    keys[1, torch.randperm(3000, generator=g)[:1500]] = _NONE
    _check(keys, 1024)


def test_bad_shapes_raise():
    keys = torch.zeros(2, 10, dtype=torch.int64)
    with pytest.raises(ValueError, match="k <= N"):
        topk_keys(keys, 11, torch.empty(2, 11, dtype=torch.int64))
    with pytest.raises(ValueError, match="cand"):
        topk_keys(keys, 4, torch.empty(2, 4, dtype=torch.int64), torch.empty(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        topk_keys(keys.int(), 4, torch.empty(2, 4, dtype=torch.int64))
