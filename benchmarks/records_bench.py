"""Record-kernel benchmark: paged encode (write) and gather-decode for the four record formats.

On a CUDA GPU it times the CUDA kernels of csrc/cuda/records.cu through their
binding (sparkinfer.formats.native) at sizes that fill the chip (default 1M and
4M records), with CUDA events (triton.testing.do_bench, median), for two slot
orders: ``random`` (a permutation: every record lands in / comes from a random
slot, as a paged cache does) and ``sequential`` (slot i for token i). Before
timing it fills the cache with 0xA5; after timing it encodes once more into a
cache filled with 0x5A and requires both to be equal (every byte written), and
checks a sample of the records and of the decoded values against the torch
reference, so a kernel that writes nothing or the wrong bytes cannot produce a
number.

Bytes moved are counted exactly as what each kernel must read and write once:

    encode  N * (4 * (value_dim + rope_dim)    fp32 latent/key and rope read
                 + 8                           int64 slot read
                 + record_bytes)               record written
    decode  N * (8                             int64 index read
                 + record_bytes                record read
                 + 4 * (value_dim + rope_dim)) fp32 values written

(value_dim 512 / rope_dim 64 for 368/432/656, 128 / 0 for the 132-byte indexer
key). GB/s is that over the median time, compared with the device-to-device
copy ceiling measured in the same run (a large torch copy, bytes read + written)
and with the H200 datasheet's 4.8 TB/s.

Without a GPU it says so and runs the HOST TWIN (csrc/host, g++) through the
same binding at a small size, timed with perf_counter (median), against a torch
CPU copy: a check that the benchmark works, not a GPU number.

    python benchmarks/records_bench.py [--records 1048576 4194304] [--orders random sequential]
                                       [--formats 368 432 656 132] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time

import torch

from sparkinfer.formats import ALL_FORMATS, get_format
from sparkinfer.formats import native

DATASHEET_GBPS = 4800.0  # H200 HBM3e, vendor datasheet
GPU_RECORDS = [1 << 20, 1 << 22]
CPU_RECORDS = [4096]
ORDERS = ("random", "sequential")
CHECK_SAMPLE = 1024  # records compared with the torch reference after timing
POISON = 0xA5


def bytes_moved(fmt, n: int, op: str) -> int:
    """Bytes one ``op`` ("encode" or "decode") of ``n`` records must move through memory: the same
    three terms both ways (fp32 values, int64 slot/index, record), read and written in reverse."""
    if op not in ("encode", "decode"):
        raise ValueError(f"op must be 'encode' or 'decode', got {op!r}")
    return n * (4 * (fmt.value_dim + fmt.rope_dim) + 8 + fmt.record_bytes)


def _median_ms(fn, device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=max(reps, 1) * 10, return_mode="median"))
    fn()  # warm-up: library load, first-touch of the outputs
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def copy_ceiling(device: torch.device, nbytes: int, reps: int) -> dict:
    """A large ``dst.copy_(src)``: the memory ceiling, counting bytes read plus bytes written."""
    gen = torch.Generator(device=device).manual_seed(1)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, reps)
    if not torch.equal(dst, src):
        raise RuntimeError("copy ceiling: the copy did not reproduce its source")
    return {"format": "torch copy", "op": "copy", "order": "sequential", "records": 0,
            "bytes": 2 * nbytes, "ms": ms, "gbps": 2 * nbytes / ms / 1e6}


def make_case(fmt, n: int, order: str, device: torch.device, seed: int):
    """fp32 inputs, a poisoned cache [n, record_bytes] and int64 slot / index vectors for one run."""
    gen = torch.Generator(device=device).manual_seed(seed)
    latent = torch.randn(n, fmt.value_dim, device=device, generator=gen)
    rope = torch.randn(n, fmt.rope_dim, device=device, generator=gen) if fmt.rope_dim else None
    cache = torch.full((n, fmt.record_bytes), POISON, dtype=torch.uint8, device=device)
    if order == "random":
        slots = torch.randperm(n, device=device, generator=gen)
        idx = torch.randperm(n, device=device, generator=gen)
    elif order == "sequential":
        slots = torch.arange(n, device=device)
        idx = torch.arange(n, device=device)
    else:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return latent, rope, cache, slots, idx


def check_sample(fmt, latent, rope, cache, slots, idx, decoded) -> None:
    """The kernels' output on CHECK_SAMPLE tokens equals the torch reference (raises otherwise)."""
    m = min(CHECK_SAMPLE, latent.shape[0])
    lat_s = latent[:m].cpu()
    rope_s = rope[:m].cpu() if rope is not None else None
    want = fmt.encode(lat_s, rope_s, backend="torch")
    got = cache[slots[:m]].cpu()
    if not torch.equal(got, want):
        bad = int((got != want).any(dim=1).sum())
        raise RuntimeError(f"{fmt.name}: {bad} of {m} sampled records differ from the torch reference")
    ref = fmt.decode(cache[idx[:m]].cpu(), backend="torch")
    ref = (ref,) if fmt.rope_dim == 0 else ref
    for name, r, d in zip(("latent", "rope"), ref, decoded):
        if not torch.equal(d[:m].cpu(), r):
            raise RuntimeError(f"{fmt.name}: decoded {name} differs from the torch reference")


