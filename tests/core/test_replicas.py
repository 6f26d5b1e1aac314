"""The replica rule (sparkinfer/core/replicas.py) against a literal ring replayed write by write.

The brute force keeps what each store row really contains (which request, which position, which
write) and what each request has committed; every position the rule calls held must be in its
row, written by that request's accepted write. Sequences cover MTP rows with random acceptance,
chunked prefills longer than the window, requests that skip steps, preemption (a re-prefill from
0), aborts whose key a new request reuses, and more requests than slots.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer.core.replicas import ReplicaWindow, StepReplicas, store_bytes, window_for_budget


class _Truth:
    """The literal store and each live request's committed records."""

    def __init__(self, window, slots):
        self.window = window
        self.rows = {}  # store row -> (request uid, position, write id)
        self.committed = {}  # uid -> {position: write id}
        self.write_id = 0

    def write(self, uid, step: StepReplicas, b, rows):
        start, n = int(step.start[b]), int(step.n[b])
        ids = {}
        for p, row in zip(range(start, start + n), rows):
            self.write_id += 1
            ids[p] = self.write_id
            if row >= 0:
                self.rows[int(row)] = (uid, p, self.write_id)
        return ids

    def check(self, uid, step: StepReplicas, b):
        for p in range(int(step.lo[b]), int(step.start[b])):
            row = int(step.rows(np.array([b]), np.array([p]))[0])
            assert self.rows.get(row) == (uid, p, self.committed[uid][p]), (
                f"request {uid} position {p}: rule says held at row {row}, the row holds {self.rows.get(row)}")


ops = st.lists(st.tuples(st.sampled_from(["step", "step", "step", "new", "abort", "preempt"]),
                         st.integers(0, 10**6)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 24), slots=st.integers(1, 4), rows=st.integers(1, 4), seq=ops)
def test_held_positions_are_exactly_the_committed_records_in_the_store(window, slots, rows, seq):
    rule = ReplicaWindow(window, slots)
    truth = _Truth(window, slots)
    live = {}  # uid -> dict(key, context, pending (accepted rows so far?))
    free_keys = list(range(6))
    next_uid = 0
    for op, r in seq:
        rng = np.random.default_rng(r)
        if op == "new" and free_keys:
            key = free_keys.pop(int(rng.integers(len(free_keys))))
            live[next_uid] = {"key": key, "context": 0, "prompt": int(rng.integers(1, 3 * window + 2))}
            truth.committed[next_uid] = {}
            next_uid += 1
        elif op in ("abort", "preempt") and live:
            uid = sorted(live)[int(rng.integers(len(live)))]
            req = live[uid]
            if op == "abort":  # gone; its key goes back to the pool unannounced half of the time
                if rng.integers(2):
                    rule.drop(req["key"])
                free_keys.append(req["key"])
                del live[uid]
            else:  # preempted: blocks freed, later recomputed from position 0 under the same key
                rule.drop(req["key"])
                req["prompt"] += req["context"]
                req["context"] = 0
                truth.committed[uid] = {}
        elif op == "step" and live:
            uids = [u for u in sorted(live) if rng.random() < 0.8] or [sorted(live)[0]]
            rng.shuffle(uids)
            starts, lens = [], []
            for u in uids:
                req = live[u]
                if req["prompt"] > 0:  # prefill, possibly chunked
                    chunk = int(rng.integers(1, req["prompt"] + 1))
                    starts.append(req["context"])
                    lens.append(chunk)
                else:
                    starts.append(req["context"])
                    lens.append(int(rng.integers(1, rows + 1)))  # vLLM may schedule fewer drafts
            step = rule.begin_step([live[u]["key"] for u in uids], starts, lens)
            wrows = step.write_rows()
            kept = wrows[wrows >= 0]
            assert len(np.unique(kept)) == len(kept), "one step writes a store row twice (scatter order)"
            off = 0
            for b, u in enumerate(uids):
                n = int(step.n[b])
                ids = truth.write(u, step, b, wrows[off:off + n])
                off += n
                truth.check(u, step, b)
                req = live[u]
                if req["prompt"] > 0:  # a prefill chunk commits every row
                    accepted = n
                    req["prompt"] -= n
                else:  # 1 + accepted drafts of the step's rows
                    accepted = 1 + int(rng.integers(n))
                for p in range(req["context"], req["context"] + accepted):
                    truth.committed[u][p] = ids[p]
                req["context"] += accepted


