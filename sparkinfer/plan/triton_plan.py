"""Triton kernels of a Full layer's group plan (``sparkinfer.decode.group_plan``): after the union
kernel, two launches instead of ~75 torch ops per Full layer, into the plan's buffers. Each
equals the plan's torch twin bit for bit (``TRITON_INTERPRET=1`` on CPU); E = B x U, U = R x K.

* ``patch``, one program per request b over its U union entries: the workspace slots of its
  top-k (``b * U + remap``, -1 pads), the patch of the step's own tokens (``own``: position >=
  context; ``new_rows``: their token row) and of the replica window (``kept``: lo <= position <
  context; ``store_rows``: ``base + position % window``), and ``sends[b, src]``: the union entries
  owned by ``src`` that nobody holds (neither own nor kept), which the planes list. A top-k id
  below -1 is ORed into ``flag`` (``DeviceChecks.word("selected_topk")``).
* ``planes``, one program per (request b, source src): the request's entries ``src`` sends, in
  union order, at offset ``sum(sends[:b, src])`` of ``src``'s list (request-major order, as
  ``plan.planes`` builds it): request, local ordinal on ``src``, workspace slot; the last request's
  program writes ``count[src, :]``. Entries past a count keep what an earlier plan wrote: the
  moves read only the first ``count`` (``comm.pack``).
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAN_BLOCK, PLAN_WARPS = 1024, 4


@triton.jit
def _held(tok, ctx, lo, HAS_REP: tl.constexpr):
    """(own, kept) of union entries ``tok`` (int64, -1 pads) of a request with context ``ctx``."""
    own = (tok >= ctx) & (tok >= 0)
    if HAS_REP:
        kept = (tok >= lo) & (tok < ctx) & (tok >= 0)
    else:
        kept = tl.zeros(tok.shape, dtype=tl.int1)
    return own, kept


@triton.jit
def _patch_kernel(topk_ptr, union_ptr, remap_ptr, ctx_ptr, start_ptr, lo_ptr, base_ptr, window, U, interleave,
                  slots_ptr, own_ptr, new_ptr, kept_ptr, store_ptr, sends_ptr, flag_ptr,
                  D: tl.constexpr, D_PAD: tl.constexpr, HAS_REP: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    ctx = tl.load(ctx_ptr + b).to(tl.int64)
    start = tl.load(start_ptr + b).to(tl.int64)
    lo = ctx
    base = ctx * 0
    if HAS_REP:
        lo = tl.load(lo_ptr + b).to(tl.int64)
        base = tl.load(base_ptr + b).to(tl.int64)
    rd = tl.arange(0, D_PAD)
    sends = tl.zeros([D_PAD], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for u0 in range(0, U, BLOCK):
        u = u0 + tl.arange(0, BLOCK)
        m = u < U
        at = b.to(tl.int64) * U + u
        bad = bad | (tl.load(topk_ptr + at, mask=m, other=-1) < -1).to(tl.int32)
        r = tl.load(remap_ptr + at, mask=m, other=-1)
        tl.store(slots_ptr + at, tl.where(r >= 0, r + b * U, -1), mask=m)
        tok = tl.load(union_ptr + at, mask=m, other=-1).to(tl.int64)
        own, kept = _held(tok, ctx, lo, HAS_REP)
        tl.store(own_ptr + at, own, mask=m)
        tl.store(new_ptr + at, tl.where(own, start + tok - ctx, 0).to(tl.int32), mask=m)
        if HAS_REP:
            tl.store(kept_ptr + at, kept, mask=m)
            tl.store(store_ptr + at, tl.where(kept, base + tok % window, 0).to(tl.int32), mask=m)
        send = (tok >= 0) & ~(own | kept)
        owner = (tok // interleave) % D
        sends += tl.sum(((owner[:, None] == rd[None, :]) & send[:, None]).to(tl.int32), 0)
    tl.store(sends_ptr + b * D + rd, sends, mask=rd < D)
    tl.atomic_or(flag_ptr, tl.max(bad, 0))


@triton.jit
def _planes_kernel(union_ptr, ctx_ptr, lo_ptr, sends_ptr, U, B, C, interleave, req_ptr, local_ptr, slot_ptr,
                   count_ptr, D: tl.constexpr, D_PAD: tl.constexpr, HAS_REP: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_B: tl.constexpr):
    b = tl.program_id(0)
    src = tl.program_id(1)
    rb = tl.arange(0, BLOCK_B)
    offset = tl.sum(tl.load(sends_ptr + rb * D + src, mask=rb < b, other=0), 0)
    if b == B - 1:
        rd = tl.arange(0, D_PAD)
        total = offset + tl.load(sends_ptr + b * D + src)
        tl.store(count_ptr + src * D + rd, total + rd * 0, mask=rd < D)
    ctx = tl.load(ctx_ptr + b).to(tl.int64)
    lo = ctx
    if HAS_REP:
        lo = tl.load(lo_ptr + b).to(tl.int64)
    row = src.to(tl.int64) * C
    for u0 in range(0, U, BLOCK):
        u = u0 + tl.arange(0, BLOCK)
        at = b.to(tl.int64) * U + u
        tok = tl.load(union_ptr + at, mask=u < U, other=-1).to(tl.int64)
        own, kept = _held(tok, ctx, lo, HAS_REP)
        take = (tok >= 0) & ~(own | kept) & ((tok // interleave) % D == src)
        n = take.to(tl.int32)
        dest = row + offset + tl.cumsum(n, 0) - n
        local = (tok // (D * interleave)) * interleave + tok % interleave
        tl.store(req_ptr + dest, b + u * 0, mask=take)
        tl.store(local_ptr + dest, local.to(tl.int32), mask=take)
        tl.store(slot_ptr + dest, at.to(tl.int32), mask=take)
        offset += tl.sum(n, 0)


def _block(u: int) -> int:
    return min(PLAN_BLOCK, triton.next_power_of_2(max(u, 1)))


def patch(topk, union, remap, context, row_start, lo, base, window: int, interleave: int, world: int,
          slots, own, new_rows, kept, store_rows, sends, flag) -> None:
    """The module docstring's ``patch`` over B = ``context.shape[0]`` requests: topk / union / remap
    contiguous int32 with U = ``union.shape[1]`` entries per request; context, row_start (and lo,
    base: None without replicas) int64 [B]; outputs slots / new_rows / store_rows int32 [E], own /
    kept bool [E], sends int32 [B, world]; flag int32 [1]."""
    B, U = union.shape
    rep = lo is not None
    _patch_kernel[(B,)](topk, union, remap, context, row_start, lo if rep else context, base if rep else context,
                        window, U, interleave, slots, own, new_rows, kept, store_rows, sends, flag, D=world,
                        D_PAD=triton.next_power_of_2(world), HAS_REP=rep, BLOCK=_block(U), num_warps=PLAN_WARPS)


def planes(union, context, lo, sends, interleave: int, world: int, max_batch: int, req, local, slot, count) -> None:
    """The module docstring's ``planes``: union int32 [B, U], context (lo) int64 [B], sends int32
    [B, world] from ``patch``; req / local / slot int32 [world, C] (C >= B x U, last dim contiguous),
    count int32 [world, world]. ``max_batch`` bounds B (the kernel's compiled block)."""
    B, U = union.shape
    rep = lo is not None
    _planes_kernel[(B, world)](union, context, lo if rep else context, sends, U, B, req.stride(0), interleave, req,
                               local, slot, count, D=world, D_PAD=triton.next_power_of_2(world), HAS_REP=rep,
                               BLOCK=_block(U),
                               BLOCK_B=triton.next_power_of_2(max_batch), num_warps=PLAN_WARPS)


def compile_specs() -> list[dict]:
    """Every launch configuration the wrappers use at GLM-5.2's decode (U = 4 x 2048: blocks of
    ``PLAN_BLOCK``), for compiling without a GPU (benchmarks/kernel_report.py): DCP4, with and without replicas,
    16 requests."""
    specs = []
    for rep in (False, True):
        tag = "rep" if rep else "plain"
        sig = dict(topk_ptr="*i32", union_ptr="*i32", remap_ptr="*i32", ctx_ptr="*i64", start_ptr="*i64",
                   lo_ptr="*i64", base_ptr="*i64", window="i32", U="i32", interleave="i32", slots_ptr="*i32",
                   own_ptr="*i1", new_ptr="*i32", kept_ptr="*i1", store_ptr="*i32", sends_ptr="*i32",
                   flag_ptr="*i32", D="constexpr", D_PAD="constexpr", HAS_REP="constexpr", BLOCK="constexpr")
        specs.append(dict(name=f"plan_patch[{tag}]", fn=_patch_kernel, signature={n: sig[n] for n in _patch_kernel.arg_names},
                          constexprs={"D": 4, "D_PAD": 4, "HAS_REP": rep, "BLOCK": PLAN_BLOCK},
                          num_warps=PLAN_WARPS, num_stages=1))
        sig = dict(union_ptr="*i32", ctx_ptr="*i64", lo_ptr="*i64", sends_ptr="*i32", U="i32", B="i32", C="i32",
                   interleave="i32", req_ptr="*i32", local_ptr="*i32", slot_ptr="*i32", count_ptr="*i32",
                   D="constexpr", D_PAD="constexpr", HAS_REP="constexpr", BLOCK="constexpr", BLOCK_B="constexpr")
        specs.append(dict(name=f"plan_planes[{tag}]", fn=_planes_kernel,
                          signature={n: sig[n] for n in _planes_kernel.arg_names},
                          constexprs={"D": 4, "D_PAD": 4, "HAS_REP": rep, "BLOCK": PLAN_BLOCK, "BLOCK_B": 16},
                          num_warps=PLAN_WARPS, num_stages=1))
    return specs
