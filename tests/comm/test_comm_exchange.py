"""Four-process tests of the selected-record exchange over the host fabric.

One spawned group of four ranks runs every scenario (spawning is the expensive part on two cores);
each test then checks its scenario's outcome on every rank. The property throughout: every
destination's workspace equals a gather from the unsharded cache (``Case.expected_workspace``,
computed from the union directly, not from the planes).
"""

import pytest
import torch

WORLD = 4
TIMEOUT_S = 2.0


def _ws_for(case, layers):
    L, B, T, W = case.full.shape
    return torch.zeros(len(layers), B * case.union.shape[1], W, dtype=torch.uint8)


def _diff(ws, expected) -> str:
    if torch.equal(ws, expected):
        return "equal"
    bad = (ws != expected).any(dim=2).nonzero().tolist()
    return f"{len(bad)} rows differ, first (layer, slot): {bad[:4]}"


HOST_READS = {"cpu", "tolist", "item", "numpy", "__int__", "__index__", "__bool__", "__float__"}


class HotPathGuard:
    """Records, while active, every tensor read-back to Python (``HOST_READS``, seen through
    ``__torch_function__``) and every aten op that is not a view (a new buffer: allocation or
    compute). A graph-replayable call shows neither."""

    def __enter__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        guard = self
        self.host_reads, self.new_buffers = [], []

        class Reads(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in HOST_READS:
                    guard.host_reads.append(func.__name__)
                return func(*args, **(kwargs or {}))

        class Buffers(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not func.is_view or "lift_fresh" in str(func):
                    guard.new_buffers.append(str(func))
                return func(*args, **(kwargs or {}))

        self._modes = [Reads(), Buffers()]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)


def _rank_main(rank, world):
    import time

    import torch.distributed as dist

    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.comm.fabric import FabricError
    from sparkinfer.comm.host_fabric import HostFabric
    from sparkinfer.core.slab import SlabLayout
    from sparkinfer.comm.synthetic import make_case

    results = {}

    def scenario(name, fn, layout=None, timeout_s=5.0):
        fabric = None
        try:
            if layout is not None:
                fabric = HostFabric(layout, timeout_s=timeout_s)
            results[name] = ("ok", fn(fabric))
        except Exception as e:  # the outcome is what the test inspects
            results[name] = ("error", f"{type(e).__name__}: {e}")
        finally:
            if fabric is not None:
                fabric.close()
            dist.barrier()

    def exchange_cases(cases, layers, fabric, overlap=True, sizing="host", layer_arrival=True):
        """Run several exchanges, two in flight at a time when ``overlap``; compare every result."""
        ex = SelectedExchange(fabric, sizing, layer_arrival)
        if sizing == "device":
            layers = torch.tensor(layers, dtype=torch.int32)
        send_ptr = fabric._send.data_ptr()
        out = []
        wss = [_ws_for(c, layers) for c in cases]
        if overlap:
            pend = [ex.start(c.planes, c.shard(rank), layers, ws) for c, ws in zip(cases[:2], wss[:2])]
            stats = [ex.finish(p) for p in pend]
            stats += [ex.exchange(c.planes, c.shard(rank), layers, ws) for c, ws in zip(cases[2:], wss[2:])]
        else:
            stats = [ex.exchange(c.planes, c.shard(rank), layers, ws) for c, ws in zip(cases, wss)]
        for c, ws, st in zip(cases, wss, stats):
            out.append((_diff(ws, c.expected_workspace(rank, list(map(int, layers)))), st.rounds, st.records_sent,
                        st.records_recv))
        assert fabric._send.data_ptr() == send_ptr  # replay reuses the preallocated slab
        return out

    for width, kw in ((368, {}), (432, {"interleave": 2}), (656, {"held_frac": 0.3}), (37, {"block_size": 3})):
        cases = [make_case(world, width, seed=s, **kw) for s in (1, 2, 3)]
        scenario(f"random_{width}", lambda f: exchange_cases(cases, [1, 2, 3], f),
                 SlabLayout(world, width, capacity=48, max_layers=3, depth=2))

    for width, kw in ((368, {}), (656, {"held_frac": 0.3, "interleave": 2}), (37, {"block_size": 3})):
        cases = [make_case(world, width, seed=s, **kw) for s in (21, 22, 23)]
        scenario(f"device_{width}", lambda f: exchange_cases(cases, [0, 2], f, sizing="device"),
                 SlabLayout(world, width, capacity=48, max_layers=2, depth=2))
    cases = [make_case(world, 368, seed=s) for s in (24, 25, 26)]
    scenario("device_packed", lambda f: exchange_cases(cases, [0, 1, 3], f, sizing="device", layer_arrival=False),
             SlabLayout(world, 368, capacity=48, max_layers=3, depth=2))

    def mixed(f):
        """Host- and device-sized exchanges interleaved on one fabric, two in flight."""
        cases = [make_case(world, 432, seed=s, held_frac=0.2) for s in (31, 32, 33, 34)]
        layers = torch.tensor([1, 3], dtype=torch.int32)
        ex = SelectedExchange(f)
        wss = [_ws_for(c, [1, 3]) for c in cases]
        pend = []
        for k, (c, ws) in enumerate(zip(cases, wss)):
            pend.append(ex.start(c.planes, c.shard(rank), layers, ws, sizing="host" if k % 2 else "device"))
            if len(pend) == 2:
                ex.finish(pend.pop(0))
        ex.finish(pend[0])
        try:
            SelectedExchange(f)
            second = "no error"
        except ValueError as e:
            second = str(e)
        return [second] + [_diff(ws, c.expected_workspace(rank, [1, 3])) for c, ws in zip(cases, wss)]
    scenario("mixed", mixed, SlabLayout(world, 432, capacity=48, max_layers=2, depth=2))

    def hot_path(f):
        """After one eager call, device-sized exchanges read nothing back and allocate nothing;
        the same guard sees the host-sized exchange read the counts (so it can fail)."""
        cases = [make_case(world, 368, seed=s) for s in (41, 42, 43)]
        layers = torch.tensor([0, 1], dtype=torch.int32)
        wss = [_ws_for(c, [0, 1]) for c in cases]
        dev = SelectedExchange(f, "device")
        dev.exchange(cases[0].planes, cases[0].shard(rank), layers, wss[0])  # the eager call
        side, queue_side = [], f.on_side_stream  # the Shared sections run on the side thread: guard them there

        def guarded(fn):
            def run():
                with HotPathGuard() as s:
                    fn()
                side.append(s)
            return run
        f.on_side_stream = lambda seq, fn: queue_side(seq, guarded(fn))
        with HotPathGuard() as g:
            p1 = dev.start(cases[1].planes, cases[1].shard(rank), layers, wss[1])
            p2 = dev.start(cases[2].planes, cases[2].shard(rank), layers, wss[2])
            dev.finish(p1)
            dev.finish(p2)
        f.on_side_stream = queue_side
        assert len(side) == 2  # both exchanges' side work ran, and finished before finish() returned
        for s in side:
            g.host_reads += s.host_reads
            g.new_buffers += s.new_buffers
        diffs = [_diff(ws, c.expected_workspace(rank, [0, 1])) for c, ws in zip(cases, wss)]
        with HotPathGuard() as h:
            dev.exchange(cases[1].planes, cases[1].shard(rank), layers, _ws_for(cases[1], [0, 1]), sizing="host")
        return diffs, g.host_reads, g.new_buffers, sorted(set(h.host_reads))
    scenario("hot_path", hot_path, SlabLayout(world, 368, capacity=48, max_layers=2, depth=2))

    def device_refusals(f):
        small = make_case(world, 368, capacity=20, seed=44)  # C=20 < B*U=48: a count could overflow
        ex = SelectedExchange(f, "device")
        errors = []
        for planes, layers in ((small.planes, torch.tensor([0], dtype=torch.int32)), (small.planes, [0])):
            try:
                ex.exchange(planes, small.shard(rank), layers, _ws_for(small, [0]))
                errors.append("no error")
            except ValueError as e:
                errors.append(str(e))
        return errors
    scenario("device_refusals", device_refusals, SlabLayout(world, 368, capacity=48, max_layers=1))

    def inference_mode(f):
        """Built and used under torch.inference_mode (as inside vLLM's forward): the copy thread,
        outside that mode, must still write the segments."""
        case = make_case(world, 368, seed=51)
        with torch.inference_mode():
            fab = HostFabric(SlabLayout(world, 368, capacity=48, max_layers=1), timeout_s=5)
            try:
                ws = _ws_for(case, [0])
                SelectedExchange(fab).exchange(case.planes, case.shard(rank), [0], ws)
            finally:
                fab.close()
        return _diff(ws, case.expected_workspace(rank, [0]))
    scenario("inference_mode", inference_mode)

    def copy_fails(f):
        """Rank 1's copy thread fails: every rank raises promptly (not at its timeout) naming it, by
        its next fabric call at the latest."""
        case = make_case(world, 368, seed=52)
        if rank == 1:
            own = f._recv_region_of

            def broken(owner, seq):
                if owner != rank:  # only the copy thread writes into a peer's segment
                    time.sleep(0.5)  # fail late, so the failure also surfaces at the next call
                    raise RuntimeError("injected copy failure")
                return own(owner, seq)
            f._recv_region_of = broken
        t0 = time.monotonic()
        ex = SelectedExchange(f)
        try:
            # Copies are asynchronous: rank 1's exchange may return before its copy thread runs
            # the failing job (its peers' records already landed); then its next call raises.
            for _ in range(2):
                ex.exchange(case.planes, case.shard(rank), [0], _ws_for(case, [0]))
            return "no error"
        except FabricError as e:
            return f"{time.monotonic() - t0:.1f} {e}"
    scenario("copy_fails", copy_fails, SlabLayout(world, 368, capacity=48, max_layers=1), timeout_s=20)

    def delayed_copy(f):
        """Rank 1's copy thread stalls past the timeout: its peers' step fails in the arrival wait
        (nothing stale is unpacked), and rank 1, whose own exchange returned, fails at its next
        step's check (comm.errors.StepChecks: the peers' abort words) instead of going on."""
        from sparkinfer.comm.errors import DeviceCheckFailed, StepChecks

        case = make_case(world, 368, seed=53)
        if rank == 1:
            own = f._recv_region_of

            def slow(owner, seq):
                if owner != rank:  # only the copy thread writes into a peer's segment
                    time.sleep(3 * f.timeout_s)
                return own(owner, seq)
            f._recv_region_of = slow
        checks, out = StepChecks(f), []
        try:
            SelectedExchange(f).exchange(case.planes, case.shard(rank), [0], _ws_for(case, [0]))
            checks.end_step()
            out.append("step ok")
        except FabricError as e:
            out.append(f"step failed: {e}")
        dist.barrier()  # every waiting peer gave up by now
        try:
            checks.poll()
            out.append("next step ok")
        except DeviceCheckFailed as e:
            out.append(f"next step failed: {e}")
        return out
    scenario("delayed_copy", delayed_copy, SlabLayout(world, 368, capacity=48, max_layers=1), timeout_s=1.5)

    scenario("empty", lambda f: exchange_cases([make_case(world, 368, empty=True)], [0], f, overlap=False),
             SlabLayout(world, 368, capacity=8, max_layers=1))
    scenario("one_owner", lambda f: exchange_cases([make_case(world, 432, owner_only=0, seed=4)], [0, 3], f,
                                                   overlap=False),
             SlabLayout(world, 432, capacity=48, max_layers=2))
    scenario("chunked", lambda f: exchange_cases([make_case(world, 368, seed=s, union_len=30) for s in (5, 6, 7)],
                                                 [2, 0], f),
             SlabLayout(world, 368, capacity=5, max_layers=2, depth=2))

    def counters(f):
        """Bytes and non-empty copies the fabric counted per destination, after a barrier."""
        cases = [make_case(world, 368, seed=s, union_len=30, held_frac=0.3) for s in (13, 14)]
        exchange_cases(cases, [2, 0], f, overlap=False)
        dist.barrier()  # every peer saw our arrivals, so our copy thread counted them
        # plain lists: tensors would travel back through shared-memory handles of an exited process
        return list(f.copied_bytes), list(f.copies), [(c.union.tolist(), c.counts.tolist(), c.held.tolist())
                                                      for c in cases]
    scenario("counters", counters, SlabLayout(world, 368, capacity=5, max_layers=2, depth=2))

    def overflow(f):
        case = make_case(world, 368, capacity=3, seed=8)
        assert case.planes.overflow
        SelectedExchange(f).exchange(case.planes, case.shard(rank), [0], _ws_for(case, [0]))
    scenario("overflow", overflow, SlabLayout(world, 368, capacity=8, max_layers=1))

    def bad_workspace(f):
        case = make_case(world, 368, seed=9)
        SelectedExchange(f).exchange(case.planes, case.shard(rank), [0, 1], _ws_for(case, [0]))
    scenario("bad_workspace", bad_workspace, SlabLayout(world, 368, capacity=48, max_layers=2))

    scenario("mismatch", lambda f: HostFabric(SlabLayout(world, 432 if rank == 2 else 368, capacity=8,
                                                         max_layers=1)))

    def decode_ring(f):
        from sparkinfer.comm.ring import PrefetchRing, decode_groups
        from sparkinfer.core.topology import IndexSharePattern

        pattern = IndexSharePattern.parse("FFSSSFSS", 8)
        base = make_case(world, 432, n_layers=8, seed=11)
        ring = PrefetchRing(SelectedExchange(f), depth=3, rows=base.full.shape[1] * base.union.shape[1])
        out = []
        for group in decode_groups(pattern, 3):
            case = base.replan(seed=100 + group[0], held_frac=0.2)  # the Full layer's own top-k
            ring.prefetch(case.planes, case.shard(rank), group)
            for layer in group:
                rows = case.delivered(rank)  # other rows hold older layers' records (never read)
                out.append((layer, _diff(ring.get(layer)[None, rows], case.expected_workspace(rank, [layer])[:, rows])))
                ring.release(layer)
        return out
    scenario("decode_ring", decode_ring, SlabLayout(world, 432, capacity=48, max_layers=4, depth=2))

    def held_sections(f, sizing):
        """Every rank holds back its Shared layers' sections (and the regions' arrive) of one
        layered exchange (F + 3 Shared layers): the host-sized copies, or the device-sized side
        work. F's get must return while they are held, with F's records complete; a get that
        waited for them would time out. Then the held work is issued and the Shared layers land
        byte for byte too."""
        from sparkinfer.comm.ring import PrefetchRing

        case = make_case(world, 368, n_layers=4, seed=61)
        ring = PrefetchRing(SelectedExchange(f, sizing), depth=3, rows=case.full.shape[1] * case.union.shape[1])
        held = []
        if sizing == "host":
            issue = f.copy

            def holding(seq, dst, nbytes, offset=0, layer=None, src_offset=0):
                if layer == 0:
                    issue(seq, dst, nbytes, offset, layer, src_offset)
                else:
                    held.append((seq, dst, nbytes, offset, layer, src_offset))
            f.copy = holding
        else:
            issue = f.on_side_stream
            f.on_side_stream = lambda seq, fn: held.append((seq, fn))
        group, rows = [0, 1, 2, 3], case.delivered(rank)
        ring.prefetch(case.planes, case.shard(rank), group)
        t = time.monotonic()
        first = _diff(ring.get(0)[None, rows], case.expected_workspace(rank, [0])[:, rows])
        waited, n_held = time.monotonic() - t, len(held)
        dist.barrier()  # every rank's F returned before any rank issues its held work
        if sizing == "host":
            f.copy = issue
        else:
            f.on_side_stream = issue
        for args in held:
            issue(*args)
        out = [first, n_held, waited]
        for layer in group:
            out.append(_diff(ring.get(layer)[None, rows], case.expected_workspace(rank, [layer])[:, rows]))
            ring.release(layer)
        return out
    for sizing in ("host", "device"):
        scenario(f"held_sections_{sizing}", lambda f: held_sections(f, sizing),
                 SlabLayout(world, 368, capacity=48, max_layers=4, depth=2), timeout_s=10.0)

    def prefill_ring(f):
        from sparkinfer.comm.ring import PrefetchRing, prefill_planes

        case = make_case(world, 368, n_layers=5, seq_len=24, interleave=2, seed=12)
        seq_lens = [24, 19]
        planes = prefill_planes(seq_lens, case.dcp)
        T = 24
        ring = PrefetchRing(SelectedExchange(f), depth=2, rows=2 * T)
        for layer in range(3):  # three single-layer exchanges in flight
            ring.prefetch(planes, case.shard(rank), [layer])
        out = []
        for layer in range(5):
            ws = ring.get(layer).view(2, T, -1)
            ok = all(torch.equal(ws[b, :n], case.full[layer, b, :n]) for b, n in enumerate(seq_lens))
            out.append((layer, ok))
            ring.release(layer)
            if layer + 3 < 5:
                ring.prefetch(planes, case.shard(rank), [layer + 3])
        return out
    scenario("prefill_ring", prefill_ring, SlabLayout(world, 368, capacity=2 * 12, max_layers=1, depth=3))

    def never_arrives(f):
        case = make_case(world, 368, seed=10)
        ex = SelectedExchange(f)
        t0 = time.monotonic()
        if rank == 3:  # the late rank: arrives only after the others gave up
            dist.barrier()
        try:
            ex.exchange(case.planes, case.shard(rank), [0], _ws_for(case, [0]))
            return "no error"
        except FabricError as e:
            return f"FabricError after {time.monotonic() - t0:.1f}s: {e}"
        finally:
            if rank != 3:
                dist.barrier()
    scenario("never_arrives", never_arrives, SlabLayout(world, 368, capacity=48, max_layers=1), timeout_s=TIMEOUT_S)

    def late_construction(_):
        if rank == 3:
            dist.barrier()  # arrives only after the others gave up
        try:
            HostFabric(SlabLayout(world, 368, capacity=8, max_layers=1), timeout_s=TIMEOUT_S).close()
            return "no error"
        except FabricError as e:
            return f"FabricError: {e}"
        finally:
            if rank != 3:
                dist.barrier()
    scenario("late_construction", late_construction)
    return results


@pytest.fixture(scope="module")
def outcomes():
    from sparkinfer.comm.launch import run_ranks

    return run_ranks(_rank_main, WORLD, timeout_s=150, pg_timeout_s=60)


def _ok(outcomes, name):
    for rank, res in enumerate(outcomes):
        status, value = res[name]
        assert status == "ok", f"rank {rank} {name}: {value}"
        yield rank, value


pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("width", [368, 432, 656, 37])
def test_random_planes_layered_replay(outcomes, width):
    for rank, runs in _ok(outcomes, f"random_{width}"):
        assert len(runs) == 3
        for diff, rounds, sent, recv in runs:
            assert diff == "equal", f"rank {rank}: {diff}"
            assert rounds == 1 and sent > 0 and recv > 0


@pytest.mark.parametrize("variant", ["368", "656", "37", "packed"])
def test_device_sized_exchange_matches_gather(outcomes, variant):
    """Layered (J = 2: F's section on the caller's stream, the other on the side stream) at three
    widths, and packed (``layer_arrival=False``, J = 3: one arrival per region)."""
    for rank, runs in _ok(outcomes, f"device_{variant}"):
        assert len(runs) == 3
        for diff, rounds, sent, recv in runs:
            assert diff == "equal", f"rank {rank}: {diff}"
            assert rounds == 1 and sent == 0 and recv == 0  # counts never reach the host


def test_host_and_device_sized_exchanges_share_a_fabric(outcomes):
    for rank, (second, *diffs) in _ok(outcomes, "mixed"):
        assert diffs == ["equal"] * 4, f"rank {rank}: {diffs}"
        assert "already has a SelectedExchange" in second


def test_device_sized_exchange_replays_without_reads_or_allocations(outcomes):
    for rank, (diffs, reads, buffers, host_sized_reads) in _ok(outcomes, "hot_path"):
        assert diffs == ["equal"] * 3, f"rank {rank}: {diffs}"
        assert reads == [] and buffers == [], f"rank {rank}: host reads {reads}, new buffers {buffers}"
        assert "tolist" in host_sized_reads  # the guard does see a host read


def test_device_sized_exchange_refuses_what_it_cannot_replay(outcomes):
    for rank, (small_capacity, list_layers) in _ok(outcomes, "device_refusals"):
        assert "C >= B * U" in small_capacity
        assert "int32 tensor" in list_layers


def test_fabric_built_under_inference_mode_works(outcomes):
    for rank, diff in _ok(outcomes, "inference_mode"):
        assert diff == "equal", f"rank {rank}: {diff}"


def test_failed_copy_fails_every_rank_promptly(outcomes):
    for rank, msg in _ok(outcomes, "copy_fails"):
        assert msg != "no error", f"rank {rank} never raised"
        seconds, text = msg.split(" ", 1)
        assert float(seconds) < 10, f"rank {rank} waited {seconds} s (the timeout is 20 s): {text}"
        if rank == 1:
            assert "injected copy failure" in text
        else:
            assert "aborted by a peer: rank 1 failed" in text, text


def test_a_delayed_copy_fails_every_rank_by_its_next_step(outcomes):
    for rank, out in _ok(outcomes, "delayed_copy"):
        assert out[-1].startswith("next step failed") and "earlier step" in out[-1], (rank, out)
        if rank != 1:  # the step itself failed (timed out or aborted by a peer that did), naming the late rank
            assert out[0].startswith("step failed") and "[1]" in out[0], (rank, out)
        else:  # its exchange may have returned: the check a step later names who gave up on it
            assert "gave up waiting for rank(s) [1]" in out[-1], (rank, out)


def test_fabric_counts_the_bytes_and_copies_it_moved(outcomes):
    """Against the byte accounting computed from the unions (not from the planes): 2 layers x 368 B
    per missing record; a pair with n records needs ceil(n / c) non-empty copies, c the widest
    per-pair window whose blocks fit every destination's shared region of 5 records (brute force)."""
    import numpy as np

    from sparkinfer.core.accounting import missing_counts
    from sparkinfer.core.topology import DcpLayout

    for rank, (nbytes, copies, cases) in _ok(outcomes, "counters"):
        want_bytes, want_copies = np.zeros(WORLD, np.int64), np.zeros(WORLD, np.int64)
        for union, counts, held in cases:
            full = missing_counts(np.array(union), np.array(counts), DcpLayout(WORLD, 1), np.array(held))
            np.fill_diagonal(full, 0)
            c = max(c for c in range(1, max(2, min(5, full.max()) + 1))  # send regions hold 5 too
                    if all(np.minimum(full[:, d], c).sum() <= 5 for d in range(WORLD)))
            m = full[rank]
            want_bytes += m * 2 * 368
            want_copies += -(-m // c)
        assert nbytes == want_bytes.tolist() and copies == want_copies.tolist(), f"rank {rank}"
        assert nbytes[rank] == 0 and sum(nbytes) > 0


def test_decode_ring_layered_prefetch(outcomes):
    for rank, runs in _ok(outcomes, "decode_ring"):
        assert [l for l, _ in runs] == list(range(8))
        assert all(d == "equal" for _, d in runs), f"rank {rank}: {runs}"


@pytest.mark.parametrize("sizing", ["host", "device"])
def test_full_layer_get_does_not_wait_for_the_shared_sections(outcomes, sizing):
    """F's get returned (F's rows equal the gather) while every rank held its Shared layers'
    sections (host sizing: their copies; device sizing: the side work packing them): the held work
    is issued only after it returns, so a get that waited for it would have timed out (the
    scenario's 10 s) and failed on every rank, as it does with ``layer_arrival=False``. The held
    work then delivered every layer."""
    for rank, (first, n_held, waited, *layers) in _ok(outcomes, f"held_sections_{sizing}"):
        assert first == "equal", f"rank {rank}: {first}"
        if sizing == "host":  # 3 Shared sections per non-empty pair + 3 arrives
            assert n_held >= 3 * (WORLD - 1) + (WORLD - 1)
        else:  # one side job for the exchange
            assert n_held == 1
        assert waited < 10.0
        assert layers == ["equal"] * 4, f"rank {rank}: {layers}"


def test_prefill_ring_gathers_full_ckv(outcomes):
    for rank, runs in _ok(outcomes, "prefill_ring"):
        assert runs == [(l, True) for l in range(5)]


def test_empty_planes(outcomes):
    for rank, runs in _ok(outcomes, "empty"):
        assert runs == [("equal", 1, 0, 0)]


def test_one_rank_owns_everything(outcomes):
    for rank, runs in _ok(outcomes, "one_owner"):
        diff, rounds, sent, recv = runs[0]
        assert diff == "equal"
        if rank == 0:
            assert sent > 0 and recv == 0
        else:
            assert sent == 0 and recv > 0


def test_capacity_overflow_is_chunked(outcomes):
    for rank, runs in _ok(outcomes, "chunked"):
        for diff, rounds, sent, recv in runs:
            assert diff == "equal" and rounds > 1


def test_planes_overflow_raises_on_every_rank(outcomes):
    for rank, res in enumerate(outcomes):
        status, msg = res["overflow"]
        assert status == "error" and msg.startswith("ExchangeOverflow") and "stock path" in msg


def test_bad_workspace_is_rejected(outcomes):
    for rank, res in enumerate(outcomes):
        status, msg = res["bad_workspace"]
        assert status == "error" and "workspace must be uint8 [2," in msg


def test_mismatched_configuration_fails_everywhere(outcomes):
    for rank, res in enumerate(outcomes):
        status, msg = res["mismatch"]
        assert status == "error" and "'width'" in msg and "rank 2" in msg, msg


def test_rank_that_never_arrives_times_out_everywhere(outcomes):
    for rank, res in enumerate(outcomes):
        status, msg = res["never_arrives"]
        assert status == "ok" and msg.startswith("FabricError"), f"rank {rank}: {msg}"
        if rank == 3:
            assert "gave up waiting for rank(s) [3]" in msg
        else:  # its own timeout, or a peer's abort that beat it: both name rank 3
            assert "missing peer(s): [3]" in msg or "gave up waiting for rank(s) [3]" in msg, msg
            assert float(msg.split("after ")[1].split("s")[0]) < TIMEOUT_S + 2


def test_rank_missing_at_construction_fails_everywhere(outcomes):
    for rank, res in enumerate(outcomes):
        status, msg = res["late_construction"]
        assert status == "ok" and msg.startswith("FabricError"), f"rank {rank}: {msg}"
        if rank == 3:
            assert "aborted by a peer" in msg and "[3]" in msg
        else:
            assert "missing peer(s): [3]" in msg or ("aborted by a peer" in msg and "[3]" in msg), msg