def test_a_window_larger_than_every_context_holds_every_committed_position():
    rule = ReplicaWindow(window=1000, slots=2)
    s = rule.begin_step(["a", "b"], [0, 0], [37, 5])
    assert s.all_local and list(s.held_counts) == [0, 0]
    ctx = {"a": 37, "b": 5}
    for _ in range(50):
        s = rule.begin_step(["b", "a"], [ctx["b"], ctx["a"]], [4, 4])
        assert s.all_local
        assert list(s.held_counts) == [ctx["b"], ctx["a"]]
        ctx["a"] += 3
        ctx["b"] += 1


def test_a_small_window_holds_the_last_window_minus_the_steps_rows():
    rule = ReplicaWindow(window=16, slots=1)
    rule.begin_step([7], [0], [40])  # prefill longer than the window
    s = rule.begin_step([7], [40], [4])  # MTP3 decode: rows 40..43 overwrite 24..27
    assert (s.lo[0], s.start[0]) == (28, 40)
    held = s.held_mask(np.array([[0, 27, 28, 39, 40, -1]]))
    assert held.tolist() == [[False, False, True, True, False, False]]
    s = rule.begin_step([7], [41], [4])  # one accepted row: 42, 43 were rejected drafts
    assert (s.lo[0], s.start[0]) == (29, 41)


def test_key_reused_by_a_new_request_holds_nothing_of_the_old_one():
    rule = ReplicaWindow(window=64, slots=1)
    rule.begin_step(["blk3"], [0], [30])
    rule.begin_step(["blk3"], [30], [1])  # old request, then it ends unannounced
    s = rule.begin_step(["blk3"], [0], [10])  # a new request under the same key
    assert (s.lo[0], s.start[0]) == (0, 0)
    s = rule.begin_step(["blk3"], [10], [1])
    assert (s.lo[0], s.start[0]) == (0, 10)


def test_more_requests_than_slots_get_no_slot_not_a_wrong_one():
    rule = ReplicaWindow(window=8, slots=1)
    s = rule.begin_step(["x", "y"], [0, 0], [3, 3])
    assert s.slot.tolist() == [0, -1] and s.write_rows()[3:].tolist() == [-1, -1, -1]
    s = rule.begin_step(["y"], [3], [1])  # y evicts x (least recently written): a new run from 3
    assert s.slot.tolist() == [0] and (s.lo[0], s.start[0]) == (3, 3)
    s = rule.begin_step(["x"], [3], [1])
    assert (s.lo[0], s.start[0]) == (3, 3)


def test_window_zero_is_off_and_bad_input_is_refused():
    s = ReplicaWindow(0, 4).begin_step([1], [5], [1])
    assert s.slot.tolist() == [-1] and not s.held_mask(np.array([[0, 4]])).any()
    with pytest.raises(ValueError, match="window"):
        ReplicaWindow(-1, 1)
    with pytest.raises(ValueError, match="twice"):
        ReplicaWindow(4, 2).begin_step([1, 1], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="starts"):
        ReplicaWindow(4, 2).begin_step([1], [0, 0], [1])


def test_budget_arithmetic():
    assert window_for_budget(store_bytes(1000, 8, 78, 368), 8, 78, 368) == 1000
    assert window_for_budget(store_bytes(1000, 8, 78, 368) - 1, 8, 78, 368) == 999


def test_a_gap_in_the_writes_starts_a_new_run():
    rule = ReplicaWindow(window=64, slots=1)
    rule.begin_step(["k"], [0], [10])
    s = rule.begin_step(["k"], [20], [1])  # positions 10..19 were never written here
    assert (s.lo[0], s.start[0]) == (20, 20)
    s = rule.begin_step(["k"], [5], [1])  # a rewrite below the run
    assert (s.lo[0], s.start[0]) == (5, 5)
