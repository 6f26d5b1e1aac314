"""Cross-step reuse: the tracker against a brute-force pool model, invariants under
random operation sequences (hypothesis), and agreement across processes."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer.core import accounting as acc
from sparkinfer.core.reuse import ReuseTracker
from sparkinfer.core.topology import DcpLayout


class BrutePools:
    """Reference: per destination a dict (req, layer, token) -> last-used clock."""

    def __init__(self, d, interleave, capacity, num_layers):
        self.d, self.i = d, interleave
        self.shared = num_layers is None
        self.cap = capacity if self.shared else capacity // num_layers  # rows per partition
        self.pool = [dict() for _ in range(d)]
        self.clock = 0
        self.warm = {}  # req -> [hits, remote] over (dst, layer) pairs that already held records of req

    def steady(self, req, prior):
        h, r = self.warm.get(req, (0, 0))
        return prior if r == 0 else 1 - h / r

    def owner(self, t):
        return (t // self.i) % self.d

    def held(self, layer, reqs, union, counts):
        out = np.zeros((self.d,) + union.shape, bool)
        for dst in range(self.d):
            for b, r in enumerate(reqs):
                for u in range(counts[b]):
                    out[dst, b, u] = (r, layer, int(union[b, u])) in self.pool[dst]
        return out

    def commit(self, layer, reqs, union, counts, committed):
        self.clock += 1
        for b, r in enumerate(reqs):
            self.invalidate(r, committed[b], None, layer)
        for dst in range(self.d):
            pool = self.pool[dst]
            new = []
            for b, r in enumerate(reqs):
                if any(k[0] == r and k[1] == layer for k in pool):
                    w = self.warm.setdefault(r, [0, 0])
                    for u in range(counts[b]):
                        t = int(union[b, u])
                        if self.owner(t) != dst:
                            w[0] += (r, layer, t) in pool
                            w[1] += 1
                for u in range(counts[b]):
                    t = int(union[b, u])
                    key = (r, layer, t)
                    if key in pool:
                        pool[key] = self.clock
                    elif self.owner(t) != dst and t < committed[b]:
                        new.append(key)
            new = new[:self.cap]
            same = (lambda k: True) if self.shared else (lambda k: k[1] == layer)
            while sum(map(same, pool)) + len(new) > self.cap:
                victim = min((k for k in pool if same(k)), key=lambda k: (pool[k], k[0], k[1], k[2]))
                del pool[victim]
            for k in new:
                pool[k] = self.clock

    def invalidate(self, req, start, end=None, layer=None):
        for pool in self.pool:
            for k in [k for k in pool if k[0] == req and k[2] >= start and (end is None or k[2] < end)
                      and (layer is None or k[1] == layer)]:
                del pool[k]


def _random_union(rng, reqs, ctx, width):
    u = np.full((len(reqs), width), -1, np.int64)
    counts = rng.integers(0, width + 1, size=len(reqs))
    for b in range(len(reqs)):
        u[b, :counts[b]] = rng.choice(ctx, size=counts[b], replace=False)
    return u, counts


def _state(tr):
    """Every destination's holdings as a comparable set."""
    out = []
    for dst in range(tr.world_size):
        s = set()
        for (r, layer), e in tr._entries[dst].items():
            s |= {(r, layer, int(t)) for t in e.tokens}
        out.append(s)
    return out


def _check_invariants(tr, committed_now):
    for dst in range(tr.world_size):
        for part in range(tr.parts):
            free = tr._free_rows(dst, part).tolist()
            slots = np.concatenate([e.slots for (_, la), e in tr._entries[dst].items() if tr._part(la) == part]
                                   or [np.zeros(0, np.int64)])
            assert len(slots) == len(set(slots.tolist())), "duplicate pool slot"
            assert len(slots) + len(free) == tr.quota
            assert np.all((slots >= part * tr.quota) & (slots < (part + 1) * tr.quota)), "row outside its partition"
            assert not set(slots.tolist()) & set(free)
        assert tr.occupancy()[dst] <= tr.capacity
        for (r, layer), e in tr._entries[dst].items():
            owner, _ = tr.layout.owner_and_local(e.tokens)
            assert np.all(owner != dst), "a destination holds its own token"
            assert np.all(e.tokens < committed_now.get(r, 0)), "an uncommitted position is held"
            assert np.all(np.diff(e.tokens) > 0)


