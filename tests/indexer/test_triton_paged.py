"""The paged top-k (``indexer.triton_paged``, interpreted on CPU) against today's tiled top-k
(``tiled.indexer_topk_rows`` over the same keys listed by slot, Triton and its torch twin): the
selected int64 keys and ids bit for bit, the tie rule included (duplicated keys score equal), for
rows shorter than k, rows at block boundaries, rows of different lengths in one call, several
tiles per row, one split and several, a block-outermost (strided) cache view, fp8 q, pages of 16
tokens and of a chunk or more (64, 80), and a DCP rank's share of the positions (a sharded step's
candidates)."""

import pytest
import torch

from sparkinfer.core import indexer_tiles
from sparkinfer.core.indexer_tiles import paged_workspace_bytes
from sparkinfer.core.topology import DcpLayout
from sparkinfer.formats import get_format
from sparkinfer.indexer import TopkWorkspace, indexer_topk_rows, plan_rows
from sparkinfer.indexer.triton_paged import paged_topk_rows

IDX = get_format("indexer_fp8")
BS = 16  # tokens per page


def _pages(lens, rows_per_req, strided, seed=0, exact=True):
    """A paged indexer cache holding requests of ``lens`` tokens in shuffled blocks, exact keys
    (integers in [-15, 15], the first 20 repeated at 100: exact score ties) or random ones, and the
    step's rows: each request's last ``rows_per_req`` positions. -> (cache, table, row_req, pos, slots
    per request)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BS) for n in lens) + 1
    nb = len(lens) * width + 2
    backing = torch.zeros(nb, BS, 132 + (40 if strided else 0), dtype=torch.uint8)
    cache = backing[:, :, :132]
    table = torch.randperm(nb, generator=g)[:len(lens) * width].view(len(lens), width).to(torch.int32)
    slots = []
    for r, n in enumerate(lens):
        t = torch.arange(n)
        sl = table[r, t // BS].long() * BS + t % BS
        keys = torch.randint(-15, 16, (n, 128), generator=g).float() if exact else torch.randn(n, 128, generator=g)
        if n > 120:
            keys[100:120] = keys[:20]
        for i in range(n):
            cache[sl[i] // BS, sl[i] % BS] = IDX.encode(keys[i:i + 1])[0]
        slots.append(sl)
    row_req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(rows_per_req))
    pos = torch.cat([torch.arange(n - r, n) for n, r in zip(lens, rows_per_req)])
    return cache, table, row_req, pos, slots


def _qw(m, hi=4, seed=1, exact=True):
    g = torch.Generator().manual_seed(seed)
    if exact:
        return (torch.randint(-3, 4, (m, hi, 128), generator=g).float(),
                torch.randint(0, 9, (m, hi), generator=g).float() / 4)
    return torch.randn(m, hi, 128, generator=g), torch.randn(m, hi, generator=g)


def _tiled(q, w, cache, row_req, pos, slots, k, backend, shard=None):
    """Today's top-k keys: each row lists its request's slots (a DCP rank's owned ones with their
    token ids), in the cache's flat row view."""
    m = q.shape[0]
    pitch = cache.stride(1)  # bytes between a page's records: the flat view's row stride
    rows = cache.as_strided(((cache.shape[0] - 1) * cache.stride(0) // pitch + cache.shape[1], 132), (pitch, 1))
    to_row = lambda s: (s // BS) * (cache.stride(0) // pitch) + s % BS
    reqs = []
    for r, sl in enumerate(slots):
        mine = torch.nonzero(row_req == r).flatten()
        if shard is None:
            reqs.append((mine, to_row(sl), None))
        else:
            rank, layout = shard
            tok = layout.token_of(rank, torch.arange(layout.local_len(sl.numel(), rank)))
            reqs.append((mine, to_row(sl[tok]), tok))
    plan = plan_rows(reqs, m)
    return indexer_topk_rows(q, w, rows, pos, k, **plan.kwargs(), backend=backend, tile_bytes=1, as_keys=True)


def _paged(q, w, cache, table, row_req, pos, k, tile, shard=None, as_keys=True, rows_per_req=1):
    ws = TopkWorkspace(paged_workspace_bytes(q.shape[0], k, tile), "cpu")
    out = torch.full((q.shape[0], k), 7, dtype=torch.int64 if as_keys else torch.int32)
    return paged_topk_rows(q, w, cache, table, row_req, pos, k, tile=tile, workspace=ws, out=out, shard=shard,
                           as_keys=as_keys, rows_per_req=rows_per_req)


@pytest.mark.parametrize("programs, rows_per_req", [(1, 1), (256, 1), (1, 4), (256, 4)])
def test_paged_equals_tiled_ties_short_rows_and_block_boundaries(monkeypatch, programs, rows_per_req):
    """Three requests (200 tokens with 4 MTP rows, 64 = 4 whole pages with 3 rows, 5 with 1 row) and
    a row moved to position 15 (the end of the first page) and one to 16 (the first of the next):
    rows shorter than k, at block boundaries, of different lengths, in one call; passes of 64
    positions; one split per row (one launch) and several; a program per row, and per 4 rows (a
    request's MTP rows share its keys; the second group holds two requests). Keys, ids and the -1 /
    INT64_MIN padding equal today's (Triton and its torch twin)."""
    monkeypatch.setattr(indexer_tiles, "PAGED_PROGRAMS", programs)
    cache, table, row_req, pos, slots = _pages((200, 64, 5), (4, 3, 1), strided=False)
    pos[4], pos[5] = BS - 1, BS  # request 1's rows at a page's last and the next page's first token
    q, w = _qw(pos.numel())
    k = 40
    want = _tiled(q, w, cache, row_req, pos, slots, k, "triton")
    assert torch.equal(want, _tiled(q, w, cache, row_req, pos, slots, k, "torch"))
    got = _paged(q, w, cache, table, row_req, pos, k, tile=64, rows_per_req=rows_per_req)
    assert torch.equal(got, want)
    ids = _paged(q, w, cache, table, row_req, pos, k, tile=64, as_keys=False, rows_per_req=rows_per_req)
    assert torch.equal(ids, (~want).to(torch.int32))  # unpack_keys' rule: the key's complement is the id
    assert (ids[7, :5] >= 0).all() and (ids[7, 5:] == -1).all()  # positions 0 .. 4, k 40
    assert (ids[4, BS:] == -1).all() and (ids[5, BS + 1:] == -1).all()
    # the tie rule decides: at least one selected pair of equal scores (repeated keys) in id order
    scores = (want >> 32)
    assert ((scores[:, 1:] == scores[:, :-1]) & (want[:, 1:] != torch.iinfo(torch.int64).min)).any()


@pytest.mark.parametrize("bs", [64, 80, 128, 192])
def test_paged_pages_of_a_chunk_or_more(bs):
    """Pages of a multiple of a chunk's 64 tokens (the engine's are 64 x DCP): the kernel finds a
    chunk's one page with one shift (a power of two, ``PAGE_SHIFT``) or division and one block-table
    entry (``PAGE_CHUNKS``). 64: a chunk a page; 128: two chunks a page; 192 (DCP 3): three, found by
    the division; 80: chunks across pages (a page and a place per token); rows at a
    page's last and the next page's first token, passes of 128 positions, fp8 q; the records of a
    request's last page past its tokens hold NaN codes and scales (a one-page chunk reads them
    unmasked: they must not count). Keys equal today's."""
    globals_ = globals()
    old, globals_["BS"] = globals_["BS"], bs  # the helpers' page size
    try:
        cache, table, row_req, pos, slots = _pages((300, 170), (2, 2), strided=False, seed=13)
        for r, n in enumerate((300, 170)):
            for t in range(n, -(-n // bs) * bs):
                cache[table[r, t // bs], t % bs] = 255  # E4M3 0xFF and an fp32 scale of all ones: NaN
        pos[2], pos[3] = bs - 1, bs
        q, w = _qw(pos.numel(), seed=14)
        q = q.to(torch.float8_e4m3fn)
        k = 40
        assert torch.equal(_paged(q, w, cache, table, row_req, pos, k, tile=128, rows_per_req=2),
                           _tiled(q, w, cache, row_req, pos, slots, k, "triton"))
    finally:
        globals_["BS"] = old


@pytest.mark.parametrize("bs, shard, compiled", [(16, None, False), (64, None, False), (16, (1, DcpLayout(2, 8)), False),
                                                 (64, None, True)])
def test_paged_keys_as_m_equals_tiled(monkeypatch, bs, shard, compiled):
    """The form sm_90 compiles (``KEYS_AS_M``: the chunk's keys as the dot's M, the group's rows stacked
    as its N, ``triton_scores.chunk_scores``; the rows' keys stored from one [64, ROWS] block), forced
    here: the keys equal today's for requests of 200, 64 and 5 tokens (4, 3 and 1 rows: groups of 2
    rows, one across two requests), rows at a page's last and the next page's first token, several
    splits, fp8 q, exact ties; pages of 16 (a page and a place per token), of 64 (a chunk a page, by a
    shift) and a DCP rank's share. ``compiled``: ``chunk_scores``' compiled form too (the octet-ordered
    dot and weights, ``triton_scores._KEYS_AS_M``), interpreted: the same numbers on these exact inputs."""
    import triton.language as tl

    from sparkinfer.indexer import triton_paged, triton_scores

    monkeypatch.setattr(triton_paged, "keys_as_m_on", lambda device: True)
    monkeypatch.setattr(triton_scores, "_KEYS_AS_M", tl.constexpr(compiled))
    monkeypatch.setattr(indexer_tiles, "PAGED_PROGRAMS", 256)
    globals_ = globals()
    old, globals_["BS"] = globals_["BS"], bs  # the helpers' page size
    try:
        cache, table, row_req, pos, slots = _pages((200, 64, 5), (4, 3, 1), strided=False, seed=15)
        pos[4], pos[5] = bs - 1, bs
        q, w = _qw(pos.numel(), seed=16)
        q = q.to(torch.float8_e4m3fn)
        k = 40
        want = _tiled(q, w, cache, row_req, pos, slots, k, "triton", shard=shard)
        got = _paged(q, w, cache, table, row_req, pos, k, tile=64, shard=shard, rows_per_req=4)
        assert torch.equal(got, want)
        if shard is None:  # the tie rule decides: a selected pair of equal scores in id order
            assert (((want >> 32)[:, 1:] == (want >> 32)[:, :-1]) & (want[:, 1:] != torch.iinfo(torch.int64).min)).any()
    finally:
        globals_["BS"] = old


def test_paged_strided_cache_fp8_q_and_random_scores():
    """A block-outermost cache view (pages 172 bytes apart per record), fp8 q (the engine's), random
    floats; tile 128, more rows than the splits' budget spreads (one split each)."""
    cache, table, row_req, pos, slots = _pages((200, 129), (4, 4), strided=True, exact=False, seed=3)
    q, w = _qw(pos.numel(), exact=False, seed=4)
    q = q.to(torch.float8_e4m3fn)
    k = 50
    assert torch.equal(_paged(q, w, cache, table, row_req, pos, k, tile=128, rows_per_req=4),
                       _tiled(q, w, cache, row_req, pos, slots, k, "triton"))


@pytest.mark.parametrize("interleave", [1, 8])
def test_paged_rank_share_equals_the_owned_lists(interleave):
    """Scored sharded: each DCP rank's candidates (its owned positions, ids the tokens) equal the
    tiled top-k over the positions ``DcpLayout`` gives it, for both ranks of 2, interleave 1 and 8."""
    cache, table, row_req, pos, slots = _pages((200, 37), (4, 2), strided=False, seed=5)
    q, w = _qw(pos.numel(), seed=6)
    k = 24
    for rank in range(2):
        shard = (rank, DcpLayout(2, interleave))
        assert torch.equal(_paged(q, w, cache, table, row_req, pos, k, tile=64, shard=shard, rows_per_req=2),
                           _tiled(q, w, cache, row_req, pos, slots, k, "triton", shard=shard)), rank


@pytest.mark.parametrize("programs", [1, 256])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_paged_reads_bf16_weights_and_flags_non_finite_ones(monkeypatch, programs, bad):
    """bf16 weights read as they are give the ids of their fp32 widening (one split and several), and
    the check word is set exactly when a row's weights hold a NaN or an infinity (programs of 2 rows:
    the bad row is the step's last, alone in its group)."""
    monkeypatch.setattr(indexer_tiles, "PAGED_PROGRAMS", programs)
    cache, table, row_req, pos, _ = _pages((70, 20), (2, 1), strided=False, seed=11)
    q, w = _qw(pos.numel(), exact=False, seed=12)
    w = w.bfloat16()
    if bad is not None:
        w[2, 3] = bad
    k = 16
    ws = TopkWorkspace(paged_workspace_bytes(q.shape[0], k, 64), "cpu")
    flag = torch.zeros(1, dtype=torch.int32)
    got = paged_topk_rows(q, w, cache, table, row_req, pos, k, tile=64, workspace=ws, flag=flag,
                          out=torch.zeros(q.shape[0], k, dtype=torch.int32), rows_per_req=2)
    assert int(flag) == (bad is not None)
    if bad is None:
        assert torch.equal(got, _paged(q, w.float(), cache, table, row_req, pos, k, tile=64, as_keys=False))


def test_paged_bad_input_raises():
    cache, table, row_req, pos, _ = _pages((20,), (2,), strided=False)
    q, w = _qw(2)
    with pytest.raises(ValueError, match="tile"):
        _paged(q, w, cache, table, row_req, pos, 8, tile=100)
    with pytest.raises(ValueError, match="out must be"):  # ids are int32
        paged_topk_rows(q, w, cache, table, row_req, pos, 8, tile=64, workspace=TopkWorkspace(1 << 20, "cpu"),
                        out=torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="workspace"):
        paged_topk_rows(q, w, cache, table, row_req, pos, 8, tile=64, workspace=TopkWorkspace(64, "cpu"),
                        out=torch.zeros(2, 8, dtype=torch.int32))


def test_two_steps_of_one_shape_launch_the_same_whatever_their_contexts():
    """What a captured CUDA graph needs (``testing.launches``: kernels, pointers, shapes, scalars and
    grids): two steps of 4 rows whose contexts differ (positions refilled in place, as the builder's
    persistent buffers are) make the same launches with the paged top-k after a first call (which
    makes the workspace's split counters, as vLLM's warm-up runs would) and give each its own top-k,
    while the tiled top-k over host-planned lists does not (its lists and passes follow the contexts)."""
    from sparkinfer.testing import launches

    cache, table, row_req, _, slots = _pages((330, 90), (2, 2), strided=True, seed=7)
    q, w = _qw(4, seed=8)
    k, tile = 16, 64
    pos = torch.zeros(4, dtype=torch.int64)
    ws = TopkWorkspace(paged_workspace_bytes(4, k, tile), "cpu")
    out = torch.zeros(4, k, dtype=torch.int32)
    paged_topk_rows(q, w, cache, table, row_req, pos, k, tile=tile, workspace=ws, out=out)  # warm-up: the counters
    assert not ws.counts.any()
    recs, tops = [], []
    for step in ([300, 301, 40, 41], [20, 21, 88, 89]):
        pos.copy_(torch.tensor(step))
        with launches.record() as rec:
            paged_topk_rows(q, w, cache, table, row_req, pos, k, tile=tile, workspace=ws, out=out)
        recs.append(rec)
        tops.append(out.clone())
        want = _tiled(q, w, cache, row_req, pos, [s[:max(step[2 * r:2 * r + 2]) + 1] for r, s in enumerate(slots)],
                      k, "triton")
        assert torch.equal(out, (~want).to(torch.int32))
    assert not torch.equal(tops[0], tops[1])
    assert launches.first_difference(recs[:1], recs[1:]) is None
    assert any(e[1] == "triton:_paged_topk_kernel" for e in recs[0].events)
    tiled_recs = []
    for step in ([300, 301, 40, 41], [20, 21, 88, 89]):
        pos.copy_(torch.tensor(step))
        with launches.record() as rec:
            _tiled(q, w, cache, row_req, pos, [s[:max(step[2 * r:2 * r + 2]) + 1] for r, s in enumerate(slots)],
                   k, "triton")
        tiled_recs.append(rec)
    assert launches.first_difference(tiled_recs[:1], tiled_recs[1:]) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "random"])
def test_gpu_paged_equals_tiled_at_decode_shapes(exact):
    """On a GPU, where the splits run at once and the row's last one merges (the memory ordering the
    interpreter cannot check): 16 and 64 rows (16 and 4 splits) of four requests over 40,000-token
    contexts of 64-token pages, k 2,048, the engine's tile. Exact inputs (integer keys, q and
    weights in quarters: every sum exact in any order; duplicated keys: ties): the tiled call's ids
    bit for bit. Random inputs: the two kernels sum a score's heads in different fp32 orders (the
    tiled scorer's octet layout, ``triton_scores.chunk_scores``), so each must be a top-k of the
    float64 reference scores up to fp32's error (``_within_error``), not the other's bits."""
    from sparkinfer.core.indexer_tiles import paged_tile

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(9)
    t, bs, k = 40000, 64, 2048
    if exact:
        keys = torch.randint(-15, 16, (4 * t, 128), generator=g).float()
        keys[5000:5100] = keys[:100]  # exact score ties across the requests' first pages
    else:
        keys = torch.randn(4 * t, 128, generator=g)
    records = IDX.encode(keys).to(dev)
    pages = records.view(-1, bs, 132)
    table = torch.randperm(pages.shape[0], generator=g).view(4, -1).to(dev, torch.int32)
    slots = (table.long()[:, :, None] * bs + torch.arange(bs, device=dev)).view(4, -1)[:, :t]
    for m in (16, 64):
        if exact:
            q = torch.randint(-3, 4, (m, 32, 128), generator=g).float().to(dev, torch.bfloat16)
            w = (torch.randint(0, 9, (m, 32), generator=g).float() / 4).to(dev)
        else:
            q = torch.randn(m, 32, 128, generator=g).to(dev, torch.bfloat16)
            w = torch.rand(m, 32, generator=g).to(dev)
        req = torch.arange(m, device=dev) % 4
        pos = t - 1 - torch.randint(0, 3000, (m,), generator=g).to(dev)
        ws = TopkWorkspace(paged_workspace_bytes(m, k, paged_tile(t)), dev)
        got = paged_topk_rows(q, w, pages, table, req, pos, k, tile=paged_tile(t), workspace=ws,
                              out=torch.empty(m, k, dtype=torch.int32, device=dev))
        assert not ws.counts.any()
        plan = plan_rows([(torch.nonzero(req.cpu() == r).flatten(), slots[r].cpu(), None) for r in range(4)], m)
        want = indexer_topk_rows(q, w, records, pos, k, **plan.to(dev).kwargs(), check_values=False)
        if exact:
            assert torch.equal(got, want), m
            continue
        for ids in (got, want):
            _within_error(ids, q, w, IDX.decode(records).double(), slots, req, pos, k)


def _within_error(ids, q, w, keys, slots, req, pos, k):
    """``ids`` [M, k] (token ids of each row's request, best first) is a top-k of the float64 scores up
    to fp32's error: every selected token scores at least the k-th best score less its bound, every
    other at most the k-th plus its bound (bound 2^-18 of the row's terms |w| |q| . |key|, as
    test_indexer's reference check), and the ids are distinct."""
    for m in range(ids.shape[0]):
        kv = keys[slots[int(req[m])][: int(pos[m]) + 1]]
        dots = torch.einsum("hd,td->ht", q[m].double(), kv)
        score = (w[m].double()[:, None] * dots.clamp(min=0)).sum(0)
        terms = (w[m].double().abs()[:, None] * torch.einsum("hd,td->ht", q[m].double().abs(), kv.abs())).sum(0)
        bound = 2.0**-18 * terms
        kth = score.topk(k).values[-1]
        sel = torch.zeros_like(score, dtype=torch.bool)
        sel[ids[m].long()] = True
        assert int(sel.sum()) == k, m  # distinct ids, all of the row's tokens
        assert (score[sel] >= kth - bound[sel]).all() and (score[~sel] <= kth + bound[~sel]).all(), m
