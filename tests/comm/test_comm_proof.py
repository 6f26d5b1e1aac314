"""The engine-start proof of a fabric (sparkinfer/comm/proof.py) on the host fabric, four ranks:
a healthy fabric passes in both sizings with the engine's own slab layout; a fabric that corrupts
one rank's deliveries, or one whose copies never land, fails the proof, and every rank learns the
same verdict (what the engine's fallback to stock DCP decides on), within the timeout."""

import time

import pytest

from sparkinfer.comm.launch import run_ranks

pytestmark = pytest.mark.multiproc
WORLD = 4


def _rank(rank, world):
    import torch

    import ctypes

    from sparkinfer.comm import flags
    from sparkinfer.comm import pack as P
    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.comm.host_fabric import HostFabric
    from sparkinfer.comm.proof import agreed_proof
    from sparkinfer.core.reservations import SelectedSizing

    # the engine's own layout (host sizing on CPU: a send slab), small: 2 requests x 1 x 16 rows
    layout = SelectedSizing(dcp=world, record_bytes=368, max_num_seqs=2, rows=1, topk=16, prefetch_depth=1,
                            pool_mb=1, sizing="host").slab()
    out = {}
    move = P.direct
    for fault in ("none", "corrupt", "lost"):
        fabric = HostFabric(layout, timeout_s=1.5)
        if fault == "corrupt" and rank == 2:  # what rank 2's moves store into a peer's region lands flipped
            def flip_then_publish(*args, arrive=None, **kwargs):
                move(*args, **kwargs)
                if arrive is not None:  # into a peer's region (args[7]): flip it, then publish it
                    args[7].bitwise_xor_(1)
                    flag, seq = arrive
                    flags.store_at(flag, ctypes.c_int64.from_address(seq).value)
            P.direct = flip_then_publish
        if fault == "lost" and rank == 2:  # rank 2's copy thread never runs its copies
            fabric._jobs.put = lambda job: None
        t0 = time.monotonic()
        try:
            proven, failed = agreed_proof(SelectedExchange(fabric))
            out[fault] = (proven, {r: v.split(":")[0] for r, v in failed.items()}, time.monotonic() - t0)
        finally:
            P.direct = move
            fabric.close()
    return out


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(_rank, WORLD, timeout_s=240)


def test_a_healthy_fabric_passes_in_both_sizings(outcomes):
    for out in outcomes:
        proven, failed, _ = out["none"]
        assert proven == ["device", "host"] and failed == {}


def test_lost_copies_fail_the_proof_on_every_rank_within_the_timeout(outcomes):
    verdicts = [out["lost"][1] for out in outcomes]
    assert all(v == verdicts[0] for v in verdicts)  # the whole group agrees
    assert verdicts[0] and set(verdicts[0].values()) == {"FabricError"}
    assert all(out["lost"][2] < 30 for out in outcomes)


def test_a_corrupting_fabric_fails_the_proof_and_every_rank_agrees(outcomes):
    verdicts = [out["corrupt"][1] for out in outcomes]
    assert all(v == verdicts[0] for v in verdicts)
    others = {r: v for r, v in verdicts[0].items() if r != 2}
    assert others == {r: "ProofFailed" for r in range(WORLD) if r != 2}  # what rank 2 delivered is wrong
    # rank 2's own device-sized proof passed; its host-sized one then times out: the peers stopped
    assert verdicts[0].get(2, "FabricError") == "FabricError"