ops = st.lists(st.tuples(st.sampled_from(["step", "step", "step", "rollback", "drop", "block"]),
                         st.integers(0, 2 ** 31 - 1)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 4), interleave=st.integers(1, 3), cap=st.integers(0, 30), seq=ops,
       num_layers=st.sampled_from([None, 2]))
def test_tracker_matches_brute_force_and_invariants(d, interleave, cap, seq, num_layers):
    layout = DcpLayout(d, interleave)
    tr, ref = ReuseTracker(layout, cap, num_layers), BrutePools(d, interleave, cap, num_layers)
    reqs_all = ["a", "b", "c"]
    length = {r: 8 for r in reqs_all}  # committed length per request
    for kind, seed in seq:
        rng = np.random.default_rng(seed)
        if kind == "step":
            reqs = [r for r in reqs_all if rng.random() < 0.8] or ["a"]
            layer = int(rng.integers(0, 2))
            ctx = max(length[r] for r in reqs) + 4  # 4 speculative positions past the longest
            union, counts = _random_union(rng, reqs, ctx, 10)
            held = tr.held(layer, reqs, union, counts)
            np.testing.assert_array_equal(held, ref.held(layer, reqs, union, counts))
            if num_layers == 2:  # one exchange for both layers: held only where both hold it
                np.testing.assert_array_equal(tr.held_group([0, 1], reqs, union, counts),
                                              ref.held(0, reqs, union, counts) & ref.held(1, reqs, union, counts))
            slots = tr.slots(layer, reqs, union, counts)
            assert np.array_equal(slots >= 0, held)
            committed = np.array([length[r] + int(rng.integers(1, 5)) for r in reqs])
            res = tr.commit(layer, reqs, union, counts, committed)
            ref.commit(layer, reqs, union, counts, committed)
            for b, r in enumerate(reqs):
                length[r] = int(committed[b])
            # the stored records are exactly the remote, committed, not-held ones (up to the quota)
            for dst in range(d):
                bb, uu, ss = res.stored[dst]
                assert len(ss) <= tr.quota
                for b, u in zip(bb, uu):
                    t = union[b, u]
                    assert not held[dst, b, u] and (t // interleave) % d != dst and t < committed[b]
        elif kind == "rollback":
            r = reqs_all[seed % 3]
            length[r] = max(1, length[r] - 1 - seed % 3)
            tr.invalidate_from(r, length[r])
            ref.invalidate(r, length[r])
        elif kind == "drop":
            r = reqs_all[seed % 3]
            tr.drop_request(r)
            ref.invalidate(r, 0)
            ref.warm.pop(r, None)
            length[r] = 8
        else:  # a KV block freed / reused
            r, start = reqs_all[seed % 3], seed % 8
            tr.invalidate_range(r, start, start + 4)
            ref.invalidate(r, start, start + 4)
        assert _state(tr) == [{k for k in p} for p in ref.pool]
        assert [tr.steady_new_fraction(r, -1.0) for r in reqs_all] == [ref.steady(r, -1.0) for r in reqs_all]
        _check_invariants(tr, length)


def test_reuse_bytes_are_the_new_records():
    """With the held mask, the exchange moves exactly the remote records not received before."""
    layout = DcpLayout(4, 1)
    tr = ReuseTracker(layout, 10_000)
    first = np.arange(0, 64)[None, :]
    tr.commit(0, ["r"], first, [64], [100])
    second = np.arange(32, 96)[None, :]  # 32 old tokens, 32 new
    held = tr.held(0, ["r"], second, [64])
    lb = acc.selected_layer(acc.missing_counts(second, np.array([64]), layout, held), 368)
    full = acc.selected_layer(acc.missing_counts(second, np.array([64]), layout), 368)
    assert full.total == 64 * 3 // 4 * 4 * 368  # 48 remote records for each of 4 dsts
    assert lb.total == 32 * 3 // 4 * 4 * 368


def test_speculative_positions_not_reused():
    layout = DcpLayout(2, 1)
    tr = ReuseTracker(layout, 100)
    union = np.array([[1, 3, 10, 11]])
    tr.commit(0, ["r"], union, [4], committed_len=[11])  # 11 was a rejected draft
    assert tr.holdings(0, "r", 0).tolist() == [1, 3]  # rank 0 owns even tokens
    assert tr.holdings(1, "r", 0).tolist() == [10]
    held = tr.held(0, ["r"], union, [4])
    assert held[0, 0].tolist() == [True, True, False, False]
    tr.invalidate_from("r", 5)
    assert tr.holdings(1, "r", 0).tolist() == []


def test_eviction_is_lru_then_order():
    layout = DcpLayout(2, 1)
    tr = ReuseTracker(layout, 3)
    tr.commit(0, ["r"], np.array([[1, 3, 5]]), [3], [100])   # rank 0 holds 1,3,5
    tr.commit(0, ["r"], np.array([[3, 7]]), [2], [100])      # 3 used; 7 new -> evict 1 (oldest, lowest)
    assert tr.holdings(0, "r", 0).tolist() == [3, 5, 7]
    tr.commit(0, ["r"], np.array([[9, 11]]), [2], [100])     # evict 3 and 5 (older than 7)
    assert tr.holdings(0, "r", 0).tolist() == [7, 9, 11]
    assert tr.occupancy().tolist() == [3, 0]


def test_zero_capacity_holds_nothing():
    tr = ReuseTracker(DcpLayout(4, 1), 0)
    res = tr.commit(0, [0], np.arange(16)[None], [16], [100])
    assert res.stored_count.tolist() == [0, 0, 0, 0]
    assert not tr.held(0, [0], np.arange(16)[None], [16]).any()


def test_held_group_needs_a_layer():
    with pytest.raises(ValueError, match="at least one layer"):
        ReuseTracker(DcpLayout(2, 1), 8).held_group([], ["a"], np.zeros((1, 1), np.int64), [0])


def test_steady_fraction_observed_on_warm_commits_only():
    """The cold first commit is no observation (it says nothing of steady state); the second,
    warm one is; request end forgets it."""
    tr = ReuseTracker(DcpLayout(2, 1), 64)
    u1 = np.array([[0, 1, 2, 3, 4, 5]])
    assert tr.steady_new_fraction("a", 0.25) == 0.25
    tr.commit(0, ["a"], u1, [6], [20])
    assert tr.steady_new_fraction("a", 0.25) == 0.25
    # dst 0 held 1, 3, 5 and now wants 1, 3, 7 (remote for it): 2 of 3 held; dst 1 likewise 0, 2 of 0, 2, 6
    tr.commit(0, ["a"], np.array([[0, 1, 2, 3, 6, 7]]), [6], [20])
    assert tr.steady_new_fraction("a", 0.25) == pytest.approx(1 - 4 / 6)
    tr.drop_request("a")
    assert tr.steady_new_fraction("a", 0.25) == 0.25


def test_bad_inputs():
    tr = ReuseTracker(DcpLayout(2, 1), 4)
    with pytest.raises(ValueError, match="capacity"):
        ReuseTracker(DcpLayout(2, 1), -1)
    with pytest.raises(ValueError, match="repeats"):
        tr.held(0, ["r"], np.array([[1, 1]]), [2])
    with pytest.raises(ValueError, match="distinct"):
        tr.held(0, ["r", "r"], np.zeros((2, 1)), [1, 1])
    with pytest.raises(ValueError, match="committed_len"):
        tr.commit(0, ["r"], np.array([[1]]), [1], [1, 2])
    with pytest.raises(ValueError, match="layer must be"):
        ReuseTracker(DcpLayout(2, 1), 4, num_layers=1).held(1, ["r"], np.array([[1]]), [1])
    with pytest.raises(ValueError, match="num_layers"):
        ReuseTracker(DcpLayout(2, 1), 4, num_layers=0)
    with pytest.raises(ValueError, match=r"\[B, U\]"):
        tr.held(0, ["r"], np.array([1]), [1])


_SCRIPT = r"""
import hashlib, numpy as np
from sparkinfer.core.reuse import ReuseTracker
from sparkinfer.core.topology import DcpLayout
rng = np.random.default_rng(5)
tr = ReuseTracker(DcpLayout(4, 1), 200, num_layers=3)
h = hashlib.sha256()
for step in range(30):
    base = 20 + step * 2
    toks = np.unique(rng.integers(0, base + 4, size=40))
    rng.shuffle(toks)
    union = toks[None, :]
    h.update(tr.held(step % 3, [7], union, [len(toks)]).tobytes())
    res = tr.commit(step % 3, [7], union, [len(toks)], [base + 2])
    for b, u, s in res.stored:
        h.update(s.tobytes())
print(h.hexdigest())
"""


def test_identical_across_processes():
    """Every rank derives the same holdings and pool slots: run the same inputs in separate
    interpreters (different hash seeds) and compare digests."""
    outs = set()
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin",
                                "PYTHONPATH": ":".join(sys.path)}, check=True)
        outs.add(r.stdout.strip())
    assert len(outs) == 1 and len(next(iter(outs))) == 64


