"""Single-process checks of the exchange's and the ring's input handling (a one-rank gloo group:
no peers, own records only), complementing the four-process tests."""

import datetime

import pytest
import torch
import torch.distributed as dist

from sparkinfer.comm.exchange import SelectedExchange
from sparkinfer.comm.host_fabric import HostFabric
from sparkinfer.comm.ring import PrefetchRing, decode_groups
from sparkinfer.core.slab import SlabLayout
from sparkinfer.comm.synthetic import make_case
from sparkinfer.core.topology import IndexSharePattern


@pytest.fixture(scope="module")
def fabric(tmp_path_factory):
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    f = HostFabric(SlabLayout(1, 368, capacity=64, max_layers=4, depth=2), timeout_s=2)
    yield f
    f.close()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def exchange(fabric):
    return SelectedExchange(fabric)  # one per fabric: sequence numbers are the fabric's


def test_one_rank_exchange_is_a_local_gather(exchange):
    case = make_case(1, 368, n_layers=4, seed=3)
    ws = torch.zeros(2, case.full.shape[1] * case.union.shape[1], 368, dtype=torch.uint8)
    st = exchange.exchange(case.planes, case.shard(0), [3, 1], ws)
    assert torch.equal(ws, case.expected_workspace(0, [3, 1]))
    assert st.records_sent == 0 and st.records_local == 2 * int(case.counts.sum())


def test_exchange_rejects_mismatched_inputs(exchange):
    case = make_case(1, 368, n_layers=4, seed=4)
    rows = case.full.shape[1] * case.union.shape[1]
    ws = torch.zeros(1, rows, 368, dtype=torch.uint8)
    two = make_case(2, 368, seed=4)
    with pytest.raises(ValueError, match=r"planes.count must be int32 \[1, 1\]"):
        exchange.exchange(two.planes, case.shard(0), [0], ws)
    with pytest.raises(ValueError, match="width 432 != exchange width 368"):
        exchange.exchange(case.planes, make_case(1, 432, seed=4).shard(0), [0], ws)
    with pytest.raises(ValueError, match="slab holds 1..4"):
        exchange.exchange(case.planes, case.shard(0), [0, 1, 2, 3, 0], torch.zeros(5, rows, 368, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out of range"):
        exchange.exchange(case.planes, case.shard(0), [7], ws)


def test_ring_slots_are_never_reused_while_held(exchange):
    pattern = IndexSharePattern.parse("FSSSFS", 6)
    assert decode_groups(pattern, 3) == [[0, 1, 2, 3], [4, 5]]
    assert decode_groups(pattern, 1) == [[0, 1], [4, 5]]
    base = make_case(1, 368, n_layers=6, seed=5)
    ring = PrefetchRing(exchange, depth=3, rows=base.full.shape[1] * base.union.shape[1])
    ring.prefetch(base.planes, base.shard(0), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="already in the ring"):
        ring.prefetch(base.planes, base.shard(0), [3])
    with pytest.raises(RuntimeError, match=r"ring full: slot\(s\) \[0\] still hold layer\(s\) \[0\]"):
        ring.prefetch(base.planes, base.shard(0), [4])
    with pytest.raises(ValueError, match="do not fit"):
        ring.prefetch(base.planes, base.shard(0), [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="was not prefetched"):
        ring.get(5)
    rows = base.delivered(0)
    for layer in (0, 1, 2, 3):
        assert torch.equal(ring.get(layer)[rows], base.expected_workspace(0, [layer])[0, rows])
        ring.release(layer)
    with pytest.raises(ValueError, match="not in the ring"):
        ring.release(0)
    nxt = base.replan(seed=9)
    ring.prefetch(nxt.planes, nxt.shard(0), [4, 5])  # slots free again: wraps to slot 0
    rows = nxt.delivered(0)
    assert torch.equal(ring.get(5)[rows], nxt.expected_workspace(0, [5])[0, rows])


def test_a_widened_ring_is_one_slot_of_every_row_between_steps(exchange):
    """``widen``: the same bytes as one slot of (depth + 1) x rows rows (a gathered step larger than a
    slot), a layer at a time; refused while a slot is held; back to depth + 1 slots after."""
    base = make_case(1, 368, n_layers=4, seed=6)
    rows = base.full.shape[1] * base.union.shape[1]
    ring = PrefetchRing(exchange, depth=1, rows=rows)
    ring.prefetch(base.planes, base.shard(0), [0])
    with pytest.raises(RuntimeError, match=r"between steps; layer\(s\) \[0\] are held"):
        ring.widen(True)
    ring.release(0)
    ptr = ring.buf.data_ptr()
    ring.widen(True)
    assert (tuple(ring.buf.shape), ring.depth, ring.buf.data_ptr()) == ((1, 2 * rows, 368), 0, ptr)
    with pytest.raises(ValueError, match="do not fit a ring of 1 slots"):
        ring.prefetch(base.planes, base.shard(0), [1, 2])
    ring.prefetch(base.planes, base.shard(0), [2])
    got = base.delivered(0)
    assert torch.equal(ring.get(2)[:rows][got], base.expected_workspace(0, [2])[0, got])
    ring.release(2)
    ring.widen(False)
    assert (tuple(ring.buf.shape), ring.depth) == ((2, rows, 368), 1)
    ring.prefetch(base.planes, base.shard(0), [1, 3])
    assert torch.equal(ring.get(3)[got], base.expected_workspace(0, [3])[0, got])
    for layer in (1, 3):
        ring.release(layer)
