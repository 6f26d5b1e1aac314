"""Pack / unpack / direct record moves: the host twin (csrc/host/pack_host.cpp, same header as the
CUDA kernels) against the torch reference, byte for byte; and the CUDA kernels against both."""

import ctypes
import time

import pytest
import torch

from sparkinfer import native
from sparkinfer.comm import flags as F
from sparkinfer.comm import pack as P

WIDTHS = [368, 432, 656, 132, 37, 1]


def make_shard(width, n_layers=3, batch=3, blocks_per_req=4, block_size=4, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n_blocks = batch * blocks_per_req + 2
    cache = torch.randint(0, 256, (n_layers, n_blocks * block_size, width), generator=g, dtype=torch.uint8)
    perm = torch.randperm(n_blocks, generator=g)[: batch * blocks_per_req]
    bt = perm.view(batch, blocks_per_req).to(torch.int32).contiguous()
    return P.Shard(cache.to(device), bt.to(device), block_size)


def random_rows(shard, n, seed):
    g = torch.Generator().manual_seed(seed)
    B, cols = shard.block_table.shape
    req = torch.randint(0, B, (n,), generator=g, dtype=torch.int32)
    local = torch.randint(0, cols * shard.block_size, (n,), generator=g, dtype=torch.int32)
    return req, local


@pytest.mark.parametrize("width", WIDTHS)
def test_pack_unpack_direct_match_reference(width):
    shard = make_shard(width, seed=width)
    layers = torch.tensor([2, 0], dtype=torch.int32)
    cap, n = 11, 9
    req, local = random_rows(shard, cap, seed=width + 1)
    count = torch.tensor(n, dtype=torch.int32)

    out = torch.zeros(2 * cap * width, dtype=torch.uint8)
    P.pack(shard, layers, req, local, count, cap, out)
    ref = P.pack_reference(shard, layers, req, local, n)
    assert torch.equal(out[: 2 * n * width].view(2, n, width), ref)
    assert not out[2 * n * width:].any()  # nothing written past the packed records

    # independent check of the row rule: brute force through the block table
    for j, l in enumerate(layers.tolist()):
        for i in range(n):
            b, o = int(req[i]), int(local[i])
            row = int(shard.block_table[b, o // shard.block_size]) * shard.block_size + o % shard.block_size
            assert torch.equal(ref[j, i], shard.cache[l, row])

    slot = torch.randperm(20, generator=torch.Generator().manual_seed(width))[:cap].to(torch.int32)
    ws = torch.zeros(2, 20, width, dtype=torch.uint8)
    ws_ref = ws.clone()
    P.unpack(out, 2, count, cap, slot, ws)
    P.unpack_reference(ref, slot, n, ws_ref)
    assert torch.equal(ws, ws_ref)

    ws2 = torch.zeros_like(ws)
    P.direct(shard, layers, req, local, slot, count, cap, ws2)
    assert torch.equal(ws2, ws_ref)


def test_per_layer_tensors_move_like_one_stacked_cache():
    """vLLM's layouts: one separately allocated tensor per layer (no common stride), or per-layer
    views that interleave the layers block by block; pack and direct read the same records."""
    stacked = make_shard(368, n_layers=4, seed=5)
    copies = [stacked.cache[l].clone() for l in range(4)]  # fresh allocations, addresses unrelated
    split = P.Shard(copies, stacked.block_table, stacked.block_size)
    assert split.layer_ptrs.tolist() == [t.data_ptr() for t in copies]
    # a step's shard over the same caches shares the prior step's table; other caches get their own
    again = P.Shard(copies, stacked.block_table[:1].contiguous(), stacked.block_size, prior=split)
    assert again.layer_ptrs is split.layer_ptrs
    moved = P.Shard(copies[::-1], stacked.block_table, stacked.block_size, prior=split)
    assert moved.layer_ptrs.tolist() == [t.data_ptr() for t in copies[::-1]]
    layers = torch.tensor([3, 0, 2], dtype=torch.int32)
    cap = 10
    req, local = random_rows(stacked, cap, seed=6)
    count = torch.tensor(cap, dtype=torch.int32)
    a, b = (torch.zeros(3 * cap * 368, dtype=torch.uint8) for _ in range(2))
    P.pack(stacked, layers, req, local, count, cap, a)
    P.pack(split, layers, req, local, count, cap, b)
    assert torch.equal(a, b) and torch.equal(b.view(3, cap, 368), P.pack_reference(stacked, layers, req, local, cap))
    slot = torch.arange(cap, dtype=torch.int32)
    wa, wb = (torch.zeros(3, cap, 368, dtype=torch.uint8) for _ in range(2))
    P.direct(stacked, layers, req, local, slot, count, cap, wa)
    P.direct(split, layers, req, local, slot, count, cap, wb)
    assert torch.equal(wa, wb) and wa.any()
    # block-outermost interleaving: [n_blocks, L, block_size, W], layer l = buf[:, l] (block stride L*bs*W)
    bs = stacked.block_size
    buf = stacked.cache.view(4, -1, bs, 368).transpose(0, 1).contiguous()
    inter = P.Shard([buf[:, l] for l in range(4)], stacked.block_table, bs)
    assert inter.layers[0].stride(0) == 4 * bs * 368
    c = torch.zeros(3 * cap * 368, dtype=torch.uint8)
    P.pack(inter, layers, req, local, count, cap, c)
    assert torch.equal(a, c)
    with pytest.raises(ValueError, match="layer 1 is"):
        P.Shard([copies[0], copies[1][:-4]], stacked.block_table, 4)
    with pytest.raises(ValueError, match="rows % block_size"):
        P.Shard([copies[0][:-1]], stacked.block_table, 4)
    with pytest.raises(ValueError, match="no layers"):
        P.Shard([], stacked.block_table, 4)


def test_layer_strided_and_unaligned_workspace():
    width = 368
    shard = make_shard(width, seed=5)
    layers = torch.tensor([1], dtype=torch.int32)
    req, local = random_rows(shard, 6, seed=6)
    slot = torch.arange(6, dtype=torch.int32)
    count = torch.tensor(6, dtype=torch.int32)
    # a ring of 3 layer slots; the target is the middle one, offset by 4 bytes (4-byte copy path)
    big = torch.zeros(3 * 8 * width + 4, dtype=torch.uint8)
    ws = big[4:].view(3, 8, width)[1:2]
    P.direct(shard, layers, req, local, slot, count, 6, ws)
    ref = P.pack_reference(shard, layers, req, local, 6)
    assert torch.equal(ws[0, :6], ref[0])
    assert not big[: 4 + 8 * width].any() and not big[4 + 8 * width + 6 * width:].any()


def test_empty_count_is_a_noop():
    shard = make_shard(432)
    layers = torch.tensor([0], dtype=torch.int32)
    req, local = random_rows(shard, 4, seed=1)
    ws = torch.zeros(1, 4, 432, dtype=torch.uint8)
    P.direct(shard, layers, req, local, torch.arange(4, dtype=torch.int32), torch.tensor(0, dtype=torch.int32), 4, ws)
    assert not ws.any()


def test_bad_inputs_raise():
    shard = make_shard(368)
    layers = torch.tensor([0], dtype=torch.int32)
    req, local = random_rows(shard, 4, seed=2)
    out = torch.zeros(4 * 368, dtype=torch.uint8)
    n4 = torch.tensor(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        P.pack(shard, layers, req, local, torch.tensor(5, dtype=torch.int32), 4, out)
    bad_local = local.clone()
    bad_local[2] = shard.block_table.shape[1] * shard.block_size  # one past the table
    with pytest.raises(ValueError, match="out of range"):
        P.pack(shard, layers, req, bad_local, n4, 4, out)
    with pytest.raises(ValueError, match="out of range"):
        P.pack(shard, torch.tensor([7], dtype=torch.int32), req, local, n4, 4, out)
    ws = torch.zeros(1, 4, 368, dtype=torch.uint8)
    with pytest.raises(ValueError, match="out of range"):
        P.unpack(out, 1, n4, 4, torch.tensor([0, 1, 2, 4], dtype=torch.int32), ws)
    with pytest.raises(ValueError, match="int32"):
        P.pack(shard, layers, req.long(), local, n4, 4, out)
    with pytest.raises(ValueError, match="region"):
        P.unpack(out, 1, n4, 4, torch.arange(4, dtype=torch.int32), torch.zeros(1, 4, 432, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        P.Shard(torch.zeros(1, 4, 8), shard.block_table, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("width", WIDTHS)
def test_cuda_kernels_match_host_twin(width):
    dev = torch.device("cuda")
    host = make_shard(width, seed=width)
    shard = P.Shard(host.cache.to(dev), host.block_table.to(dev), host.block_size)
    layers = torch.tensor([2, 0], dtype=torch.int32)
    cap, n = 11, 9
    req, local = random_rows(host, cap, seed=width + 1)
    slot = torch.randperm(20)[:cap].to(torch.int32)
    count = torch.tensor(n, dtype=torch.int32)
    out_h = torch.zeros(2 * cap * width, dtype=torch.uint8)
    P.pack(host, layers, req, local, count, cap, out_h)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    out_d = torch.zeros(2 * cap * width, dtype=torch.uint8, device=dev)
    P.pack(shard, layers.to(dev), req.to(dev), local.to(dev), count.to(dev), cap, out_d, err=err)
    ws_h = torch.zeros(2, 20, width, dtype=torch.uint8)
    P.unpack(out_h, 2, count, cap, slot, ws_h)
    ws_d = torch.zeros(2, 20, width, dtype=torch.uint8, device=dev)
    P.unpack(out_d, 2, count.to(dev), cap, slot.to(dev), ws_d, err=err)
    ws_dd = torch.zeros_like(ws_d)
    P.direct(shard, layers.to(dev), req.to(dev), local.to(dev), slot.to(dev), count.to(dev), cap, ws_dd, err=err)
    P.check_error_word(err)
    assert torch.equal(out_d.cpu(), out_h) and torch.equal(ws_d.cpu(), ws_h) and torch.equal(ws_dd.cpu(), ws_h)
    P.pack(shard, layers.to(dev), req.to(dev), local.to(dev), torch.tensor(cap + 1, dtype=torch.int32, device=dev),
           cap, out_d, err=err)
    with pytest.raises(ValueError, match="out of range"):
        P.check_error_word(err)
    assert int(err) == 0  # the check cleared it


# --- fixed grids, the error word and the arrival signal (issue #16/#17 semantics) -------------------


def test_grid_is_bounded_by_the_sm_count_not_the_capacity():
    # a few CTAs per SM, whatever the capacity: 10^5 records x 4 layers used to be 10^5 CTAs
    assert P.grid_ctas(100_000, 4, sms=188) == P.grid_ctas(10**7, 4, sms=188) == 8 * 188
    assert P.grid_ctas(100_000, 4, sms=132) == 8 * 132
    assert P.grid_ctas(10, 4, sms=188) == 10  # a small capacity launches only what it can use (4 warps/CTA)
    assert P.grid_ctas(1, 1, sms=188) == 1


def _word():
    return torch.zeros(1, dtype=torch.int32)


def _case(width=368, cap=8, n=6):
    shard = make_shard(width, seed=3)
    layers = torch.tensor([1, 2], dtype=torch.int32)
    req, local = random_rows(shard, cap, seed=4)
    slot = torch.randperm(cap + 3, generator=torch.Generator().manual_seed(5))[:cap].to(torch.int32)
    return shard, layers, req, local, slot, torch.tensor(n, dtype=torch.int32), cap


def test_errors_go_to_the_word_first_error_wins_and_later_moves_skip():
    shard, layers, req, local, slot, count, cap = _case()
    err = _word()
    out = torch.zeros(2 * cap * 368, dtype=torch.uint8)
    bad = local.clone()
    bad[1] = shard.block_table.shape[1] * shard.block_size
    P.pack(shard, layers, req, bad, count, cap, out, err=err)  # recorded, not raised
    first = int(err)
    assert F.decode_error(first) == {"status": F.ERR_RANGE, "check": F.CHECK_RECORD, "op": F.OP_PACK, "peer": None}
    assert "source record" in F.describe_error(first)
    ref = P.pack_reference(shard, layers, req, local, 6)
    got = out[: 2 * 6 * 368].view(2, 6, 368)
    assert torch.equal(got[:, 0], ref[:, 0]) and torch.equal(got[:, 2:], ref[:, 2:]) and not got[:, 1].any()
    # a second, different error does not overwrite the root cause; and every move now skips
    ws = torch.zeros(2, cap + 3, 368, dtype=torch.uint8)
    P.unpack(out, 2, torch.tensor(cap + 1, dtype=torch.int32), cap, slot, ws, err=err)
    P.direct(shard, layers, req, local, slot, count, cap, ws, err=err)
    assert int(err) == first and not ws.any()
    err.zero_()
    P.unpack(out, 2, torch.tensor(cap + 1, dtype=torch.int32), cap, slot, ws, err=err)
    assert F.decode_error(int(err))["check"] == F.CHECK_COUNT and F.decode_error(int(err))["op"] == F.OP_UNPACK
    err.zero_()
    P.direct(shard, layers, req, local, torch.full((cap,), cap + 3, dtype=torch.int32), count, cap, ws, err=err)
    assert F.decode_error(int(err))["check"] == F.CHECK_SLOT


def _twins():
    lib = native.host_lib()
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    native.declare(lib, {"si_comm_signal_twin": [vp, vp, vp],
                         "si_comm_wait_twin": [vp, i32, i64, vp, i64, i32, i64, vp]})
    return lib


def test_pack_signals_arrival_after_its_records_unless_the_word_is_set():
    shard, layers, req, local, _, count, cap = _case()
    flag, seq = torch.zeros(1, dtype=torch.int64), torch.tensor([7], dtype=torch.int64)
    out = torch.zeros(2 * cap * 368, dtype=torch.uint8)
    err = _word()
    P.pack(shard, layers, req, local, count, cap, out, err=err, arrive=(flag.data_ptr(), seq.data_ptr()))
    assert int(flag) == 7 and int(err) == 0
    assert torch.equal(out[: 2 * 6 * 368].view(2, 6, 368), P.pack_reference(shard, layers, req, local, 6))
    seq[0] = 8  # next exchange, but its pack fails: no arrival, so the peer can never consume it
    bad = req.clone()
    bad[0] = 99
    P.pack(shard, layers, bad, local, count, cap, out, err=err, arrive=(flag.data_ptr(), seq.data_ptr()))
    assert int(flag) == 7 and F.decode_error(int(err))["check"] == F.CHECK_RECORD
    with pytest.raises(ValueError, match="aligned"):
        P.pack(shard, layers, req, local, count, cap, out, arrive=(flag.data_ptr() + 4, seq.data_ptr()))


def test_direct_into_a_peer_region_signals_arrival_after_its_records():
    """A device-sized exchange's move into a peer's region publishes it itself, as a pack does: the
    flag carries seq after the records, and not at all once the word is set."""
    shard, layers, req, local, slot, count, cap = _case()
    flag, seq = torch.zeros(1, dtype=torch.int64), torch.tensor([7], dtype=torch.int64)
    ws, want = (torch.zeros(2, cap + 3, 368, dtype=torch.uint8) for _ in range(2))
    err = _word()
    P.direct(shard, layers, req, local, slot, count, cap, ws, err=err, arrive=(flag.data_ptr(), seq.data_ptr()))
    P.direct_reference(shard, layers, req, local, slot, 6, want)
    assert int(flag) == 7 and int(err) == 0 and torch.equal(ws, want)
    seq[0] = 8
    bad = slot.clone()
    bad[2] = cap + 3  # outside the region's rows
    P.direct(shard, layers, req, local, bad, count, cap, ws, err=err, arrive=(flag.data_ptr(), seq.data_ptr()))
    assert int(flag) == 7 and F.decode_error(int(err))["check"] == F.CHECK_SLOT


def test_timed_out_wait_sets_the_word_and_the_unpack_consumes_nothing():
    lib = _twins()
    stride = 8
    flags = torch.zeros(3 * stride, dtype=torch.int64)
    seq = torch.tensor([5], dtype=torch.int64)
    err = _word()
    flags[0], flags[stride] = 5, 4  # peer 1 (k = 0) arrived, peer 2 (k = 1) is one exchange behind
    t = time.monotonic()
    assert lib.si_comm_wait_twin(flags.data_ptr(), 2, stride, seq.data_ptr(), 0, 1, 50_000_000, err.data_ptr()) == 0
    assert time.monotonic() - t >= 0.05
    assert F.decode_error(int(err)) == {"status": F.ERR_TIMEOUT, "check": F.CHECK_WAIT, "op": F.OP_WAIT, "peer": 2}
    assert "peer 2 never signalled" in F.describe_error(int(err))
    # the region's bytes are stale: the unpack that follows the wait leaves the workspace alone
    region = torch.randint(0, 256, (2 * 4 * 368,), dtype=torch.uint8)
    ws = torch.zeros(2, 4, 368, dtype=torch.uint8)
    P.unpack(region, 2, torch.tensor(4, dtype=torch.int32), 4, torch.arange(4, dtype=torch.int32), ws, err=err)
    assert not ws.any() and F.decode_error(int(err))["peer"] == 2
    # later waits of the step return at once instead of spinning for the same dead peer again
    t = time.monotonic()
    lib.si_comm_wait_twin(flags.data_ptr(), 2, stride, seq.data_ptr(), 0, 1, 5_000_000_000, err.data_ptr())
    assert time.monotonic() - t < 1.0
    # and a checked signal does not publish data that depended on the failed step
    out_flag = torch.zeros(1, dtype=torch.int64)
    lib.si_comm_signal_twin(out_flag.data_ptr(), seq.data_ptr(), err.data_ptr())
    assert int(out_flag) == 0
    err.zero_()
    flags[stride] = 5
    lib.si_comm_wait_twin(flags.data_ptr(), 2, stride, seq.data_ptr(), 0, 1, 5_000_000_000, err.data_ptr())
    lib.si_comm_signal_twin(out_flag.data_ptr(), seq.data_ptr(), err.data_ptr())
    assert int(err) == 0 and int(out_flag) == 5
    P.unpack(region, 2, torch.tensor(4, dtype=torch.int32), 4, torch.arange(4, dtype=torch.int32), ws, err=err)
    assert torch.equal(ws, region.view(2, 4, 368))


@pytest.mark.gpu
def test_cuda_error_words_and_arrival_match_the_host_twin():
    dev = torch.device("cuda")
    shard, layers, req, local, slot, count, cap = _case()
    dshard = P.Shard(shard.cache.to(dev), shard.block_table.to(dev), shard.block_size)
    bad = local.clone()
    bad[1] = shard.block_table.shape[1] * shard.block_size
    for name, args in (("record", (req, bad, count)), ("count", (req, local, torch.tensor(cap + 1, dtype=torch.int32)))):
        herr, derr = _word(), torch.zeros(1, dtype=torch.int32, device=dev)
        hflag, hseq = torch.zeros(1, dtype=torch.int64), torch.tensor([3], dtype=torch.int64)
        dflag, dseq = hflag.to(dev), hseq.to(dev)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)  # the flag's CTA counter (a fabric's)
        hout = torch.zeros(2 * cap * 368, dtype=torch.uint8)
        dout = hout.to(dev)
        P.pack(shard, layers, *args, cap, hout, err=herr, arrive=(hflag.data_ptr(), hseq.data_ptr()))
        P.pack(dshard, layers.to(dev), *(a.to(dev) for a in args), cap, dout, err=derr,
               arrive=(dflag.data_ptr(), dseq.data_ptr(), counter.data_ptr()))
        torch.cuda.synchronize()
        assert int(derr) == int(herr) != 0, name
        assert int(dflag) == int(hflag) == 0 and torch.equal(dout.cpu(), hout), name
        assert int(counter) == 0, name  # a failed move resets the counter too
    # clean runs into the same flag: it carries each launch's seq (the last CTA's counter was reset to
    # zero, so the next launch signals again), and the bytes match
    derr, dflag, dseq = (torch.zeros(1, dtype=t, device=dev) for t in (torch.int32, torch.int64, torch.int64))
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    arrive = (dflag.data_ptr(), dseq.data_ptr(), counter.data_ptr())
    dout = torch.zeros(2 * cap * 368, dtype=torch.uint8, device=dev)
    for seq in (9, 10, 11):
        dseq.fill_(seq)
        P.pack(dshard, layers.to(dev), req.to(dev), local.to(dev), count.to(dev), cap, dout, err=derr, arrive=arrive)
        torch.cuda.synchronize()
        assert int(derr) == 0 and int(dflag) == seq and int(counter) == 0
    assert torch.equal(dout.cpu()[: 2 * 6 * 368].view(2, 6, 368), P.pack_reference(shard, layers, req, local, 6))
    # a direct move into a region signals the same way (the device-sized exchange's)
    dws = torch.zeros(2, cap + 3, 368, dtype=torch.uint8, device=dev)
    want = torch.zeros(2, cap + 3, 368, dtype=torch.uint8)
    P.direct_reference(shard, layers, req, local, slot, 6, want)
    for seq in (12, 13):
        dseq.fill_(seq)
        P.direct(dshard, layers.to(dev), req.to(dev), local.to(dev), slot.to(dev), count.to(dev), cap, dws, err=derr,
                 arrive=arrive)
        torch.cuda.synchronize()
        assert int(derr) == 0 and int(dflag) == seq and int(counter) == 0
    assert torch.equal(dws.cpu(), want)
    # a CUDA move without its counter, or without an error word, is refused before any launch
    with pytest.raises(ValueError, match="counter"):
        P.pack(dshard, layers.to(dev), req.to(dev), local.to(dev), count.to(dev), cap, dout, err=derr,
               arrive=arrive[:2])
    with pytest.raises(ValueError, match="err="):
        P.direct(dshard, layers.to(dev), req.to(dev), local.to(dev), slot.to(dev), count.to(dev), cap, dws)
    # a set (pinned host) word: the unpack on the device consumes nothing, like the twin
    perr = torch.tensor([F.error_word(F.ERR_TIMEOUT, F.CHECK_WAIT, F.OP_WAIT, 1)], dtype=torch.int32).pin_memory()
    ws = torch.zeros(2, cap + 3, 368, dtype=torch.uint8, device=dev)
    P.unpack(dout, 2, count.to(dev), cap, slot.to(dev), ws, err=perr)
    torch.cuda.synchronize()
    assert not ws.any() and F.decode_error(int(perr))["peer"] == 1
    assert P.grid_ctas(10**5, 4) == 8 * torch.cuda.get_device_properties(dev).multi_processor_count


def test_a_device_and_its_index_are_one_device_key(monkeypatch):
    """``cuda`` and ``cuda:<current>`` are one device to what is keyed by device (``WorkerRuntime``'s
    device): on the first GPU run a per-device error word was found under the tensors' ``cuda:0``
    while a check of ``"cuda"`` read another word, so a set word went unseen and stopped the next
    test's kernels. (The move kernels' words now belong to the fabric or the caller, not a device.)"""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert native.device_key("cuda") == native.device_key(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert native.device_key("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert native.device_key("cuda") == torch.device("cuda", 1) != native.device_key("cuda:0")
