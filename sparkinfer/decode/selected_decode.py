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

Replica records (``sparkinfer.core.replicas``): with ``begin_step(..., replicas=LocalReplicas(...))``
every position of request ``b`` in ``[lo[b], context[b])`` is in this rank's replica store (every
rank keeps the same window), so it is held for every destination as well: nobody sends it and each
rank copies it from its store into the workspace. A group whose planes then carry nothing runs no
exchange at all (no pack, copy or barrier; the ring slots are only reserved).

Gathered steps (a prefill chunk or a mixed batch: rows not R per request): ``begin_step`` with
``query_lens`` int64 ``[B]`` (the request's rows are token rows ``start[b] .. start[b] +
query_lens[b]``, ``start`` the running sum), then ``gather()``: every rank receives each request's
whole prefix ``0 .. context[b]`` in every layer (the prefill-side full-CKV gather, ``T = max
(context + query_lens)``, workspace row ``b * T + t`` = token t), the layers in chunks of
``depth + 1`` through the same ring (one layer at a time through the whole ring as one slot when
``B x T`` rows pass a slot: ``PrefetchRing.widen``), and the step's own tokens patched in locally
as above. Each
layer's ``attend`` then takes its top-k (logical positions, the indexer's buffer) and reads rows
``b * T + topk``. A cold prefill (context 0) moves nothing at all: every token is the step's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.attention import sparse_mla_decode
from sparkinfer.comm.exchange import ExchangeStats, SelectedExchange
from sparkinfer.comm.pack import Shard
from sparkinfer.comm.ring import PrefetchRing, prefix_union
from sparkinfer.core.topology import DcpLayout, IndexSharePattern
from sparkinfer.decode.group_plan import GroupPlan, patch_and_planes, plan_reference
from sparkinfer.decode.layer_buffers import AttentionArena, attend_in_blocks
from sparkinfer.decode.paged_sparse_mla import copy_rows


@dataclass
class LocalReplicas:
    """This rank's replica store as one step sees it.

    store   per model layer a uint8 ``[slots * window, W]`` tensor (position p of the request in
            slot k at row ``k * window + p % window``)
    lo      int64 ``[B]``: positions ``[lo[b], context[b])`` of request b are in the store
    base    int64 ``[B]``: ``slot * window`` of request b (any value where ``lo == context``)
    """

    store: list
    lo: torch.Tensor
    base: torch.Tensor
    window: int
    all_local: bool | None = None  # known on the host: the window holds every request's whole context


