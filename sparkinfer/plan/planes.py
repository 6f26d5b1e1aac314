"""Transport planes: which union records each source rank sends to each destination.

Attention at TP4/DCP4 runs each rank's local heads over the whole union, so
every destination needs every union record; a record lives on one source (its
DCP owner). A plane is the list of records one (src, dst) pair moves, at a
fixed capacity ``C`` so a packing kernel and one bulk copy per pair can use
static buffers.

Shapes (all int32 torch tensors on the union's device; ``D`` = DCP size,
``B`` requests, ``U`` = union width = ``union.shape[1]``)::

    count [D_src, D_dst]     records src sends to dst (the true number, even past C);
                             src == dst are the rank's own records, copied locally
    req   [D_src, D_dst, C]  request b of each record, -1 pad
    local [D_src, D_dst, C]  local ordinal of the token on its owner src, -1 pad
    slot  [D_src, D_dst, C]  destination workspace slot b * U + u, -1 pad
    overflow                 True when some count > C; entries past C are not
                             written (the caller falls back), nothing is dropped silently

Order inside a plane: request-major, then union order. It depends only on the
inputs, so every rank computes the same planes. ``held`` (bool [D_dst, B, U],
True where the destination already holds that union record, e.g. from an
earlier step) removes those entries; without it all destinations of one source
get the same list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.core.topology import DcpLayout


@dataclass
class TransportPlanes:
    count: torch.Tensor  # int32 [D_src, D_dst]
    req: torch.Tensor  # int32 [D_src, D_dst, C]
    local: torch.Tensor  # int32 [D_src, D_dst, C]
    slot: torch.Tensor  # int32 [D_src, D_dst, C]
    overflow: bool

    @property
    def capacity(self) -> int:
        return self.req.shape[2]


def _check_inputs(union, counts, layout, capacity, held, validate):
    if not isinstance(layout, DcpLayout):
        raise ValueError(f"layout must be a DcpLayout, got {type(layout).__name__}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
    for name, t, dim in (("union", union, 2), ("counts", counts, 1)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dim:
            got = (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"{name} must be an int32 tensor with {dim} dims, got {got}")
    b, u = union.shape
    if counts.shape[0] != b:
        raise ValueError(f"counts has {counts.shape[0]} entries for {b} union rows")
    if counts.device != union.device:
        raise ValueError(f"counts on {counts.device}, union on {union.device}")
    d = layout.world_size
    if held is not None:
        if not isinstance(held, torch.Tensor) or held.dtype != torch.bool:
            raise ValueError("held must be a bool tensor [D_dst, B, U]")
        if tuple(held.shape) != (d, b, u):
            raise ValueError(f"held must be [D_dst, B, U] = {(d, b, u)}, got {tuple(held.shape)}")
        if held.device != union.device:
            raise ValueError(f"held on {held.device}, union on {union.device}")
    if validate and union.numel():
        # union[b, u] >= 0 exactly for u < counts[b] (what mtp_union returns)
        live = torch.arange(u, device=union.device) < counts.long()[:, None]
        if bool((counts < 0).any()) or bool((counts > u).any()):
            raise ValueError(f"counts must lie in [0, {u}]")
        if not bool(((union >= 0) == live).all()):
            raise ValueError("union must hold tokens >= 0 in its first counts[b] entries and -1 "
                             "after them (the mtp_union contract)")


def build_planes(union: torch.Tensor, counts: torch.Tensor, layout: DcpLayout, capacity: int,
                 held: torch.Tensor | None = None, validate: bool = True) -> TransportPlanes:
    """Transport planes for ``union`` int32 [B, U] / ``counts`` int32 [B] (module docstring).

    ``validate`` checks that union and counts agree (a device sync); hot paths
    that build the union with ``mtp_union`` may pass False.
    """
    _check_inputs(union, counts, layout, capacity, held, validate)
    b, u = union.shape
    d, dev = layout.world_size, union.device
    e = b * u
    live = (torch.arange(u, device=dev) < counts.long()[:, None]).reshape(e)
    tok = union.reshape(e).long().clamp_min(0)
    owner, local = layout.owner_and_local(tok)
    # mask[src, dst, e]: record e goes from src to dst (dst dim 1 when held is None).
    mask = (owner[None, :] == torch.arange(d, device=dev)[:, None]) & live[None, :]
    mask = mask[:, None, :]
    if held is not None:
        mask = mask & ~held.reshape(1, d, e)
    mask = mask.expand(d, d, e)
    count = mask.sum(dim=2)
    pos = torch.cumsum(mask, dim=2) - 1
    # Entries that are masked out or past capacity land in a dump column C.
    dest = torch.where(mask & (pos < capacity), pos, torch.full_like(pos, capacity))
    flat = torch.arange(e, device=dev)

    def plane(values: torch.Tensor) -> torch.Tensor:
        out = torch.full((d, d, capacity + 1), -1, dtype=torch.long, device=dev)
        out.scatter_(2, dest, values.expand(d, d, e))
        return out[:, :, :capacity].to(torch.int32).contiguous()

    return TransportPlanes(
        count=count.to(torch.int32),
        req=plane(flat // max(u, 1)),
        local=plane(local),
        slot=plane(flat),
        # a plane holds at most the B * U entries of the union: no read needed when they all fit
        overflow=False if capacity >= e else bool((count > capacity).any()),
    )
