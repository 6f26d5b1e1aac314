"""The indexer's top-k over int64 selection keys: ``triton_topk.topk_keys`` against ``torch.topk``.

On a CUDA GPU, for each shape (rows x keys a row: a tiled pass's work buffer k + tile, or a decode
row's whole list) of keys packed from normal scores and shuffled ids (``topk.pack_keys``), the median
time (triton.testing.do_bench) of torch.topk (sorted), topk_keys sorted (a candidate buffer of 2k,
the last pass) and unsorted (the passes before), checks the selected keys equal torch.topk's, and
prints the time a single read of the keys takes at the GPU's bandwidth (``--bw``, default the
H200's 4.8 TB/s) for comparison. Without a GPU it checks the same at a tiny shape under the
Triton interpreter and times nothing.

    python benchmarks/topk_bench.py [--shapes 2048x18432 512x18432 64x67584 4x133120] [--k 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def make_keys(m: int, n: int, device, seed: int = 0) -> torch.Tensor:
    from sparkinfer.indexer.topk import pack_keys

    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(m, n, generator=g).argsort(dim=1)  # a shuffled 0..n-1 per row: distinct keys
    return pack_keys(torch.randn(m, n, generator=g), ids).to(device)


def run(shape: tuple[int, int], k: int, device, bw: float) -> dict:
    import triton.testing

    from sparkinfer.indexer.triton_topk import topk_keys

    m, n = shape
    keys = make_keys(m, n, device)
    cand = torch.empty(m, 2 * k, dtype=torch.int64, device=device)
    out = torch.empty(m, k, dtype=torch.int64, device=device)
    want = torch.topk(keys, k, dim=1, sorted=True).values
    sorted_ok = torch.equal(topk_keys(keys, k, cand[:, :k], cand), want)
    unsorted_ok = torch.equal(topk_keys(keys, k, out, sorted=False).sort(dim=1, descending=True).values, want)
    row = {"rows": m, "keys_per_row": n, "k": k, "sorted_equal": sorted_ok, "unsorted_equal": unsorted_ok,
           "one_read_us": round(m * n * 8 / bw * 1e6, 1)}
    if device.type == "cuda":
        row["torch_topk_us"] = round(triton.testing.do_bench(lambda: torch.topk(keys, k, dim=1, sorted=True)) * 1e3, 1)
        row["topk_keys_us"] = round(triton.testing.do_bench(lambda: topk_keys(keys, k, cand[:, :k], cand)) * 1e3, 1)
        row["topk_keys_unsorted_us"] = round(
            triton.testing.do_bench(lambda: topk_keys(keys, k, out, sorted=False)) * 1e3, 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["2048x18432", "512x18432", "64x67584", "4x133120"])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--bw", type=float, default=4.8e12, help="bytes/s for the one-read column")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if torch.cuda.is_available():
        device, shapes, k = torch.device("cuda"), [tuple(map(int, s.split("x"))) for s in args.shapes], args.k
    else:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("no CUDA device: rerun with TRITON_INTERPRET=1 for the interpreted check at a tiny shape")
            return 1
        device, shapes, k = torch.device("cpu"), [(3, 700)], 40
        print("no CUDA device: an interpreted equality check at a tiny shape, nothing timed")
    rows = [run(s, k, device, args.bw) for s in shapes]
    for r in rows:
        print(json.dumps(r) if args.json else "  ".join(f"{key}={v}" for key, v in r.items()))
    return 0 if all(r["sorted_equal"] and r["unsorted_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
