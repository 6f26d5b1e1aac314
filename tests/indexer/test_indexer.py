"""Replicated DSA indexer: Triton scoring (interpreter on CPU) + select_topk against the float64 reference.

Two kinds of input:
* exact: integer keys in [-15, 15] (dequantized exactly from fp8), integer
  queries in [-3, 3] and weights in multiples of 1/4, so every score is an
  exact fp32 number in any summation order. Kernel and reference must then
  agree bit for bit on scores and exactly on the ordered top-k, ties included
  (many ties: duplicated keys, small integer range).
* random floats: the kernel's fp32 scores must be within 1e-5 relative of the
  float64 reference, and the selected sets may differ only on tokens whose
  reference score lies within that tolerance of the k-th best score.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer.formats import get_format
from sparkinfer.core.topology import IndexSharePattern
from sparkinfer.indexer import (ReplicatedIndexerCache, indexer_scores, indexer_scores_torch, indexer_topk,
                                indexer_topk_rows, indexer_topk_torch, merge_candidates, plan_rows, select_topk,
                                shard_candidates)
from sparkinfer.indexer import tiled, triton_scores

IDX = get_format("indexer_fp8")


def exact_case(m=4, hi=4, t=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-15, 16, (t, 128), generator=g).float()
    keys[t // 2: t // 2 + 20] = keys[:20]  # duplicated keys: exact score ties
    q = torch.randint(-3, 4, (m, hi, 128), generator=g).float()
    w = torch.randint(0, 9, (m, hi), generator=g).float() / 4
    pos = torch.randint(0, t, (m,), generator=g)
    pos[0] = t - 1
    return q, w, IDX.encode(keys), pos, keys


def random_case(m=4, hi=4, t=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(t, 128, generator=g)
    q = torch.randn(m, hi, 128, generator=g)
    w = torch.randn(m, hi, generator=g)
    pos = torch.randint(0, t, (m,), generator=g)
    pos[0] = t - 1
    return q, w, IDX.encode(keys), pos


def brute_topk(scores, k):
    """Python reference of the tie rule on a float64 score matrix."""
    out = []
    for row in scores.tolist():
        order = sorted((i for i, s in enumerate(row) if s != -math.inf), key=lambda i: (-row[i], i))[:k]
        out.append(order + [-1] * (k - len(order)))
    return torch.tensor(out, dtype=torch.int32)


def test_exact_inputs_dequantize_exactly():
    _, _, records, _, keys = exact_case()
    assert torch.equal(IDX.decode(records), keys)


@pytest.mark.parametrize("k", [8, 64, 250])
def test_triton_matches_reference_exactly_on_exact_inputs(k):
    q, w, records, pos, _ = exact_case()
    ref_scores = indexer_scores_torch(q, w, records, pos)
    scores = indexer_scores(q, w, records, pos, backend="triton")
    assert torch.equal(scores.double(), ref_scores)
    ids = indexer_topk(q, w, records, pos, k, backend="triton")
    ref = indexer_topk_torch(q, w, records, pos, k)
    assert ids.dtype == torch.int32 and ids.shape == (4, k)
    assert torch.equal(ids, ref)
    assert torch.equal(ref, brute_topk(ref_scores, k))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp8_q_scores_as_its_values(backend):
    """vLLM's quantized q (float8_e4m3fn, read as its bytes by the Triton kernel) scores and selects
    exactly as the same values widened to fp32; with ties among duplicated keys, at every k."""
    q, w, records, pos, _ = exact_case(seed=3)
    g = torch.Generator().manual_seed(3)
    spread = torch.exp2(torch.randint(-12, 9, q.shape, generator=g).float())  # e4m3's range, subnormals included
    q = (q * spread).to(torch.float8_e4m3fn)
    assert ((q.float().abs() < 2 ** -6) & (q.float() != 0)).any()
    assert torch.equal(indexer_scores(q, w, records, pos, backend=backend),
                       indexer_scores(q.float(), w, records, pos, backend=backend))
    for k in (8, 250):
        assert torch.equal(indexer_topk(q, w, records, pos, k, backend=backend),
                           indexer_topk(q.float(), w, records, pos, k, backend=backend))


def test_ties_break_to_lower_token_id():
    keys = torch.zeros(10, 128)
    keys[:, 0] = torch.tensor([1, 3, 3, 2, 3, 1, 0, 3, 2, 1]).float()
    q = torch.zeros(1, 1, 128)
    q[0, 0, 0] = 1
    w = torch.ones(1, 1)
    pos = torch.tensor([9])
    for backend in ("triton", "torch"):
        ids = indexer_topk(q, w, IDX.encode(keys), pos, 6, backend=backend)
        assert ids.tolist() == [[1, 2, 4, 7, 3, 8]]


def test_causal_prefix_and_padding():
    q, w, records, _, _ = exact_case(m=3, t=50)
    pos = torch.tensor([0, 4, 49])
    for backend in ("triton", "torch"):
        ids = indexer_topk(q, w, records, pos, 8, backend=backend)
        assert ids[0].tolist() == [0] + [-1] * 7
        assert sorted(ids[1, :5].tolist()) == [0, 1, 2, 3, 4] and ids[1, 5:].tolist() == [-1] * 3
        assert (ids[2] >= 0).all() and ids[2].unique().numel() == 8
    # k larger than the whole cache
    assert indexer_topk(q, w, records, pos, 64, backend="triton").shape == (3, 64)


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_on_random_floats_within_tolerance(seed):
    q, w, records, pos = random_case(seed=seed)
    q = q.to(torch.bfloat16) if seed else q
    ref = indexer_scores_torch(q, w, records, pos)
    scores = indexer_scores(q, w, records, pos, backend="triton")
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(scores), finite)
    tol = 1e-5 * (ref[finite].abs() + 1)
    assert ((scores.double()[finite] - ref[finite]).abs() <= tol).all()
    k = 32
    ids = indexer_topk(q, w, records, pos, k, backend="triton")
    ref_ids = indexer_topk_torch(q, w, records, pos, k)
    for r in range(q.shape[0]):
        a, b = set(ids[r].tolist()) - {-1}, set(ref_ids[r].tolist()) - {-1}
        kth = ref[r].sort(descending=True).values[min(k, int(pos[r]) + 1) - 1]
        for t in a ^ b:
            assert abs(ref[r, t] - kth) <= 2e-5 * (abs(kth) + 1), (r, t)


def test_strided_q_and_w_equal_contiguous():
    q, w, records, pos = random_case(t=60, hi=3)
    q_wide = torch.zeros(4, 6, 128)
    q_wide[:, ::2] = q
    w_t = w.t().contiguous().t()  # column-major [M, Hi]
    for backend in ("triton", "torch"):
        assert torch.equal(indexer_scores(q_wide[:, ::2], w_t, records, pos, backend=backend),
                           indexer_scores(q, w, records, pos, backend=backend))
    # fp8 q whose heads are off 4-byte alignment (129 bytes apart): the Triton kernel reads a head's codes
    # as words, so ``q_operand`` copies it
    q8 = q.to(torch.float8_e4m3fn)
    odd = torch.zeros(4, 3, 129, dtype=torch.uint8)
    odd[:, :, 1:] = q8.view(torch.uint8)
    q_odd = odd[:, :, 1:].view(torch.float8_e4m3fn)
    assert triton_scores.q_operand(q_odd)[0].stride(1) % 4 == 0
    assert torch.equal(indexer_scores(q_odd, w_t, records, pos, backend="triton"),
                       indexer_scores(q8, w, records, pos, backend="triton"))


def test_triton_kernel_refuses_an_empty_cache():
    """A position past its row's list reads record 0 (the key pass loads a chunk's key words without a
    mask, ``triton_scores.chunk_scores``), so a launch over a cache without records is refused."""
    q, w, records, pos = random_case(t=10)
    with pytest.raises(ValueError, match="records are supported"):
        triton_scores.indexer_scores_triton(q, w, records[:0], pos, torch.zeros(3, dtype=torch.int64))


def test_paged_token_slots_equal_contiguous():
    q, w, records, pos = random_case(t=120)
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(3))
    pool = torch.zeros(200, 132, dtype=torch.uint8)
    slots = perm + 40
    pool[slots] = records
    for backend in ("triton", "torch"):
        assert torch.equal(indexer_topk(q, w, pool, pos, 16, slots, backend=backend),
                           indexer_topk(q, w, records, pos, 16, backend=backend))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_select_topk_matches_brute_force(data):
    m = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(1, 12))
    k = data.draw(st.integers(1, 15))
    values = st.sampled_from([-math.inf, -2.5, -0.0, 0.0, 1.0, 1.0000001, 3.0, 1e30])
    scores = torch.tensor([[data.draw(values) for _ in range(n)] for _ in range(m)], dtype=torch.float32)
    ids, best = select_topk(scores, k, with_scores=True)
    assert torch.equal(ids, brute_topk(scores.double(), k))
    expect = torch.where(ids >= 0, scores.gather(1, ids.clamp(min=0).long()), torch.tensor(-math.inf))
    assert torch.equal(best, expect + 0.0)


def test_sharded_candidates_merge_to_replicated_topk():
    """Upstream DCP (each rank scores its shard, global merge) selects what the replicated indexer does."""
    q, w, records, pos = random_case(t=150, seed=4)
    k = 24
    replicated = indexer_topk(q, w, records, pos, k, backend="triton")
    for world, interleave in ((4, 1), (4, 8), (3, 2)):
        tokens = torch.arange(150)
        cands = []
        for rank in range(world):
            mine = tokens[(tokens // interleave) % world == rank]
            cands.append(shard_candidates(q, w, records[mine], mine, pos, k, backend="triton"))
        merged = merge_candidates(torch.stack([c[0] for c in cands]), torch.stack([c[1] for c in cands]), k)
        assert torch.equal(merged, replicated), (world, interleave)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_key_merge_equals_the_score_merge(backend):
    """``all_gather_merge`` (the engine's: int64 keys in ``MergeBuffers``, one top-k: torch.topk or
    the Triton one into its CAP = k output) against
    ``merge_candidates`` (scores and ids, ``select_topk``) on candidates with tied scores, -0.0 and
    padding, the all-gather simulated in rank order; buffers of fewer rows than a call give buffers
    of its size, the same answer."""
    from sparkinfer.indexer import MergeBuffers, all_gather_merge
    from sparkinfer.indexer.topk import pack_keys

    g = torch.Generator().manual_seed(9)
    world, m, k = 3, 5, 6
    scores = torch.randint(-3, 3, (world, m, k), generator=g).float()  # many ties across ranks
    scores[0, 0, 0] = -0.0
    ids = torch.stack([torch.randperm(40, generator=g)[: m * k].view(m, k) * world + r for r in range(world)])
    ids = ids.to(torch.int32)
    pad = torch.rand(world, m, k, generator=g) < 0.3
    scores, ids = scores.masked_fill(pad, float("-inf")), ids.masked_fill(pad, -1)
    want = merge_candidates(scores, ids, k)
    every = pack_keys(scores, ids.clamp(min=0)).view(world * m, k)
    for rows in (m, m - 2):
        for rank in range(world):
            views = MergeBuffers(world, rows, k, "cpu").take(m)
            views.mine.copy_(every[rank * m:(rank + 1) * m])
            out = torch.full((m, k + 2), 7, dtype=torch.int32)
            got = all_gather_merge(views, lambda into, mine: into.copy_(every), out[:, :k], backend)
            assert got.data_ptr() == out.data_ptr() and torch.equal(got, want), (rows, rank)
            assert bool((out[:, k:] == 7).all())


def test_cache_write_and_topk():
    layers = [0, 1, 2, 6, 10]
    cache = ReplicatedIndexerCache(layers, capacity=64)
    assert cache.bytes_per_token == 5 * 132
    glm = ReplicatedIndexerCache.for_pattern(IndexSharePattern.glm52(), capacity=1)
    assert glm.bytes_per_token == 22 * 132 == 2904  # 21 Full layers + the MTP layer
    assert glm.layers[:4] == (0, 1, 2, 6) and glm.layers[-2:] == (74, 78)
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(40, 128, generator=g)
    slots = torch.randperm(64, generator=g)[:40]
    cache.write(6, slots, keys)
    assert torch.equal(cache.layer_records(6)[slots], IDX.encode(keys))
    assert torch.all(cache.layer_records(2) == 0)
    q, w = torch.randn(2, 4, 128, generator=g), torch.rand(2, 4, generator=g)
    pos = torch.tensor([39, 10])
    got = cache.topk(6, q, w, pos, 8, slots, backend="triton")
    assert torch.equal(got, indexer_topk(q, w, IDX.encode(keys), pos, 8, backend="triton"))
    with pytest.raises(ValueError, match="layer 3 has no indexer cache"):
        cache.write(3, slots, keys)
    with pytest.raises(ValueError, match="distinct"):
        cache.write(0, torch.tensor([1, 1]), keys[:2])
    with pytest.raises(ValueError, match="capacity"):
        cache.write(0, torch.tensor([64]), keys[:1])
    with pytest.raises(ValueError, match="keys must be"):
        cache.write(0, torch.tensor([1]), keys[:2])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_input_raises(backend):
    q, w, records, pos = random_case(t=30)
    call = lambda **kw: indexer_topk(**{**dict(q=q, w=w, records=records, pos=pos, k=4, backend=backend), **kw})
    with pytest.raises(ValueError, match="q must be"):
        call(q=q[..., :64])
    with pytest.raises(ValueError, match="w must be"):
        call(w=w[:, :2])
    with pytest.raises(ValueError, match="records must be"):
        call(records=torch.zeros(30, 368, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pos must lie"):
        call(pos=pos + 30)
    with pytest.raises(ValueError, match="pos must be"):
        call(pos=pos[:2])
    with pytest.raises(ValueError, match="finite"):
        call(q=q * math.inf)
    with pytest.raises(ValueError, match="k must be"):
        call(k=0)
    with pytest.raises(ValueError, match="token_slots must lie"):
        call(token_slots=torch.tensor([0, 1, 99]), pos=torch.zeros(4, dtype=torch.int64))


# --- tiled scoring with a running top-k merge (tiled.py) ---------------------------------------------
# tile_bytes=1 gives the smallest tile, 64 positions a pass: T = 300 is five passes with a partial
# last tile, k = 40 < 64 < 100 < T exercises a running top-k shorter and longer than a tile.


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("k", [40, 100])
def test_tiled_topk_equals_untiled_across_tiles(backend, k):
    """Random floats (no exactness to lean on): the tiled merge returns exactly select_topk over the
    whole [M, T] score matrix of the same scorer, ids, order and scores."""
    q, w, records, pos = random_case(m=5, t=300, seed=7)
    pos[1] = 70  # a prefix that ends one position past the first tile
    scores = indexer_scores(q, w, records, pos, backend=backend)
    want_ids, want_best = select_topk(scores, k, with_scores=True)
    for tile_bytes in (1, 5 * 8 * 128, None):  # 64 / 128 positions a pass (Triton), one pass
        ids, best = indexer_topk_rows(q, w, records, pos, k, **tiled.one_list(5, 300, "cpu"), backend=backend,
                                      with_scores=True, tile_bytes=tile_bytes)
        assert torch.equal(ids, want_ids) and torch.equal(best, want_best), tile_bytes


def test_tiled_topk_ties_and_short_rows_equal_the_reference():
    """Exact inputs full of ties (duplicated keys across tile boundaries): tiled Triton, tiled torch,
    the float64 stable-sort reference and the brute-force tie rule agree; rows whose prefix holds
    fewer than k tokens are -1 padded at the end."""
    q, w, records, pos, _ = exact_case(m=4, t=260, seed=2)
    keys = IDX.decode(records)
    keys[64:128] = keys[0:64]  # a whole tile equal to the first one: every score tied across a boundary
    keys[200:210] = keys[60:70]
    records = IDX.encode(keys)
    pos = torch.tensor([259, 130, 20, 63])
    k = 90
    ref = indexer_topk_torch(q, w, records, pos, k)
    assert torch.equal(ref, brute_topk(indexer_scores_torch(q, w, records, pos), k))
    for backend in ("triton", "torch"):
        got = indexer_topk_rows(q, w, records, pos, k, **tiled.one_list(4, 260, "cpu"), backend=backend,
                                tile_bytes=1)
        assert torch.equal(got, ref), backend
    assert (ref[2, 21:] == -1).all() and (ref[2, :21] >= 0).all() and (ref[3, 64:] == -1).all()


@pytest.mark.parametrize("k", [13, 90])
def test_forced_gpu_topk_keys_equal_the_torch_twin(monkeypatch, k):
    """The engine's backend choice with the GPU implementations forced (``decode.impls.kernel_backend``:
    the Triton scorer and ``triton_topk.topk_keys`` every pass) against the torch twin (float64
    scores, torch.topk): the selected int64 keys bit for bit, INT64_MIN padding of short rows
    included, over 64-position passes; k not a power of two, 13 (a pass's k + 64 keys overflow the
    2k candidate buffer: the radix levels decide) and 90 (longer than a pass)."""
    from sparkinfer.decode.impls import FORCE_ENV, kernel_backend

    monkeypatch.setenv(FORCE_ENV, "1")
    backend = kernel_backend(torch.device("cpu"))
    assert backend == "triton"
    q, w, records, pos, _ = exact_case(m=4, t=260, seed=5)
    pos = torch.tensor([259, 130, 20, 63])
    got, want = (indexer_topk_rows(q, w, records, pos, k, **tiled.one_list(4, 260, "cpu"), backend=b,
                                   tile_bytes=1, as_keys=True) for b in (backend, "torch"))
    assert torch.equal(got, want)
    short = min(k, 21)  # row 2 scores positions 0..20
    assert (got[2, short:] == torch.iinfo(torch.int64).min).all() and (got[2, :short] > 0).all()


def _step(seed=11):
    """Three requests of a step in one paged pool: (requests for plan_rows, q, w, pool, pos, per
    request (rows, slots)). Lengths 200, 70 and 1; rows 4 (MTP-like), 3 and 1."""
    g = torch.Generator().manual_seed(seed)
    lens, nrows = (200, 70, 1), (4, 3, 1)
    pool = torch.zeros(400, 132, dtype=torch.uint8)
    free = torch.randperm(400, generator=g)
    m = sum(nrows)
    q, w = torch.randn(m, 4, 128, generator=g), torch.randn(m, 4, generator=g)
    pos = torch.empty(m, dtype=torch.int64)
    reqs, at, row = [], 0, 0
    for n, r in zip(lens, nrows):
        slots = free[at:at + n].long()
        pool[slots] = IDX.encode(torch.randn(n, 128, generator=g))
        rows = torch.arange(row, row + r)
        pos[rows] = n - r + torch.arange(r)  # the request's last r positions, as a step's query rows
        reqs.append((rows, slots))
        at, row = at + n, row + r
    pos[4] = 10  # a row whose prefix is shorter than k
    return q, w, pool, pos, reqs


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_batched_rows_equal_per_request_calls(backend):
    """One batched call over every request of a step (what replicated_indexer's loop over requests
    does in one go) equals the per-request indexer_topk calls, and, with token ids (a rank's owned
    positions), the per-request shard_candidates."""
    q, w, pool, pos, reqs = _step()
    k = 24
    plan = plan_rows([(rows, slots, None) for rows, slots in reqs], q.shape[0])
    assert plan.max_len == 200 and plan.token_ids is None
    got = indexer_topk_rows(q, w, pool, pos, k, **plan.kwargs(), backend=backend, tile_bytes=1)
    for rows, slots in reqs:
        want = indexer_topk(q[rows], w[rows], pool, pos[rows], k, slots, backend=backend)
        assert torch.equal(got[rows], want)
    # sharded: each request scores the positions t with t % 3 == 1 (ids are those positions)
    owned = [(rows, slots[1::3], torch.arange(slots.numel())[1::3]) for rows, slots in reqs]
    plan = plan_rows(owned, q.shape[0] + 1)  # one row more: in no request, all -1
    q1, w1, pos1 = torch.cat([q, q[:1]]), torch.cat([w, w[:1]]), torch.cat([pos, pos[:1]])
    ids, best = indexer_topk_rows(q1, w1, pool, pos1, k, **plan.kwargs(), backend=backend, with_scores=True,
                                  tile_bytes=1)
    assert (ids[-1] == -1).all() and torch.isinf(best[-1]).all()
    for rows, slots, tid in owned:
        s, i = shard_candidates(q[rows], w[rows], pool, tid, pos[rows], k, token_slots=slots, backend=backend)
        assert torch.equal(ids[rows], i) and torch.equal(best[rows], s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_grouped_rows_of_several_lists_equal_the_reference(dtype):
    """A Triton program scores ``GROUPS[precision]`` consecutive rows (4 for bf16 and fp8 q), each
    key chunk loaded once for them: groups that mix requests (rows 4, 3 and 1 of three requests, a row
    in none, so rows 4-7 span two lists and the last group runs past M) select each row's own list
    with the torch twin's keys bit for bit on exact inputs; the score matrix of 5 rows (a group past
    M) equals the float64 reference's."""
    q, w, pool, pos, reqs = _step()
    g = torch.Generator().manual_seed(4)
    pool = IDX.encode(torch.randint(-15, 16, (pool.shape[0], 128), generator=g).float())
    q = torch.cat([q, q[:1]])
    q = torch.randint(-3, 4, q.shape, generator=g).float().to(dtype)
    w = torch.randint(0, 9, q.shape[:2], generator=g).float() / 4
    pos = torch.cat([pos, pos[:1]])
    plan = plan_rows([(rows, slots, None) for rows, slots in reqs], q.shape[0])  # the last row in none
    assert triton_scores.GROUPS[triton_scores.q_operand(q)[1]] == 4
    got, want = (indexer_topk_rows(q, w, pool, pos, 24, **plan.kwargs(), backend=b, tile_bytes=1, as_keys=True)
                 for b in ("triton", "torch"))
    assert torch.equal(got, want) and (got[-1] == torch.iinfo(torch.int64).min).all()
    assert torch.equal(indexer_scores(q[:5], w[:5], pool, pos[:5], backend="triton").double(),
                       indexer_scores_torch(q[:5], w[:5], pool, pos[:5]))


