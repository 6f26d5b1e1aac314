"""Time each GPU kernel at the kernel report's roofline shapes and divide its floor by the time.

    python benchmarks/device/kernel_timing.py --json kernel_timing.json          # on a GPU
    python benchmarks/device/kernel_timing.py --smoke --json /tmp/kt.json        # CPU: tiny shapes

The shapes, bytes, FLOPs and floors are those of ``benchmarks/kernel_report.py`` (``roofline()``:
GLM-5.2 at the main profile). On a GPU each kernel runs through its public entry point (the
sparse-MLA and indexer wrappers and the tiled indexer top-k ``indexer_topk_rows`` with the Triton
backend and no host-side checks, the pack moves of ``sparkinfer.comm.pack``, the MTP union, the
record codecs) on random inputs (the timing does not depend on the values: random record bytes
may decode to NaN), timed with ``triton.testing.do_bench``
(median; L2 flushed before each call). Per row: ``measured_us``, the floor of this GPU (the H200's
figures unless the device is an RTX PRO 6000), ``frac_of_floor`` = floor / measured (1.0 = at the
roofline), and the tensor-core target floor where the kernel has one.

Then the engine's hot kernels as its forward launches them today (``engine_rows``: the fused decode
through ``layer_buffers.attend_in_blocks``, the paged top-k, ``native.write_paged``, the q
quantization into preallocated buffers) at the shapes of issue 33: selected main, stock DCP4, batch
1; 4 / 16 / 64 rows; 8K and 64K tokens per request. Every timed row is also captured in a CUDA
graph and replayed (``graph_us``), and ``nvidia-smi`` samples the SM and memory clocks every 100 ms
in the background (``clocks`` per row and for the run: a row timed at a low clock reads slow).
``--warm`` calls each case once at full shape (Triton's compiles, cached for the timed run: the
lease's warm stage). ``--smoke`` runs the same code at tiny shapes on the CPU (Triton interpreter,
host twins), so the script is tested without a GPU; its times mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report_module():
    spec = importlib.util.spec_from_file_location("kernel_report", os.path.join(REPO, "benchmarks/kernel_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _timer(device, smoke: bool):
    if smoke:  # one call: the interpreter is slow and these times mean nothing
        def run(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        return run
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def _graph_time(fn) -> float:
    """Median us of ``fn`` captured in a CUDA graph and replayed: the GPU's time without the host's
    launch overhead (a Triton launch costs tens of us of Python; vLLM runs the sparkinfer layers
    outside its graphs, so the eager number is what a step pays today, this one what the kernels
    cost). Raises what the capture raises (a host read or a sync inside ``fn``)."""
    import torch
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture wants
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3


def _mla_indices(p, pool, g, smoke):
    """int32 [M, listed] indices into a pool of records: K valid per row, the rest -1 at random places
    (other ranks' tokens on the stock DCP path)."""
    import torch

    m, listed, k = (2, 32, 32 * p["K"] // p["listed"]) if smoke else (p["M"], p["listed"], p["K"])
    idx = torch.randint(0, pool, (m, k), generator=g, dtype=torch.int32)
    if not smoke and p["gathered"] < m * k:  # each request's 4 rows draw from one union of U records
        per = p["gathered"] // (m // 4)
        unions = torch.stack([torch.randperm(pool, generator=g)[:per] for _ in range(m // 4)])
        idx = unions.repeat_interleave(4, 0).gather(1, torch.randint(0, per, (m, k), generator=g)).to(torch.int32)
    full = torch.full((m, listed), -1, dtype=torch.int32)
    at = torch.rand(m, listed, generator=g).argsort(1)[:, :k].sort(1).values
    return full.scatter_(1, at, idx)


def _mla_inputs(row, dev, smoke):
    """(fmt, q_nope, q_rope, records, indices int32 [M, listed]) of a decode row: random record bytes
    in a pool of 65,536 (the time does not depend on the values)."""
    import torch

    from sparkinfer.formats import get_format

    p = row["params"]
    m, h = (2, 16) if smoke else (p["M"], p["H"])
    pool = 256 if smoke else 65536
    g = torch.Generator(device="cpu").manual_seed(0)
    q_nope = torch.randn(m, h, 512, generator=g).to(dev, torch.bfloat16)
    q_rope = torch.randn(m, h, 64, generator=g).to(dev, torch.bfloat16)
    records = torch.randint(0, 256, (pool, p["record"]), generator=g, dtype=torch.uint8).to(dev)
    return get_format(str(p["record"])), q_nope, q_rope, records, _mla_indices(p, pool, g, smoke).to(dev)


def _mla_case(row, dev, smoke):
    from sparkinfer.attention import sparse_mla_decode

    fmt, q_nope, q_rope, records, idx = _mla_inputs(row, dev, smoke)
    return lambda: sparse_mla_decode(q_nope, q_rope, records, fmt, idx, 0.04, backend="triton",
                                     check_indices=False)


def _union_decode_case(row, dev, smoke):
    """``sparse_mla_union_decode``: B requests, each a union of U records from a pool, each of its R
    rows keeping K of them (its row mask, ``plan.union.union_row_masks``); one launch."""
    import torch

    from sparkinfer.attention.triton_union_decode import sparse_mla_union_decode
    from sparkinfer.core.layouts import layout
    from sparkinfer.plan.union import union_row_masks

    p = row["params"]
    b, r, h, u, k = (2, 2, 4, 40, 16) if smoke else (p["B"], p["R"], p["H"], p["U"], p["K"])
    pool = 256 if smoke else 65536
    g = torch.Generator(device="cpu").manual_seed(0)
    q_nope = torch.randn(b * r, h, 512, generator=g).to(dev, torch.bfloat16)
    q_rope = torch.randn(b * r, h, 64, generator=g).to(dev, torch.bfloat16)
    records = torch.randint(0, 256, (pool, p["record"]), generator=g, dtype=torch.uint8).to(dev)
    union = torch.stack([torch.randperm(pool, generator=g)[:u] for _ in range(b)]).to(dev)
    union_len = torch.full((b,), u, dtype=torch.int32, device=dev)
    remap = torch.rand(b, r, u, generator=g).argsort(-1)[..., :k].to(torch.int32)
    mask = union_row_masks(remap, u).to(dev)
    lay = layout(str(p["record"]))
    return lambda: sparse_mla_union_decode(q_nope, q_rope, records, lay, union, union_len, mask, r, 0.04)


def _indexer_inputs(row, dev, smoke):
    import torch

    p = row["params"]
    m, t = (2, 256) if smoke else (p["M"], p["T"])
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(m, p["heads"], p["dim"], generator=g).to(dev, torch.bfloat16)  # the engine's dtype
    w = torch.rand(m, p["heads"], generator=g).to(dev)
    records = torch.randint(0, 256, (t, 132), generator=g, dtype=torch.uint8).to(dev)
    records[:, 128:] = 0  # a zero fp32 key scale: finite scores whatever the fp8 bytes
    pos = torch.full((m,), t - 1, dtype=torch.int64, device=dev)
    slots = torch.arange(t, dtype=torch.int64, device=dev)
    return q, w, records, pos, slots


def _indexer_case(row, dev, smoke):
    from sparkinfer.indexer import indexer_scores

    q, w, records, pos, slots = _indexer_inputs(row, dev, smoke)
    return lambda: indexer_scores(q, w, records, pos, slots, backend="triton", check_values=False)


def _indexer_tiled_case(row, dev, smoke):
    """``indexer_topk_rows``: every row over the whole context through cache slots, top-k (smoke: 16)."""
    from sparkinfer.indexer.tiled import indexer_topk_rows, one_list

    q, w, records, pos, slots = _indexer_inputs(row, dev, smoke)
    k = 16 if smoke else row["params"]["K"]
    rows = one_list(q.shape[0], records.shape[0], dev)
    return lambda: indexer_topk_rows(q, w, records, pos, k, **rows, token_slots=slots, backend="triton",
                                     check_values=False)


def _move_case(row, dev, smoke):
    import torch

    from sparkinfer.comm import pack as P

    p = row["params"]
    n, cap, width, layers = (min(p["records"], 10), 64, p["width"], 2) if smoke else (
        p["records"], p["capacity"], p["width"], p["layers"])
    block, blocks = 64, (4 if smoke else 2048)  # 2048 blocks x 64 = 131,072 rows per layer (one rank's shard)
    g = torch.Generator(device="cpu").manual_seed(2)
    cache = [torch.randint(0, 256, (blocks, block, width), generator=g, dtype=torch.uint8).to(dev)
             for _ in range(layers)]
    reqs = 16 if not smoke else 2
    bt = torch.randperm(blocks, generator=g)[: reqs * (blocks // reqs)].view(reqs, -1).to(torch.int32).to(dev)
    shard = P.Shard(cache, bt.contiguous(), block)
    lay = torch.arange(layers, dtype=torch.int32, device=dev)
    req = torch.randint(0, reqs, (cap,), generator=g, dtype=torch.int32).to(dev)
    local = torch.randint(0, (blocks // reqs) * block, (cap,), generator=g, dtype=torch.int32).to(dev)
    slot = torch.randperm(cap, generator=g).to(torch.int32).to(dev)
    count = torch.tensor(n, dtype=torch.int32, device=dev)
    region = torch.zeros(layers * cap * width, dtype=torch.uint8, device=dev)
    ws = torch.zeros(layers, cap, width, dtype=torch.uint8, device=dev)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    if row["kernel"] == "pack":
        return lambda: P.pack(shard, lay, req, local, count, cap, region, err=err)
    if row["kernel"] == "unpack":
        return lambda: P.unpack(region, layers, count, cap, slot, ws, err=err)
    return lambda: P.direct(shard, lay, req, local, slot, count, cap, ws, err=err)


def _union_case(row, dev, smoke):
    import torch

    from sparkinfer.plan.union import mtp_union

    p = row["params"]
    b, r, k = (2, 4, 32) if smoke else (p["B"], p["R"], p["K"])
    topk = torch.randint(0, 4 * k, (b, r, k), dtype=torch.int32, device=dev)
    return lambda: mtp_union(topk, validate=False)


def _records_case(row, dev, smoke):
    import torch

    from sparkinfer.formats import get_format, native

    fmt = get_format("368")
    n = 16 if smoke else (row["params"].get("tokens") or row["params"]["records"])
    latent = torch.randn(n, 512, device=dev)
    rope = torch.randn(n, 64, device=dev)
    cache = torch.zeros(n, 368, dtype=torch.uint8, device=dev)
    slots = torch.randperm(n, device=dev)
    if row["kernel"].startswith("records_encode"):
        return lambda: native.encode(fmt, latent, rope, cache, slots)
    native.encode(fmt, latent, rope, cache, slots)
    return lambda: native.gather(fmt, cache, slots)


# ---- the engine's hot kernels as its forward launches them (``engine_rows``) ------------------------
ENGINE_PAGED_ROWS, ENGINE_CONTEXTS = (4, 16, 64), (8192, 65536)  # 1 / 4 / 16 requests x 4 MTP rows


def engine_rows(kr) -> list[dict]:
    """The rows of the kernels a decode step launches today, at the shapes issue 33 names: the fused
    decode (``layer_buffers.attend_in_blocks`` over an arena: compaction, split-K and the ticketed
    merge in one launch) at the selected main shape, stock DCP4 and batch 1 (kernel_report's rows:
    its floors), at the first also with its record loads synchronous and with them pipelined in one
    buffer (``_with_stages``: what the pipeline and its second buffer each gain); the
    paged top-k (``triton_paged.paged_topk_rows``, fp8 q, the engine's tile and
    workspace) for 4 / 16 / 64 rows (1 / 4 / 16 requests x 4 rows) at 8K and 64K tokens per request
    and for a prefill block of 64 rows at 128K (floor: the scorer's, ``kernel_report._indexer`` over
    the same keys); the cache write
    (``native.write_paged``, bf16 rows) and the indexer's q quantization (``group_quant_fp8`` into
    preallocated buffers) for 4 / 16 / 64 rows (the report's main-profile rows, bytes scaled by rows)."""
    roof = kr.roofline()
    main = {(r["kernel"], r["shape"].split(":")[0]): r for r in roof}
    one = {r["kernel"]: r for r in roof}  # the kernels with one row (the main profile's 16 x 4 rows)
    rows = []
    for label, key in (("selected main: 16 req x 4 rows, 16 heads/rank, top-2048", "selected"),
                       ("stock DCP4: 16 req x 4 rows, 64 heads, 512 of 2048 listed", "stock DCP4"),
                       ("batch 1: 4 rows, 16 heads/rank, top-2048", "batch 1")):
        r = dict(main[("sparse_mla_decode[nvfp4_368]", key)], kernel="fused_decode[nvfp4_368]", shape=label)
        rows.append(dict(r, engine="decode"))
        if key == "selected":  # the same launch with fewer pipeline stages: the pipelining's A/B (two more
            for loads in LOADS:  # compiles for the lease's warm-up: at the main shape only)
                rows.append(dict(r, kernel=f"fused_decode[nvfp4_368,{loads}]", engine="decode", loads=loads))
    mb = kr.B * kr.R
    for m in ENGINE_PAGED_ROWS:
        for t in ENGINE_CONTEXTS:
            r = kr._indexer(kr.R, (m // kr.R) * t, "")
            rows.append(dict(r, kernel="paged_topk[k2048]", engine="paged_topk",
                             shape=f"{m // kr.R} req x {kr.R} rows at {t // 1024}K (one launch)",
                             params={"M": m, "T": t, "K": kr.K, "heads": kr.INDEX_HEADS, "dim": kr.INDEX_DIM}))
    # a prefill chunk's 64-row block at 128K through the pages, which the engine no longer takes there
    # (``core.indexer_tiles.scores_lists``): 32 of these against the roofline's tiled 2,048-row chunk
    from sparkinfer.core.indexer_tiles import INDEXER_ROWS

    r, t = INDEXER_ROWS, 131072
    rows.append(dict(kr._indexer(r, t, ""), kernel="paged_topk[k2048]", engine="paged_topk",
                     shape=f"a prefill block: {r} rows of one request at {t // 1024}K (one launch)",
                     params={"M": r, "T": t, "K": kr.K, "heads": kr.INDEX_HEADS, "dim": kr.INDEX_DIM,
                             "rows_per_req": r}))
    for m in ENGINE_PAGED_ROWS:
        for name, kernel, engine in (("records_write_paged[nvfp4_368]", "write_paged[nvfp4_368]", "write"),
                                     ("indexer_q_quant", "q_quant[fp8]", "q_quant")):
            base = one[name]
            rows.append(kr._row(kernel, f"{m} rows ({m // kr.R} req x {kr.R})", {"rows": m},
                                base["bytes"] * m / mb, 0, "none", base["expect"]) | {"engine": engine})
    return rows


# The decode's record loads as the A/B rows launch them (their kernel tag: ``triton_decode.NUM_STAGES`` for
# the call). 1: synchronous loads; 3: pipelined into one buffer, so each tile's copies are issued at the end
# of the iteration before and waited for at its top (``triton_decode.NUM_STAGES``' comment).
LOADS = {"sync loads": 1, "one buffer": 3}


def _with_stages(fn, stages):
    """``fn`` with the decode's ``triton_decode.NUM_STAGES`` = ``stages`` for the call (the wrapper reads it
    at each launch; Triton compiles that variant once), the launch otherwise the same: what pipelining the
    record loads gains, timed on the same GPU in the same run."""
    from sparkinfer.attention import triton_decode as td

    def call():
        saved, td.NUM_STAGES = td.NUM_STAGES, stages
        try:
            return fn()
        finally:
            td.NUM_STAGES = saved
    return call


def _engine_decode_case(row, dev, smoke):
    """The fused decode as ``attend_in_blocks`` launches it: the arena's views, one plan (made by the
    first call), the selected path's int32 workspace slots or the stock path's int64 cache rows, each
    row's valid ones first where the row says so (``compacted``: ``triton_paging.topk_rows(compact=True)``)."""
    import torch

    from sparkinfer.decode.layer_buffers import AttentionArena, attend_in_blocks

    fmt, q_nope, q_rope, records, idx = _mla_inputs(row, dev, smoke)
    if row["params"]["listed_bytes"] == 8:
        idx = idx.long()
    compacted = row["params"].get("compacted", False)
    if compacted:  # a stable sort of each row by "is -1"
        idx = idx.gather(1, torch.sort((idx < 0).to(torch.int8), dim=1, stable=True).indices)
    arena, plans = AttentionArena(dev), {}
    return lambda: attend_in_blocks(arena, q_nope, q_rope, fmt, 0.04, idx.shape[1], lambda a, b, _: (records, idx[a:b]),
                                    plans, compacted=compacted)


def _engine_paged_case(row, dev, smoke):
    """The paged top-k as ``run_indexer`` launches it: fp8 q and folded weights, each request's pages
    through a permuted block table, rows at the request's last positions (4 MTP rows, or a prefill block's), the engine's tile and a
    workspace made beforehand (``engine_workspace_bytes``), int32 ids out."""
    import torch

    from sparkinfer.core.indexer_tiles import engine_workspace_bytes, paged_tile
    from sparkinfer.formats import get_format
    from sparkinfer.indexer import TopkWorkspace
    from sparkinfer.indexer.triton_paged import paged_topk_rows
    from sparkinfer.indexer.triton_quant import group_quant_fp8

    p = row["params"]
    m, t, k, hi = (4, 64, 16, 2) if smoke else (p["M"], p["T"], p["K"], p["heads"])
    r = min(p.get("rows_per_req", 4), m)  # a decode request's 4 MTP rows, or a prefill block's
    b, bs = m // r, 64
    g = torch.Generator(device="cpu").manual_seed(3)
    per = -(-(t + 1) // bs)
    table = (torch.randperm(b * per, generator=g) + 1).view(b, per).to(torch.int32).to(dev)
    gd = torch.Generator(device=dev).manual_seed(3)  # 1M keys at 16 x 64K: made on the device
    keys = get_format("indexer_fp8").encode(torch.randn((b * per + 1) * bs, 128, generator=gd, device=dev))
    cache = keys.view(-1, bs, 132)
    q8, scales = group_quant_fp8(torch.randn(m * hi, 128, generator=g).to(dev, torch.bfloat16), 128, True)
    w = (torch.rand(m, hi, generator=g).to(dev) * scales.view(m, hi)).contiguous()
    q8 = q8.view(m, hi, 128)
    req = torch.arange(b, device=dev).repeat_interleave(r)
    pos = (t - r + torch.arange(r, device=dev)).repeat(b)
    tile = paged_tile(t + 4)
    ws = TopkWorkspace(engine_workspace_bytes(m, k, t + 4), dev)
    out = torch.empty(m, k, dtype=torch.int32, device=dev)
    return lambda: paged_topk_rows(q8, w, cache, table, req, pos, k, tile=tile, workspace=ws, out=out)


def _engine_small_case(row, dev, smoke):
    """The cache write (``native.write_paged``: bf16 rows of a step into the paged cache, the checks'
    words) or the indexer's q quantization (``group_quant_fp8`` into buffers made beforehand)."""
    import torch

    from sparkinfer.decode.device_checks import DeviceChecks
    from sparkinfer.decode.paged_sparse_mla import NULL_BLOCK
    from sparkinfer.formats import get_format, native
    from sparkinfer.indexer.triton_quant import group_quant_fp8

    m = 1 if smoke else row["params"]["rows"]
    g = torch.Generator(device="cpu").manual_seed(4)
    if row["engine"] == "q_quant":
        x = torch.randn(m * 32, 128, generator=g).to(dev, torch.bfloat16)
        q, s = torch.empty(m * 32, 128, dtype=torch.float8_e4m3fn, device=dev), torch.empty(m * 32, 1, device=dev)
        return lambda: group_quant_fp8(x, 128, True, out=(q, s))
    fmt = get_format("nvfp4_368")
    blocks = 64 if smoke else 4096
    cache = torch.zeros(blocks, 64, 368, dtype=torch.uint8, device=dev)
    slots = (torch.randperm((blocks - 1) * 64, generator=g)[:m] + 64).to(dev)
    latent = torch.randn(m, 512, generator=g).to(dev, torch.bfloat16)
    rope = torch.randn(m, 64, generator=g).to(dev, torch.bfloat16)
    checks = DeviceChecks(dev)
    words = checks.word("record_values"), checks.word("cache_slots")
    return lambda: native.write_paged(fmt, latent, rope, cache, slots, NULL_BLOCK, *words)


def _case(row, dev, smoke):
    """A callable running the row's kernel at its shape, or (None, why not)."""
    name = row["kernel"]
    engine = row.get("engine")
    if engine == "decode":
        fn = _engine_decode_case(row, dev, smoke)
        return (_with_stages(fn, LOADS[row["loads"]]) if "loads" in row else fn), None
    if engine == "paged_topk":
        return _engine_paged_case(row, dev, smoke), None
    if engine in ("write", "q_quant"):
        return _engine_small_case(row, dev, smoke), None
    if name.startswith("sparse_mla_decode"):
        return _mla_case(row, dev, smoke), None
    if name.startswith("sparse_mla_union_decode"):
        return _union_decode_case(row, dev, smoke), None
    if name == "indexer_scores":
        return _indexer_case(row, dev, smoke), None
    if name == "indexer_topk_rows":
        return _indexer_tiled_case(row, dev, smoke), None
    if name in ("pack", "unpack", "direct"):
        return _move_case(row, dev, smoke), None
    if name == "union":
        return _union_case(row, dev, smoke), None
    if name.startswith("records_write_paged"):  # the engine's write at the row's tokens (was timed as a gather)
        return _engine_small_case({**row, "engine": "write", "params": {"rows": row["params"]["tokens"]}}, dev,
                                  smoke), None
    if name.startswith("records_"):
        return _records_case(row, dev, smoke), None
    return None, "no case of its own: its engine row below, or inside the whole step (graph_step)"


class Clocks:
    """The GPU's SM and memory clocks while the rows run: ``nvidia-smi`` queried every 100 ms in the
    background (a read-only query), the samples of each row's window attached to it (``of``)."""

    QUERY = "clocks.sm,clocks.mem,temperature.gpu,power.draw"

    def __init__(self, enabled: bool):
        import shutil
        import subprocess
        import threading

        self.samples: list = []
        self.proc = None
        if not enabled or not shutil.which("nvidia-smi"):
            return
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                      "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def read():
            for line in self.proc.stdout:
                try:
                    self.samples.append((time.time(), *(float(v) for v in line.split(","))))
                except ValueError:  # "[N/A]" or a partial line
                    pass
        threading.Thread(target=read, daemon=True).start()

    def of(self, t0: float, t1: float) -> dict | None:
        """{sm_mhz, mem_mhz: [min, median, max], temp_c, power_w: max} of the samples in [t0, t1]."""
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return None
        col = list(zip(*got))

        def spread(v):
            v = sorted(v)
            return [v[0], v[len(v) // 2], v[-1]]
        return {"sm_mhz": spread(col[1]), "mem_mhz": spread(col[2]), "temp_c": max(col[3]), "power_w": max(col[4]),
                "samples": len(got)}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()


def run(smoke: bool = False, only: str | None = None, warm: bool = False) -> dict:
    import torch

    kr = _report_module()
    dev = torch.device("cpu" if smoke else "cuda")
    name = "cpu (smoke)" if smoke else torch.cuda.get_device_name(dev)
    gpu = "rtx_pro_6000" if "RTX PRO 6000" in name else "h200"
    timer = _timer(dev, smoke or warm)
    clocks = Clocks(not smoke and not warm)
    start = time.time()
    out = []
    try:
        for row in kr.roofline() + engine_rows(kr):
            if only and only not in row["kernel"]:
                continue
            out.append(_time_row(row, dev, smoke, gpu, timer, clocks, capture=not (smoke or warm)))
    finally:
        clocks.close()
    doc = {"device": name, "figures": gpu, "smoke": smoke, "rows": out}
    if not smoke and gpu == "h200" and "H200" not in name:  # an H100's 3.35 TB/s: every memory floor ~1.4x longer
        doc["figures_note"] = f"floors are the H200's, the device is {name}"
    if clocks.proc is not None:
        doc["clocks"] = clocks.of(start, time.time())
    return doc


def _time_row(row, dev, smoke, gpu, timer, clocks, capture: bool) -> dict:
    t0 = time.time()
    rec = {"kernel": row["kernel"], "shape": row["shape"], "params": row["params"],
           "floor_us": row["times"][gpu]["floor_us"], "bound": row["times"][gpu]["bound"], "expect": row["expect"]}
    for key in ("engine", "loads"):
        if key in row:
            rec[key] = row[key]
    if "target_floor" in row:
        rec["target_floor_us"] = row["target_floor"][gpu]["floor_us"]
    try:
        fn, why = _case(row, dev, smoke)
        if fn is None:
            rec["note"] = why
        else:
            us = timer(fn)
            rec.update(measured_us=round(us, 2), frac_of_floor=float(f"{rec['floor_us'] / us:.3g}"))
            if "target_floor_us" in rec:
                rec["frac_of_target"] = float(f"{rec['target_floor_us'] / us:.3g}")
            if capture:
                try:
                    rec["graph_us"] = round(_graph_time(fn), 2)
                except Exception as e:  # the finding: this call cannot be captured
                    rec["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    except Exception as e:  # one kernel failing must not hide the others' numbers
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    clk = clocks.of(t0, time.time())
    if clk:
        rec["clocks"] = clk
    print(f"{rec['kernel'][:30]:30} {rec['shape'][:52]:52} "
          + (f"{rec['measured_us']:10.2f} us  floor {rec['floor_us']:9.2f}  {rec['frac_of_floor']:6.1%}"
             + (f"  graph {rec['graph_us']:9.2f} us" if "graph_us" in rec else "")
             + (f"  SM {clk['sm_mhz'][0]:.0f}-{clk['sm_mhz'][2]:.0f} MHz" if clk else "")
             if "measured_us" in rec else rec.get("error") or rec.get("note", "")), flush=True)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (plumbing check)")
    ap.add_argument("--only", default=None, help="substring of the kernel names to time")
    ap.add_argument("--warm", action="store_true",
                    help="each case once, nothing timed: Triton's compiles, cached for the timed run")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        warnings.filterwarnings("ignore", category=RuntimeWarning)  # random record bytes decode to NaN
    sys.path.insert(0, REPO)
    if a.smoke:
        from sparkinfer.attention import interpret

        interpret.install()  # helpers skip the interpreter's re-patch (sparkinfer.attention.interpret)
    doc = run(a.smoke, a.only, a.warm)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    errors = [r for r in doc["rows"] if "error" in r]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
