"""Sparse MLA over a vLLM-style paged record cache (sparkinfer.decode.paged_sparse_mla), no vllm needed.

References: a Python loop for the slot mapping (spec rule for DCP placement) and a float64
attention over the decoded records of each row's selected tokens.
"""

import random

import pytest
import torch

from sparkinfer.attention import merge_lse
from sparkinfer.formats import get_format
from sparkinfer.vllm.cache_dtypes import write_records
from sparkinfer.decode.paged_sparse_mla import compact_pages, paged_sparse_mla, topk_to_slots


def slot_loop(topk, token_req, block_table, bs, rank, world, inter):
    out = []
    for m, row in enumerate(topk.tolist()):
        r = int(token_req[m])
        slots = []
        for t in row:
            if t < 0 or (t // inter) % world != rank:
                slots.append(-1)
                continue
            local = (t // (world * inter)) * inter + t % inter
            slots.append(int(block_table[r, local // bs]) * bs + local % bs)
        out.append(slots)
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("world,inter", [(1, 1), (2, 1), (4, 1), (2, 4), (4, 2)])
def test_topk_to_slots_matches_loop(world, inter):
    g = torch.Generator().manual_seed(world * 10 + inter)
    bs, nreq, nblk, m, k = 4, 3, 6, 7, 5
    block_table = torch.randperm(nreq * nblk, generator=g).view(nreq, nblk).to(torch.int32)
    token_req = torch.randint(0, nreq, (m,), generator=g)
    topk = torch.randint(-1, nblk * bs * world, (m, k), generator=g).to(torch.int32)
    for rank in range(world):
        got = topk_to_slots(topk, token_req, block_table, bs, rank, world, inter)
        assert torch.equal(got, slot_loop(topk, token_req, block_table, bs, rank, world, inter))
    if world > 1:  # every used position is owned by exactly one rank
        owned = sum((topk_to_slots(topk, token_req, block_table, bs, r, world, inter) >= 0).int()
                    for r in range(world))
        assert torch.equal(owned, (topk >= 0).int())


def test_topk_to_slots_rejects_bad_input():
    bt = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="beyond the request's 3 blocks of 4"):
        topk_to_slots(torch.tensor([[12]]), torch.tensor([0]), bt, 4)
    with pytest.raises(ValueError, match=r"token_req must lie in \[0, 2\)"):
        topk_to_slots(torch.tensor([[1]]), torch.tensor([2]), bt, 4)
    with pytest.raises(ValueError, match=">= -1"):
        topk_to_slots(torch.tensor([[-2]]), torch.tensor([0]), bt, 4)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        topk_to_slots(torch.tensor([1, 2]), torch.tensor([0]), bt, 4)
    with pytest.raises(ValueError, match="dcp_rank"):
        topk_to_slots(torch.tensor([[1]]), torch.tensor([0]), bt, 4, dcp_rank=2, dcp_world=2)


def _scenario(cache_dtype, world=1, inter=1, seed=0):
    """Requests of random lengths, their tokens written to per-rank paged caches, random top-k rows."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    fmt = get_format(cache_dtype)
    bs, nreq, heads, k = 4, 2, 2, 6
    lens = [13, 9]
    latent = [torch.randn(n, 512, generator=g) for n in lens]
    rope = [torch.randn(n, 64, generator=g) for n in lens]
    nblk = 8
    caches, tables = [], []
    for rank in range(world):
        cache = torch.zeros(nreq * nblk + 1, bs, fmt.record_bytes, dtype=torch.uint8)
        ids = list(range(1, nreq * nblk + 1))  # block 0 unused, as vLLM's null block
        rnd.shuffle(ids)
        table = torch.tensor(ids, dtype=torch.int32).view(nreq, nblk)
        for r, n in enumerate(lens):
            toks = [t for t in range(n) if (t // inter) % world == rank]
            local = [(t // (world * inter)) * inter + t % inter for t in toks]
            slots = torch.tensor([int(table[r, o // bs]) * bs + o % bs for o in local], dtype=torch.int64)
            write_records(cache_dtype, latent[r][toks], rope[r][toks], cache, slots)
        caches.append(cache)
        tables.append(table)
    token_req = torch.tensor([0, 0, 1, 1, 1])
    topk = torch.full((5, k), -1, dtype=torch.int32)
    for m, r in enumerate(token_req.tolist()):
        chosen = rnd.sample(range(lens[r]), rnd.randint(1, k))
        topk[m, :len(chosen)] = torch.tensor(chosen)
    q_nope = torch.randn(5, heads, 512, generator=g) * 0.05
    q_rope = torch.randn(5, heads, 64, generator=g) * 0.05
    return fmt, latent, rope, caches, tables, token_req, topk, q_nope, q_rope


def _reference(fmt, latent, rope, token_req, topk, q_nope, q_rope, scale):
    """float64 attention over the *decoded* records (the cache holds quantized values)."""
    outs, lses = [], []
    for m, r in enumerate(token_req.tolist()):
        sel = [t for t in topk[m].tolist() if t >= 0]
        lat, rp = fmt.decode(fmt.encode(latent[r][sel], rope[r][sel]))
        lat, rp = lat.double(), rp.double()
        s = scale * (q_nope[m].double() @ lat.T + q_rope[m].double() @ rp.T)  # [H, n]
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.softmax(s, dim=-1) @ lat)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("cache_dtype", ["nvfp4_368", "nvfp4_432", "fp8_ds_mla"])
def test_paged_sparse_mla_matches_float64(cache_dtype):
    fmt, latent, rope, caches, tables, token_req, topk, q_nope, q_rope = _scenario(cache_dtype)
    scale = 576 ** -0.5
    out, lse = paged_sparse_mla(q_nope, q_rope, caches[0], cache_dtype, topk, token_req, tables[0], scale)
    ref_out, ref_lse = _reference(fmt, latent, rope, token_req, topk, q_nope, q_rope, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("world,inter", [(2, 1), (4, 2)])
def test_dcp_partials_merge_to_the_dcp1_result(world, inter):
    """Each rank attends its shard of the same global top-k; merging the partials by LSE gives DCP 1."""
    args = _scenario("nvfp4_368", world, inter, seed=3)
    fmt, latent, rope, caches, tables, token_req, topk, q_nope, q_rope = args
    scale = 576 ** -0.5
    parts = [paged_sparse_mla(q_nope, q_rope, caches[r], "nvfp4_368", topk, token_req, tables[r], scale,
                              r, world, inter) for r in range(world)]
    out, lse = merge_lse(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    ref_out, ref_lse = _reference(fmt, latent, rope, token_req, topk, q_nope, q_rope, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


def test_paged_sparse_mla_rejects_a_wrong_cache():
    with pytest.raises(ValueError, match=r"uint8 \[num_blocks, block_size, 432\]"):
        paged_sparse_mla(torch.zeros(1, 1, 512), torch.zeros(1, 1, 64), torch.zeros(2, 4, 368, dtype=torch.uint8),
                         "nvfp4_432", torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                         torch.zeros(1, 2, dtype=torch.int32), 1.0)


def test_rows_without_a_local_token_get_lse_minus_inf():
    """Under DCP a row whose top-k lies wholly on other ranks attends nothing here: lse -inf, output 0."""
    fmt, latent, rope, caches, tables, token_req, topk, q_nope, q_rope = _scenario("nvfp4_432", 2, 1, seed=5)
    topk[0] = torch.tensor([1, 3, 5, -1, -1, -1], dtype=torch.int32)  # odd positions: all on rank 1
    out, lse = paged_sparse_mla(q_nope, q_rope, caches[0], "nvfp4_432", topk, token_req, tables[0], 0.1, 0, 2)
    assert bool(torch.isneginf(lse[0]).all()) and torch.equal(out[0], torch.zeros_like(out[0]))
    assert bool(torch.isfinite(lse[1:]).any())


@pytest.mark.parametrize("cache_dtype", ["nvfp4_368", "nvfp4_432"])
def test_block_outermost_layer_view_reads_and_writes_like_a_contiguous_cache(cache_dtype):
    """vLLM's block-outermost layout interleaves layers' pages: one layer's view is strided."""
    fmt, latent, rope, caches, tables, token_req, topk, q_nope, q_rope = _scenario(cache_dtype)
    cache = caches[0]
    raw = torch.randint(0, 255, (cache.shape[0], 3, *cache.shape[1:]), dtype=torch.uint8)  # [B, L, bs, rec]
    raw[:, 1] = cache
    view = raw[:, 1]
    assert not view.is_contiguous()
    got = paged_sparse_mla(q_nope, q_rope, view, cache_dtype, topk, token_req, tables[0], 0.1)
    want = paged_sparse_mla(q_nope, q_rope, cache, cache_dtype, topk, token_req, tables[0], 0.1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    slots = torch.tensor([9, -1, 30, 10])
    lat, rp = torch.randn(4, 512), torch.randn(4, 64)
    others = raw[:, [0, 2]].clone()
    pages, local, blocks = compact_pages(view, slots)
    write_records(cache_dtype, lat, rp, pages, local)
    view[blocks] = pages
    write_records(cache_dtype, lat, rp, cache, slots)
    assert torch.equal(view, cache) and torch.equal(raw[:, [0, 2]], others)  # other layers untouched
    assert compact_pages(cache, slots)[0] is cache  # contiguous: used as is


@pytest.mark.parametrize("width, layers, layer", [(132, 3, 1), (368, 2, 0), (132, 1, 0)])
def test_row_view_reads_a_strided_layer_in_place(width, layers, layer):
    """``row_view``: every slot's row of the overlapping view is that slot's record of the layer, the
    view shares the cache's storage (no copy), and a stride that is not a multiple of 4 is refused."""
    from sparkinfer.decode.paged_sparse_mla import row_view

    g = torch.Generator().manual_seed(width)
    raw = torch.randint(0, 255, (5, layers, 16, width), generator=g, dtype=torch.uint8)  # [B, L, bs, rec]
    view = raw[:, layer]
    slots = torch.randperm(5 * 16, generator=g)[:40]
    rows, at = row_view(view, slots)
    want = view.reshape(-1, width)[slots]  # reshape copies the strided view: the reference
    assert torch.equal(rows[at], want)
    assert rows.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    assert (rows.data_ptr() == view.data_ptr()) and (layers == 1) == view.is_contiguous()
    odd = torch.zeros(5, 2, 16, 133, dtype=torch.uint8)[:, 0, :, :132]  # 133-byte pitch: unaligned rows
    assert row_view(odd, slots) is None