def check_all_written(fmt, latent, rope, cache, slots) -> None:
    """Encode once more into a cache poisoned with the complement byte: any byte the kernel leaves
    unwritten (or writes non-deterministically) differs from ``cache`` (raises then)."""
    other = torch.full_like(cache, POISON ^ 0xFF)
    native.encode(fmt, latent, rope, other, slots)
    if not torch.equal(other, cache):
        rows = int((other != cache).any(dim=1).sum())
        raise RuntimeError(f"{fmt.name}: {rows} of {cache.shape[0]} records not fully written by the encode "
                           f"(or written differently by two runs)")


def bench_format(fmt, n: int, order: str, device: torch.device, reps: int, seed: int) -> list[dict]:
    latent, rope, cache, slots, idx = make_case(fmt, n, order, device, seed)
    fmt.write(cache, slots, latent, rope)  # validated call first: shapes, dtypes and slot range
    enc_ms = _median_ms(lambda: native.encode(fmt, latent, rope, cache, slots), device, reps)
    dec_ms = _median_ms(lambda: native.gather(fmt, cache, idx), device, reps)
    check_all_written(fmt, latent, rope, cache, slots)
    decoded = native.gather(fmt, cache, idx)
    check_sample(fmt, latent, rope, cache, slots, idx, decoded)
    rows = []
    for op, ms in (("encode", enc_ms), ("decode", dec_ms)):
        nbytes = bytes_moved(fmt, n, op)
        rows.append({"format": fmt.name, "op": op, "order": order, "records": n, "bytes": nbytes, "ms": ms,
                     "gbps": nbytes / ms / 1e6})
    return rows


def run(formats, records, orders, device: torch.device, reps: int, copy_bytes: int) -> list[dict]:
    """All rows: the copy ceiling first, then encode/decode per format, size and order."""
    ceiling = copy_ceiling(device, copy_bytes, reps)
    rows = [ceiling]
    for name in formats:
        fmt = get_format(name)
        for n in records:
            for order in orders:
                rows += bench_format(fmt, n, order, device, reps, seed=n + fmt.record_bytes)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the next case's buffers differ in size
    for r in rows:
        r["frac_copy"] = r["gbps"] / ceiling["gbps"]
        r["frac_datasheet"] = r["gbps"] / DATASHEET_GBPS
        r["floor_ms_copy"] = r["bytes"] / ceiling["gbps"] / 1e6
    return rows


def show(rows, title: str, gpu: bool) -> None:
    """Rich table; the datasheet column only means something on the GPU."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = ["format", "op", "order", "records", "MB moved", "ms", "GB/s", "of copy"] + (["of 4.8 TB/s"] if gpu else [])
    for col in cols:
        t.add_column(col, justify="left" if col in ("format", "op", "order") else "right")
    for r in rows:
        cells = [r["format"], r["op"], r["order"], f"{r['records']:,}" if r["records"] else "-",
                 f"{r['bytes'] / 1e6:,.1f}", f"{r['ms']:.4f}", f"{r['gbps']:,.1f}", f"{r['frac_copy']:.1%}"]
        t.add_row(*cells, *([f"{r['frac_datasheet']:.1%}"] if gpu else []))
    Console(width=200).print(t)


def write_csv(rows, path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=list(ALL_FORMATS), help="names or widths (368 432 656 132)")
    ap.add_argument("--records", type=int, nargs="+", default=None,
                    help=f"records per call (default {GPU_RECORDS} on a GPU, {CPU_RECORDS} on the host twin)")
    ap.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS)
    ap.add_argument("--reps", type=int, default=10, help="CPU: timed repetitions; GPU: do_bench rep = 10x ms")
    ap.add_argument("--copy-mb", type=int, default=None, help="copy-ceiling buffer (default 2048 GPU, 64 CPU)")
    ap.add_argument("--cpu", action="store_true", help="run the host twin even when a GPU is present")
    ap.add_argument("--csv", default=None, help="write all rows here as CSV")
    args = ap.parse_args(argv)

    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    records = args.records or (GPU_RECORDS if gpu else CPU_RECORDS)
    if any(n <= 0 for n in records):
        raise ValueError(f"--records must be positive, got {records}")
    copy_bytes = (args.copy_mb or (2048 if gpu else 64)) << 20
    if gpu:
        title = f"record kernels (CUDA) on {torch.cuda.get_device_name(device)}; do_bench median"
    else:
        print("no CUDA device (or --cpu): measuring the HOST TWIN (csrc/host, g++) at a small size; "
              "these are not GPU numbers")
        title = f"record kernels, HOST TWIN on CPU ({torch.get_num_threads()} torch threads); perf_counter median"
    rows = run(args.formats, records, args.orders, device, args.reps, copy_bytes)
    show(rows, title, gpu)
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
