"""A Full layer's plan of its group's exchange, built into buffers held from engine start.

At each Full layer of a decode step ``SelectedDecode`` turns the layer's top-k into what its group
(the Full layer and the Shared layers reusing its top-k) needs: the per-request MTP union
(``plan.union``), the workspace slots of every top-k entry, the workspace patch (the step's own
records and the replica window's, held on every rank and copied in locally) and the transport
planes of the records that move (``plan.planes``). Composed of torch ops that is ~75 launches and as
many allocations per Full layer; here it is three launches into ``GroupPlan``'s buffers: the union
kernel (``csrc``: CUDA on a GPU, its host build on CPU) and two Triton kernels (``triton_plan``).
``plan_reference`` is the torch twin the kernels are held to (``tests/plan/test_triton_plan.py``) and
what the torch backend runs.

Buffers (``core.reservations``, ``group_plan``; E = max_batch x U, U = R x K, D = DCP size)::

    union, remap  int32 [max_batch, U]     counts int32 [max_batch]   scratch: the union kernel's
    slots         int32 [E]  workspace row b * U + remap of each top-k entry, -1 pads
    own, kept     bool [E]   the entry is the step's own token / in the replica window
    new_rows, store_rows  int32 [E]  its token row / replica store row (0 where not own / kept)
    sends         int32 [max_batch, D]  entries request b needs from source src
    req, local, slot  int32 [D, E]  the planes: every destination gets the same list from a source
                                    (what is held is held everywhere), so one row per source, seen
                                    as [D, D, capacity] through a stride-0 view
    count         int32 [D, D]

A plan lives until its group's last layer is attended; the next Full layer comes after that, so
one set of buffers serves the step (stream order on a GPU).
"""

from __future__ import annotations

import torch

from sparkinfer.core.reservations import union_scratch_ints
from sparkinfer.core.topology import DcpLayout
from sparkinfer.plan import TransportPlanes, build_planes, mtp_union, mtp_union_reference, workspace_slots


def patch_and_planes(union, counts, context, row_start, replicas, dcp: DcpLayout, capacity: int, validate: bool):
    """(patch, planes) of ``union`` int32 [B, U'] (workspace row ``b * U' + u``) in torch ops: the
    patch dict (``own``, ``new_rows``, ``kept``, ``store_rows``: [B * U'] each, kept / store_rows None
    without ``replicas``) and ``TransportPlanes`` of capacity ``capacity`` with every record held
    (own or kept) left out for every destination."""
    B, width = union.shape
    own = (union >= context[:, None]) & (union >= 0)
    local = own
    # workspace row b * U' + u of each own-step token <- its token row start[b] + (t - context[b])
    new_rows = torch.where(own, row_start[:, None] + union.long() - context[:, None], 0)
    patch = {"own": own.reshape(-1), "new_rows": new_rows.reshape(-1), "kept": None, "store_rows": None}
    if replicas is not None:  # the window every rank keeps: held for every destination, copied from the store
        kept = (union >= replicas.lo[:, None]) & (union < context[:, None]) & (union >= 0)
        local = own | kept
        patch["kept"] = kept.reshape(-1)
        patch["store_rows"] = torch.where(kept, replicas.base[:, None] + union.long() % replicas.window, 0).reshape(-1)
    held = local[None].expand(dcp.world_size, B, width)
    return patch, build_planes(union, counts, dcp, capacity, held=held, validate=validate)


def plan_reference(topk, context, row_start, replicas, dcp: DcpLayout, rows: int, capacity: int, validate: bool):
    """(slots int32 [B * R, K], patch, planes) of a decode step's Full layer: the torch twin."""
    B = context.shape[0]
    K = topk.shape[1]
    union, remap, counts = mtp_union_reference(topk.view(B, rows, K), validate=validate)
    patch, planes = patch_and_planes(union, counts, context, row_start, replicas, dcp, capacity, validate)
    return workspace_slots(remap, rows * K), patch, planes


