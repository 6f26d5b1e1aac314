"""The torch reuse tracker against the numpy ReuseTracker (the independent reference), call by
call: held masks, pool slots, commit results, evictions, invalidation counts, warm statistics and
the full pool state, on hypothesis-generated operation sequences and on hand cases."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_reuse import _random_union, ops

from sparkinfer.core.reuse import ReuseTracker
from sparkinfer.core.topology import DcpLayout
from sparkinfer.plan.reuse_device import DEAD, TOKEN_END, DeviceReuseTracker


def _pool_state(tr):
    """Reference pools as per destination {(req, layer, token): (slot, last used)}."""
    out = []
    for dst in range(tr.world_size):
        s = {}
        for (r, layer), e in tr._entries[dst].items():
            s.update({(r, layer, int(t)): (int(sl), int(us)) for t, sl, us in zip(e.tokens, e.slots, e.used)})
        out.append(s)
    return out


def _device_state(tr):
    """The same from the device tables (keys decoded)."""
    keys, rows, used = (x.cpu().numpy() for x in (tr._keys, tr._rows, tr._used))
    out = [{} for _ in range(tr.world_size)]
    for p, dst, i in zip(*np.nonzero(used != DEAD)):
        k = int(keys[p, dst, i])
        req, rest = divmod(k, 1 << 40)
        layer, tok = divmod(rest, TOKEN_END)
        out[dst][(req, layer, tok)] = (int(rows[p, dst, i]) + int(p) * tr.quota, int(used[p, dst, i]))
    return out


def _assert_commit_equal(dev_res, ref_res):
    got = dev_res.to_host()
    np.testing.assert_array_equal(got.evicted, ref_res.evicted)
    for (b, u, s), (rb, ru, rs) in zip(got.stored, ref_res.stored):
        np.testing.assert_array_equal(b, rb)
        np.testing.assert_array_equal(u, ru)
        np.testing.assert_array_equal(s, rs)


class Twin:
    """Drives both trackers with the same calls and compares every result."""

    def __init__(self, d, interleave, cap, num_layers, device="cpu", validate=True):
        layout = DcpLayout(d, interleave)
        self.ref = ReuseTracker(layout, cap, num_layers)
        self.dev = DeviceReuseTracker(layout, cap, num_layers, max_requests=8, device=device, validate=validate)
        self.device = device

    def _t(self, x):
        return torch.as_tensor(np.asarray(x), device=self.device)

    def step(self, layer, reqs, union, counts, committed, group=None):
        ref, dev = self.ref, self.dev
        args = (self._t(reqs), self._t(union), self._t(counts))
        ref_slots = ref.slots(layer, reqs, union, counts)
        np.testing.assert_array_equal(dev.slots(layer, *args).cpu().numpy(), ref_slots)
        np.testing.assert_array_equal(dev.held(layer, *args).cpu().numpy(), ref.held(layer, reqs, union, counts))
        if group is not None:
            np.testing.assert_array_equal(dev.held_group(group, *args).cpu().numpy(),
                                          ref.held_group(group, reqs, union, counts))
        res = dev.commit(layer, *args, self._t(committed))
        ref_res = ref.commit(layer, reqs, union, counts, committed)
        _assert_commit_equal(res, ref_res)
        return res, ref_res

    def step_layers(self, reqs, unions, counts, committed):
        """Layers 0..L-1 in one device call each for slots and commit, per layer on the reference."""
        layers = list(range(len(unions)))
        got = self.dev.slots_layers(layers, self._t(reqs), self._t(unions), self._t(counts)).cpu().numpy()
        res = self.dev.commit_layers(layers, self._t(reqs), self._t(unions), self._t(counts), self._t(committed))
        for la in layers:
            np.testing.assert_array_equal(got[la], self.ref.slots(la, reqs, unions[la], counts[la]))
        for la in layers:
            _assert_commit_equal(res.layer(la), self.ref.commit(la, reqs, unions[la], counts[la], committed))
        return int(res.evicted.sum())

    def check_state(self, reqs_all):
        assert _device_state(self.dev) == _pool_state(self.ref)
        np.testing.assert_array_equal(self.dev.occupancy(), self.ref.occupancy())
        for r in reqs_all:
            assert self.dev.steady_new_fraction(r, -1.0) == self.ref.steady_new_fraction(r, -1.0)


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 4), interleave=st.integers(1, 3), cap=st.integers(0, 30), seq=ops,
       num_layers=st.sampled_from([None, 2, 3]), width=st.sampled_from([1, 10]))
def test_device_tracker_matches_numpy_tracker(d, interleave, cap, seq, num_layers, width):
    tw = Twin(d, interleave, cap, num_layers)
    reqs_all = [0, 1, 2]
    length = {r: 8 for r in reqs_all}
    for kind, seed in seq:
        rng = np.random.default_rng(seed)
        if kind == "step":
            reqs = [r for r in reqs_all if rng.random() < 0.8] or [0]
            rng.shuffle(reqs)  # batch order is not request order: insertion is batch-major
            layer = int(rng.integers(0, 2))
            ctx = max(max(length[r] for r in reqs) + 4, width)  # 4 speculative positions past the longest
            union, counts = _random_union(rng, reqs, ctx, width)
            committed = np.array([length[r] + int(rng.integers(-2, 5)) for r in reqs])  # < 0: a rollback
            tw.step(layer, reqs, union, counts, committed, group=[0, 1])
            for b, r in enumerate(reqs):
                length[r] = max(1, int(committed[b]))
        elif kind == "rollback":
            r = reqs_all[seed % 3]
            length[r] = max(1, length[r] - 1 - seed % 3)
            layers = None if seed % 2 else [seed % 2]
            assert tw.dev.invalidate_from(r, length[r], layers) == tw.ref.invalidate_from(r, length[r], layers)
        elif kind == "drop":
            r = reqs_all[seed % 3]
            assert tw.dev.drop_request(r) == tw.ref.drop_request(r)
            length[r] = 8
        else:
            r, start = reqs_all[seed % 3], seed % 8
            assert tw.dev.invalidate_range(r, start, start + 4) == tw.ref.invalidate_range(r, start, start + 4)
        tw.check_state(reqs_all)


def _sliding_steps(tw, steps, batch, width, ctx, layers, seed, batched=False, keep=0.7):
    """Realistic-ish traffic: per request and layer the next union keeps ``keep`` of the last one
    and draws the rest from the prefix; MTP-like commits of 1..4 tokens; every layer every step,
    one by one or (``batched``) all in one ``slots_layers`` / ``commit_layers`` call."""
    rng = np.random.default_rng(seed)
    reqs = list(range(batch))
    length = np.full(batch, ctx)
    last = np.stack([[rng.choice(ctx, size=width, replace=False) for _ in reqs] for _ in range(layers)])
    evicted = 0
    for _ in range(steps):
        union = np.empty_like(last)
        for la, b in np.ndindex(layers, batch):
            old = rng.choice(last[la, b], size=int(keep * width), replace=False)
            fresh = np.setdiff1d(np.arange(length[b] + 4), old)
            union[la, b] = rng.permutation(np.concatenate([old, rng.choice(fresh, width - len(old), replace=False)]))
        counts = rng.integers(width // 2, width + 1, size=(layers, batch))
        committed = length + rng.integers(1, 5, size=batch)
        if batched:
            evicted += tw.step_layers(reqs, union, counts, committed)
        else:
            for layer in range(layers):
                res, _ = tw.step(layer, reqs, union[layer], counts[layer], committed)
                evicted += int(res.evicted.sum())
        last, length = union, committed
    return evicted


@pytest.mark.parametrize("num_layers,batched", [(None, False), (3, False), (3, True)])
def test_device_tracker_matches_on_sliding_traffic(num_layers, batched):
    """Larger batches and unions with pools that fill up, so eviction runs every step; with
    ``batched`` all layers go through one call each step and must equal per-layer reference calls.
    The hot-path mode (no value checks) must give the same results."""
    tw = Twin(4, 2, 3 * 4 * 60, num_layers, validate=False)
    evicted = _sliding_steps(tw, steps=8, batch=4, width=64, ctx=400, layers=3, seed=3, batched=batched)
    assert evicted > 0
    tw.check_state(range(4))
    for r in (2, 0):
        assert tw.dev.drop_request(r) == tw.ref.drop_request(r)
    tw.check_state(range(4))


def test_hand_lru_order():
    """Hand-derived: DCP2, 4 rows. Rank 0 receives odd tokens. Equal clocks evict in
    (request, token) order; a record used again survives."""
    tr = DeviceReuseTracker(DcpLayout(2, 1), 4)
    t = torch.tensor
    tr.commit(0, t([1, 0]), t([[1, 3], [5, 7]]), t([2, 2]), t([100, 100]))  # clock 1: (0,5) (0,7) (1,1) (1,3)
    assert tr.holdings(0, 0, 0).tolist() == [5, 7] and tr.holdings(0, 1, 0).tolist() == [1, 3]
    res = tr.commit(0, t([1]), t([[3, 9, 11]]), t([3]), t([100]))  # clock 2: 3 refreshed, 9 and 11 new
    # victims: the two oldest in (request, token) order, (0, 5) and (0, 7); their rows are reused
    assert tr.holdings(0, 0, 0).tolist() == [] and tr.holdings(0, 1, 0).tolist() == [1, 3, 9, 11]
    assert res.evicted.tolist() == [2, 0]
    # insertion is batch-major: request 1 took rows 0, 1 and request 0 rows 2, 3, now freed
    assert res.slot[0].tolist() == [[-1, 2, 3]]
    assert tr.slots(0, t([1]), t([[1, 3, 9, 11]]), t([4]))[0].tolist() == [[0, 1, 2, 3]]


def test_hand_speculative_and_rollback():
    tr = DeviceReuseTracker(DcpLayout(2, 1), 100, num_layers=2)
    t = torch.tensor
    res = tr.commit(1, t([3]), t([[1, 3, 10, 11]]), t([4]), t([11]))  # 11 is a rejected draft
    assert tr.holdings(0, 3, 1).tolist() == [1, 3] and tr.holdings(1, 3, 1).tolist() == [10]
    assert res.slot.tolist() == [[[50, 51, -1, -1]], [[-1, -1, 50, -1]]]  # layer 1 owns rows 50..99
    assert tr.invalidate_from(3, 3, layers=[0]) == 0  # another layer: nothing
    assert tr.invalidate_from(3, 3) == 2  # 3 and 10
    assert tr.holdings(0, 3, 1).tolist() == [1]
    assert tr.occupancy().tolist() == [1, 0]


def test_zero_capacity_and_warm_statistics():
    tr = DeviceReuseTracker(DcpLayout(4, 1), 0)
    res = tr.commit(0, [0], torch.arange(16)[None], [16], [100])
    assert (res.slot == -1).all() and res.evicted.tolist() == [0] * 4
    assert tr.steady_new_fraction(0, 0.25) == 0.25
    tr = DeviceReuseTracker(DcpLayout(2, 1), 64)
    tr.commit(0, [0], torch.tensor([[0, 1, 2, 3, 4, 5]]), [6], [20])
    tr.commit(0, [0], torch.tensor([[0, 1, 2, 3, 6, 7]]), [6], [20])  # each rank held 2 of its 3 remote
    assert tr.steady_new_fraction(0, 0.25) == pytest.approx(1 - 4 / 6)


def test_bad_inputs():
    tr = DeviceReuseTracker(DcpLayout(2, 1), 4, max_requests=4)
    t = torch.tensor
    cases = [
        (lambda: DeviceReuseTracker(DcpLayout(2, 1), -1), "capacity"),
        (lambda: DeviceReuseTracker(DcpLayout(2, 1), 4, num_layers=300), "num_layers"),
        (lambda: tr.held(0, t([0]), t([[1, 1]]), t([2])), "repeats"),
        (lambda: tr.held(0, t([0, 0]), t([[1], [2]]), t([1, 1])), "distinct"),
        (lambda: tr.held(0, t([4]), t([[1]]), t([1])), "max_requests"),
        (lambda: tr.held(0, t([0]), t([[-3]]), t([1])), "token ids"),
        (lambda: tr.held(0, t([0]), t([[TOKEN_END]]), t([1])), "token ids"),
        (lambda: tr.held(0, t([0]), t([[1]]), t([2])), "counts"),
        (lambda: tr.held(0, t([0]), t([1]), t([1])), r"\[B, U\]"),
        (lambda: tr.held(0, t([0]), t([[1.0]]), t([1])), r"\[B, U\]"),
        (lambda: tr.held(256, t([0]), t([[1]]), t([1])), "layer must be"),
        (lambda: tr.commit(0, t([0]), t([[1]]), t([1]), t([1, 2])), "committed_len"),
        (lambda: tr.held_group([], t([0]), t([[1]]), t([1])), "at least one layer"),
        (lambda: tr.drop_request(9), "request id"),
        (lambda: DeviceReuseTracker(DcpLayout(2, 1), 8, num_layers=4).held_group(
            [0, 1], t([0]), t([[1]]), t([[1]])), "counts int \\[B\\]"),
        (lambda: tr.commit_layers([0, 1], t([0]), t([[[1]], [[2]]]), t([[1], [1]]), t([5])), "per-layer quotas"),
        (lambda: DeviceReuseTracker(DcpLayout(2, 1), 8, num_layers=4).slots_layers(
            [0, 2], t([0]), t([[[1]], [[2]]]), t([[1], [1]])), "consecutive"),
        (lambda: DeviceReuseTracker(DcpLayout(2, 1), 8, num_layers=4).slots_layers(
            [0, 1], t([0]), t([[[1]]]), t([[1], [1]])), "one \\[B, U\\] union per layer"),
        (lambda: DeviceReuseTracker(DcpLayout(2, 1), 4, num_layers=2).invalidate_from(0, 0, layers=[2]),
         "layer must be"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


@pytest.mark.gpu
def test_cuda_twin_and_no_host_sync():
    """On a GPU: the CUDA tracker equals the numpy reference (per layer and batched), and with
    validate=False the per-layer and batched calls never synchronize with the host."""
    tw = Twin(4, 1, 4 * 4 * 60, 3, device="cuda", validate=False)
    assert _sliding_steps(tw, steps=6, batch=4, width=64, ctx=400, layers=3, seed=5) > 0
    assert _sliding_steps(tw, steps=4, batch=4, width=64, ctx=420, layers=3, seed=6, batched=True) > 0
    tw.check_state(range(4))
    dev = tw.dev
    union = torch.randperm(500, device="cuda")[:256].view(4, 64)
    reqs, counts = torch.arange(4, device="cuda"), torch.full((4,), 64, device="cuda")
    committed = torch.full((4,), 600, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev.held_group([0, 1], reqs, union, counts)
        dev.slots(2, reqs, union, counts)
        dev.commit(2, reqs, union, counts, committed)
        dev.slots_layers([0, 1, 2], reqs, union.expand(3, -1, -1), counts.expand(3, -1))
        dev.commit_layers([0, 1, 2], reqs, union.expand(3, -1, -1), counts.expand(3, -1), committed + 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
