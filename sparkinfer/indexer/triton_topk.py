"""The indexer's top-k over int64 selection keys in one Triton launch: a radix select per row.

``topk_keys(work, k, out, cand)`` writes the k largest keys of every row of ``work`` int64 [M, N]
into ``out`` int64 [M, k], largest first: bit for bit ``torch.topk(work, k, sorted=True).values``,
since the keys of a row are distinct (``topk.pack_keys``; only INT64_MIN, "nothing", repeats, and
topk fills a row with fewer than k keys above it with INT64_MIN, as this does).

One program per row, in three steps over the row in global memory:

1. Radix select, 8 bits a level from the top: a histogram of the next byte of the keys whose higher
   bits equal the prefix chosen so far gives the byte of the k-th largest key and how many keys lie
   strictly above it. The keys at a prefix are a range of int64, lo .. hi (lo the least of them), so
   a key is at it by one unsigned compare of its offset from the range's first key, and its byte is
   its offset from lo shifted (no mask: the offset is below 256 << shift); at the top level lo is
   INT64_MIN and the offset flips the sign bit, so the top byte orders as unsigned. Comparing the
   final lo with a key compares prefixes (a 2026-12-07 form: two fewer 64-bit shifts and four fewer
   predicates a key than the shifted prefixes it replaced, the same bytes).
2. The levels stop as soon as every key at or above the chosen prefix fits the candidate buffer
   (``cand``, CAP columns): then those keys hold the top k whatever the lower bits. Real scores
   spread over the top 16 bits (sign, exponent, 7 mantissa bits), so at GLM-5.2's k = 2,048 and a
   2k buffer a row typically takes two histogram passes, not eight (a host replay of the levels
   on packed normal and relu-sum scores at N = 18,432, 67,584 and 131,072: 1 or 2; 3 or 4 with a
   buffer of k). At the last level the prefix is the whole key: the k-th largest itself.
   INT64_MIN is never counted nor collected (it is the padding): a row of fewer than k other keys
   finds no byte at the first level, takes them all and pads the output with INT64_MIN.
3. One more pass compacts those keys into ``cand`` (a block's in-order cumsum gives each its slot),
   then the CTA loads them, sorts SORT = next_pow2(CAP) of them descending (``sort_desc``, INT64_MIN
   filling) and stores the first k into ``out``. ``out`` may be ``cand[:, :k]``: the sorted block is
   in registers before the store. Unsorted (``sorted=False``, a tiled call's passes but the last):
   CAP = k, so the levels stop exactly at the k-th key (3 or 4 levels in the replay above), the k
   keys are compacted straight into ``out`` and no sort runs: the 4,096-key sort is most of the
   kernel's instructions (about 15K of the 17K PTX lines).

Reads per row: (levels + 1) x N x 8 bytes (levels = 8 at most); the row stays in L2 across the
passes when the CTAs in flight hold fewer rows than L2 does. Any k <= N (k need not be a power of
two: the sort block is padded); no allocation, no host read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys a scan step loads: 16 int64 a thread in flight, so that one CTA per row keeps enough loads
# outstanding when a decode step has fewer rows than SMs (not yet timed on a GPU; 1,024 to 4,096
# compile to the same 128 registers, no spills: the 4,096-key sort sets them).
BLOCK = 4096
NUM_WARPS = 8
NUM_STAGES = 1  # the scan loops are not software-pipelined at any num_stages (no cp.async in the PTX)
_MIN = tl.constexpr(-9223372036854775808)  # INT64_MIN: "nothing" (topk._NONE)
# consecutive int64 a thread holds of a sort's load (``sort_desc``): Triton's layout for the paged top-k's
# 2,048-key loads on sm_90 (4 warps) and sm_120 (8 warps), read in the TTGIR (2026-12-07)
SORT_VEC = tl.constexpr(4)


@triton.jit
def _topk_keys_kernel(work_ptr, out_ptr, cand_ptr, N, K, CAP, s_work, s_out, s_cand,
                      BLOCK: tl.constexpr, SORT: tl.constexpr, SORTED: tl.constexpr, THREADS: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    select_row(work_ptr + m * s_work, N, K, CAP, cand_ptr + m * s_cand, out_ptr + m * s_out, BLOCK, SORT, SORTED,
               False, THREADS)


@triton.jit
def select_row(row, N, K, CAP, cand, out, BLOCK: tl.constexpr, SORT: tl.constexpr, SORTED: tl.constexpr,
               IDS: tl.constexpr, THREADS: tl.constexpr):
    """The k largest of the N keys at ``row`` into ``out`` (the module docstring's three steps), in
    one program: ``_topk_keys_kernel``'s row, and the paged top-k's running selection
    (``triton_paged``), which selects a row's head in place (``out`` = ``cand`` = ``row``, unsorted:
    a key is compacted to a column at or before its own, already read). ``IDS`` (sorted only): ``out``
    is int32 and takes the keys' token ids, -1 for INT64_MIN (``key_ids``), not the keys. ``THREADS``:
    32 x the launch's warps (``sort_desc``)."""
    bins = tl.arange(0, 256)
    lanes = tl.arange(0, BLOCK)
    ones = tl.full((), -1, tl.int64).to(tl.uint64, bitcast=True)  # 2**64 - 1
    shift = tl.full((), 56, tl.int64)  # the level's byte: bits shift .. shift + 7
    lo = tl.full((), _MIN, tl.int64)  # the least key at the prefix chosen so far (every key at the top level)
    above = tl.full((), 0, tl.int32)  # keys whose prefix is strictly greater
    need = tl.full((), 0, tl.int32) + K  # the k-th largest's rank among the keys at the prefix
    done = tl.full((), 0, tl.int32)
    while done == 0:
        # the keys at the prefix are lo .. hi (as unsigned offsets from lo, a byte's value is the level's
        # digit: at the top level lo is INT64_MIN, so the offset flips the sign bit); INT64_MIN is never
        # one of them (first: lo but INT64_MIN), nor a column past N (loaded as INT64_MIN)
        lo_u = lo.to(tl.uint64, bitcast=True)
        sh_u = shift.to(tl.uint64)
        first_u = tl.maximum(lo, _MIN + 1).to(tl.uint64, bitcast=True)
        span_u = lo_u + (ones >> (56 - sh_u)) - first_u  # hi - first
        hist = tl.zeros([256], tl.int32)
        for c0 in range(0, N, BLOCK):
            cols = c0 + lanes
            key = tl.load(row + cols, mask=cols < N, other=_MIN).to(tl.uint64, bitcast=True)
            digit = ((key - lo_u) >> sh_u).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=key - first_u <= span_u)
        at_or_above = tl.cumsum(hist, 0, reverse=True)
        byte = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
        here = tl.sum(tl.where(bins == byte, hist, 0), 0)
        higher = tl.sum(tl.where(bins == byte, at_or_above, 0), 0) - here
        above += higher
        need -= higher
        # the k-th largest's byte (none at the top level when fewer than k keys are real: lo stays
        # INT64_MIN and they are all taken)
        lo = (lo_u + (tl.maximum(byte, 0).to(tl.uint64) << sh_u)).to(tl.int64, bitcast=True)
        # every key at or above the prefix fits the buffer (always at the last level, where the
        # prefix is the k-th largest key itself and the keys above it number k - 1)
        done = ((above + here <= CAP) | (shift == 0)).to(tl.int32)
        shift = tl.where(done != 0, shift, shift - 8)
    count = tl.full((), 0, tl.int32)
    first = tl.maximum(lo, _MIN + 1)  # the keys at or above the prefix: key >= first
    for c0 in range(0, N, BLOCK):
        cols = c0 + lanes
        key = tl.load(row + cols, mask=cols < N, other=_MIN)
        take = key >= first
        slot = count + tl.cumsum(take.to(tl.int32), 0) - 1
        # slot < CAP holds for distinct keys; the bound keeps keys against the contract (repeats) in the row
        tl.store(cand + slot, key, mask=take & (slot < CAP))
        count += tl.sum(take.to(tl.int32), 0)
    if SORTED:
        tl.debug_barrier()  # the compacted keys are visible to the whole CTA
        i = tl.arange(0, SORT)
        best = sort_desc(tl.load(cand + i, mask=(i < count) & (i < CAP), other=_MIN), THREADS)
        tl.debug_barrier()  # every thread has loaded cand before out (possibly cand's head) is written
        if IDS:
            tl.store(out + i, key_ids(best), mask=i < K)
        else:
            tl.store(out + i, best, mask=i < K)
    else:  # cand is out and CAP = K: the k keys are in place, in scan order; pad a short row
        for i0 in range(0, K, BLOCK):
            i = i0 + lanes
            tl.store(out + i, tl.full([BLOCK], _MIN, tl.int64), mask=(i >= count) & (i < K))


