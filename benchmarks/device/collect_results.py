"""Gather one run of run_gpu_checks.sh into one JSON document.

Reads what the stages left under OUT (stage rows, env.txt, pytest_gpu.xml) and in BENCH_LOG_DIR
(records_bench.csv, transport_device.csv, graph_exchange.json, graph_decode_step.json,
kernel_timing.json, and the text output of the attention / indexer / union / reuse benchmarks) and
writes OUT/gpu_checks.json; with ``--copy-to DIR`` also DIR/<date>-<gpu>.json (benchmarks/results/gpu/
in the repo: the session that ran the device check commits it).

    python benchmarks/device/collect_results.py OUT ROWS_FILE BENCH_LOG_DIR [--copy-to DIR]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import xml.etree.ElementTree as ET


def _rows(path):
    out = []
    if os.path.exists(path):
        for line in open(path):
            if line.strip():
                name, rc, secs, note = line.rstrip("\n").split("|", 3)
                out.append({"stage": name, "rc": rc, "seconds": secs, "note": note})
    return out


def _csv(path):
    return [dict(r) for r in csv.DictReader(open(path))] if os.path.exists(path) else None


def _junit(path):
    if not os.path.exists(path):
        return None
    s = ET.parse(path).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    n, f, e, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    cases = []
    for c in s.iter("testcase"):
        state = ("failed" if c.find("failure") is not None else "error" if c.find("error") is not None
                 else "skipped" if c.find("skipped") is not None else "passed")
        cases.append({"test": f"{c.get('classname')}::{c.get('name')}", "state": state,
                      "seconds": float(c.get("time", 0))})
    return {"passed": n - f - e - sk, "failed": f, "errors": e, "skipped": sk, "cases": cases}


def _text(path):
    if not os.path.exists(path):
        return None
    return [l.rstrip() for l in open(path, errors="replace") if l.strip() and not l.startswith("=====")]


def collect(out: str, rows_file: str, bench_dir: str) -> dict:
    env = _text(os.path.join(out, "env.txt")) or []
    device = next((l.split("device: ", 1)[1] for l in env if l.startswith("device: ")), None)
    doc = {
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "stages": _rows(rows_file),
        "env": env,
        "gpu_tests": _junit(os.path.join(out, "pytest_gpu.xml")),
        "records": _csv(os.path.join(bench_dir, "records_bench.csv")),
        "transport_device": _csv(os.path.join(bench_dir, "transport_device.csv")),
    }
    for name in ("graph_exchange", "graph_decode_step", "kernel_timing"):
        p = os.path.join(bench_dir, f"{name}.json")
        doc[name] = json.load(open(p)) if os.path.exists(p) else None
    for name in ("attention", "indexer", "union", "reuse"):  # these print tables: kept as their lines
        doc[name] = _text(os.path.join(bench_dir, f"{name}.log"))
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("rows")
    ap.add_argument("bench_dir")
    ap.add_argument("--copy-to", default=None)
    a = ap.parse_args()
    doc = collect(a.out, a.rows, a.bench_dir)
    text = json.dumps(doc, indent=1)
    with open(os.path.join(a.out, "gpu_checks.json"), "w") as f:
        f.write(text + "\n")
    if a.copy_to:
        os.makedirs(a.copy_to, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", (doc["device"] or "no-gpu").split(",")[0].lower()).strip("-")
        path = os.path.join(a.copy_to, f"{doc['utc'][:10]}-{slug}.json")
        with open(path, "w") as f:
            f.write(text + "\n")
        print(f"results: {path}")
    print(f"results: {os.path.join(a.out, 'gpu_checks.json')} ({len(doc['stages'])} stages)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
