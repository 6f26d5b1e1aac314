"""Slab layout arithmetic (torch-free) and the host flag primitives, single process."""

import itertools
import time

import pytest
import torch

from sparkinfer.comm import flags
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer.core.slab import (ABORT, ACK, ARRIVE, FLAG_STRIDE, LANDED, SlabLayout, chunk_rounds, host_offsets,
                                 rotated_peers)


@pytest.mark.parametrize("world,width,cap,layers,depth", [(4, 368, 10, 3, 2), (2, 37, 1, 1, 1), (8, 656, 7, 4, 3)])
def test_regions_are_disjoint_aligned_and_inside(world, width, cap, layers, depth):
    lay = SlabLayout(world, width, cap, layers, depth)
    assert lay.region_bytes >= layers * cap * width and lay.region_bytes % 256 == 0
    # one shared receive region per slot (all sources together), one send region per (slot, dst)
    recv = sorted(lay.recv_offset(seq) for seq in range(depth))
    send = sorted(lay.send_offset(seq, dst) for seq in range(depth) for dst in range(world))
    for offs, end, size, n in ((recv, lay.segment_bytes, lay.region_bytes, depth),
                               (send, lay.send_bytes, lay.send_region_bytes, world * depth)):
        assert len(set(offs)) == n
        assert all(b - a >= size for a, b in zip(offs, offs[1:]))
        assert offs[-1] + size <= end and all(o % 256 == 0 for o in offs)
    assert lay.segment_bytes == lay.flags_bytes + depth * lay.region_bytes  # nothing per source
    assert recv[0] >= lay.flags_bytes  # data never overlaps the flag lines
    kinds = (ARRIVE, ACK, ABORT) + tuple(LANDED + j for j in range(layers))  # one landed flag per layer
    words = {lay.flag_index(k, p) for k in kinds for p in range(world)}
    assert len(words) == (3 + layers) * world and max(words) * 8 < lay.flags_bytes
    with pytest.raises(ValueError, match="max_layers"):
        lay.flag_index(LANDED + layers, 0)
    assert all(w % FLAG_STRIDE == 0 for w in words)
    assert lay.recv_offset(depth) == lay.recv_offset(0)  # seq wraps onto slot seq % depth
    assert SlabLayout(world, width, cap, layers, depth, send_capacity=0).send_bytes == 0


@settings(max_examples=200, deadline=None)
@given(world=st.integers(2, 6), cap=st.integers(5, 40), send=st.integers(1, 50), data=st.data())
def test_host_window_is_the_largest_that_fits_every_destination(world, cap, send, data):
    """Against a brute force over every window: each round's blocks fit each destination's shared
    region and the send regions, and the blocks of the sources tile it without overlap."""
    lay = SlabLayout(world, 368, cap, 1, send_capacity=send)
    counts = [[data.draw(st.integers(0, 3 * cap)) for _ in range(world)] for _ in range(world)]
    need = max(counts[s][d] for s in range(world) for d in range(world) if s != d)  # a wider window moves no more
    fits = [c for c in range(1, need + 1) if c <= send and all(
        sum(min(counts[s][d], c) for s in range(world) if s != d) <= cap for d in range(world))]
    c = lay.host_window(counts)
    assert c == max(fits, default=1)
    for d in range(world):
        shares = [min(counts[s][d], c) for s in range(world)]
        offs = host_offsets(shares, d)
        blocks = sorted((offs[s], offs[s] + shares[s]) for s in range(world) if s != d and shares[s])
        assert all(b[0] >= a[1] for a, b in zip(blocks, blocks[1:])) and all(e <= cap for _, e in blocks)
    with pytest.raises(ValueError, match="send slab"):
        SlabLayout(world, 368, cap, 1, send_capacity=0).host_window(counts)


def test_nbytes_rejects_overfull_regions():
    lay = SlabLayout(4, 368, 10, 2)
    assert lay.nbytes(2, 10) == 2 * 10 * 368
    with pytest.raises(ValueError, match="exceeds"):
        lay.nbytes(2, 11)
    with pytest.raises(ValueError, match="positive"):
        SlabLayout(4, 0, 10, 2)


def test_rotation_covers_every_peer_and_spreads_destinations():
    for world in range(1, 9):
        orders = [rotated_peers(r, world) for r in range(world)]
        for r, order in enumerate(orders):
            assert sorted(order) == [p for p in range(world) if p != r]
        for step in range(world - 1):  # at each step every rank targets a different destination
            assert len({order[step] for order in orders}) == world


def test_chunk_rounds():
    for n, cap in itertools.product(range(0, 30), range(1, 9)):
        r = chunk_rounds(n, cap)
        assert r >= 1 and r * cap >= n and (r - 1) * cap < max(n, 1)


def test_flag_wait_ok_timeout_and_abort():
    words = torch.zeros(64, dtype=torch.int64)
    flags.store(words, 0, 5)
    flags.store(words, 8, 7)
    assert flags.load(words, 8) == 7
    assert flags.wait(words, 0, [0, 1], 8, 5, 32, 2, 1.0) == (flags.WAIT_OK, [])
    t = time.monotonic()
    assert flags.wait(words, 0, [0, 1], 8, 6, 32, 2, 0.05) == (flags.WAIT_TIMEOUT, [0])
    assert time.monotonic() - t < 1.0
    flags.store(words, 40, 1)
    assert flags.wait(words, 0, [0, 1], 8, 5, 32, 2, 1.0)[0] == flags.WAIT_ABORTED