class GroupPlan:
    """The buffers of one decoder's group plans (module docstring) and their builder."""

    def __init__(self, dcp: DcpLayout, *, max_batch: int, rows: int, topk: int, device, backend: str):
        U, D = rows * topk, dcp.world_size
        E = max_batch * U
        self.dcp, self.R, self.K, self.U, self.max_batch, self.backend = dcp, rows, topk, U, max_batch, backend

        def i32(*shape):
            return torch.empty(shape, dtype=torch.int32, device=device)
        self.union, self.remap, self.counts = i32(max_batch, U), i32(max_batch, U), i32(max_batch)
        self.scratch = i32(max_batch * union_scratch_ints(U))
        self.slots, self.new_rows, self.store_rows = i32(E), i32(E), i32(E)
        self.own = torch.empty(E, dtype=torch.bool, device=device)
        self.kept = torch.empty(E, dtype=torch.bool, device=device)
        self.sends, self.count = i32(max_batch, D), i32(D, D)
        self.req, self.local, self.slot = i32(D, E), i32(D, E), i32(D, E)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))

    def build(self, topk: torch.Tensor, context: torch.Tensor, row_start: torch.Tensor, replicas, capacity: int,
              checks):
        """(slots int32 [B * R, K], patch, planes) of a Full layer's ``topk`` int32 [B * R, K]
        (contiguous) for B = ``context.shape[0]`` requests (context, row_start int64 [B]), as
        ``plan_reference`` returns them, in this plan's buffers; planes of ``capacity`` (B x U <=
        capacity <= max_batch x U) with entries past a count unspecified. A top-k id below -1 sets
        ``checks``' ``selected_topk`` word (``DeviceChecks``) instead of being read back. No host read;
        no allocation on the Triton backend."""
        B, R, K, D = context.shape[0], self.R, self.K, self.dcp.world_size
        E, cap = B * self.U, capacity
        if not B * self.U <= cap <= self.max_batch * self.U:
            raise ValueError(f"capacity {cap} outside [{B * self.U}, {self.max_batch * self.U}]: B x R x K records "
                             "must fit one plane and the plan holds max_batch requests")
        slots, own, kept, new_rows, store_rows = (t[:E] for t in (self.slots, self.own, self.kept, self.new_rows,
                                                                   self.store_rows))
        if self.backend == "triton":
            self._union(topk.view(B, R, K), B)
            from sparkinfer.plan import triton_plan

            rep = replicas is not None
            lo, base = (replicas.lo, replicas.base) if rep else (None, None)
            triton_plan.patch(topk, self.union[:B], self.remap[:B], context, row_start, lo, base,
                              replicas.window if rep else 1, self.dcp.interleave, D, slots, own, new_rows, kept,
                              store_rows, self.sends[:B], checks.word("selected_topk"))
            triton_plan.planes(self.union[:B], context, lo, self.sends[:B], self.dcp.interleave, D, self.max_batch,
                               self.req, self.local, self.slot, self.count)
        else:
            checks.flag("selected_topk", topk < -1)
            ref_slots, ref_patch, ref = plan_reference(topk, context, row_start, replicas, self.dcp, R, cap,
                                                       validate=False)
            slots.copy_(ref_slots.reshape(-1))
            own.copy_(ref_patch["own"])
            new_rows.copy_(ref_patch["new_rows"])
            if replicas is not None:
                kept.copy_(ref_patch["kept"])
                store_rows.copy_(ref_patch["store_rows"])
            for name in ("req", "local", "slot"):
                getattr(self, name)[:, :cap].copy_(getattr(ref, name)[:, 0])
            self.count.copy_(ref.count)
        patch = {"own": own, "new_rows": new_rows, "kept": kept if replicas is not None else None,
                 "store_rows": store_rows if replicas is not None else None}
        planes = TransportPlanes(count=self.count, overflow=False, **{
            name: getattr(self, name)[:, None, :cap].expand(D, D, cap) for name in ("req", "local", "slot")})
        return slots.view(B * R, K), patch, planes

    def _union(self, topk: torch.Tensor, B: int) -> None:
        """The union kernel into the buffers: CUDA on a GPU, its host build on CPU."""
        from sparkinfer.plan import _native

        out = (self.union[:B], self.remap[:B].view(topk.shape), self.counts[:B], self.scratch)
        if not topk.is_cuda:
            _native.mtp_union_host(topk, validate=False, out=out)
        elif _native.cuda_available():
            _native.mtp_union_cuda(topk, validate=False, out=out)
        else:  # no CUDA build of csrc: the reference (``plan.union`` logs it), then into the buffers
            for buf, value in zip(out, mtp_union(topk, validate=False)):
                buf.copy_(value)