def test_sharded_merge_equals_replicated_with_small_tiles(monkeypatch):
    """The sharded-scoring merge still gives the replicated top-k when both score in 64-position passes."""
    monkeypatch.setattr(tiled, "TILE_BYTES", 1)
    q, w, records, pos = random_case(t=330, seed=8)
    k = 70
    replicated = indexer_topk(q, w, records, pos, k, backend="triton")
    assert torch.equal(replicated, select_topk(indexer_scores(q, w, records, pos, backend="triton"), k))
    tokens = torch.arange(330)
    for world, interleave in ((4, 1), (3, 64)):
        cands = [shard_candidates(q, w, records[mine], mine, pos, k, backend="triton")
                 for mine in (tokens[(tokens // interleave) % world == r] for r in range(world))]
        merged = merge_candidates(torch.stack([c[0] for c in cands]), torch.stack([c[1] for c in cands]), k)
        assert torch.equal(merged, replicated), (world, interleave)


def test_tile_is_bounded_by_the_budget_not_the_context():
    assert tiled.pick_tile(2048, 65536, 8, 256 << 20) == tiled.pick_tile(2048, 1 << 20, 8, 256 << 20) == 16384
    assert tiled.pick_tile(4, 300, 8, 256 << 20) == 320  # a short context: one pass
    assert tiled.pick_tile(8192, 1 << 20, 8, 1) == 64


def test_batched_rows_bad_input_raises():
    q, w, pool, pos, reqs = _step()
    plan = plan_rows([(rows, slots, None) for rows, slots in reqs], q.shape[0])
    call = lambda **kw: indexer_topk_rows(**{**dict(q=q, w=w, records=pool, pos=pos, k=4, **plan.kwargs()), **kw})
    with pytest.raises(ValueError, match="max_len"):
        call(max_len=100)
    with pytest.raises(ValueError, match="row lists must lie"):
        call(row_start=plan.row_start + 300)
    with pytest.raises(ValueError, match="row_len must be"):
        call(row_len=plan.row_len[:2])
    with pytest.raises(ValueError, match="token_ids must be"):
        call(token_ids=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="k must be"):
        call(k=0)


@pytest.mark.gpu
def test_gpu_scores_match_reference():
    q, w, records, pos = random_case(m=8, hi=32, t=20000, seed=12)
    ref = indexer_scores_torch(q, w, records, pos)
    dev = torch.device("cuda")
    got = indexer_scores(q.to(dev), w.to(dev), records.to(dev), pos.to(dev)).cpu().double()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite)
    # fp32 q goes through tf32x3 (q kept to ~22 bits) and fp32 accumulation over 128 dims and the
    # heads: the error scales with the terms' magnitudes, not with the (cancelling) score. A relative
    # 1e-5 of the score failed on the first GPU run where heads cancel; a wrong key, scale or mask is
    # off by the order of the terms themselves
    keys = IDX.decode(records).double()
    terms = (w.double().abs()[:, :, None] * torch.einsum("mhd,td->mht", q.double().abs(), keys.abs())).sum(1)
    err = (got[finite] - ref[finite]).abs()
    assert (err <= 2.0**-18 * terms[finite]).all(), float((err / terms[finite]).max())
    qe, we, re, pe, _ = exact_case(m=8, hi=32, t=5000)
    ids = indexer_topk(qe.to(dev), we.to(dev), re.to(dev), pe.to(dev), 2048).cpu()
    assert torch.equal(ids, indexer_topk_torch(qe, we, re, pe, 2048))


@pytest.mark.gpu
def test_gpu_tiled_topk_equals_untiled_and_offsets_past_int32():
    """Compiled Triton: the tiled merge equals select_topk over the full scores at GLM-5.2's shape,
    and an [M, T] score matrix of more than 2**31 elements is addressed correctly (int64 offsets)."""
    dev = torch.device("cuda")
    q, w, records, pos = (t.to(dev) for t in random_case(m=8, hi=32, t=40000, seed=13))
    scores = indexer_scores(q, w, records, pos)
    for tile_bytes in (1, None):
        got = indexer_topk_rows(q, w, records, pos, 2048, **tiled.one_list(8, 40000, dev), tile_bytes=tile_bytes)
        assert torch.equal(got, select_topk(scores, 2048))
    m, t = 2, (1 << 30) + 64  # 2**31 + 128 scores: the last row's offsets pass 2**31
    slots = torch.zeros(t, dtype=torch.int64, device=dev)
    big = indexer_scores(q[:m], w[:m], records, None, slots)
    assert torch.equal(big[:, -1], scores[:m, 0]) and torch.equal(big[:, 12345], scores[:m, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_gpu_fp8_q_every_code_and_record_offsets_past_int32(dtype):
    """Compiled, the f16 (fp8 q) and bf16 forms (a key word's 4 codes converted by two
    ``cvt.rn.f16x2.e4m3x2`` in inline PTX, and for bf16 on through f32, ``key_rows``; a record's byte
    offset by ``mul.wide.s32``, ``record_rows``): keys holding every finite E4M3 code, in records whose
    byte offsets pass 2**31, score within fp32's error of the float64 reference, and the key pass's
    top-k is the torch twin's on exact inputs."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(21)
    n, hi, m = 4096, 32, 8
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    small = torch.empty(n, 132, dtype=torch.uint8)
    small[:, :128] = finite[torch.arange(n * 128) % len(finite)].view(n, 128)  # every code, in every dim over rows
    small[:, 128:] = torch.full((n,), 2.0**-6).view(torch.uint8).view(n, 4)
    q = torch.randn(m, hi, 128, generator=g).to(dtype)
    w = torch.randn(m, hi, generator=g)
    pos = torch.full((m,), n - 1)
    rows = (1 << 31) // 132 + 1000  # the small records sit past byte 2**31
    records = torch.zeros(rows + n, 132, dtype=torch.uint8, device=dev)
    records[rows:] = small.to(dev)
    slots = torch.arange(rows, rows + n, device=dev)
    got = indexer_scores(q.to(dev), w.to(dev), records, pos.to(dev), slots).cpu().double()
    ref = indexer_scores_torch(q.float(), w, small, pos)
    keys = IDX.decode(small).double()
    terms = (w.double().abs()[:, :, None] * torch.einsum("mhd,td->mht", q.double().abs(), keys.abs())).sum(1)
    assert ((got - ref).abs() <= 2.0**-18 * terms).all()
    qe, we, re, pe, _ = exact_case(m=8, hi=32, t=3000)
    qe = qe.to(dtype)
    big = torch.zeros(rows + 3000, 132, dtype=torch.uint8, device=dev)
    big[rows:] = re.to(dev)
    plan = plan_rows([(torch.arange(8), torch.arange(rows, rows + 3000), None)], 8)
    ids = indexer_topk_rows(qe.to(dev), we.to(dev), big, pe.to(dev), 256, **plan.to(dev).kwargs())
    assert torch.equal(ids.cpu(), indexer_topk_torch(qe.float(), we, re, pe, 256))


def test_prefill_memory_bench_peak_is_flat_in_the_context():
    """benchmarks/indexer_bench.py --prefill-memory on CPU (torch path, 64-position passes): the
    measured peak is the same at a context 4x longer, and holds at least the work buffer."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("indexer_bench",
                                                  Path(__file__).parents[2] / "benchmarks/indexer_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.prefill_memory([640, 2560], chunk=8, heads=2, k=16, device=torch.device("cpu"), tile_bytes=1)
    assert [r["passes"] for r in rows] == [10, 40] and all(r["tile"] == 64 for r in rows)
    assert rows[0]["peak_bytes"] == rows[1]["peak_bytes"] >= 8 * (16 + 64) * 8
    assert all(r["selected_rows_full"] == 8 for r in rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("hi", [4, 32])
def test_compiled_chunk_form_on_exact_inputs(monkeypatch, dtype, hi):
    """The compiled kernel's form of a chunk's scores (``triton_scores.chunk_scores``: the keys as the
    dot's M, the rows' heads as N in ``octets``' order, the head sum per row, the records' scales after
    it), which the interpreter otherwise leaves for ``row_scores``', run interpreted: on exact inputs
    (every order gives the same fp32 numbers) the score matrix of 6 rows (groups of 4: one past M)
    equals the float64 reference bit for bit and the tiled top-k the torch twin's keys, at 4 heads
    (BLOCK_H 16) and at GLM-5.2's 32, over rows of two requests in one group."""
    import triton.language as tl

    monkeypatch.setattr(triton_scores, "_KEYS_AS_M", tl.constexpr(True))
    q, w, records, pos, _ = exact_case(m=6, hi=hi, t=150, seed=5)
    q = q.to(dtype)
    assert torch.equal(indexer_scores(q, w, records, pos, backend="triton").double(),
                       indexer_scores_torch(q.float(), w, records, pos))
    rows = torch.arange(6)
    plan = plan_rows([(rows[:3], torch.arange(150), None), (rows[3:], torch.arange(40, 150), None)], 6)
    got, want = (indexer_topk_rows(q, w, records, pos, 20, **plan.kwargs(), backend=b, tile_bytes=1, as_keys=True)
                 for b in ("triton", "torch"))
    assert torch.equal(got, want)
