"""The paged-addressing kernels (sparkinfer.attention.triton_paging) against their torch twins, bit for bit.

``topk_rows`` against ``topk_slots`` + ``row_view``, ``scatter_rows`` against the torch form of
``forward_scatter_rows``: over contiguous caches and vLLM-like strided layer views (block-outermost, layers
interleaved), DCP worlds 1, 2 and 4 with interleaves 1 and 4, top-k shapes across the kernels'
tiles, and bad inputs (positions beyond the blocks or below -1, slots in the null block or outside
the cache): the same rows or bytes, the same device flag, and the bad entries never written. Under
``TRITON_INTERPRET=1`` on CPU (conftest), natively on a GPU (the ``cuda`` cases, ``-m gpu``). Both allocate nothing in sparkinfer code
given ``topk_rows``'s ``out`` (``host_reads.count_allocations``).
"""

import pytest
import torch

from sparkinfer.testing import host_reads
from sparkinfer.attention import triton_paging
from sparkinfer.decode.device_checks import DeviceChecks
from sparkinfer.decode.forward_step import ForwardStep
from sparkinfer.decode.paged_sparse_mla import (NULL_BLOCK, forward_scatter_rows, row_align, row_strides, row_view,
                                                topk_slots, topk_to_slots)
from sparkinfer.decode.paged_sparse_mla import scatter_rows as torch_scatter_rows


DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted only without a GPU")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _backing(nb=7, bs=16, width=368, g=None, dtype=torch.uint8):
    """[nb, 3 layers, bs, width + 12]: layer 1's view is strided like vLLM's block-outermost layouts."""
    if dtype == torch.uint8:
        return torch.randint(0, 256, (nb, 3, bs, width + 12), generator=g, dtype=torch.uint8)
    return torch.randn(nb, 3, bs, width + 12, generator=g).to(dtype)


def _layer(backing, width, strided: bool):
    view = backing[:, 1, :, :width]
    return view if strided else view.contiguous()


def _ours(made) -> list[str]:
    """The allocations booked at sparkinfer sites (the interpreter's own, on CPU, are not the kernel's)."""
    return [k for k in made if "|sparkinfer:" in k]


def _topk_case(g, m, k, max_pos, bad: bool):
    topk = torch.randint(-1, max_pos, (m, k), generator=g, dtype=torch.int32)
    if bad:
        topk[0, 0] = -3
        topk[-1, k // 2] = max_pos + 500  # beyond every request's blocks
    return topk


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (4, 4)])
@pytest.mark.parametrize("m,k,bad", [(3, 8, False), (9, 300, True), (1, 2048, True), (2, 2500, False)])
@pytest.mark.parametrize("compact", [False, True])
def test_topk_rows_equal_the_torch_slots_through_the_row_view(dev, strided, world, interleave, m, k, bad, compact):
    """``compact`` (the attention's paged path): the same rows, each row's kept ones first in their listed
    order, then -1 (K = 2,500: two trips of ``compact_launch``'s 2,048, the second placing after the
    first's count)."""
    g = torch.Generator().manual_seed(m * 131 + k + world)
    cache = _layer(_backing(g=g), 368, strided)
    nb, bs = cache.shape[:2]
    table = torch.randint(1, nb, (3, 4), generator=g, dtype=torch.int32)  # 3 requests, 4 blocks each
    token_req = torch.randint(0, 3, (m,), generator=g, dtype=torch.int64)
    topk = _topk_case(g, m, k, 4 * bs * world, bad)
    for rank in range(world):
        want_checks, got_checks = DeviceChecks("cpu"), DeviceChecks(dev)
        slots, bad_entries = topk_slots(topk, token_req, table, bs, rank, world, interleave)
        want_checks.flag("topk_position", bad_entries)  # what the forward's torch form does
        rows, want = row_view(cache, slots)
        if compact:  # a stable sort of each row by "is -1"
            want = torch.gather(want, 1, torch.sort((want < 0).to(torch.int8), dim=1, stable=True).indices)
        got = triton_paging.topk_rows(topk.to(dev), token_req.to(dev), table.to(dev), bs, *row_strides(cache),
                                      got_checks.word("topk_position"), rank, world, interleave, compact=compact).cpu()
        assert got.dtype == torch.int64 and torch.equal(got, want)
        assert torch.equal(got_checks.flags.cpu(), want_checks.flags)
        assert bool(want_checks.flags[0]) == bad  # the -3 is bad on every rank
        assert (got >= 0).any()  # the case is not all -1
        assert (got < rows.shape[0]).all()


