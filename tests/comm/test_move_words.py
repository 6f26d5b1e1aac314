"""Who owns the move kernels' error word and arrival counters (issue 35: one runtime object owns
the worker's state, no module-level registry does): the fabric makes them and the exchange hands
them to every move; a CUDA move without them is refused. Runs without a GPU: the CUDA fabric's
``arrival_flag`` runs on a stand-in holding CPU tensors (it only does address arithmetic), the
exchange on a one-rank stand-in fabric (its only move is the own-records one)."""

from types import SimpleNamespace

import pytest
import torch

from sparkinfer.comm import flags as F
from sparkinfer.comm import pack as P
from sparkinfer.comm.cuda_fabric import CudaFabric
from sparkinfer.comm.exchange import SelectedExchange
from sparkinfer.comm.synthetic import make_case
from sparkinfer.core.slab import SlabLayout


def test_a_cuda_move_needs_an_error_word_and_a_counter():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with pytest.raises(ValueError, match=r"err=fabric\.move_err"):
        P._err_arg(None, cuda)
    with pytest.raises(ValueError, match="CudaFabric.arrival_flag returns all three"):
        P._arrive_args((8, 16), cuda)
    with pytest.raises(ValueError, match="aligned int32 counter"):
        P._arrive_args((8, 16, 2), cuda)
    assert [a.value for a in P._arrive_args((8, 16, 4), cuda)] == [8, 16, 4]
    # the host twin: no word means raise at once, and the arrival is the flag and its seq word
    assert P._err_arg(None, cpu) is None
    assert [a.value for a in P._arrive_args((8, 16), cpu)] == [8, 16]
    with pytest.raises(ValueError, match="arrival_flag returns all three"):
        P._arrive_args((8, 16, 4), cpu)


def _cuda_fabric(layout: SlabLayout, rank: int) -> CudaFabric:
    """A CudaFabric holding what ``arrival_flag`` reads, its own words made as ``__init__`` makes them
    (on the CPU here); the peers' segments at made-up addresses (only offsets are added to them)."""
    f = CudaFabric.__new__(CudaFabric)
    f.layout, f.rank, f.world, f._closed, f._last_copy = layout, rank, layout.world, False, {}
    f._err = torch.zeros(1, dtype=torch.int32)
    f._seq = torch.zeros(layout.depth, dtype=torch.int64)
    f._peer_ptr = {r: (r + 1) << 32 for r in range(layout.world) if r != rank}
    f.move_err, f._arrive_counters = CudaFabric._move_words(layout, torch.device("cpu"))
    return f


def test_every_flag_a_cuda_fabric_publishes_has_its_own_counter_and_fabrics_share_none():
    layout = SlabLayout(4, 368, capacity=48, max_layers=3)
    a, b = _cuda_fabric(layout, 1), _cuda_fabric(layout, 1)
    counters = {}  # flag address -> its counter's address
    for dst in (0, 2, 3):
        for layer in (None, 0, 1, 2):  # ARRIVE, then LANDED + layer
            flag, seq, counter = a.arrival_flag(5, dst, layer)
            assert flag not in counters and seq == a._seq.data_ptr() + 8 * layout.slot(5)
            counters[flag] = counter
    assert len(set(counters.values())) == len(counters)
    base, n = a._arrive_counters.data_ptr(), a._arrive_counters.numel()
    assert all(base <= c < base + 4 * n and c % 4 == 0 for c in counters.values())
    assert a._arrive_counters.dtype == torch.int32 and not a._arrive_counters.any()  # zeroed, as the kernel needs
    assert a.move_err.dtype == torch.int32 and a.move_err.shape == (1,) and not a.move_err.any()
    b_words = {b.move_err.data_ptr()} | {b.arrival_flag(5, dst, None)[2] for dst in (0, 2, 3)}
    assert a.move_err.data_ptr() not in b_words and not set(counters.values()) & b_words


def _one_rank_fabric(move_err):
    """The fabric calls a one-rank exchange makes (no peer: no copy, flag or wait), with its word."""
    return SimpleNamespace(layout=SlabLayout(1, 368, capacity=48, max_layers=2), rank=0, world=1,
                           device=torch.device("cpu"), move_err=move_err, recv_region=lambda seq: None)


@pytest.mark.parametrize("sizing", ["host", "device"])
def test_the_exchange_hands_its_fabric_word_to_its_moves(sizing):
    case = make_case(1, 368, seed=3)
    rows = case.union.numel()
    assert int(case.planes.count[0, 0]) > 0
    case.planes.slot[0, 0, 0] = rows + 5  # the own move's first record goes to a row past the workspace
    layers = torch.tensor([0, 1], dtype=torch.int32)

    def run(move_err):
        ws = torch.zeros(2, rows, 368, dtype=torch.uint8)
        SelectedExchange(_one_rank_fabric(move_err), sizing, layer_arrival=False).exchange(
            case.planes, case.shard(0), layers, ws)
        return ws

    # a fabric with a word (the CUDA fabric's way): the error is recorded there, the exchange returns
    word = torch.zeros(1, dtype=torch.int32)
    ws = run(word)
    assert F.decode_error(int(word))["check"] == F.CHECK_SLOT and F.decode_error(int(word))["op"] == F.OP_DIRECT
    assert ws.any()  # the other records moved; only the bad one was skipped
    # a fabric without one (the host fabric's way): the move raises at once
    with pytest.raises(ValueError, match="out of range"):
        run(None)
