"""Selected-record decode at DCP > 1: the per-step executor the sparse-MLA backend drives.

Instead of stock DCP (all-gather the queries, attend with every head over the local shard, merge
the partial outputs with their LSE), each rank fetches the records its rows selected from their
owners and attends with its own heads over them. Inputs, per rank, as vLLM holds them:

* ``caches``: the DSA layers' main record caches, one uint8 ``[num_blocks * block_size, W]``
  tensor per model layer (vLLM's per-layer caches viewed as rows; a stacked ``[L, rows, W]``
  tensor works too): the pack kernels reach them through a table of layer addresses;
  token ``t`` of request ``b`` lives on rank ``owner(t)`` (``DcpLayout``, vLLM's
  ``cp_kv_cache_interleave_size`` placement) at local ordinal ``local(t)``, row
  ``block_table[b, local // block_size] * block_size + local % block_size``;
* ``block_table`` int32 ``[B, max_blocks]`` of the DCP-sharded group (this rank's blocks);
* ``context`` int64 ``[B]``: tokens of request ``b`` before this step; its ``R`` rows (1 + the
  speculative tokens; every request has the same R, else the step is not eligible) are at
  positions ``context[b] + r``, token row ``b * R + r``;
* ``topk`` int32 ``[B * R, K]``: logical positions from the replicated indexer (-1 pad),
  identical on every rank, so every rank builds the same union and planes without talking;
* ``q_nope`` ``[B * R, H, 512]``, ``q_rope`` ``[B * R, H, 64]``: this rank's ``H`` heads;
* ``new_records`` uint8 ``[B * R, W]``: the step's own records of the layer. Every rank has the
  step's latents (hidden states are replicated over TP), but vLLM writes them into the owner's
  shard only at that layer's forward, after the group's prefetch was issued: so no rank sends
  them (they are ``held`` everywhere in the planes) and each rank patches them in locally.

Per step: ``begin_step`` (cache, block table, context); at each Full layer ``full_layer(F,
topk)``: per-request union of the R rows' top-k (``mtp_union``), planes with capacity ``B * U``
(``U = R * K``), and the layered exchange of F and the Shared layers that reuse its top-k, in
chunks of ``depth + 1`` layers (one ring of ``depth + 1`` slots; the next chunk is issued when the
previous one was consumed); at every DSA layer ``attend(l, ...)``: the workspace from the ring,
the step's own records patched in, ``sparse_mla_decode`` over it with the top-k remapped to
workspace rows ``b * U + u``. Returns the output and LSE of this rank's heads: no merge follows.
"""

from __future__ import annotations

import torch

from sparkinfer.attention import sparse_mla_decode
from sparkinfer.comm.exchange import SelectedExchange
from sparkinfer.comm.pack import Shard
from sparkinfer.comm.ring import PrefetchRing
from sparkinfer.core.topology import DcpLayout, IndexSharePattern
from sparkinfer.plan import build_planes, mtp_union, workspace_slots


