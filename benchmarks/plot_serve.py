"""Plot serve_bench.py results: one or more result files (CSV or JSON lines) side by side.

Writes three PNGs into ``--out``:
- ``decode_vs_context.png``: aggregate decode tokens/s against the decode prompt length, one line
  per input file and concurrency;
- ``decode_vs_concurrency.png``: aggregate and per-stream decode tokens/s against concurrency, one
  line per input file and prompt length;
- ``ttft_vs_prompt.png``: cold-prefill time to first token against the prompt length, one line per
  input file.
Each file's line is named by its ``label`` column (serve_bench.py ``--label``, default profile or
model and sparkinfer mode), or ``--labels`` in the order of the files. Needs matplotlib
(``pip install -e '.[plot]'``).

    python benchmarks/plot_serve.py stock.csv selected.jsonl --out plots/
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

NUMERIC = ("context", "concurrency", "requests", "ttft_s", "prefill_tok_s", "decode_tok_s", "stream_tok_s",
           "itl_p50_ms", "itl_p99_ms")
FIGURES = ("decode_vs_context.png", "decode_vs_concurrency.png", "ttft_vs_prompt.png")


def load(path: str) -> list[dict]:
    """Rows of one result file, numbers as floats (missing or null -> NaN); JSON lines by content."""
    with open(path, newline="") as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise ValueError(f"{path}: no result rows")
    missing = [k for k in ("phase", *NUMERIC) if k not in rows[0]]
    if missing:
        raise ValueError(f"{path}: not a serve_bench.py result file (no {', '.join(missing)} column)")
    for r in rows:
        for k in NUMERIC:
            v = r.get(k)
            r[k] = float("nan") if v in (None, "", "nan") else float(v)
    return rows


def run_label(rows: list[dict], path: str) -> str:
    label = rows[0].get("label") or ""
    return label or os.path.splitext(os.path.basename(path))[0]


def _series(rows, phase, group, x, y):
    """{group value: (xs, ys)} sorted by x, for rows of ``phase`` with a finite y."""
    out: dict = {}
    for r in sorted((r for r in rows if r["phase"] == phase and r[y] == r[y]), key=lambda r: r[x]):
        xs, ys = out.setdefault(r[group], ([], []))
        xs.append(r[x])
        ys.append(r[y])
    return out


def plot(runs: list[tuple[str, list[dict]]], out_dir: str) -> dict[str, int]:
    """Write the three figures; returns {file name: number of lines drawn}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    drawn = {}

    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = 0
    for i, (label, rows) in enumerate(runs):
        by_conc = _series(rows, "decode", "concurrency", "context", "decode_tok_s")
        for j, (c, (xs, ys)) in enumerate(sorted(by_conc.items())):
            ax.plot(xs, ys, styles[j % len(styles)], marker="o", color=colors[i % len(colors)],
                    label=f"{label}, {int(c)} stream{'s' if c != 1 else ''}")
            n += 1
    _axes(ax, "decode prompt length (tokens)", "decode tokens/s (all streams)", "decode throughput vs context")
    drawn[FIGURES[0]] = _finish(fig, ax, n, os.path.join(out_dir, FIGURES[0]))

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    n = 0
    for i, (label, rows) in enumerate(runs):
        agg = _series(rows, "decode", "context", "concurrency", "decode_tok_s")
        per = _series(rows, "decode", "context", "concurrency", "stream_tok_s")
        for j, ctx in enumerate(sorted(agg)):
            kw = dict(marker="o", color=colors[i % len(colors)], label=f"{label}, {int(ctx):,} tok")
            a.plot(*agg[ctx], styles[j % len(styles)], **kw)
            if ctx in per:
                b.plot(*per[ctx], styles[j % len(styles)], **kw)
            n += 1
    _axes(a, "concurrent streams", "decode tokens/s (all streams)", "decode throughput vs concurrency")
    _axes(b, "concurrent streams", "decode tokens/s per stream", "per-stream rate vs concurrency")
    if n:
        b.legend(fontsize=7)
    drawn[FIGURES[1]] = _finish(fig, a, n, os.path.join(out_dir, FIGURES[1]))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = 0
    for i, (label, rows) in enumerate(runs):
        for xs, ys in _series(rows, "prefill", "phase", "context", "ttft_s").values():
            ax.plot(xs, ys, "-", marker="o", color=colors[i % len(colors)], label=label)
            n += 1
    _axes(ax, "prompt length (tokens, cold prefill)", "time to first token (s, median)", "TTFT vs prompt length")
    drawn[FIGURES[2]] = _finish(fig, ax, n, os.path.join(out_dir, FIGURES[2]))
    plt.close("all")
    return drawn


def _axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xscale("log", base=2)  # contexts and concurrencies are swept in powers of two
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)


def _ticks_at_data(ax) -> None:
    """Log2 x axis ticked at the measured values, written as plain integers (1,024 rather than 2^10)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    xs = sorted({x for line in ax.get_lines() for x in line.get_xdata()})
    if xs:
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(round(x)):,}"))


def _finish(fig, ax, lines: int, path: str) -> int:
    for axis in fig.axes:
        _ticks_at_data(axis)
    if lines:
        ax.legend(fontsize=7)
    else:  # a run without that phase: say so on the figure rather than leave a blank one
        ax.text(0.5, 0.5, "no rows of this kind in the input files", ha="center", transform=ax.transAxes)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="serve_bench.py --csv or --jsonl files")
    ap.add_argument("--out", default=".", help="directory for the PNGs (default: the current one)")
    ap.add_argument("--labels", nargs="+", default=None, help="legend names, one per file (default: their label)")
    args = ap.parse_args(argv)
    if args.labels and len(args.labels) != len(args.files):
        ap.error(f"--labels names {len(args.labels)} runs for {len(args.files)} files")
    try:
        loaded = [load(p) for p in args.files]
    except (OSError, ValueError) as e:
        print(f"plot_serve: {e}", file=sys.stderr)
        return 1
    runs = [(args.labels[i] if args.labels else run_label(rows, p), rows)
            for i, (p, rows) in enumerate(zip(args.files, loaded))]
    try:
        drawn = plot(runs, args.out)
    except ImportError:
        print("plot_serve: matplotlib is not installed (pip install -e '.[plot]')", file=sys.stderr)
        return 1
    for name, lines in drawn.items():
        print(f"wrote {os.path.join(args.out, name)} ({lines} line{'s' if lines != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