class SelectedDecode:
    """One per rank and model; ``rows`` = R (1 + speculative tokens), ``topk`` = K."""

    def __init__(self, exchange: SelectedExchange, fmt, dcp: DcpLayout, pattern: IndexSharePattern, *,
                 max_batch: int, rows: int, topk: int, depth: int, scale: float, backend: str = "auto",
                 gather_rows: int = 0, checks=None, arena=None):
        """``gather_rows``: workspace rows a gathered step may use (``B * T``); the ring holds
        ``max(max_batch * R * K, gather_rows / (depth + 1))`` rows per slot, and a gathered step larger
        than a slot takes the whole ring as one slot, a layer at a time (``PrefetchRing.widen``). ``checks``
        (``sparkinfer.decode.device_checks.DeviceChecks``): a decode step's values are then checked on
        the device, not read back (None: on the host). ``arena`` (``layer_buffers.AttentionArena``): the
        worker's, where the forward's form attends (None: one of this decoder's own)."""
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
        self.depth, self.scale, self.backend, self.checks = depth, scale, backend, checks
        self.ring = PrefetchRing(exchange, depth, rows=max(max_batch * U, -(-gather_rows // (depth + 1))))
        self.arena = arena if arena is not None else AttentionArena(self.ring.buf.device)
        # a decode step's Full-layer plans, held from engine start (None: this decoder gathers only)
        self.plan = GroupPlan(dcp, max_batch=max_batch, rows=rows, topk=topk, device=self.ring.buf.device,
                              backend="triton" if backend == "triton" else "torch") if max_batch else None
        self._decode_row_start = torch.arange(max_batch, device=self.ring.buf.device) * rows  # b * R
        self._shard: Shard | None = None
        self._context: torch.Tensor | None = None
        self._query_lens: torch.Tensor | None = None  # None: a decode step of R rows per request
        self._row_start: torch.Tensor | None = None  # int64 [B]: token row of each request's first row
        self._group: dict = {}
        self._pending: list = []  # the exchanges of the step in progress (their stats)
        self._replicas: LocalReplicas | None = None
        self.exchanges = self.skipped = 0  # layered exchanges started / not needed (every record local)

    def begin_step(self, caches, block_table: torch.Tensor, block_size: int,
                   context: torch.Tensor, query_lens: torch.Tensor | None = None,
                   replicas: LocalReplicas | None = None) -> None:
        """``query_lens`` None: a decode step (R rows per request, ``full_layer`` plans); else the
        rows of each request in a gathered step (``gather`` plans). ``replicas``: what this rank's
        replica store holds for the step's requests (None: nothing)."""
        if self._group:
            raise RuntimeError(f"layers {sorted(self._group)} of the previous step were never attended")
        B = context.shape[0]
        if B < 1 or (query_lens is None and B > self.max_batch):
            raise ValueError(f"{B} requests in the step; this decoder's decode steps hold 1..{self.max_batch}")
        shard = Shard(caches, block_table[:B].contiguous(), block_size, prior=self._shard)
        if len(shard.layers) != self.pattern.num_layers or shard.width != self.fmt.record_bytes:
            raise ValueError(f"caches must hold {self.pattern.num_layers} layers of {self.fmt.record_bytes}-byte "
                             f"records, got {len(shard.layers)} of {shard.width} bytes")
        if query_lens is not None and query_lens.shape != context.shape:
            raise ValueError(f"query_lens {tuple(query_lens.shape)} must match context {tuple(context.shape)}")
        if replicas is not None and (replicas.lo.shape != context.shape or replicas.base.shape != context.shape
                                     or len(replicas.store) != self.pattern.num_layers):
            raise ValueError(f"replicas need lo and base of shape {tuple(context.shape)} and one store per layer "
                             f"({self.pattern.num_layers})")
        self._shard = shard
        self._pending = []
        self._replicas = replicas
        self._context = context.to(torch.int64)
        if query_lens is None:
            self.ring.widen(False)  # a decode step's chunks of depth + 1 layers
            self._query_lens = None
            self._row_start = self._decode_row_start[:B]
        else:
            self._query_lens = query_lens.to(torch.int64)
            self._row_start = torch.cumsum(self._query_lens, 0) - self._query_lens

    def full_layer(self, layer: int, topk: torch.Tensor) -> None:
        """Plan the records of Full ``layer``'s group from its top-k and start the first exchange."""
        if self._shard is None:
            raise RuntimeError("full_layer() before begin_step()")
        if self._query_lens is not None:
            raise RuntimeError("full_layer() in a gathered step: gather() planned every layer at begin")
        if not self.pattern.is_full(layer):
            raise ValueError(f"layer {layer} is Shared; its top-k comes from layer {self.pattern.topk_source(layer)}")
        B, R, K = self._context.shape[0], self.R, self.K
        if topk.shape != (B * R, K) or topk.dtype != torch.int32:
            raise ValueError(f"topk must be int32 [{B * R}, {K}] (B={B} requests x R={R} rows), "
                             f"got {topk.dtype} {tuple(topk.shape)}")
        # device sizing (the GPU path): planes of a fixed capacity covering every batch, no host read
        capacity = self.max_batch * self.U if self.ring.exchange.sizing == "device" else B * self.U
        args = (self._context, self._row_start, self._replicas)
        if self.checks is not None:  # the forward's form: three launches into the plan's buffers
            slots, patch, planes = self.plan.build(topk.contiguous(), *args, capacity, self.checks)
        else:
            slots, patch, planes = plan_reference(topk, *args, self.dcp, R, capacity, validate=True)
        layers = [layer] + self.pattern.prefetch_targets(layer, self.pattern.num_layers)
        self._start_group(layers, planes, slots, patch, None)

    def gather(self) -> None:
        """Plan a gathered step: every layer's whole prefix of every request, chunk by chunk."""
        if self._shard is None or self._query_lens is None:
            raise RuntimeError("gather() needs begin_step(..., query_lens=...) first")
        union, counts = prefix_union(self._context + self._query_lens)  # host read: prefill is never captured
        B, T = union.shape
        if B * T > self.ring.buf.numel() // self.ring.buf.shape[2]:
            raise ValueError(f"a gathered step of {B} requests x {T} tokens needs {B * T} workspace rows, the "
                             f"ring holds {self.ring.buf.numel() // self.ring.buf.shape[2]}: take the stock path")
        self.ring.widen(B * T > self.ring.slot_rows)
        base = torch.repeat_interleave(torch.arange(B, device=union.device) * T, self._query_lens)
        patch, planes = patch_and_planes(union, counts, self._context, self._row_start, self._replicas, self.dcp,
                                         B * self.dcp.max_local_len(T), validate=True)
        self._start_group(list(range(self.pattern.num_layers)), planes, base, patch, "host")

    def _start_group(self, layers, planes, slots, patch, sizing) -> None:
        """Exchange ``planes`` (workspace row ``b * U' + u`` of union entry (b, u)) of ``layers`` in
        chunks of ``depth + 1``; ``slots``: the rows' workspace slots (decode) or per-row base ``b * U'``
        to add to each layer's top-k (gathered); ``patch``: the rows of the step's own tokens and of the
        replica window, held (patched, not moved) on every rank (``group_plan.patch_and_planes``)."""
        rep = self._replicas
        step = self.ring.depth + 1  # depth + 1 layers, or one at a time through a widened ring
        chunks = [layers[i:i + step] for i in range(0, len(layers), step)]
        if rep is None:
            moves = True
        elif sizing is None and self.ring.exchange.sizing == "device":
            moves = not rep.all_local  # decided on the host: a device-sized exchange may run empty
        else:  # host read of the counts: a group with nothing remote runs no exchange
            moves = bool(planes.count.any())
        group = {"planes": planes, "slots": slots, "patch": patch, "chunks": chunks[1:],
                 "left": len(chunks[0]), "sizing": sizing, "moves": moves}
        for l in layers:  # left: layers of the chunk in the ring not attended
            self._group[l] = group
        self._fetch(group, chunks[0])

    def _fetch(self, group: dict, layers: list[int]) -> None:
        if group["moves"]:
            self.exchanges += 1
            device_sized = group["sizing"] is None and self.ring.exchange.sizing == "device"
            rows = self.max_batch * self.U if device_sized else None
            self._pending.append(self.ring.prefetch(group["planes"], self._shard, layers, group["sizing"], rows))
        else:
            self.skipped += 1
            self.ring.reserve(layers)

    def attend(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, new_records: torch.Tensor,
               topk: torch.Tensor | None = None):
        """(out [N, H, 512], lse float32 [N, H]) of this rank's heads at ``layer`` for the step's N token
        rows (out bf16 for bf16 queries in the forward's Triton form, else float32); ``topk`` int [N, K]
        (logical positions) only in a gathered step."""
        group = self._group.pop(layer, None)
        if group is None:
            raise ValueError(f"layer {layer} has no plan: call full_layer() for layer "
                             f"{self.pattern.topk_source(layer)} first")
        W = self.fmt.record_bytes
        slots = group["slots"]
        if self._query_lens is not None:  # gathered: slots from this layer's top-k, row b*T + position
            if topk is None or topk.dim() != 2 or topk.shape[0] != slots.shape[0]:
                raise ValueError(f"a gathered step needs each layer's top-k [{slots.shape[0]}, K], got "
                                 f"{None if topk is None else tuple(topk.shape)}")
            # int32: a workspace row, below the ring's rows per slot (gather() checked B * T against them)
            slots = torch.where(topk >= 0, topk.long() + slots[:, None], -1).to(torch.int32)
        if new_records.dtype != torch.uint8 or new_records.shape != (slots.shape[0], W):
            raise ValueError(f"new_records must be uint8 [{slots.shape[0]}, {W}], "
                             f"got {new_records.dtype} {tuple(new_records.shape)}")
        # the slots index rows of one ring slot: int32 holds them (2^31 rows of >= 368 B would be a
        # 790 GB slot); the decode widens them to int64 before the address (attention.triton_decode)
        ws = self.ring.get(layer)
        patch = group["patch"]
        own = patch["own"]
        rows = ws[: own.shape[0]]  # workspace row b * U' + u of union entry (b, u)
        # only the patched rows are touched (own and kept are disjoint: before and from the context)
        copy_rows(rows, new_records, patch["new_rows"], own)
        if patch["kept"] is not None:
            copy_rows(rows, self._replicas.store[layer], patch["store_rows"], patch["kept"])
        if self.backend == "triton" and self.checks is not None:  # the forward's form: block by block into
            # views of the attention arena, consumed by the layer before the next call (``layer_buffers``)
            out, lse = attend_in_blocks(self.arena, q_nope, q_rope, self.fmt, self.scale, slots.shape[1],
                                        lambda a, b, _: (ws, slots[a:b]))
        else:
            out, lse = sparse_mla_decode(q_nope, q_rope, ws, self.fmt, slots, self.scale, backend=self.backend,
                                         check_indices=self.checks is None)
        self.ring.release(layer)
        group["left"] -= 1
        if group["left"] == 0 and group["chunks"]:  # the ring is free again: the group's next layers
            nxt = group["chunks"].pop(0)
            group["left"] = len(nxt)
            self._fetch(group, nxt)
        return out, lse

    def step_stats(self) -> ExchangeStats:
        """Records and bytes this rank's exchanges of the current step moved so far (complete once
        every layer attended)."""
        total = ExchangeStats()
        for p in self._pending:
            if p.done:
                total.add(p.stats)
        return total