@triton.jit
def sort_desc(x, THREADS: tl.constexpr):
    """``x`` [n] sorted descending (``tl.sort``, a bitonic sort over the index bits), its elements taken
    in another order first, which does not change the result. A compare-and-swap stage along an index
    bit held in a thread's registers costs a compare and a select; along a lane's bit, two shuffles
    and the int64 repacked besides; along a warp's, a trip through shared memory; and the low bits
    take the most stages (bit b: log2(n) - b of them). The load gives each of the ``THREADS`` threads
    ``SORT_VEC`` consecutive keys a repeat, the repeats at the top bits: read as [repeats, threads,
    SORT_VEC] and transposed, a thread's keys are consecutive (the low bits), the lanes' bits above
    and the warps' at the top (sm_90, 4 warps, 2,048 keys: the sort 9,031 -> 6,871 PTX a warp). The
    layout is Triton's choice: another one sorts the same, in more instructions."""
    if x.shape[0] >= 2 * SORT_VEC * THREADS:
        x = tl.reshape(tl.permute(tl.reshape(x, [x.shape[0] // (SORT_VEC * THREADS), THREADS, SORT_VEC]), (1, 0, 2)),
                       [x.shape[0]])
    return tl.sort(x, 0, descending=True)


@triton.jit
def key_ids(keys):
    """int32 token ids of int64 selection keys, -1 for INT64_MIN (``topk.unpack_keys``' rule: the key's
    low word 2**32 - 1 - id, narrowed to int32, is -1 - id, and 0 at INT64_MIN; its complement is the
    id, or -1)."""
    return (~keys).to(tl.int32)


def topk_keys(work: torch.Tensor, k: int, out: torch.Tensor, cand: torch.Tensor | None = None,
              sorted: bool = True) -> torch.Tensor:
    """The k largest keys of each row of ``work`` int64 [M, N] (N >= k, unit column stride), largest
    first, into ``out`` int64 [M, k] (unit column stride); ``cand`` int64 [M, CAP >= k] the candidate
    buffer (default ``out`` itself; ``out`` may be ``cand[:, :k]``; a wider one stops the radix levels
    earlier, module docstring). ``sorted=False``: the same keys in scan order, no sort (``cand`` is
    not used: the levels run down to the k-th key exactly and the keys go straight to ``out``), for
    a running top-k whose order nothing reads. One launch; returns ``out``."""
    m, n = work.shape
    cand = out if cand is None or not sorted else cand
    cap = cand.shape[1]
    if not (1 <= k <= n and cap >= k and out.shape == (m, k) and cand.shape[0] == m):
        raise ValueError(f"topk_keys needs 1 <= k <= N and out [M, k], cand [M, >= k]: work {tuple(work.shape)}, "
                         f"k {k}, out {tuple(out.shape)}, cand {tuple(cand.shape)}")
    if any(t.dtype != torch.int64 or t.stride(1) != 1 for t in (work, out, cand)):
        raise ValueError("work, out and cand must be int64 with unit column stride")
    if m:
        _topk_keys_kernel[(m,)](work, out, cand, n, k, cap, work.stride(0), out.stride(0), cand.stride(0),
                                BLOCK=BLOCK, SORT=triton.next_power_of_2(cap), SORTED=sorted, THREADS=32 * NUM_WARPS,
                                num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def compile_specs(k: int = 2048) -> list[dict]:
    """The launches ``tiled.indexer_topk_rows`` makes in the engine (GLM-5.2's k = 2,048), as
    kernel_report.py reads them: name, fn, signature, constexprs, num_warps, num_stages. A pass's
    unsorted running top-k (CAP = k), the last pass's sorted one (a candidate buffer of 2k: SORT
    4,096; the sharded merge's sorted one into its output, SORT 2,048, is the same code smaller)."""
    specs = []
    for name, sort, is_sorted in (("topk_keys", 2 * k, True), ("topk_keys_unsorted", 1, False)):
        constexprs = {"BLOCK": BLOCK, "SORT": triton.next_power_of_2(sort), "SORTED": is_sorted,
                      "THREADS": 32 * NUM_WARPS}
        sig = {n: "*i64" if n.endswith("_ptr") else "i32" for n in _topk_keys_kernel.arg_names if n not in constexprs}
        sig.update({n: "constexpr" for n in constexprs})
        specs.append({"name": f"{name}[k{k}]", "fn": _topk_keys_kernel, "signature": sig, "constexprs": constexprs,
                      "num_warps": NUM_WARPS, "num_stages": NUM_STAGES})
    return specs