def _vllm_pool(nb, bs, widths, lead=0, g=None):
    """A block-outermost pool as vLLM's allocator packs it (``kv_cache_utils``: each block holds one page
    of every layer, block_size x record bytes, side by side from byte ``lead``) -> each layer's
    [nb, bs, width] view of it."""
    pages = [bs * w for w in widths]
    pool = torch.randint(0, 256, (nb, lead + sum(pages)), generator=g, dtype=torch.uint8)
    offsets = [lead + sum(pages[:i]) for i in range(len(pages))]
    return [pool[:, o:o + p].view(nb, bs, w) for o, p, w in zip(offsets, pages, widths)]


@pytest.mark.parametrize("dev", DEVICES)
def test_row_align_takes_16_byte_rows_where_vllm_packs_the_pages(dev):
    """``row_align``: 16 for the record layers of a vLLM-like block-outermost pool (368 / 432 / 656-byte
    pages beside a 132-byte indexer page, 64 slots a block), 4 for the indexer's 132-byte slots and for
    every layer of a pool shifted by 4 bytes (no 16-byte rows: ``row_view`` refuses them there, its
    4-byte rows still serve). A slot's record is the same through either pitch's rows, and
    ``topk_rows`` with the 16-byte strides gives ``row_view``'s rows."""
    g = torch.Generator().manual_seed(16)
    nb, bs = 5, 64
    for lead, want in ((0, (16, 16, 16, 4)), (4, (4, 4, 4, 4))):
        for view, align in zip(_vllm_pool(nb, bs, (368, 432, 656, 132), lead, g), want):
            assert not view.is_contiguous() and row_align(view) == align
            slots = torch.randperm(nb * bs, generator=g)[:50]
            slots[::7] = -1
            ref = view.reshape(-1, view.shape[-1])[slots.clamp(min=0)]  # reshape copies: the reference
            for a in (4, 16):
                got = row_view(view, slots, a)
                if a > align:
                    assert got is None and row_strides(view, a) is None
                    continue
                rows, at = got
                assert rows.stride(0) == a and rows.data_ptr() == view.data_ptr()
                assert torch.equal(at < 0, slots < 0) and torch.equal(rows[at.clamp(min=0)], ref)
    cache = _vllm_pool(nb, 16, (368, 132), 0, g)[0]
    table = torch.randint(1, nb, (2, 3), generator=g, dtype=torch.int32)
    token_req = torch.tensor([0, 1, 1])
    topk = _topk_case(g, 3, 40, 3 * 16, False)
    slots, _ = topk_slots(topk, token_req, table, 16)
    want = row_view(cache, slots, 16)[1]
    got = triton_paging.topk_rows(topk.to(dev), token_req.to(dev), table.to(dev), 16, *row_strides(cache, 16),
                                  DeviceChecks(dev).word("topk_position")).cpu()
    assert torch.equal(got, want) and (got >= 0).any()


