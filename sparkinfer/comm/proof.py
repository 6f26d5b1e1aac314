"""Prove at engine start that a fabric moves records between every pair of ranks.

``prove(exchange)`` runs real exchanges through the engine's own ``SelectedExchange`` (the same
fabric, slabs, pack / unpack kernels and arrival / release flags a step uses) on a small synthetic
case that every rank builds from the same seed (``synthetic.make_case``): every rank sends records
to every other rank, once device-sized (the decode path: stores into the peers' regions) and, when
the slab has a send slab, once host-sized (copies). Each rank then reads its workspace back and
compares it byte for byte with what the unsharded cache says it must hold. ``cudaDeviceCanAccessPeer``
alone says nothing about IOMMU / ACS setups that map P2P but corrupt or drop the writes; this does.

A wait that times out raises :class:`FabricError` on this rank and (abort words) on its peers;
a wrong read-back raises :class:`ProofFailed`. Either way the caller serves stock DCP.
"""

from __future__ import annotations

import torch

from .exchange import SelectedExchange
from .pack import Shard
from .synthetic import make_case

PROOF_SEED = 1601


class ProofFailed(RuntimeError):
    """The fabric delivered records that differ from what was sent."""


def _to(shard: Shard, device) -> Shard:
    cache = shard.cache.to(device) if isinstance(shard.cache, torch.Tensor) else [t.to(device) for t in shard.cache]
    return Shard(cache, shard.block_table.to(device), shard.block_size)


def _planes_to(planes, device):
    from dataclasses import fields, is_dataclass, replace

    if not is_dataclass(planes):
        raise TypeError(f"planes of type {type(planes).__name__} are not a dataclass")
    moved = {f.name: getattr(planes, f.name).to(device) for f in fields(planes)
             if isinstance(getattr(planes, f.name), torch.Tensor)}
    return replace(planes, **moved)


def prove(exchange: SelectedExchange) -> list[str]:
    """Exchange a synthetic case in every sizing the slab supports and check it; returns the sizings
    proven. Raises FabricError (a peer missing / timed out) or ProofFailed (wrong bytes)."""
    lay, rank, dev = exchange.layout, exchange.rank, exchange.fabric.device
    union = min(8, lay.capacity)  # B x U workspace rows: within the region of a device-sized exchange
    case = make_case(exchange.world, lay.width, batch=1, seq_len=max(16, 2 * union), union_len=union,
                     n_layers=min(2, lay.max_layers), seed=PROOF_SEED)
    layers = list(range(case.full.shape[0]))
    shard, planes = _to(case.shard(rank), dev), _planes_to(case.planes, dev)
    want = case.expected_workspace(rank, layers)
    ids = torch.tensor(layers, dtype=torch.int32, device=dev)
    sizings = ["device"] + (["host"] if lay.send_capacity > 0 else [])
    for sizing in sizings:
        ws = torch.zeros(want.shape, dtype=torch.uint8, device=dev)
        exchange.exchange(planes, shard, ids, ws, sizing=sizing)
        got = ws.cpu()  # engine start: the one read back the proof exists for
        check = getattr(exchange.fabric, "check", None)
        if check is not None:
            check()  # device-side error words (a timed-out wait, a bad index) of the proof's kernels
        if not torch.equal(got, want):
            bad = int((got != want).any(dim=-1).sum())
            raise ProofFailed(f"rank {rank}: the {exchange.fabric.kind} fabric's {sizing}-sized proof exchange "
                              f"delivered {bad} of {want.shape[0] * want.shape[1]} records wrong")
    return sizings


def agreed_proof(exchange: SelectedExchange, group=None) -> tuple[list[str], dict[int, str]]:
    """``prove`` on every rank of ``group``, then the verdicts all-gathered: (sizings proven,
    {rank: what failed there}), the same failures on every rank, so the whole group takes the same
    decision (a rank whose own proof passed still learns that a peer's did not). A proof failure
    never hangs: a wait times out and aborts the peers (FabricError), a wrong byte is ProofFailed."""
    import torch.distributed as dist

    from .fabric import FabricError

    proven, problem = [], None
    try:
        proven = prove(exchange)
    except (ProofFailed, FabricError) as e:
        problem = f"{type(e).__name__}: {e}"
    verdicts: list = [None] * exchange.world
    dist.all_gather_object(verdicts, problem, group=group)
    return proven, {r: v for r, v in enumerate(verdicts) if v is not None}