def test_bytes_per_token_replay():
    """The benchmark's replay: with the same old top-k at every position, only the first step
    moves records when reuse is on; plain selected records move the same bytes every step."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bytes_per_token.py")
    spec = importlib.util.spec_from_file_location("bytes_per_token", path)
    bpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bpt)
    assert bpt.first_occurrence_union(np.array([[5, 3, 5], [1, 3, 9]])).tolist() == [5, 3, 1, 9]
    topk = np.arange(0, 64)  # tokens 0..63, all committed long before the window
    for fresh in (False, True):
        res = bpt.replay(lambda layer, pos: topk, np.arange(100, 140), layers=2, capacity=1000, seed=1,
                         fresh=fresh)
        per_step = 2 * 48 * 4 * 368  # 2 layers, 48 remote records for each of 4 destinations
        assert res["selected"].tolist() == [per_step] * len(res["selected"])
        assert res["reuse"][0] == per_step and not res["reuse"][1:].any()
        assert res["overlap"] == 1.0 and 1 <= res["tokens"].min() and res["tokens"].max() <= 4


def test_reuse_gather_matches_reference_across_steps():
    """End to end on CPU: per step, every destination builds its dense union workspace from
    (a) records sent through build_planes' planes (held removed), (b) its reuse pool at
    ReuseTracker.slots, (c) its own shard; the workspace must equal a gather from the unsharded
    cache bit for bit, while rejected drafts' positions are rewritten with new bytes each step
    (a stale pooled record would show)."""
    torch = pytest.importorskip("torch")
    from sparkinfer.plan import build_planes, mtp_union

    d, rec, rows, k = 4, 16, 4, 12
    layout = DcpLayout(d, 1)
    rng = np.random.default_rng(11)
    cache = rng.integers(0, 256, size=(400, rec), dtype=np.uint8)  # the unsharded cache, one layer
    tracker = ReuseTracker(layout, 40)
    pools = np.zeros((d, 40, rec), np.uint8)
    length = 60  # committed tokens
    moved_with, moved_without = 0, 0
    for step in range(12):
        # the 4 rows at positions length .. length+3 (speculative records written this step)
        cache[length:length + rows] = rng.integers(0, 256, size=(rows, rec), dtype=np.uint8)
        topk = np.stack([np.concatenate([rng.choice(length + j, size=k - 1, replace=False), [length + j]])
                         for j in range(rows)])
        union_t, _, counts_t = mtp_union(torch.tensor(topk[None], dtype=torch.int32))
        union, counts = union_t.numpy(), counts_t.numpy()
        held = tracker.held(0, ["r"], union, counts)
        slots = tracker.slots(0, ["r"], union, counts)
        planes = build_planes(union_t, counts_t, layout, union.shape[1], held=torch.from_numpy(held))
        assert not planes.overflow
        owner, local = layout.owner_and_local(np.maximum(union, 0))
        for dst in range(d):
            ws = np.zeros((union.shape[1], rec), np.uint8)
            for src in range(d):
                n = int(planes.count[src, dst])
                for c in range(n):
                    tok = layout.token_of(src, int(planes.local[src, dst, c]))
                    ws[int(planes.slot[src, dst, c])] = cache[tok]  # the owner's shard row
            for u in range(counts[0]):
                if held[dst, 0, u]:
                    ws[u] = pools[dst, slots[dst, 0, u]]
            np.testing.assert_array_equal(ws[:counts[0]], cache[union[0, :counts[0]]])
        moved_with += int((planes.count.numpy() * (1 - np.eye(d, dtype=np.int32))).sum())
        moved_without += sum(int((owner[0, :counts[0]] != t).sum()) for t in range(d))
        # acceptance: 1..4 tokens commit; store what each destination received
        a = int(rng.integers(1, rows + 1))
        res = tracker.commit(0, ["r"], union, counts, [length + a])
        for dst, (bb, uu, ss) in enumerate(res.stored):
            pools[dst, ss] = cache[union[bb, uu]]
        length += a
    assert moved_with < moved_without  # reuse saved transfers