@pytest.mark.parametrize("dev", DEVICES)
def test_topk_rows_past_2_31_are_exact(dev):
    """Rows of a layer view spanning ~120 GiB of 4-byte rows (a block stride of 2^29 rows, blocks 4..59:
    rows from 2^31 to ~2^35; no cache allocated, the kernel only computes them) against the torch
    slots through ``row_view``'s formula, at DCP2: every kept row passes 2^31 and none wraps."""
    g = torch.Generator().manual_seed(5)
    bs, row_s0, row_s1 = 16, 1 << 29, 92
    table = torch.randint(4, 60, (3, 4), generator=g, dtype=torch.int32)
    token_req = torch.randint(0, 3, (5,), generator=g, dtype=torch.int64)
    topk = _topk_case(g, 5, 300, 4 * bs * 2, False)
    for rank in range(2):
        slots = topk_to_slots(topk, token_req, table, bs, rank, 2, 1)
        want = torch.where(slots >= 0, (slots // bs) * row_s0 + (slots % bs) * row_s1, -1)
        checks = DeviceChecks(dev)
        got = triton_paging.topk_rows(topk.to(dev), token_req.to(dev), table.to(dev), bs, row_s0, row_s1,
                                      checks.word("topk_position"), rank, 2, 1).cpu()
        assert torch.equal(got, want) and not bool(checks.flags.any())
        assert (got >= 0).any() and bool((got[got >= 0] >= 1 << 31).all())


@pytest.mark.parametrize("dev", DEVICES)
def test_topk_rows_writes_only_its_output(dev):
    g = torch.Generator().manual_seed(3)
    cache = _layer(_backing(g=g), 368, True)
    table = torch.randint(1, 7, (2, 4), generator=g, dtype=torch.int32).to(dev)
    topk = _topk_case(g, 4, 64, 64, False).to(dev)
    token_req = torch.zeros(4, dtype=torch.int64, device=dev)
    out = torch.full((4, 64), 123, dtype=torch.int64, device=dev)
    checks = DeviceChecks(dev)
    with host_reads.count_allocations() as made, host_reads.count_reads() as reads:
        triton_paging.topk_rows(topk, token_req, table, 16, *row_strides(cache), checks.word("topk_position"), out=out)
    assert not reads and not _ours(made), (dict(reads), dict(made))
    assert not (out == 123).any()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype,width", [(torch.uint8, 368), (torch.uint8, 656), (torch.uint8, 132),
                                         (torch.bfloat16, 576)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("bad", [False, True])
def test_scatter_rows_equal_the_torch_twin(dev, dtype, width, strided, bad):
    g = torch.Generator().manual_seed(width + strided)
    backing = _backing(width=width, g=g, dtype=dtype)
    nb, bs = backing.shape[0], backing.shape[2]
    n = 11
    slots = torch.randperm((nb - 1) * bs, generator=g)[:n] + bs  # distinct, outside the null block
    slots[2] = -1
    if bad:
        slots[4] = NULL_BLOCK * bs + 3
        slots[7] = nb * bs + 5
    rows = (torch.randint(0, 256, (n, width), generator=g, dtype=torch.uint8) if dtype == torch.uint8
            else torch.randn(n, width, generator=g).to(dtype))
    want_backing, got_backing = backing.clone(), backing.to(dev)
    want_cache, got_cache = _layer(want_backing, width, strided), _layer(got_backing, width, strided)
    before = got_cache.clone()
    want_checks, got_checks = DeviceChecks("cpu"), DeviceChecks(dev)
    forward_scatter_rows(ForwardStep("torch", want_checks, None), want_cache, slots, rows)  # the torch twin
    dev_slots, dev_rows = slots.to(dev), rows.to(dev)
    with host_reads.count_allocations() as made, host_reads.count_reads() as reads:
        triton_paging.scatter_rows(got_cache, dev_slots, dev_rows, NULL_BLOCK, got_checks.word("cache_slots"))
    assert not reads and not _ours(made), (dict(reads), dict(made))
    got_backing, got_cache, before = got_backing.cpu(), got_cache.cpu(), before.cpu()
    assert torch.equal(got_checks.flags.cpu(), want_checks.flags) and bool(want_checks.flags[2]) == bad
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(got_backing, want_backing)  # nothing outside the layer's view written either
    assert torch.equal(got_cache[NULL_BLOCK], before[NULL_BLOCK])  # the null block keeps its bytes
    for i in (0, 1, 10):
        s = int(slots[i])
        assert torch.equal(got_cache[s // bs, s % bs], rows[i])


def test_torch_scatter_rows_direct_call_refuses_a_null_block_slot():
    cache = _layer(_backing(width=32), 32, False)
    with pytest.raises(ValueError, match="null block"):
        torch_scatter_rows(cache, torch.tensor([20, NULL_BLOCK * 16 + 1]), torch.zeros(2, 32, dtype=torch.uint8))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("width", [368, 432])
@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("form", ["masked", "listed"])
def test_copy_rows_equals_the_torch_twin_and_touches_only_taken_rows(monkeypatch, dev, width, n, form):
    """The workspace patch's row copy: masked (the workspace's own and kept rows) and listed (the
    replica store's rows) give the torch twin's bytes; rows not taken keep theirs, and an index of a
    row not taken is never followed (out of range there: the kernel does not read it)."""
    from sparkinfer.decode.paged_sparse_mla import copy_rows

    g = torch.Generator().manual_seed(n + width)
    src = torch.randint(0, 256, (50, width), generator=g, dtype=torch.uint8)
    dst = torch.randint(0, 256, (n + 5, width), generator=g, dtype=torch.uint8)
    src_rows = torch.randint(0, 50, (n,), generator=g)
    if form == "masked":
        mask = torch.rand(n, generator=g) < 0.3
        kwargs = dict(mask=mask)
        dst = dst[:n]
    else:
        mask = torch.ones(n, dtype=torch.bool)
        kwargs = dict(dst_rows=torch.randperm(n + 5, generator=g)[:n])
    monkeypatch.setenv("SPARKINFER_FORCE_GPU_IMPLS", "0")
    want = dst.clone()
    copy_rows(want, src, src_rows, **kwargs)
    expect = dst.clone()
    at = kwargs.get("dst_rows", torch.arange(n))
    expect[at[mask]] = src[src_rows[mask]]  # the rule, by boolean indexing
    assert torch.equal(want, expect)
    monkeypatch.setenv("SPARKINFER_FORCE_GPU_IMPLS", "1")
    got = dst.clone().to(dev)
    if form == "masked":  # a row not taken may carry any index: it is never read
        src_rows = torch.where(mask, src_rows, 1 << 40)
    kwargs = {k: v.to(dev) for k, v in kwargs.items()}
    with host_reads.count_allocations() as made:
        triton_paging.copy_rows(got, src.to(dev), src_rows.to(dev), kwargs.get("mask"), kwargs.get("dst_rows"))
    assert not _ours(made)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("n, d, at", [(3, 64, (2, 63)), (5, 600, (4, 599)), (6, 128, (0, 0))])
def test_flag_nonfinite_sets_the_word_as_the_torch_twin(monkeypatch, dev, dtype, bad, n, d, at):
    """The check kernel (``DeviceChecks.flag_nonfinite`` on the Triton backend) flags a NaN or an
    infinity anywhere in rows of any stride, past the column tile too, as the torch twin does, and
    nothing in finite rows; its word only (an OR: a set word stays set)."""
    from sparkinfer.decode import impls

    g = torch.Generator().manual_seed(n * d)
    t = (100 * torch.randn(n, d + 9, generator=g)).to(dtype)[:, 5:5 + d].to(dev)  # a row stride past the width
    if bad is not None:
        t[at] = bad
    words = []
    for forced in ("1", "0"):
        monkeypatch.setenv(impls.FORCE_ENV, forced)
        checks = DeviceChecks(dev)
        assert checks.backend == ("triton" if forced == "1" or dev == "cuda" else "torch")
        checks.flag_nonfinite("indexer_inputs", t)
        words.append(checks.flags.tolist())
    want = [0, 0, 0, int(bad is not None), 0]
    assert words[0] == words[1] == want
