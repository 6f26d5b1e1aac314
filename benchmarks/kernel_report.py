"""Kernel report: registers, spills, shared memory and tensor-core use of every GPU kernel, for
sm_120 and sm_90, without a GPU; and a roofline figure per kernel at GLM-5.2 shapes.

    python benchmarks/kernel_report.py                 # rich tables (compile + roofline)
    python benchmarks/kernel_report.py --json -        # the same as one JSON document on stdout
    python benchmarks/kernel_report.py --json out.json --archs 120 --only csrc

Compiled kernels:

* Triton: every entry of ``compile_specs()`` of ``sparkinfer.attention.triton_decode``,
  ``sparkinfer.attention.triton_union_decode``, ``sparkinfer.indexer.triton_scores``,
  ``sparkinfer.indexer.triton_topk``, ``sparkinfer.attention.triton_paging``, ``sparkinfer.plan.triton_plan``
  and ``sparkinfer.indexer.triton_quant`` (the wrappers' launch configurations: dicts of name, fn,
  signature, constexprs, num_warps, num_stages and optional attrs, the argument divisibilities a
  launch would specialize), compiled with
  ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``;
  its PTX then goes through the same ptxas Triton uses (``-v``) for registers and spills; shared
  memory is Triton's (dynamic) allocation.
* csrc/: every ``csrc/cuda/*.cu`` through ``nvcc -Xptxas -v -cubin`` with the build's flags
  (sparkinfer/native/build.py), one row per ``__global__`` kernel (static shared memory).

"MMA" is read from the SASS (``cuobjdump -sass``: HMMA / HGMMA / QMMA / IMMA / OMMA ...), with the
PTX instruction (``mma.sync`` / ``wgmma``) named when the PTX is at hand.

Roofline (``roofline()``): for each kernel at the shapes the engine runs at the main profile
(GLM-5.2, TP4/DCP4, 16 requests, MTP3 -> 4 query rows per request, top-2048, 3,584-record unions,
a Full layer and its three Shared layers per exchange, 368-byte records), from first principles:
bytes moved, FLOPs, and the time those take at each GPU's memory bandwidth and at its tensor-core
and CUDA-core peaks; the floor is the largest of the bytes time and the compute time at the
precision the kernel uses (bf16 MMA for sparse MLA and for the indexer's fp8 / bf16 queries: on tensor cores)
and a launch. ``expect`` says what a GPU run must show. benchmarks/device/kernel_timing.py
times the same shapes on a GPU and divides by these floors.

Issue bound (``issue_bound()``): the instructions a kernel's warps issue at a row's shape, counted in
its SASS (``cuobjdump -sass``; the PTX without cuobjdump) for sm_120 (the RTX PRO 6000's figure) and
sm_90 (the H200's): the hot loop's instructions per iteration (found from the control flow: the
rule above ``parse_sass``) times its iterations under the wrapper's grid (``_launch``, next to the
row builders), plus the rest once per warp, over the SMs' issue rate (4 schedulers x 1 instruction
per clock) of the busiest SM (ceil(CTAs / SMs) CTAs: a CTA issues on one SM). The sparse-MLA decode
counts its critical path instead, every loop at its trip count (``_mla``, ``decode_path_issue``): the
program that merges the splits runs the merge's loops S times. A kernel whose issue time exceeds its
floor cannot reach the floor: the table flags it.

Without nvcc/ptxas (or without Triton's NVIDIA backend) the compile rows say why they are missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # sparkinfer from this checkout (build flags, compile_specs)
ARCHS = (120, 90)
TRITON_MODULES = ("sparkinfer.attention.triton_decode", "sparkinfer.attention.triton_union_decode",
                  "sparkinfer.indexer.triton_scores", "sparkinfer.indexer.triton_topk",
                  "sparkinfer.attention.triton_paging", "sparkinfer.plan.triton_plan", "sparkinfer.indexer.triton_quant",
                  "sparkinfer.indexer.triton_paged")

# ---- hardware -------------------------------------------------------------------------------------
# Peaks in bytes/s and FLOP/s (an FMA is 2 FLOPs), dense (no sparsity).
# RTX PRO 6000 Blackwell: 1.79 TB/s GDDR7 and 188 SMs (/work/shared/spec/glm52-and-hardware.md),
# fp32 125 TFLOP/s (datasheet); tensor cores DERIVED from the datasheet's 4,000 FP4 AI TOPS, which
# count 2:4 sparsity: 2,000 dense FP4 -> 1,000 FP8 -> 500 BF16 -> 250 TF32 (to be confirmed by a GPU run).
# H200: 4.8 TB/s HBM3e, 989 BF16 / 1,979 FP8 / 494 TF32 / 67 fp32 TFLOP/s (datasheet, dense); measured
# on the lent H200s (/work/.library/device/KINDS.md): ~4.3 TB/s D2D copy, 788 TFLOP/s bf16 GEMM 8192^3.
# Instruction issue (issue_bound()): an SM of either GPU (Hopper, Blackwell) has 4 warp schedulers, each
# issuing at most one warp instruction per clock. SM clocks: H200 1,980 MHz, what nvidia-smi read on the lent
# H200 under load (gpu-validation.md, 2026-12-04; the datasheet's boost clock, an H100 SXM's too); RTX PRO 6000
# Blackwell 2,617 MHz, the datasheet's boost clock (not measured here). SMs: 188 (glm52-and-hardware.md) and 132.
# smem_optin: the shared memory a block may opt in to (sm_120 99 KB, sm_90 227 KB; CUDA's arch tables).
# l2: L2 bytes (RTX PRO 6000 Blackwell: GB202's 128 MB, NVIDIA's RTX Blackwell architecture paper; H200: 50 MB,
# an H100 SXM's, the same GH100 configuration; neither measured here): where a kernel's scratch that another
# program reads back right after it is written fits, the read-back is an L2 hit (``_mla``'s split partials).
HW = {
    "rtx_pro_6000": {"bw": 1.79e12, "bf16": 500e12, "fp8": 1000e12, "tf32": 250e12, "fp32": 125e12, "sms": 188,
                     "p2p": 55e9, "clock_hz": 2.617e9, "schedulers": 4, "smem_optin": 99 * 1024, "l2": 128 << 20},
    "h200": {"bw": 4.8e12, "bf16": 989e12, "fp8": 1979e12, "tf32": 494e12, "fp32": 67e12, "sms": 132, "p2p": None,
             "clock_hz": 1.98e9, "schedulers": 4, "smem_optin": 227 * 1024, "l2": 50 << 20},
}
GPU_OF_ARCH = {120: "rtx_pro_6000", 90: "h200"}  # the compiled arch whose code each GPU's issue figure counts
LAUNCH_US = 3.0  # a kernel launch + an almost empty grid, order of magnitude: the floor of tiny kernels

# ---- GLM-5.2 shapes at the main profile ---------------------------------------------------------------
B, R, K, U, D, J = 16, 4, 2048, 3584, 4, 4  # requests, rows/request, top-k, union/request, DCP, layers/exchange
HEADS, HEADS_PER_RANK = 64, 16
LATENT, ROPE = 512, 64
INDEX_HEADS, INDEX_DIM, INDEX_RECORD = 32, 128, 132
RECORD = {"nvfp4_368": 368, "nvfp4_432": 432, "fp8_ds_mla": 656}


def _times(nbytes: float, flops: float, compute: str, p2p_bytes: float = 0.0, mma_flops: float | None = None) -> dict:
    """Times in us on each GPU: bytes at bandwidth, flops at the tensor-core (bf16/fp8/tf32) and fp32
    peaks, ``p2p_bytes`` over the PCIe peer link (the node only), and the floor: the largest of
    those at the precision ``compute`` the kernel runs in ("bf16", "fp8", "tf32", "fp32", or "none"
    for pure moves) and a launch. ``mma_flops``: the tensor-core FLOPs the kernel issues when they
    exceed ``flops`` (a hi + lo split runs two dots for one product)."""
    out = {}
    issued = flops if mma_flops is None else mma_flops
    for gpu, h in HW.items():
        t = {"mem_us": nbytes / h["bw"] * 1e6}
        if flops:
            for prec in ("bf16", "fp8", "tf32"):
                t[f"tc_{prec}_us"] = issued / h[prec] * 1e6
            t["fp32_us"] = flops / h["fp32"] * 1e6
        if p2p_bytes and h["p2p"]:
            t["p2p_us"] = p2p_bytes / h["p2p"] * 1e6
        bound = {"memory": t["mem_us"], "launch": LAUNCH_US, "p2p": t.get("p2p_us", 0.0)}
        if flops and compute != "none":
            bound[f"compute ({compute})"] = t["fp32_us"] if compute == "fp32" else t[f"tc_{compute}_us"]
        t["bound"] = max(bound, key=bound.get)
        t["floor_us"] = bound[t["bound"]]
        out[gpu] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}
    return out


def _row(kernel: str, shape: str, params: dict, nbytes: float, flops: float, compute: str, expect: str,
         p2p_bytes: float = 0.0, target: str | None = None, covers: list | None = None,
         mma_flops: float | None = None, launch: dict | None = None) -> dict:
    """One roofline row; ``covers``: the compiled kernels (report names) it is the figure of; ``launch``:
    its grid as the wrapper launches it (``_launch``), for the issue-bound figure."""
    row = {"kernel": kernel, "covers": covers or [kernel], "shape": shape, "params": params, "bytes": int(nbytes),
           "flops": int(flops), "compute": compute, "times": _times(nbytes, flops, compute, p2p_bytes, mma_flops),
           "expect": expect}
    if launch:
        row["launch"] = launch
    if mma_flops is not None:
        row["mma_flops"] = int(mma_flops)
    if target:  # a cheaper tensor-core precision the kernel could run in (its floor then)
        row["target_floor"] = _times(nbytes, flops, target)
        row["target"] = target
    return row


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch(kernel: str, ctas: int, warps: int, iters: int = 0, loop: str = "none", trips: dict | None = None,
            path: dict | None = None) -> dict:
    """How the wrapper launches ``kernel`` (its compiled report name) at a row's shape: ``ctas`` programs
    of ``warps`` warps; ``iters`` the iterations of its hot loop (``loop`` says which) summed over the
    grid, each run by every warp of its CTA. ``issue_bound`` multiplies these by the compiled counts.
    ``trips`` (a kernel whose work is in nested loops): iterations per CTA of every loop by its kind
    instead, {"mma": the innermost loops holding tensor-core instructions, "mma_parent": the loops
    directly around them, "other": every other loop}, and optionally "sites": rules that count the loops
    of a source site at their own trips (``site_trips``: a helper's loops at the trips of one of its calls)
    (``nested_issue``). ``path`` (the sparse-MLA decode): the trip counts of its critical path's loops
    instead (``decode_path_issue``)."""
    out = {"kernel": kernel, "ctas": int(ctas), "warps": int(warps), "iters": int(iters), "loop": loop}
    if trips:
        out["trips"] = {k: v if k == "sites" else float(v) for k, v in trips.items()}
    if path:
        out["path"] = {k: [int(x) for x in v] if isinstance(v, list) else int(v) for k, v in path.items()}
    return out


def _splits(m: int, h: int, listed: int) -> int:
    """The wrapper's split-K count at this shape on the RTX PRO 6000 (the same on the H200's 132 SMs at
    every shape below: one wave of programs either way)."""
    from sparkinfer.attention.triton_decode import num_splits_for

    return num_splits_for(m, h, listed, HW["rtx_pro_6000"]["sms"])


def compact_trips(listed: int, k: int, per: int, n: int, block: int, compacted: bool = False) -> list[int]:
    """Trips of the decode's compaction loops (``triton_decode._compact_split``) in a program of n splits
    of ``per`` keys over k valid of ``listed`` indices, each the most of any split (the merging program
    may be any): the count of all the listed ones (4 blocks a trip); with the valid ones the first k
    listed (all listed valid, or ``compacted``: the paged path's rows, ``triton_paging.topk_rows``) the
    copy of the split's slice (4 blocks a trip) and nothing else; else the count before the split's
    first block (4 blocks a trip) and the scan (a block a trip) from there to the last listed index its
    slice may come from (hi + listed - k)."""
    copy = prefix = scan = 0
    for i in range(n):
        lo, hi = min(i * per, k), min((i + 1) * per, k)
        if k == listed or compacted:
            copy = max(copy, _cdiv(hi - lo, 4 * block))
            continue
        start = lo // block * block
        end = min(listed, hi + listed - k) if lo < hi else start  # an empty split scans nothing
        prefix, scan = max(prefix, _cdiv(start, 4 * block)), max(scan, _cdiv(end - start, block))
    return [_cdiv(listed, 4 * block), copy, prefix, scan]


def _mla(fmt: str, m: int, h: int, k: int, shape: str, gathered: int | None = None, listed: int = K,
         listed_bytes: int = 4, compacted: bool = False) -> dict:
    """Sparse-MLA decode, one launch per call: each row's ``listed`` indices (the selected path's int32
    workspace slots, the stock path's int64 cache rows: ``listed_bytes``; k < listed when other
    ranks' entries are -1, ``compacted``: the first k, ``triton_paging.topk_rows``) are read from DRAM once (every program of the row reads them again to
    compact its split, from L2), its k valid ones written to the workspace as int64 and read back,
    and those records gathered (``gathered`` records in all when the rows of a request read their
    union once), QK over 576 dims, PV over 512 (absorbed), bf16 MMA with an fp32 accumulator. The
    engine's default "bf16x2" keeps bf16 queries whole (one QK dot) and splits the fp32
    probabilities into hi + lo (two PV dots). With S > 1 splits it writes S fp32 partials (out +
    LSE), which the last split of each row and head block reads back and merges into the output (the
    fused merge); with one split the output only (counted fp32). The records are read 16 bytes at a
    time (``triton_decode.record_alignment``): the selected path's contiguous workspace, and the stock
    path's paged cache as 16-byte rows (``paged_sparse_mla.row_align``: every layer view vLLM makes; a
    4-byte view takes the ",a4" variants, compiled and tested, not reported).

    The partials' bytes: where they fit in half the smaller L2 (``HW``'s l2; 2.1 MB at batch 1 with 16
    splits, 4.2 MB at the main shape with 2, against 50 MB on the H200), they are counted once, as
    DRAM writes (their dirty lines are written back at most once a call, when evicted; the workspace is
    the same addresses every call), and their read-back not at all: the merging program reads them
    within the same wave that wrote them, from L2. Larger ones: written and read back from DRAM.

    Issue (``decode_path_issue``): the critical path, the program that merges: the compaction's loops
    at their trips (``compact_trips``: the count of the listed indices, the copy of the split's slice
    when all are valid, else the count before the split's first block and the scan from there), its split's tiles (the first split's, the most),
    and the merge: its loops over the S splits S times (with one pass over the output's columns, 16
    heads a program: ``triton_decode.merge_chunks``; with more, the chunk loop that many times and the
    loop over the splits inside it that many times S); the busiest SM runs that program
    after the others it holds (one wave at every shape here: none). With S > 1 the launch also holds
    that path at every other split count of one wave (``path_by_splits``; the issue figure's
    ``by_splits`` and ``best_splits``: what ``num_splits_for`` should pick)."""
    import torch

    from sparkinfer.attention import triton_decode as td
    from sparkinfer.core.layouts import FP8_DS_MLA, NVFP4_368, NVFP4_432

    gathered = m * k if gathered is None else gathered
    s = _splits(m, h, listed)
    # grid (M, H / BLOCK_H, S); split i walks keys [i kps, min((i + 1) kps, k)) in BLOCK_K tiles
    # (kps = ceil(ceil(k / S) / BLOCK_K) BLOCK_K, the kernel's k_per_split); rows and head blocks alike
    lay = {x.short: x for x in (NVFP4_368, NVFP4_432, FP8_DS_MLA)}[fmt]

    def launch_on(gpu: str) -> dict:
        """The compiled variant the wrapper launches on ``gpu``: heads a program by its shared memory
        (``heads_per_program``: ",h32"), with the fused merge for S > 1, ",s1" for one split, keys a tile
        by its shared memory (``block_k``: ",k32")."""
        bh = td.heads_per_program(lay, torch.bfloat16, h, m * _cdiv(h, td.BLOCK_H) * s, HW[gpu]["sms"],
                                  HW[gpu]["smem_optin"])
        hb = _cdiv(h, bh)
        warps = td.launch_options(lay, torch.bfloat16, bh)["num_warps"]  # the engine's bf16 queries
        bk = td.block_k(lay, torch.bfloat16, 16, HW[gpu]["smem_optin"])  # 16-byte aligned records
        kps = _cdiv(_cdiv(k, s), bk) * bk
        tiles = sum(_cdiv(max(0, min(kps, k - i * kps)), bk) for i in range(s))
        name = f"{fmt}{'' if bh == td.BLOCK_H else f',h{bh}'}{'' if s > 1 else ',s1'}" \
            + ("" if bk == td.block_k(lay, torch.bfloat16) else f",k{bk}")
        def path(n: int) -> dict:  # the critical path's trips with n splits (``decode_path_issue``)
            per = _cdiv(_cdiv(k, n), bk) * bk
            block = td.compact_block(lay, torch.bfloat16, bh)
            return {"compact": compact_trips(listed, k, per, n, block, compacted), "tiles": _cdiv(min(per, k), bk),
                    "splits": n, "merge_chunks": td.merge_chunks(bh)}  # ``_merge_partials``' passes over the columns

        out = _launch(f"sparse_mla_decode[{name}]", m * hb * s, warps, m * hb * tiles, f"{bk}-key tiles", path=path(s))
        if s > 1:  # the other split counts of one wave and the same compiled variant (``issue_bound``: by_splits)
            wave = min(td.MAX_SPLITS, HW["rtx_pro_6000"]["sms"] // (m * _cdiv(h, td.BLOCK_H)))
            out["path_by_splits"] = {n: path(n) for n in range(2, wave + 1)}
        return out

    launch = launch_on("rtx_pro_6000")
    by_gpu = {gpu: launch_on(gpu) for gpu in HW if launch_on(gpu) != launch}
    out = m * h * (LATENT + 1) * 4
    in_l2 = s * out <= min(x["l2"] for x in HW.values()) // 2  # the partials' read-back (docstring)
    nbytes = gathered * RECORD[fmt] + m * listed * listed_bytes + 2 * m * k * 8 + m * h * (LATENT + ROPE) * 2 \
        + ((1 if in_l2 else 2) * s * out + out if s > 1 else out)
    flops = 2 * m * h * k * (LATENT + ROPE + LATENT)
    mma = 2 * m * h * k * (LATENT + ROPE + 2 * LATENT)
    expect = ("bf16 tensor cores (mma.sync), memory-bound on both GPUs: within 2x of the floor on the H200 "
              "and faster than the upstream sm_12x split-K Triton kernel's 28.7 us per call")
    row = _row(f"sparse_mla_decode[{fmt}]", shape, {"M": m, "H": h, "K": k, "listed": listed,
                                                    "listed_bytes": listed_bytes, "compacted": compacted, "splits": s,
                                                    "record": RECORD[fmt], "gathered": gathered,
                                                    "partials_in_l2": bool(s > 1 and in_l2)},
               nbytes, flops, "bf16", expect, mma_flops=mma, launch=launch)
    if by_gpu:  # a GPU that launches another variant (``issue_bound``)
        row["launch_by_gpu"] = by_gpu
    return row


def _mla_union(fmt: str, b: int, r: int, h: int, u: int, k: int, shape: str) -> dict:
    """Sparse-MLA decode over each request's union (``triton_union_decode``): per request and M block
    (R rows x H heads, 64 at most) two programs, one per half of the 512 output columns, each gather
    the U union records with their int64 index and int32 row mask (counted twice here: the second
    gather may hit L2, which a GPU timing settles); every (row, head) of the block runs QK over 576
    in both programs and PV over 256 in each on all U entries (a row's mask only zeroes its weights:
    the MMA FLOPs are those of U, the useful ones those of its k), PV twice (hi + lo). With S > 1
    splits the partials are written, read back by the merging program and the output written; with
    one split the output only."""
    from sparkinfer.attention import triton_union_decode as tu

    bm = tu.block_m(r, h)
    mb = -(-(r * h) // bm)
    s = tu.union_splits_for(b, mb, u, HW["rtx_pro_6000"]["sms"])
    # grid (B, 2 MB, S); split i walks union entries [i ups, min((i + 1) ups, U)) in BLOCK_K tiles
    # (ups = ceil(ceil(U / S) / BLOCK_K) BLOCK_K, the kernel's _split_range)
    ups = _cdiv(_cdiv(u, s), tu.BLOCK_K) * tu.BLOCK_K
    tiles = sum(_cdiv(max(0, min(ups, u - i * ups)), tu.BLOCK_K) for i in range(s))
    launch = _launch(f"sparse_mla_union_decode[{fmt}]", 2 * b * mb * s, tu.NUM_WARPS, 2 * b * mb * tiles,
                     f"{tu.BLOCK_K}-entry union tiles")
    out = b * r * h * (LATENT + 1) * 4
    nbytes = 2 * b * mb * u * (RECORD[fmt] + 12) + b * 4 + b * r * h * (LATENT + ROPE) * 2 \
        + (2 * s * out + out if s > 1 else out)
    flops = 2 * b * r * h * k * (LATENT + ROPE + LATENT)
    mma = 2 * b * mb * bm * u * 2 * (LATENT + ROPE + LATENT)
    expect = ("bf16 tensor cores (mma.sync on sm_120, wgmma on sm_90), no spills: U/k more MMA FLOPs than the "
              "per-row kernel (1.75x at 3,584/2,048) and QK twice (once per column half), so compute-bound on "
              "both GPUs; time it against sparse_mla_decode at this shape before wiring it")
    return _row(f"sparse_mla_union_decode[{fmt}]", shape, {"B": b, "R": r, "H": h, "U": u, "K": k, "splits": s,
                                                           "block_m": bm, "record": RECORD[fmt]},
                nbytes, flops, "bf16", expect, mma_flops=mma, launch=launch)


def _qw_bytes(m: int) -> int:
    """fp32 index queries and head weights of M rows."""
    return m * INDEX_HEADS * (INDEX_DIM + 1) * 4


def _indexer_launch(kernel: str, m: int, positions: int, precision: str) -> dict:
    """The indexer kernel's grid over ``positions`` per row: (M / GROUP, positions / SPAN) programs, each
    looping over its SPAN positions in chunks of BLOCK_T (one dot over the 128 dims a chunk for its
    GROUP rows (``GROUPS`` by the dot's ``precision``), which share their list at every shape below: one
    pass a program)."""
    from sparkinfer.indexer import triton_scores as ts

    groups = _cdiv(m, ts.GROUPS[precision])
    return _launch(kernel, groups * _cdiv(positions, ts.SPAN), ts.WARPS[precision], groups * _cdiv(positions, ts.BLOCK_T),
                   f"{ts.BLOCK_T}-position chunks")


def _indexer(m: int, t: int, shape: str) -> dict:
    """Indexer scores (``indexer_scores``, the [M, T] fp32 matrix): per row and token, 32 head dots
    of 128 (the keys' fp8 codes converted to bf16, exact; their scales multiply the dots) on bf16
    tensor cores, one MMA pass for the engine's fp8 / bf16 queries (fp32 queries take three tf32
    passes), relu, weight, sum over heads on CUDA cores."""
    nbytes = t * (INDEX_RECORD + 8) + m * t * 4 + _qw_bytes(m)  # key record + its int64 slot; fp32 scores
    flops = 2 * m * INDEX_HEADS * t * INDEX_DIM + 3 * m * INDEX_HEADS * t
    expect = ("bf16 tensor cores (mma.sync; wgmma on sm_90, a chunk's 64 keys as M): within 2x of the bf16 floor; on fp8 "
              "MMA (the keys are E4M3 codes) the floor would drop to the target's")
    return _row("indexer_scores", shape, {"M": m, "T": t, "heads": INDEX_HEADS, "dim": INDEX_DIM},
                nbytes, flops, "bf16", expect, target="fp8",
                covers=["indexer_scores[q_fp32]", "indexer_scores[q_bf16]"],
                launch=_indexer_launch("indexer_scores[q_bf16]", m, t, "bf16"))


def _indexer_tiled(m: int, t: int, shape: str) -> dict:
    """``indexer_topk_rows`` (docs/design/indexer.md): P passes of ``tile`` positions; each pass's
    key kernel reads the tile's keys, q and w and writes int64 keys [M, tile] into the work buffer
    [M, k + tile]; the Triton top-k (``triton_topk.topk_keys``) then reads the buffer (once from
    DRAM: its further radix levels re-read the row from L2 while the rows in flight fit there) and
    writes the running top-k [M, k] (the last pass: at most 2k candidates written and read back,
    then the sorted [M, k]), and the top-k is copied back to the buffer's head. The selection keys
    move 8 B per score twice (written, read back), so the bytes exceed the materialized path's;
    the memory does not."""
    from sparkinfer.indexer.tiled import TILE_BYTES, pick_tile

    tile = pick_tile(m, t, 8, TILE_BYTES)
    passes = -(-t // tile)
    per_pass = tile * (INDEX_RECORD + 8) + _qw_bytes(m) + m * tile * 8 + m * (K + tile) * 8 + m * K * 8 + m * K * 16
    flops = 2 * m * INDEX_HEADS * t * INDEX_DIM + 3 * m * INDEX_HEADS * t
    expect = ("bf16 tensor cores (selection keys moved twice per score): within 2x of the floor, with the "
              "peak extra memory M x (k + tile) x 8 B whatever the context")
    return _row("indexer_topk_rows", shape, {"M": m, "T": t, "K": K, "tile": tile, "passes": passes,
                                            "heads": INDEX_HEADS, "dim": INDEX_DIM, "work_bytes": m * (K + tile) * 8},
                passes * per_pass + m * 2 * K * 16, flops, "bf16", expect, target="fp8",
                covers=["indexer_keys[q_fp32]", "indexer_keys[q_bf16]", "indexer_keys_ids[q_fp32]",
                        "indexer_keys_ids[q_bf16]", "topk_keys[k2048]", "topk_keys_unsorted[k2048]"],
                # the engine's key pass (fp8 q), every pass; the issue figure leaves out the top-k
                # kernel's own passes (topk_keys)
                launch=_indexer_launch("indexer_keys[q_fp8]", m, passes * tile, "f16"))


def _radix_levels(keys, k: int, cap: int) -> int:
    """The radix levels ``triton_topk.select_row`` runs on the int64 ``keys`` (numpy) for the k largest
    with a buffer of ``cap``: its level loop replayed on the host."""
    import numpy as np

    shift, pref, above, need, levels = 56, 0, 0, k, 0
    real = keys != np.iinfo(np.int64).min
    while True:
        levels += 1
        top = shift == 56
        match = real if top else real & ((keys >> min(shift + 8, 63)) == pref)
        digit = ((keys[match] >> shift) & 255) ^ (128 if top else 0)
        hist = np.bincount(digit.astype(np.int64), minlength=256)
        at_or_above = np.cumsum(hist[::-1])[::-1]
        byte = int(np.flatnonzero(at_or_above >= need).max(initial=-1))
        here = int(hist[byte]) if byte >= 0 else 0
        higher = (int(at_or_above[byte]) - here) if byte >= 0 else 0
        above, need = above + higher, need - higher
        pref = byte - 128 if top else pref * 256 + byte
        if above + here <= cap or shift == 0:
            return levels
        shift -= 8


def _paged_levels(t: int, splits: int, tile: int, seed: int = 0) -> tuple[float, float]:
    """Mean radix levels of the paged top-k's selections at context t (``_radix_levels``): a program's
    running select per tile (its k kept keys and the tile's, CAP k) and the merge of the splits' heads
    (CAP k), on one row's packed keys (``topk.pack_keys``) of relu-sum scores (32 heads' relu'd dots,
    weighted: the indexer's form) at random, seeded: the levels follow the scores' bits, not a count."""
    import numpy as np
    import torch

    from sparkinfer.indexer.topk import pack_keys

    g = torch.Generator().manual_seed(seed)
    scores = (torch.relu(torch.randn(t, INDEX_HEADS, generator=g)) @ torch.rand(INDEX_HEADS, generator=g))[None]
    keys = pack_keys(scores.float(), torch.arange(t))[0].numpy()
    run, heads = [], []
    chunk = 64  # triton_scores.BLOCK_T: a split takes every splits-th chunk, tile // chunk of them a tile
    for s in range(splits):
        head = np.empty(0, np.int64)
        mine = np.concatenate([keys[c:c + chunk] for c in range(s * chunk, t, splits * chunk)] or [keys[:0]])
        for j0 in range(0, len(mine), tile):
            cand = np.concatenate([head, mine[j0:j0 + tile]])
            run.append(_radix_levels(cand, K, K))
            head = np.sort(cand)[-K:]
        heads.append(head)
    merge = _radix_levels(np.concatenate(heads), K, K)
    return float(np.mean(run)), float(merge)


def _select_rules(tiles: float, rows: int, splits: int, levels: tuple[float, float]) -> list:
    """Site rules (``site_trips``) for ``triton_paged``'s two ``select_row`` calls, per program: a tile's
    running select (tiles x rows calls over the k kept keys and the tile's) and the merge of the splits'
    heads (once per row, by its last split: the busiest program merges both its rows). Each call runs its
    level loop ``levels`` times (``_paged_levels``), a scan of its N keys BLOCK at a time in each level and
    once more to compact, and a pad of k; the rest of select_row once. The lines are select_row's loops
    and the calls' lines are read from the sources, so the rules follow the code."""
    import ast
    import inspect
    import textwrap

    from sparkinfer.core.indexer_tiles import PAGED_TILE
    from sparkinfer.indexer import triton_paged as tpg
    from sparkinfer.indexer import triton_topk as tk

    def parsed(fn):
        lines, first = inspect.getsourcelines(fn)
        return ast.parse(textwrap.dedent("".join(lines))), first - 1

    tree, off = parsed(tk.select_row.fn)
    span = lambda node: [node.lineno + off, node.end_lineno + off]
    (level,) = [n for n in ast.walk(tree) if isinstance(n, ast.While)]
    (scan,) = [n for n in level.body if isinstance(n, ast.For)]
    body = tree.body[0].body
    (compact,) = [n for n in body[body.index(level) + 1:] if isinstance(n, ast.For)][:1]
    pad = [n for n in ast.walk(tree) if isinstance(n, ast.For) and n not in (scan, compact)]
    topk = os.path.basename(inspect.getsourcefile(tk.select_row.fn))
    tree, off_k = parsed(tpg._paged_topk_kernel.fn)
    calls = sorted(n.lineno + off_k for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and getattr(n.func, "id", None) == "select_row")
    paged = os.path.basename(inspect.getsourcefile(tpg._paged_topk_kernel.fn))
    assert len(calls) == 2 and len(pad) == 1, (calls, pad)  # the tile's select and the merge
    block = tpg.BLOCK
    rules = []
    for line, n_calls, n_keys, lv in ((calls[0], tiles * rows, K + PAGED_TILE, levels[0]),
                                      (calls[1], rows, splits * K, levels[1])):
        steps = _cdiv(n_keys, block)
        call = f"{paged}:{line}"
        for node, trips in ((scan, lv * steps), (level, lv), (compact, steps), (pad[0], _cdiv(K, block))):
            rules.append({"call": call, "file": topk, "lines": span(node), "trips": n_calls * trips})
        rules.append({"call": call, "file": topk, "lines": None, "trips": n_calls})
    return rules


def _indexer_paged(b: int, r: int, t: int, shape: str) -> dict:
    """The paged top-k (``triton_paged``, the engine's decode scorer and selection in one launch): b
    requests of r rows at context t. A program takes a group of rows (``compile_specs``' ROWS: a
    request's rows) and one split of their positions, reads each key once for the group, scores it
    for every row (the rows' dots share the converted keys) and keeps each row's running top-k
    of k + tile keys. DRAM bytes: each request's keys once per group of its rows, their block-table
    entries, fp8 q and fp32 w, each row's keys written into its work row and read back by the
    selection (8 B per row and position, twice), the split heads and the output. Issue: the tensor-core
    loop (a tile's chunks of BLOCK_T positions, one dot over the 128 dims each) and the tile loop around
    it at their trip counts, and the selection's loops at theirs (``_select_rules``: a tile's select scans
    the row's k + tile keys BLOCK at a time once per radix level, levels replayed on the host, and once to
    compact; the merge scans the splits' heads the same way), the other loops (the heads' fills and copies)
    at rows x k / BLOCK, an upper bound. The report computes it for whichever kernel the checkout has
    (``compile_specs``' ROWS and PRECISION)."""
    from sparkinfer.core.indexer_tiles import PAGED_TILE, paged_splits
    from sparkinfer.indexer import triton_paged as tpg
    from sparkinfer.indexer import triton_scores as ts

    m = b * r
    # a spec per arch (``compile_specs``' "archs": each arch's form of the chunk's dot, its own warps)
    by_arch = {a: x for x in tpg.compile_specs(K) if x["name"] == f"paged_topk_split[k{K}]" for a in x["archs"]}
    spec = by_arch[120]
    rows = spec["constexprs"].get("ROWS", 1)
    splits = paged_splits(m)
    groups = _cdiv(m, rows)
    tiles = _cdiv(_cdiv(_cdiv(t, ts.BLOCK_T), splits) * ts.BLOCK_T, PAGED_TILE)  # per program (every splits-th chunk)
    chunks = tiles * PAGED_TILE // ts.BLOCK_T
    reads = _cdiv(r, rows) if rows <= r else 1  # key reads per request: once per group of its rows
    nbytes = b * reads * t * (INDEX_RECORD + 4 / 64) + m * INDEX_HEADS * (INDEX_DIM + 4) + 2 * m * t * 8 \
        + m * splits * K * 8 * 2 + m * K * 4
    flops = 2 * m * INDEX_HEADS * t * INDEX_DIM + 3 * m * INDEX_HEADS * t
    expect = ("f16 tensor cores (wgmma on sm_90, mma.sync on sm_120), each request's keys read once per program "
              "of its rows: within "
              "2x of the floor needs the issue figure at or below it (the selection's scans counted at their "
              "trips)")
    # the chunk loop (one dot over the 128 dims a chunk of BLOCK_T positions) inside the tile loop
    levels = _paged_levels(t, splits, PAGED_TILE)
    trips = {"mma": chunks, "mma_parent": tiles, "other": rows * _cdiv(K, tpg.BLOCK),
             "sites": _select_rules(tiles, rows, splits, levels)}
    launch_on = {gpu: _launch(f"paged_topk_split[k{K}]", groups * splits, by_arch[arch]["num_warps"], loop="nested",
                              trips=trips) for arch, gpu in GPU_OF_ARCH.items()}
    launch = launch_on["rtx_pro_6000"]
    row = _row("indexer_paged_topk", shape, {"B": b, "R": r, "T": t, "K": K, "rows_per_program": rows,
                                              "splits": splits, "tile": PAGED_TILE, "key_reads_per_request": reads},
                nbytes, flops, "tf32" if spec["constexprs"]["PRECISION"] == "tf32x3" else "bf16", expect, target="fp8",
                covers=[f"paged_topk[k{K}]", f"paged_topk_split[k{K}]"], launch=launch)
    by_gpu = {gpu: x for gpu, x in launch_on.items() if x != launch}
    if by_gpu:  # a GPU that launches another variant (``issue_bound``)
        row["launch_by_gpu"] = by_gpu
    return row


def _move(kernel: str, n: int, shape: str, peer: bool = False) -> dict:
    """pack / unpack / direct: n records x J layers read once and written once, plus int32 indices."""
    rec = n * J * RECORD["nvfp4_368"]
    idx = n * 4 * (2 if kernel != "unpack" else 1)
    expect = ("launch-bound: the same time (within ~1 us) as a launch at count 0 with the same capacity: "
              "the grid is a few CTAs per SM, not capacity/4 x layers" if n <= 64 else
              "memory-bound: at least 50% of the HBM floor (L2-resident on H200 at this size: can beat it)"
              + ("; into a peer over PCIe the link bounds it (p2p_us)" if peer else ""))
    return _row(kernel, shape, {"records": n, "layers": J, "width": RECORD["nvfp4_368"], "capacity": B * U},
                2 * rec + idx, 0, "none", expect, p2p_bytes=rec if peer else 0.0, covers=["pack.cu:move_kernel"])


def _csrc_int(path: str, name: str) -> int:
    """``constexpr int name = N;`` of csrc/cuda/``path``: a launch constant of a csrc kernel."""
    with open(os.path.join(REPO, "csrc", "cuda", path)) as f:
        return int(re.search(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", f.read()).group(1))


def _write_paged_launch(rows: int, per_block: int) -> tuple[str, dict]:
    """records.cu's write_paged_nvfp4_kernel<L> as si_records_write_paged_cuda launches it for ``rows``
    rows: L = kWideWriteLanes lanes a token from kWideWriteRows rows on, else kEncodeLanes."""
    wide = rows >= _csrc_int("records.cu", "kWideWriteRows")
    lanes = _csrc_int("records.cu", "kWideWriteLanes" if wide else "kEncodeLanes")
    kernel = f"records.cu:write_paged_nvfp4_kernel<{lanes}>"
    return kernel, _launch(kernel, _cdiv(rows, per_block * (32 // lanes)), per_block)


def roofline() -> list[dict]:
    """The roofline rows (module docstring)."""
    from sparkinfer.attention import triton_paging as tp

    rows = []
    for fmt in RECORD:
        rows.append(_mla(fmt, B * R, HEADS_PER_RANK, K, "selected: 16 req x 4 rows, 16 heads/rank, top-2048"))
    rows.append(_mla("nvfp4_368", B * R, HEADS_PER_RANK, K, "selected, each request's 4 rows over their union "
                     "read once (B*U records; the kernel reads per row today)", gathered=B * U))
    for fmt in RECORD:
        rows.append(_mla_union(fmt, B, R, HEADS_PER_RANK, U, K, "selected, union kernel: 16 req x (4 rows x 16 "
                               "heads), 3,584-record unions, top-2048 per row"))
    rows.append(_mla("nvfp4_368", B * R, HEADS, K // D, "stock DCP4: 16 req x 4 rows, 64 heads, 2048 listed, "
                     "512 valid (compacted by paging_topk_rows[compact])", listed=K, listed_bytes=8, compacted=True))
    rows.append(_mla("nvfp4_368", R, HEADS_PER_RANK, K, "batch 1: 4 rows, 16 heads/rank, top-2048"))
    rows.append(_indexer(R, 131072, "decode: one request, 4 rows, 128K context"))
    rows.append(_indexer(R, B * 65536, "decode step: 16 req x 4 rows at 64K each (one batched launch)"))
    rows.append(_indexer(2048, 131072, "prefill chunk 2048 at 128K, scores materialized [M, T]"))
    rows.append(_indexer_tiled(2048, 131072, "prefill chunk 2048 at 128K, tiled with running top-k-2048"))
    rows.append(_indexer_paged(B, R, 65536, "decode step: 16 req x 4 rows at 64K, paged scoring and top-k-2048 "
                               "in one launch"))
    # the paged top-k over a prefill chunk's 64-row block, which the engine scores tiled instead
    # (``core.indexer_tiles.scores_lists``): 32 of these a chunk, against the row above's tiled chunk
    rows.append(_indexer_paged(1, 64, 131072, "prefill block: 64 rows of one request at 128K (32 a 2048-row "
                               "chunk), paged scoring and top-k-2048 in one launch"))
    per_pair = B * U // D
    rows.append(_move("pack", per_pair, f"one destination: {per_pair} records (B*U/D), F+3S, into the peer", peer=True))
    rows.append(_move("pack", 10, "10 records, capacity B*U"))
    rows.append(_move("unpack", per_pair, f"one source region: {per_pair} records, F+3S"))
    rows.append(_move("direct", per_pair, f"own records: {per_pair}, F+3S"))
    n_topk = B * R * K
    rows.append(_row("union", "16 req x 4 rows x 2048 ids", {"B": B, "R": R, "K": K},
                     n_topk * 4 * 3 + B * 4 * R * K * 2 * 4, 0, "none",
                     "latency-bound (one CTA per request, 16 of the SMs busy): a few us, well under a layer",
                     covers=["union.cu:union_kernel"]))
    chunk = 8192
    per_block = _csrc_int("records.cu", "kWarpsPerBlock")
    per_warp = 32 // _csrc_int("records.cu", "kEncodeLanes")  # NVFP4 tokens per warp (the fp8 kernel: one)
    rows.append(_row("records_encode[nvfp4_368]", f"prefill chunk {chunk} tokens", {"tokens": chunk},
                     chunk * ((LATENT + ROPE) * 4 + 8 + 368), 0, "none",
                     "memory-bound (per value two FMAs for the quotient, three roundings for the code; no loop): "
                     "near the HBM floor",
                     covers=["records.cu:encode_kernel", "records.cu:encode_fp8_kernel"],
                     launch=_launch("records.cu:encode_kernel", _cdiv(chunk, per_block * per_warp), per_block)))
    # the layer forward's write (native.write_paged) of a prefill chunk: bf16 rows in, records out, a slot
    # each; its own name (the device benchmarks key rows by name: records_write_paged is the decode step's)
    write_kernel, write_launch = _write_paged_launch(chunk, per_block)
    rows.append(_row("records_write_paged[nvfp4_368,prefill]", f"prefill chunk: {chunk} bf16 rows encoded into "
                     "the strided cache", {"tokens": chunk}, chunk * ((LATENT + ROPE) * 2 + 8 + 368), 0, "none",
                     "at the floor (12.5 MB: the H200's launch, the PRO 6000's memory) where its instructions "
                     "issue within it (no loop: the SASS count is a warp's issue)", covers=[write_kernel],
                     launch=write_launch))
    n_gather = B * R * K
    rows.append(_row("records_decode[nvfp4_368]", "gather-decode 16 req x 4 rows x 2048 records to fp32",
                     {"records": n_gather}, n_gather * ((LATENT + ROPE) * 4 + 8 + 368), 0, "none",
                     "memory-bound (a code lookup and one or two multiplies per value): near the HBM floor",
                     covers=["records.cu:decode_kernel"]))
    # the attention's paged path compacts each row (``topk_rows(compact=True)``: a program a row, one trip)
    topk_m, _, topk_warps = tp.compact_launch(K)
    rows.append(_row("paging_topk_rows", "16 req x 4 rows x 2048 positions -> cache rows, each row's kept ones "
                     "first", {"rows": B * R, "K": K}, n_topk * (4 + 4 + 8), 0, "none",
                     "latency-bound (2 MiB of int32 in, int64 out): a launch, a few us, per attention layer",
                     launch=_launch("paging_topk_rows[compact]", _cdiv(B * R, topk_m), topk_warps)))
    rows.append(_row("records_write_paged[nvfp4_368]", "a decode step's cache write: 16 x 4 bf16 rows encoded "
                     "into the strided cache", {"tokens": B * R}, B * R * ((LATENT + ROPE) * 2 + 8 + 368), 0, "none",
                     "latency-bound (115 KB): the layer's whole cache write in one launch (values and slots "
                     "checked, encoded in place)",
                     covers=[_write_paged_launch(B * R, per_block)[0], "records.cu:write_paged_kernel"],
                     launch=_write_paged_launch(B * R, per_block)[1]))
    rows.append(_row("paging_flag_nonfinite", "the indexer's weights of a decode step: 16 x 4 rows x 32 heads fp32",
                     {"rows": B * R, "heads": 32}, B * R * 32 * 4, 0, "none",
                     "latency-bound (8 KB): a launch per F layer, where the torch form took four"))
    rows.append(_row("paging_scatter_rows", "a decode step's 16 x 4 records into the strided cache",
                     {"records": B * R}, B * R * 368 * 2 + B * R * 8, 0, "none",
                     "latency-bound (47 KB): a launch per cache write of unquantized rows (records: "
                     "records.cu:write_paged_kernel)",
                     launch=_launch("paging_scatter_rows[u8]", _cdiv(B * R, tp.SCATTER_BLOCK_N), tp.SCATTER_WARPS)))
    union_rows = B * R * K  # the workspace's rows at the largest union (no MTP overlap)
    rows.append(_row("paging_copy_rows", "selected workspace patch: the step's 16 x 4 own records into "
                     f"{union_rows:,} union rows (masked)", {"rows": union_rows, "patched": B * R},
                     union_rows + B * R * (8 + 8 + 2 * 368), 0, "none",
                     "latency-bound (the mask, 131 KB, and 47 KB of records): a launch per layer, where the "
                     "torch form gathered, selected and copied every row (~3 x 48 MB)"))
    # a Full layer's group plan over B x R x K entries (E): patch reads topk, union, remap (12 B) and
    # writes slots, own, new rows, kept, store rows (14 B); planes re-read the union and write req,
    # local, slot of the entries that move (at most E, 12 B)
    rows.append(_row("plan_patch+plan_planes", f"a Full layer's group plan: {union_rows:,} union entries "
                     f"of 16 requests, DCP{D}", {"entries": union_rows, "dcp": D},
                     union_rows * (12 + 14 + 4 + 12), 0, "none",
                     "latency-bound (5.5 MB over 16 and 64 CTAs): two launches per Full layer after the "
                     "union kernel, where the torch form made ~75", covers=[
                         "plan_patch[plain]", "plan_patch[rep]", "plan_planes[plain]", "plan_planes[rep]"]))
    heads, index_dim = 32, 128
    rows.append(_row("indexer_q_quant", "16 x 4 rows x 32 heads x 128 bf16 -> fp8 + a scale per head",
                     {"rows": B * R, "heads": heads}, B * R * heads * (index_dim * 3 + 4), 0, "none",
                     "latency-bound (0.8 MB): a launch per indexer layer, in place of ten elementwise ones"))
    for name in ("signal_kernel", "wait_kernel", "bump_kernel"):
        rows.append(_row(f"comm_flags[{name}]", "one flag", {"bytes": 8}, 8, 0, "none",
                         "latency: a launch plus one PCIe write (~0.4 us); a wait returns within ~1 us of its flag",
                         covers=[f"comm_flags.cu:{name}"]))
    return rows


# ---- compiling ------------------------------------------------------------------------------------

_MMA_SASS = re.compile(r"\b([A-Z]*MMA)(?:\.[A-Z0-9_.]+)?\b")
_MMA_PTX = re.compile(r"\b(mma\.sync|wgmma\.mma_async|tcgen05\.mma)\b")


def _tool(name: str) -> str | None:
    """A CUDA tool from PATH, CUDA_HOME, or the copy Triton's NVIDIA backend ships (cuobjdump: nvcc's
    toolkit here has none)."""
    path = shutil.which(name)
    if path:
        return path
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = os.path.join(cuda, "bin", name)
    if os.path.exists(cand):
        return cand
    try:
        from triton import knobs

        cand = getattr(knobs.nvidia, name.replace("+", "p")).path
    except (ImportError, AttributeError, RuntimeError):
        return None
    return cand if cand and os.path.exists(cand) else None


def _sass(cubin: str) -> str:
    tool = _tool("cuobjdump")
    return "" if tool is None else subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout


def _sass_mma(text: str) -> dict:
    """{function name (mangled): sorted MMA opcodes} from cuobjdump -sass of a cubin."""
    out, fn = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            fn = m.group(1)
            out[fn] = set()
        elif fn is not None:
            out[fn].update(op for op in _MMA_SASS.findall(line))
    return {f: sorted(ops) for f, ops in out.items()}


# ---- instruction issue: hot loops in the compiled code ---------------------------------------------------
# A kernel's code is a list of (instruction, branch target index or None, conditional). A loop is a
# backward branch: the instructions from its target (the loop's header label) through the branch;
# several back edges to one header are one loop, ending at the last. A loop inside another's span is
# nested in it. The HOT loop is the outermost loop with the most instructions (inner loops included,
# once): per warp a kernel issues its instructions outside the hot loop once and the hot loop's
# instructions once per iteration (``_launch``'s iters). Inner loops of the hot loop count once per
# iteration (their trip counts are not known here: a lower bound), the other loops once. Every
# instruction of a span counts, taken or not on a given path (both sides of a branch). On SASS each
# line is one warp instruction; the PTX fallback counts PTX instructions (ptxas expands and folds them).
# ptxas may unroll a runtime loop into a main loop of u iterations and a remainder loop (the merge
# kernel's loop over the splits, u = 4): the SASS then has more loops than the PTX, a SASS iteration
# is not a source iteration, and the kernel gets no issue figure (``issue_bound`` says why), unless
# the hot loop holds tensor-core instructions and as many as the PTX hot loop's (each mma.sync or
# wgmma is one HMMA / HGMMA): then the unrolled loop was another one (the union kernel's fused merge
# over the splits), counted once with the rest. A kernel
# that branches at run time between whole paths (records.cu's encode: one per format) counts them all.

_LOAD_SASS = re.compile(r"\bLDG\b")  # global loads (``decode_path_issue``: a loop's unroll factor)
_LOAD_PTX = re.compile(r"\bld\.global\b")
_SASS_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_PTX_BRA = re.compile(r"^(@!?%\w+\s+)?bra(?:\.uni)?\s+([\w$]+)\s*;")


def parse_sass(text: str) -> dict:
    """{function: code} of ``cuobjdump -sass`` text. The trap after a kernel's EXIT (an unconditional
    branch to itself) and the padding behind it never run and are dropped."""
    funcs, fn = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            fn = m.group(1)
            funcs[fn] = []
            continue
        m = _SASS_INSN.match(line)
        if m and fn is not None:
            funcs[fn].append((int(m.group(1), 16), m.group(2)))
    out = {}
    for fn, insns in funcs.items():
        at = {addr: i for i, (addr, _) in enumerate(insns)}
        code = []
        for i, (_, insn) in enumerate(insns):
            pred, op = re.match(r"(@!?U?P\w+\s+)?(\S+)", insn).groups()
            target = None
            if op.split(".")[0] in ("BRA", "JMP"):
                hexes = re.findall(r"0x([0-9a-f]+)", insn)
                target = at.get(int(hexes[-1], 16)) if hexes else None
            if target == i and pred is None:
                break
            code.append((insn, target, pred is not None))
        out[fn] = code
    return out


def parse_ptx(text: str) -> dict:
    """{entry: code} of PTX: the statements of each ``.entry``'s body (directives, braces and labels
    are not instructions; a label names the instruction after it)."""
    return {fn: code for fn, (code, _) in _parse_ptx(text).items()}


_PTX_LOC = re.compile(r"\.loc\s+(\d+)\s+(\d+)\s+\d+(?:,\s*function_name\s+[\w$]+,\s*inlined_at\s+(\d+)\s+(\d+))?")


def ptx_sources(text: str) -> dict:
    """{entry: [source of each instruction of ``parse_ptx``'s code]}: ("file:line", "file:line" of the
    call it was inlined at, or None) from the ``.loc`` before it (file base names), None before any."""
    return {fn: src for fn, (_, src) in _parse_ptx(text).items()}


def _parse_ptx(text: str) -> dict:
    """{entry: (code, sources)}: ``parse_ptx``'s code and ``ptx_sources``' positions (the ``.file``
    table comes after the entries)."""
    files = {n: os.path.basename(f) for n, f in re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', text, re.M)}
    out, fn, depth, labels, code, src, loc = {}, None, 0, {}, [], [], None
    for raw in text.splitlines():
        line = raw.split("//")[0].strip()
        m = re.search(r"\.entry\s+([\w$]+)", line)
        if m:
            fn, depth, labels, code, src, loc = m.group(1), 0, {}, [], [], None
            continue
        m = _PTX_LOC.match(line)
        if m and fn is not None:
            f, ln, cf_, cl = m.groups()
            loc = (f"{files.get(f, f)}:{ln}", f"{files.get(cf_, cf_)}:{cl}" if cf_ else None)
            continue
        if fn is None or not line:
            continue
        if line == "{":
            depth += 1
            continue
        if line == "}":
            depth -= 1
            if depth == 0:
                out[fn] = ([(t, labels.get(lab) if lab else None, c) for t, lab, c in code], src)
                fn = None
            continue
        if depth == 0:
            continue
        m = re.match(r"^([\w$]+):$", line)
        if m:
            labels[m.group(1)] = len(code)
            continue
        if line.startswith(".") or not line.endswith(";"):
            continue
        m = _PTX_BRA.match(line)
        code.append((line, m.group(2) if m else None, bool(m and m.group(1))))
        src.append(loc)
    return out


def find_loops(code: list) -> list[dict]:
    """The loops of ``code`` (the rule above): start and end index, size, and depth (0: outermost)."""
    ends = {}
    for i, (_, target, _) in enumerate(code):
        if target is not None and target <= i:
            ends[target] = max(ends.get(target, i), i)
    spans = sorted(ends.items())
    return [{"start": a, "end": b, "size": b - a + 1,
             "depth": sum(1 for c, d in spans if (c, d) != (a, b) and c <= a and b <= d)} for a, b in spans]


def loop_profile(code: list, source: str) -> dict:
    """Instruction count of ``code``, its loops and its hot loop (the rule above), with the tensor-core
    instructions in the hot loop (``hot_mma``); ``source``: "sass" or "ptx"."""
    loops = find_loops(code)
    top = [lp for lp in loops if lp["depth"] == 0]
    hot = max(top, key=lambda lp: lp["size"], default=None)
    prof = {"count_from": source, "instructions": len(code), "loops": [[lp["start"], lp["end"], lp["depth"]]
                                                                        for lp in loops]}
    if hot is None:
        return {**prof, "hot_body": 0, "hot_inner_loops": 0, "outside": len(code)}
    inner = sum(1 for lp in loops if lp is not hot and hot["start"] <= lp["start"] and lp["end"] <= hot["end"])
    mma = _MMA_SASS if source == "sass" else _MMA_PTX
    hot_mma = sum(1 for insn, _, _ in code[hot["start"]:hot["end"] + 1] if mma.search(insn))
    prof["loop_mma"] = [sum(1 for insn, _, _ in code[lp["start"]:lp["end"] + 1] if mma.search(insn)) for lp in loops]
    load = _LOAD_SASS if source == "sass" else _LOAD_PTX
    prof["loop_loads"] = [sum(1 for insn, _, _ in code[lp["start"]:lp["end"] + 1] if load.search(insn)) for lp in loops]
    out = {**prof, "hot_body": hot["size"], "hot_inner_loops": inner, "outside": len(code) - hot["size"],
           "hot_mma": hot_mma}
    if source == "sass" and not inner:  # a loop inside would wait its own trips: not counted here
        w = load_waits(code, hot["start"], hot["end"])
        out["hot_load_waits"], out["hot_exposed_waits"], out["hot_load_lead"] = w["waits"], w["exposed"], w["lead"]
    if source == "sass":
        # local-memory loads and stores in the hot loop: spills an iteration pays (ptxas' spill bytes count
        # every spill, most outside the loop: once per CTA)
        out["hot_spill_ops"] = sum(1 for insn, _, _ in code[hot["start"]:hot["end"] + 1]
                                   if re.search(r"\b(?:LDL|STL)\b", insn))
    return out


# ---- global-load round trips: what an iteration of the hot loop waits for ---------------------------------
# A CTA whose warps wait on a global load sit idle for a DRAM round trip (hundreds of ns) unless other
# CTAs on the SM have work, or the load was issued early enough that the iteration's own instructions
# covered it; the sparse-MLA decode runs one CTA an SM, so the round trips an iteration waits for with
# nothing issued in between add to its time whatever the instruction count. Counted on the SASS of one
# loop iteration (the body run three times, the third counted, so that a load issued one or two
# iterations ahead is waited for where it is used), for a hot loop without loops inside it (theirs
# would count once, not at their trips):
# - a synchronous load (LDG) is pending until an instruction names one of the registers it writes (its
#   destination, 1, 2 or 4 registers by its width); that instruction waits, and so are all the loads
#   then pending (issued together, they arrive together): one round trip;
# - an asynchronous copy (LDGSTS, cp.async into shared memory) joins the group the next LDGDEPBAR
#   commits; `DEPBAR.LE SB0, n` waits until at most the n youngest committed groups are pending: one
#   round trip if it waits for any.
# A wait's lead is the instructions issued from the youngest load it waits for to the wait. A wait whose
# lead is a whole iteration's body or more is covered: the copies flew while an iteration issued (the
# decode's copies of tile i + 1 issued before tile i's compute, a second buffer); any other wait is
# exposed, and those are the round trips counted in sequence. Shared-memory and local loads are not
# counted, nor is the pipeline's start: a CTA waits once for the first tiles' indices and then their
# records, requested before its loop (the steady state's count is per iteration).

_REG = re.compile(r"(?<![\w.])R(\d+)(\.64)?\b")
_DEPBAR_LE = re.compile(r"SB0,\s*(0x[0-9a-fA-F]+|\d+)")


def _sass_regs(text: str) -> set:
    """The registers an operand text names (a ``.64`` pair: both)."""
    regs = set()
    for n, pair in _REG.findall(text):
        regs.update((int(n), int(n) + 1) if pair else (int(n),))
    return regs


def load_waits(code: list, start: int, end: int) -> dict:
    """The global-load waits of one iteration of ``code[start:end + 1]`` (SASS; the rule above):
    {"waits": all of them, "exposed": those with a lead under the body's length, "lead": the shortest
    lead (instructions; None without a wait)}."""
    body = [insn for insn, _, _ in code[start:end + 1]]
    pending = {}  # register -> when the synchronous load writing it issued
    group, committed = None, []  # the open copy group's youngest copy; committed groups' youngest, oldest first
    waits, leads, t = 0, [], 0
    for counted in (False, False, True):
        for insn in body:
            t += 1
            op, _, operands = re.sub(r"^@!?U?P\w+\s+", "", insn).partition(" ")
            lead = None
            if op.startswith("LDGSTS"):
                group = t
                continue
            if op.startswith("LDGDEPBAR"):
                if group is not None:
                    committed.append(group)
                group = None
                continue
            if op.startswith("DEPBAR"):
                n = _DEPBAR_LE.search(operands)
                keep = int(n.group(1), 0) if n else 0
                done = committed[:max(len(committed) - keep, 0)]
                committed = committed[len(done):]
                if done:
                    lead = t - done[-1]
            else:
                named = _sass_regs(operands)
                if pending.keys() & named:
                    lead = t - max(pending[r] for r in pending.keys() & named)
                    pending = {}
                if op.startswith("LDG"):
                    first = _REG.search(operands)
                    width = 4 if ".128" in op else 2 if ".64" in op else 1
                    pending.update((r, t) for r in range(int(first.group(1)), int(first.group(1)) + width))
            if lead is not None and counted:
                waits += 1
                leads.append(lead)
    return {"waits": waits, "exposed": sum(1 for x in leads if x < len(body)), "lead": min(leads, default=None)}


def _own_loop(loops: list, at: int) -> int | None:
    """The innermost loop holding instruction ``at`` (the shortest span of ``loops`` [start, end, ...])."""
    holding = [j for j, (a, b, *_) in enumerate(loops) if a <= at <= b]
    return min(holding, key=lambda j: loops[j][1] - loops[j][0]) if holding else None


def loop_sites(code: list, src: list) -> list:
    """Where each loop of ``code`` (``find_loops``' order) comes from in the source, from its own
    instructions' positions (``ptx_sources``; those of Triton's library counted at the line that
    called them, line 0's not at all): {"line": the most common "file:line", "call": the most common "file:line" a
    function was inlined at from another file (a helper's call site), or None}."""
    loops = [(lp["start"], lp["end"]) for lp in find_loops(code)]
    lines = [{} for _ in loops]
    calls = [{} for _ in loops]
    for at, pos in enumerate(src):
        j = _own_loop(loops, at)
        if j is None or pos is None:
            continue
        line, call = pos
        if line.endswith(":0"):  # code the compiler made (no source line)
            continue
        if call and _LIBRARY.match(line):
            line, call = call, None
        lines[j][line] = lines[j].get(line, 0) + 1
        if call and call.split(":")[0] != line.split(":")[0]:
            calls[j][call] = calls[j].get(call, 0) + 1
    top = lambda d: max(d, key=d.get) if d else None
    return [{"line": top(a), "call": top(b)} for a, b in zip(lines, calls)]


_LIBRARY = re.compile(r"(standard|core|math|semantic)\.py:")  # triton.language's files


def site_trips(site: dict, rules: list) -> float | None:
    """The trips of the first of ``rules`` ({"call", "file", "lines": [first, last] or None,
    "trips"}) that ``site`` (``loop_sites``) matches: its call, and its line in that file and range."""
    for r in rules:
        if site.get("call") != r["call"]:
            continue
        if r["lines"] is None:
            return r["trips"]
        f, _, ln = (site.get("line") or "::").rpartition(":")
        if f == r["file"] and ln.isdigit() and r["lines"][0] <= int(ln) <= r["lines"][1]:
            return r["trips"]
    return None


def nested_issue(profile: dict, trips: dict) -> dict:
    """Warp instructions per warp of one CTA when every loop runs ``trips`` times by its kind (``_launch``):
    each instruction counts the trips of the innermost loop holding it (the shortest span; the
    instructions in no loop once), which holds where ptxas leaves loops that overlap without one
    holding the other. The tensor-core loops are found from the code (``loop_mma``: a loop holding
    MMA instructions none of whose inner loops holds any), their parents the shortest loops around them."""
    loops = [(a, b) for a, b, _ in profile["loops"]]
    mma = profile["loop_mma"]
    within = lambda i, j: i != j and loops[j][0] <= loops[i][0] and loops[i][1] <= loops[j][1]
    leaf = {j for j in range(len(loops)) if mma[j] and not any(mma[i] and within(i, j) for i in range(len(loops)))}
    parent = {min((j for j in range(len(loops)) if within(i, j)), key=lambda j: loops[j][1] - loops[j][0])
              for i in leaf if any(within(i, j) for j in range(len(loops)))}
    kind = ["mma" if j in leaf else "mma_parent" if j in parent else "other" for j in range(len(loops))]
    # a loop a site rule names (a helper's loops at the trips of its calls) counts at the rule's trips
    sites = profile.get("loop_sites") or [{}] * len(loops)
    ruled = [site_trips(sites[j], trips.get("sites", [])) for j in range(len(loops))]
    per_warp, by_kind, outside, by_site = 0.0, {}, 0, {}
    for at in range(profile["instructions"]):
        j = _own_loop(loops, at)
        if j is None:
            per_warp += 1
            outside += 1
            continue
        if ruled[j] is not None:
            per_warp += ruled[j]
            by_site[j] = by_site.get(j, 0) + 1
            continue
        k = kind[j]
        per_warp += trips[k]
        by_kind[k] = by_kind.get(k, 0) + 1
    out = {"per_warp": per_warp, "own_by_kind": by_kind, "outside": outside}
    if by_site:  # loop index: [its own instructions, its trips]
        out["by_site"] = {str(j): [n, ruled[j]] for j, n in sorted(by_site.items())}
    return out


def _innermost(loops: list, n: int) -> list:
    """For each of ``n`` instructions the index of the shortest of ``loops`` (start, end) holding it, or None."""
    out = []
    for at in range(n):
        holding = [j for j, (a, b) in enumerate(loops) if a <= at <= b]
        out.append(min(holding, key=lambda j: loops[j][1] - loops[j][0]) if holding else None)
    return out


def decode_path_issue(profile: dict, path: dict) -> dict:
    """Warp instructions per warp of the sparse-MLA decode's critical path (``_mla``): each instruction
    counts the trips of the innermost loop holding it (the instructions in no loop once), by the loop's
    place around the hot loop (the tiles, ``path["tiles"]`` trips; a loop nested in it once a tile):
    before it the compaction's loops (``compact``: their trips in order); after it the fused merge, where a loop
    holding another is the loop over the output's chunks (``merge_chunks`` trips), the loops inside it
    the loop over the splits (``merge_chunks`` x ``splits`` trips), and the other loops the loops over
    the splits (``splits`` trips). ptxas unrolls a loop over the splits u times into a main loop, whose
    iteration loads u splits' values (u times the global loads of one), straight-line code and a
    remainder loop of one split's loads:
    the main loop then runs splits // u times and the remainder splits % u (the straight-line
    code counted once, an upper bound). Raises ValueError where the code is not that shape (another loop
    count before the hot loop than the PTX's or than ``compact`` names, more than one loop in the chunk
    loop)."""
    loops = [(a, b) for a, b, _ in profile["loops"]]
    loads = profile.get("loop_loads", [])
    loads = loads if len(loads) == len(loops) else [1] * len(loops)  # unknown: no unrolled loop recognized
    top = [j for j, (_, _, d) in enumerate(profile["loops"]) if d == 0]
    hot = max(top, key=lambda j: loops[j][1] - loops[j][0])
    within = lambda i, j: i != j and loops[j][0] <= loops[i][0] and loops[i][1] <= loops[j][1]
    before = [j for j in top if loops[j][1] < loops[hot][0]]
    ptx = profile.get("ptx_nest")
    if ptx:
        pl = [(a, b) for a, b, d in ptx["loops"]]
        ptx_hot = max((j for j, (_, _, d) in enumerate(ptx["loops"]) if d == 0), key=lambda j: pl[j][1] - pl[j][0])
        if len(before) != sum(1 for a, b in pl if b < pl[ptx_hot][0]):
            raise ValueError("ptxas restructured the compaction's loops")
    if before and len(before) != len(path["compact"]):  # each compaction loop at its own trips
        raise ValueError(f"{len(before)} loops before the tiles, {len(path['compact'])} compaction trip counts")
    trips = [0] * len(loops)
    trips[hot] = path["tiles"]
    for j in range(len(loops)):
        if within(j, hot):
            trips[j] = path["tiles"]
        elif j in before:
            trips[j] = path["compact"][before.index(j)]
        elif any(within(j, i) for i in before):
            trips[j] = path["compact"][before.index(next(i for i in before if within(j, i)))]
    after = [j for j in top if loops[j][0] > loops[hot][1]]
    leaves = []
    for j in after:
        inner = [i for i in range(len(loops)) if within(i, j)]
        if len(inner) > 1:
            raise ValueError("ptxas unrolled the merge's loop over the splits inside its chunk loop")
        if inner:
            trips[j] = path["merge_chunks"]
            trips[inner[0]] = path["merge_chunks"] * path["splits"]
        else:
            leaves.append(j)
    s, i = path["splits"], 0
    while i < len(leaves):
        j = leaves[i]
        nxt = loads[leaves[i + 1]] if i + 1 < len(leaves) else 0
        u = loads[j] // nxt if nxt and loads[j] % nxt == 0 else 1
        if u > 1:  # main loop, remainder loop
            trips[j], trips[leaves[i + 1]] = s // u, s % u
            i += 2
        else:
            trips[j] = s
            i += 1
    by_loop = [0] * len(loops)
    innermost = _innermost(loops, profile["instructions"])
    for j in innermost:
        if j is not None:
            by_loop[j] += trips[j]
    outside = innermost.count(None)
    per_warp = outside + sum(by_loop)
    merge = sum(by_loop[j] for j in range(len(loops)) if j in after or any(within(j, i) for i in after))
    return {"per_warp": per_warp, "trips": trips, "outside": outside, "tiles": by_loop[hot],
            "compact": sum(by_loop[j] for j in range(len(loops)) if trips[j] and j in before), "merge": merge}


def issue_time(profile: dict, launch: dict, gpu: str) -> dict:
    """The issue-bound time of ``launch`` (``_launch``) with ``profile``'s counts on ``gpu``: the
    instructions of the busiest SM / (schedulers x 1 per clock x clock). A CTA's warps issue on one SM,
    so with CTAs of equal work the busiest SM runs ceil(CTAs / SMs) of them (a grid of fewer CTAs
    than SMs leaves the rest idle; 192 CTAs on 188 SMs give 4 SMs two, twice the time of one). A
    lower bound: no stall, every scheduler issuing each clock, the CTAs' instructions averaged."""
    h = HW[gpu]
    # a loop the launch has no trip count for (a helper's loop in a csrc kernel) runs once per CTA here
    iters = (launch["iters"] or launch["ctas"]) if profile["hot_body"] else 0
    warp_instr = launch["warps"] * (launch["ctas"] * profile["outside"] + iters * profile["hot_body"])
    per_iter, outside = profile["hot_body"], profile["outside"]
    count_from = profile["count_from"]
    extra = {}
    if "trips" in launch:  # nested loops, each at its own trip count
        # ptxas may turn the loops into a SASS control flow that is no longer a nest (loops sharing
        # instructions without one holding the other), and site rules (``nested_issue``) name loops by
        # their instructions' source, which the SASS does not carry: then the PTX's nest is counted
        ptx = profile.get("ptx_nest")
        counted = profile
        if ptx and (len(profile["loops"]) != len(ptx["loops"]) or launch["trips"].get("sites")):
            counted, count_from = ptx, "ptx"
        nest = nested_issue(counted, launch["trips"])
        warp_instr = int(launch["warps"] * launch["ctas"] * nest["per_warp"])
        per_iter, outside = nest["own_by_kind"].get("mma", 0), nest["outside"]
        iters = launch["trips"]["mma"] * launch["ctas"]
        if "by_site" in nest:
            extra["by_site"] = nest["by_site"]
    if "path" in launch:  # the critical path, every CTA counted as the merging one (``decode_path_issue``)
        path = decode_path_issue(profile, launch["path"])
        warp_instr = launch["warps"] * launch["ctas"] * path["per_warp"]
        outside, iters = path["outside"], launch["path"]["tiles"] * launch["ctas"]
        extra["path"] = {k: path[k] for k in ("compact", "tiles", "merge", "trips")}
    busiest = _cdiv(launch["ctas"], h["sms"])  # CTAs on the busiest SM
    out = {"kernel": launch["kernel"], "per_iter": per_iter, "outside": outside,
           "iters_per_cta": round(iters / launch["ctas"], 2), "ctas": launch["ctas"], "warps": launch["warps"],
           "warp_instr": warp_instr, "count_from": count_from,
           "busiest_sm_ctas": busiest,
           "issue_us": round(warp_instr * busiest / launch["ctas"] / (h["schedulers"] * h["clock_hz"]) * 1e6, 3),
           **extra}
    if "hot_load_waits" in profile:  # DRAM round trips the busiest SM's CTAs wait for in sequence (``load_waits``)
        out["load_waits"], out["exposed_waits"] = profile["hot_load_waits"], profile["hot_exposed_waits"]
        out["round_trips"] = round(profile["hot_exposed_waits"] * iters / launch["ctas"] * busiest, 1)
    if profile["hot_body"] and not launch["iters"] and "trips" not in launch:
        out["trips_unknown"] = True
    return out


def issue_bound(doc: dict) -> None:
    """Adds ``issue`` {gpu: issue_time + floor_us, ratio = issue / floor, reaches_floor} to every
    roofline row with a launch whose kernel was compiled for that GPU's arch (GPU_OF_ARCH)."""
    profiles = {(r["kernel"], r["arch"]): r["profile"] for r in doc["kernels"] if r.get("profile")}
    for row in doc["roofline"]:
        for arch, gpu in GPU_OF_ARCH.items():
            launch = row.get("launch_by_gpu", {}).get(gpu, row.get("launch"))
            prof = profiles.get((launch["kernel"], arch)) if launch else None
            if prof is None:
                continue
            hot_intact = prof.get("hot_mma", 0) > 0 and prof["hot_mma"] == prof.get("ptx_hot_mma")
            if len(prof["loops"]) != prof.get("ptx_loops", len(prof["loops"])) and not hot_intact \
                    and "trips" not in launch:  # a nested count falls back to the PTX's nest (issue_time)
                row.setdefault("issue", {})[gpu] = {
                    "kernel": launch["kernel"], "arch": arch,
                    "error": f"ptxas unrolled a loop ({len(prof['loops'])} SASS loops, {prof['ptx_loops']} in the PTX)"}
                continue
            try:
                t = issue_time(prof, launch, gpu)
            except ValueError as e:  # code not of the shape its trip counts assume (``decode_path_issue``)
                row.setdefault("issue", {})[gpu] = {"kernel": launch["kernel"], "arch": arch, "error": str(e)}
                continue
            floor = row["times"][gpu]["floor_us"]
            t.update(arch=arch, floor_us=floor, mem_us=row["times"][gpu]["mem_us"],
                     ratio=round(t["issue_us"] / floor, 3), reaches_floor=t["issue_us"] <= floor)
            if "path_by_splits" in launch:  # the decode's critical path at every split count of one wave
                t["by_splits"] = {n: issue_time(prof, {**launch, "path": p}, gpu)["issue_us"]
                                  for n, p in launch["path_by_splits"].items()}
                t["best_splits"] = min(t["by_splits"], key=t["by_splits"].get)
            row.setdefault("issue", {})[gpu] = t


def _parse_ptxas(text: str) -> dict:
    """{mangled entry: {registers, spill_stores, spill_loads, stack_bytes, static_smem}} of ptxas -v."""
    out, props, entry = {}, {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            entry = m.group(1)
            out.setdefault(entry, {})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props_for = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and "props_for" in locals():
            props[props_for] = {"stack_bytes": int(m.group(1)), "spill_stores": int(m.group(2)),
                                "spill_loads": int(m.group(3))}
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            smem = re.search(r"(\d+) bytes smem", line)
            out[entry].update({"registers": int(m.group(1)), "static_smem": int(smem.group(1)) if smem else 0})
    for name, rec in out.items():
        rec.update(props.get(name, {"stack_bytes": 0, "spill_stores": 0, "spill_loads": 0}))
    return out


def _demangle(names: list[str]) -> dict:
    tool = _tool("cu++filt") or shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    res = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    short = {}
    for n, d in zip(names, res):
        d = d.replace("(anonymous namespace)::", "").removeprefix("void ")  # a template kernel: its return type
        short[n] = d.split("(")[0].split("::")[-1] if d else n
    return short


def _row_of(kernel, source, arch, info, mma_ops, ptx_mma=None, shared=None, profile=None):
    spill = info.get("spill_stores", 0) + info.get("spill_loads", 0)
    return {"kernel": kernel, "source": source, "arch": arch, "profile": profile, "registers": info.get("registers"),
            "spill_bytes": spill, "spill_stores": info.get("spill_stores", 0),
            "spill_loads": info.get("spill_loads", 0), "stack_bytes": info.get("stack_bytes", 0),
            "shared_bytes": info.get("static_smem", 0) if shared is None else shared,
            "mma": bool(mma_ops or ptx_mma), "mma_ops": sorted(set(mma_ops) | set(ptx_mma or []))}


def _compile_cu(path: str, arch: int, tmp: str) -> list[dict]:
    from sparkinfer.native import build

    nvcc = build.nvcc_path()
    cubin = os.path.join(tmp, f"{os.path.basename(path)}.{arch}.cubin")
    cmd = [nvcc, *[f for f in build.NVCC_FLAGS if f not in ("-shared", "-Xcompiler", "-fPIC")],
           *build.gencode_flags(str(arch)), "-I", os.path.join(build.CSRC_DIR, "include"),
           "-Xptxas", "-v", "-cubin", "-o", cubin, path]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"nvcc failed for {path} sm_{arch}:\n{run.stderr[-2000:]}")
    info = _parse_ptxas(run.stderr + run.stdout)
    text = _sass(cubin)
    sass, code = _sass_mma(text), parse_sass(text)
    names = _demangle(sorted(info))
    src = os.path.relpath(path, REPO)
    return [_row_of(f"{os.path.basename(path)}:{names[m]}", src, arch, info[m], sass.get(m, []),
                    profile=loop_profile(code[m], "sass") if m in code else None)
            for m in sorted(info, key=lambda m: names[m])]


def compile_csrc(archs=ARCHS, kernels: set | None = None) -> list[dict]:
    """One row per __global__ kernel of csrc/cuda/*.cu per arch (nvcc -Xptxas -v); ``kernels``: only
    these report names (and only their files compiled)."""
    from sparkinfer.native import build

    if build.nvcc_path() is None:
        raise RuntimeError("nvcc not found (set NVCC or PATH)")
    srcs = sorted(glob.glob(os.path.join(build.CSRC_DIR, "cuda", "*.cu")))
    if kernels is not None:
        srcs = [s for s in srcs if any(k.startswith(os.path.basename(s) + ":") for k in kernels)]
    with tempfile.TemporaryDirectory(prefix="si-kreport-") as tmp, cf.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(_compile_cu, s, a, tmp) for a in archs for s in srcs]
        return [r for j in jobs for r in j.result() if kernels is None or r["kernel"] in kernels]


def _ptxas_triton(ptx: str, arch: int, tmp: str, name: str) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    path = os.path.join(tmp, re.sub(r"\W+", "_", name) + f".{arch}.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    cubin = path[:-4] + ".cubin"
    # Triton's own options (its make_cubin, Triton 3.9: -lineinfo, and --regAllocOptLevel=2 against a
    # ptxas 13 bug), so registers and spills are those of the cubin Triton launches
    run = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                          f"--gpu-name={sm_arch_from_capability(arch)}", path, "-o", cubin],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed for {name} sm_{arch}:\n{run.stderr[-2000:]}")
    info = _parse_ptxas(run.stderr + run.stdout)
    (entry, rec), = info.items()
    return {**rec, "sass_mma": _sass_mma(_sass(cubin)).get(entry, [])}


def _compile_spec(mod: str, index: int, arch: int) -> dict:
    """Compile compile_specs()[index] of ``mod`` for ``arch`` (in a worker process)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = importlib.import_module(mod).compile_specs()[index]
    src = ASTSource(spec["fn"], spec["signature"], constexprs=spec["constexprs"], attrs=spec.get("attrs"))
    k = triton.compile(src,
                       target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"],
                                **spec.get("options", {})})
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory(prefix="si-kreport-") as tmp:
        info = _ptxas_triton(ptx, arch, tmp, spec["name"])
        cubin = os.path.join(tmp, "triton.cubin")  # the code Triton launches (its own ptxas options)
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        code = parse_sass(_sass(cubin)).get(k.metadata.name)
    ((ptx_code, ptx_src),) = _parse_ptx(ptx).values()
    ptx_loops = len(find_loops(ptx_code))
    ptx_profile = loop_profile(ptx_code, "ptx")
    # no cuobjdump: count the PTX
    profile = loop_profile(code, "sass") if code is not None else ptx_profile
    profile["ptx_loops"] = ptx_loops
    profile["ptx_hot_mma"] = ptx_profile.get("hot_mma", 0)
    # the PTX's loop nest, which nested_issue counts where ptxas restructured the SASS loops
    profile["ptx_nest"] = {k: ptx_profile[k] for k in ("instructions", "loops", "loop_mma") if k in ptx_profile}
    profile["ptx_nest"]["loop_sites"] = loop_sites(ptx_code, ptx_src)
    return _row_of(spec["name"], mod, arch, info, info["sass_mma"], ptx_mma=sorted(set(_MMA_PTX.findall(ptx))),
                   shared=k.metadata.shared, profile=profile)


def compile_triton(archs=ARCHS, kernels: set | None = None) -> list[dict]:
    """One row per compile_specs() entry per arch (Triton compile, then ptxas -v on its PTX), compiled
    in parallel worker processes (Triton's front end holds the GIL); ``kernels``: only these names."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("TRITON_INTERPRET is set: @triton.jit functions are interpreted, run without it")
    import importlib
    import multiprocessing as mp

    # a spec with "archs" compiles for those only (one whose shared memory fits only there)
    jobs = [(mod, i, arch) for mod in TRITON_MODULES for i, spec in enumerate(importlib.import_module(mod).compile_specs())
            for arch in archs if (kernels is None or spec["name"] in kernels) and arch in spec.get("archs", archs)]
    if not jobs:
        return []
    workers = max(1, min(len(jobs), os.cpu_count() or 1, 8))
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(_compile_spec, *zip(*jobs)))


# ---- output ----------------------------------------------------------------------------------------

def report(archs=ARCHS, only: str | None = None, kernels: set | None = None) -> dict:
    """The report (module docstring); ``kernels``: compile only these report names."""
    doc = {"archs": list(archs), "kernels": [], "errors": {}, "hardware": HW, "launch_us": LAUNCH_US,
           "roofline": roofline()}
    for name, fn in (("triton", compile_triton), ("csrc", compile_csrc)):
        if only and only != name:
            continue
        try:
            doc["kernels"] += fn(archs, kernels)
        except Exception as e:  # a missing toolchain is reported, not fatal: the roofline stands alone
            doc["errors"][name] = f"{type(e).__name__}: {e}"
    issue_bound(doc)
    return doc


def _print(doc: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(width=200)
    t = Table(title="GPU kernels compiled without a GPU (ptxas -v; MMA from SASS/PTX)")
    for c in ("kernel", "arch", "regs", "spill B", "stack B", "shared B", "MMA"):
        t.add_column(c, justify="left" if c in ("kernel", "MMA") else "right")
    for r in doc["kernels"]:
        spill = str(r["spill_bytes"]) if not r["spill_bytes"] else f"[red]{r['spill_bytes']}[/red]"
        t.add_row(escape(r["kernel"]), f"sm_{r['arch']}", str(r["registers"]), spill, str(r["stack_bytes"]),
                  str(r["shared_bytes"]), ",".join(r["mma_ops"]) or "no")
    con.print(t)
    for name, err in doc["errors"].items():
        con.print(f"[yellow]{name} kernels not compiled: {err}[/yellow]")
    t = Table(title="Roofline at GLM-5.2 shapes (us): bytes at bandwidth, FLOPs at the peak of the kernel's "
                    "precision (compute); floor = the max with a launch; target: at a cheaper precision")
    for c in ("kernel", "shape", "MB", "GFLOP", "compute", "PRO6000 mem", "PRO6000 compute", "PRO6000 floor",
              "H200 mem", "H200 compute", "H200 floor", "target floor H200"):
        t.add_column(c, justify="left" if c in ("kernel", "shape") else "right")
    for r in doc["roofline"]:
        a, h = r["times"]["rtx_pro_6000"], r["times"]["h200"]
        tc = "fp32_us" if r["compute"] == "fp32" else f"tc_{r['compute']}_us"
        tgt = r.get("target_floor", {}).get("h200", {}).get("floor_us")
        t.add_row(escape(r["kernel"]), r["shape"], f"{r['bytes'] / 1e6:.2f}", f"{r['flops'] / 1e9:.2f}",
                  r["compute"], f"{a['mem_us']:.2f}", f"{a[tc]:.2f}" if tc in a else "-", f"{a['floor_us']:.2f} {a['bound']}",
                  f"{h['mem_us']:.2f}", f"{h[tc]:.2f}" if tc in h else "-", f"{h['floor_us']:.2f} {h['bound']}",
                  "-" if tgt is None else f"{tgt:.2f}")
    con.print(t)
    t = Table(title="Issue-bound time at GLM-5.2 shapes (us): hot-loop SASS instructions per iteration x "
                    "iterations x warps / (SMs x 4 schedulers x clock), against the floor; issue > floor: the "
                    "kernel cannot reach its floor. waits/iter: global-load waits an iteration makes, all / exposed "
                    "(issued less than an iteration ahead: ``load_waits``); round trips: the exposed ones of the "
                    "busiest SM's CTAs (each a DRAM latency, hundreds of ns, not in the issue time)")
    for c in ("kernel", "shape", "GPU", "instr/iter", "iters/CTA", "CTAs x warps", "issue", "floor", "issue/floor",
              "reaches floor", "waits/iter", "round trips"):
        t.add_column(c, justify="left" if c in ("kernel", "shape", "GPU") else "right")
    for r in doc["roofline"]:
        for gpu, x in r.get("issue", {}).items():
            if "error" in x:
                t.add_row(escape(x["kernel"]), r["shape"], gpu, "-", "-", "-", "-", "-", "-", escape(x["error"]),
                          "-", "-")
                continue
            t.add_row(escape(x["kernel"]), r["shape"], f"{gpu} (sm_{x['arch']})", str(x["per_iter"]),
                      str(x["iters_per_cta"]), f"{x['ctas']} x {x['warps']}", f"{x['issue_us']:.2f}",
                      f"{x['floor_us']:.2f}", f"{x['ratio']:.2f}", "yes" if x["reaches_floor"] else "[red]NO[/red]",
                      f"{x['load_waits']} / {x['exposed_waits']}" if "load_waits" in x else "-",
                      str(x.get("round_trips", "-")))
    con.print(t)


def kernel_names(text: str) -> set[str]:
    """The report names of a comma-separated list; a comma inside a name's brackets is part of the name
    (``sparse_mla_decode[nvfp4_368,a4,s1]``)."""
    return set(re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(map(str, ARCHS)), help="comma-separated, default 120,90")
    ap.add_argument("--only", choices=("triton", "csrc", "none"), default=None,
                    help="compile only one family (none: the roofline alone)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON (- for stdout)")
    ap.add_argument("--kernels", default=None, help="compile only these comma-separated report names "
                    "(e.g. sparse_mla_decode[nvfp4_368],records.cu:encode_kernel)")
    a = ap.parse_args(argv)
    archs = tuple(int(x) for x in a.archs.split(",") if x.strip())
    doc = report(archs, a.only, None if a.kernels is None else kernel_names(a.kernels))
    if a.json == "-":
        print(json.dumps(doc, indent=1))
    else:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)
        _print(doc)
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # must precede importing triton: compile real GPU code
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)
    sys.exit(main())
