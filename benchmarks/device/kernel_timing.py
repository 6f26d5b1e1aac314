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
roofline), and the tensor-core target floor where the kernel has one. ``--smoke`` runs the same
code at tiny shapes on the CPU (Triton interpreter, host twins), so the script is tested without
a GPU; its times mean nothing.
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


def _mla_case(row, dev, smoke):
    import torch

    from sparkinfer.attention import sparse_mla_decode
    from sparkinfer.formats import get_format

    p = row["params"]
    m, h = (2, 16) if smoke else (p["M"], p["H"])
    fmt = get_format(str(p["record"]))
    pool = 256 if smoke else 65536
    g = torch.Generator(device="cpu").manual_seed(0)
    q_nope = torch.randn(m, h, 512, generator=g).to(dev, torch.bfloat16)
    q_rope = torch.randn(m, h, 64, generator=g).to(dev, torch.bfloat16)
    records = torch.randint(0, 256, (pool, p["record"]), generator=g, dtype=torch.uint8).to(dev)
    idx = _mla_indices(p, pool, g, smoke).to(dev)
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


def _case(row, dev, smoke):
    """A callable running the row's kernel at its shape, or (None, why not)."""
    name = row["kernel"]
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
    if name.startswith("records_"):
        return _records_case(row, dev, smoke), None
    return None, "timed inside the exchange (graph_exchange stage)"


def run(smoke: bool = False, only: str | None = None) -> dict:
    import torch

    kr = _report_module()
    dev = torch.device("cpu" if smoke else "cuda")
    name = "cpu (smoke)" if smoke else torch.cuda.get_device_name(dev)
    gpu = "rtx_pro_6000" if "RTX PRO 6000" in name else "h200"
    timer = _timer(dev, smoke)
    out = []
    for row in kr.roofline():
        if only and only not in row["kernel"]:
            continue
        rec = {"kernel": row["kernel"], "shape": row["shape"], "params": row["params"],
               "floor_us": row["times"][gpu]["floor_us"], "bound": row["times"][gpu]["bound"], "expect": row["expect"]}
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
                if not smoke:
                    try:
                        rec["graph_us"] = round(_graph_time(fn), 2)
                    except Exception as e:  # the finding: this call cannot be captured
                        rec["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        except Exception as e:  # one kernel failing must not hide the others' numbers
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(rec)
        print(f"{rec['kernel'][:30]:30} {rec['shape'][:52]:52} "
              + (f"{rec['measured_us']:10.2f} us  floor {rec['floor_us']:9.2f}  {rec['frac_of_floor']:6.1%}"
                 + (f"  graph {rec['graph_us']:9.2f} us" if "graph_us" in rec else "")
                 if "measured_us" in rec else rec.get("error") or rec.get("note", "")), flush=True)
    return {"device": name, "figures": gpu, "smoke": smoke, "rows": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (plumbing check)")
    ap.add_argument("--only", default=None, help="substring of the kernel names to time")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        warnings.filterwarnings("ignore", category=RuntimeWarning)  # random record bytes decode to NaN
    sys.path.insert(0, REPO)
    doc = run(a.smoke, a.only)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    errors = [r for r in doc["rows"] if "error" in r]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