class SelectedDecode:
    """One per rank and model; ``rows`` = R (1 + speculative tokens), ``topk`` = K."""

    def __init__(self, exchange: SelectedExchange, fmt, dcp: DcpLayout, pattern: IndexSharePattern, *,
                 max_batch: int, rows: int, topk: int, depth: int, scale: float, backend: str = "auto"):
        if exchange.layout.width != fmt.record_bytes:
            raise ValueError(f"exchange width {exchange.layout.width} != record bytes {fmt.record_bytes} of {fmt.name}")
        if dcp.world_size != exchange.world:
            raise ValueError(f"DCP size {dcp.world_size} != exchange world {exchange.world}")
        U = rows * topk
        if exchange.layout.capacity < max_batch * U:
            raise ValueError(f"slab capacity {exchange.layout.capacity} < max_batch * R * K = {max_batch * U}: "
                             "a union could not travel in one round")
        self.fmt, self.dcp, self.pattern = fmt, dcp, pattern
        self.R, self.K, self.U, self.max_batch = rows, topk, U, max_batch
        self.depth, self.scale, self.backend = depth, scale, backend
        self.ring = PrefetchRing(exchange, depth, rows=max_batch * U)
        self._shard: Shard | None = None
        self._context: torch.Tensor | None = None
        self._group: dict = {}

    def begin_step(self, caches, block_table: torch.Tensor, block_size: int,
                   context: torch.Tensor) -> None:
        if self._group:
            raise RuntimeError(f"layers {sorted(self._group)} of the previous step were never attended")
        B = context.shape[0]
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"{B} requests in the step; this decoder holds 1..{self.max_batch}")
        shard = Shard(caches, block_table[:B].contiguous(), block_size)
        if len(shard.layers) != self.pattern.num_layers or shard.width != self.fmt.record_bytes:
            raise ValueError(f"caches must hold {self.pattern.num_layers} layers of {self.fmt.record_bytes}-byte "
                             f"records, got {len(shard.layers)} of {shard.width} bytes")
        self._shard = shard
        self._context = context.to(torch.int64)

    def full_layer(self, layer: int, topk: torch.Tensor) -> None:
        """Plan the records of Full ``layer``'s group from its top-k and start the first exchange."""
        if self._shard is None:
            raise RuntimeError("full_layer() before begin_step()")
        if not self.pattern.is_full(layer):
            raise ValueError(f"layer {layer} is Shared; its top-k comes from layer {self.pattern.topk_source(layer)}")
        B, R, K = self._context.shape[0], self.R, self.K
        if topk.shape != (B * R, K) or topk.dtype != torch.int32:
            raise ValueError(f"topk must be int32 [{B * R}, {K}] (B={B} requests x R={R} rows), "
                             f"got {topk.dtype} {tuple(topk.shape)}")
        union, remap, counts = mtp_union(topk.view(B, R, K))
        b = torch.arange(B, device=union.device)[:, None]
        own = (union >= self._context[:, None]) & (union >= 0)  # this step's tokens: patched, not moved
        held = own[None].expand(self.dcp.world_size, B, self.U)
        planes = build_planes(union, counts, self.dcp, B * self.U, held=held)
        slots = workspace_slots(remap, self.U)
        # workspace row of each own-step token <- token row b * R + (t - context[b]) of new_records
        ws_rows = (b * self.U + torch.arange(self.U, device=union.device))[own]
        new_rows = (b * R + union.long() - self._context[:, None])[own]
        layers = [layer] + self.pattern.prefetch_targets(layer, self.pattern.num_layers)
        chunks = [layers[i:i + self.depth + 1] for i in range(0, len(layers), self.depth + 1)]
        group = {"planes": planes, "slots": slots, "patch": (ws_rows, new_rows), "chunks": chunks[1:],
                 "left": len(chunks[0])}  # layers of the chunk in the ring not attended yet
        for l in layers:
            self._group[l] = group
        self.ring.prefetch(planes, self._shard, chunks[0])

    def attend(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, new_records: torch.Tensor):
        """(out float32 [B*R, H, 512], lse float32 [B*R, H]) of this rank's heads at ``layer``."""
        group = self._group.pop(layer, None)
        if group is None:
            raise ValueError(f"layer {layer} has no plan: call full_layer() for layer "
                             f"{self.pattern.topk_source(layer)} first")
        W = self.fmt.record_bytes
        if new_records.dtype != torch.uint8 or new_records.shape != (group["slots"].shape[0], W):
            raise ValueError(f"new_records must be uint8 [{group['slots'].shape[0]}, {W}], "
                             f"got {new_records.dtype} {tuple(new_records.shape)}")
        ws = self.ring.get(layer)
        ws_rows, new_rows = group["patch"]
        ws[ws_rows] = new_records[new_rows]
        out, lse = sparse_mla_decode(q_nope, q_rope, ws, self.fmt, group["slots"], self.scale, backend=self.backend)
        self.ring.release(layer)
        group["left"] -= 1
        if group["left"] == 0 and group["chunks"]:  # the ring is free again: the group's next layers
            nxt = group["chunks"].pop(0)
            group["left"] = len(nxt)
            self.ring.prefetch(group["planes"], self._shard, nxt)
        return out, lse
