"""Synthetic exchange inputs shared by the tests and the transport benchmark.

Every rank builds the same case from the same seed (no communication): an unsharded record cache
per request, each rank's paged shard of it (vLLM's DCP placement, shuffled block tables), a
per-request union of distinct tokens, the planes from ``sparkinfer.plan.build_planes`` and,
independently of the planes, the workspace each destination must end up with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.core.topology import DcpLayout
from sparkinfer.plan import build_planes

from .pack import Shard


@dataclass
class Case:
    full: torch.Tensor       # uint8 [L, B, T, width]: every request's unsharded records
    union: torch.Tensor      # int32 [B, U], -1 pad
    counts: torch.Tensor     # int32 [B]
    held: torch.Tensor | None  # bool [D, B, U]: destination already holds the record
    planes: object
    shards: list             # Shard per rank
    dcp: DcpLayout
    capacity: int

    def replan(self, seed: int, *, union_len: int | None = None, held_frac: float = 0.0) -> "Case":
        """The same caches and shards with a new random union and its planes (another Full layer)."""
        union, counts, held = _random_union(self.dcp, self.full.shape[2], self.full.shape[1],
                                            union_len or self.union.shape[1], None, False, held_frac,
                                            torch.Generator().manual_seed(seed))
        planes = build_planes(union, counts, self.dcp, self.capacity, held=held)
        return Case(self.full, union, counts, held, planes, self.shards, self.dcp, self.capacity)

    def shard(self, rank: int) -> Shard:
        return self.shards[rank]

    def delivered(self, dst: int) -> torch.Tensor:
        """bool [B*U]: workspace rows the exchange must write on ``dst`` (live and not held)."""
        B, U = self.union.shape
        live = torch.arange(U)[None, :] < self.counts[:, None]
        if self.held is not None:
            live &= ~self.held[dst]
        return live.reshape(B * U)

    def expected_workspace(self, dst: int, layers: list[int]) -> torch.Tensor:
        """uint8 [J, B*U, width]: gather from the unsharded cache, zeros where nothing arrives."""
        L, B, T, W = self.full.shape
        U = self.union.shape[1]
        ws = torch.zeros(len(layers), B * U, W, dtype=torch.uint8)
        for b in range(B):
            for u in range(int(self.counts[b])):
                if self.held is not None and bool(self.held[dst, b, u]):
                    continue
                ws[:, b * U + u] = self.full[layers, b, int(self.union[b, u])]
        return ws


def make_case(world: int, width: int, *, batch: int = 2, seq_len: int = 64, union_len: int = 24,
              n_layers: int = 4, interleave: int = 1, block_size: int = 4, capacity: int | None = None,
              owner_only: int | None = None, empty: bool = False, held_frac: float = 0.0,
              seed: int = 0) -> Case:
    """A random case. ``owner_only=r`` draws union tokens only from rank r's shard; ``empty`` gives
    empty unions; ``held_frac`` marks that fraction of (dst, record) pairs as already held;
    ``capacity`` is the plane capacity (default: large enough, no overflow)."""
    g = torch.Generator().manual_seed(seed)
    dcp = DcpLayout(world, interleave)
    full = torch.randint(0, 256, (n_layers, batch, seq_len, width), generator=g, dtype=torch.uint8)
    union, counts, held = _random_union(dcp, seq_len, batch, union_len, owner_only, empty, held_frac, g)
    capacity = capacity if capacity is not None else batch * union_len
    planes = build_planes(union, counts, dcp, capacity, held=held)

    shards = [build_shard(full, dcp, r, block_size, g) for r in range(world)]
    return Case(full, union, counts, held, planes, shards, dcp, capacity)


def build_shard(full: torch.Tensor, dcp: DcpLayout, rank: int, block_size: int, g: torch.Generator) -> Shard:
    """Rank ``rank``'s paged shard of ``full`` uint8 [L, B, T, width] under DCP placement, its blocks
    scattered over the pool by a random block table (plus one spare block nobody maps)."""
    L, batch, seq_len, width = full.shape
    tokens = torch.arange(seq_len)
    owner, local = dcp.owner_and_local(tokens)
    blocks_per_req = -(-dcp.max_local_len(seq_len) // block_size)
    n_blocks = batch * blocks_per_req + 1
    bt = torch.randperm(n_blocks, generator=g)[: batch * blocks_per_req].view(batch, blocks_per_req)
    bt = bt.to(torch.int32).contiguous()
    cache = torch.zeros(L, n_blocks * block_size, width, dtype=torch.uint8)
    mine = owner == rank
    loc = local[mine]
    for b in range(batch):
        rows = bt[b, loc // block_size].long() * block_size + loc % block_size
        cache[:, rows] = full[:, b, tokens[mine]]
    return Shard(cache, bt, block_size)


def _random_union(dcp, seq_len, batch, U, owner_only, empty, held_frac, g):
    tokens = torch.arange(seq_len)
    pool = tokens if owner_only is None else tokens[dcp.owner_and_local(tokens)[0] == owner_only]
    union = torch.full((batch, U), -1, dtype=torch.int32)
    counts = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        n = 0 if empty else int(torch.randint(min(U, len(pool)) // 2, min(U, len(pool)) + 1, (1,), generator=g))
        union[b, :n] = pool[torch.randperm(len(pool), generator=g)[:n]].to(torch.int32)
        counts[b] = n
    held = torch.rand(dcp.world_size, batch, U, generator=g) < held_frac if held_frac > 0 else None
    return union, counts, held
