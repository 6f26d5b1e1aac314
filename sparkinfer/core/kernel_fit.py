"""The cost model's kernel terms fitted to kernels measured on a GPU, scaled to another GPU (torch-free).

The shipped node profiles price attention and indexer scoring with slopes fitted to another
team's published runs (``benchmarks/fit_costmodel.py``) and no per-call cost: kernels that run
at about their hardware's speed ("floor" kernels). This module reads what sparkinfer's own
kernels measured on a lent GPU (``benchmarks/results/gpu/*.json``, written by
``benchmarks/device/run_gpu_checks.sh``; docs/design/gpu-validation.md) and fits, per term, a
line ``time = fixed_us + per_unit_us * units`` by least squares on relative residuals over that
term's decode-shape points:

==========  =====================================================  ========================  =========
term        points (stage: rows of the JSON)                        units                     slope
==========  =====================================================  ========================  =========
attention   ``kernels``: ``sparse_mla_decode[nvfp4_368]`` at 16    query rows x 1024 listed  bandwidth
            heads/rank, top-2048, every index valid;               tokens (one call = one
            ``attention``: the 368-byte rows of its table          layer)
scoring     ``kernels``: ``indexer_scores`` decode rows;           query rows x scored       issue
            ``indexer``: the ``score us`` column                   tokens
topk        ``indexer``: the ``topk us`` column (``select_topk``   query rows x scored       bandwidth
            over the materialized scores)                          tokens
==========  =====================================================  ========================  =========

A kernel-stage row timed replayed in a CUDA graph (``graph_us``, the GPU's time without the host's
launches) is used instead of its eager ``measured_us``; a term with any graph-timed point is
fitted on graph-timed points alone (``TermFit.timing`` says which). The run of 2026-12-04 has no
``graph_us`` (the field came after it), so every term is eager: its per-call costs hold the host's
Python launches as well as GPU time (the sparse-MLA call is flat in the batch, which points at the
host; that run did not separate the two).

Scaling to the target GPU (``GPUS``, datasheet figures):

* byte terms (slopes of memory-bound kernels: attention reads records per row, top-k reads the
  fp32 scores) scale by HBM bandwidth: H200 4,800 GB/s / RTX PRO 6000 1,790 GB/s, x2.682 on the
  RTX;
* per-call and issue terms (every fixed cost; the scoring slope: compute, at 8% of its tf32 floor,
  so bound by issue rather than by tensor-core rate) scale by SM count x clock: H200 132 x 1,980
  MHz = 261,360, RTX PRO 6000 188 x 2,600 MHz = 488,800 (its 125 TFLOP/s fp32 over 24,064 lanes,
  128 per SM as on the H200), x0.535 on the RTX.

What the scaling assumes: that a fixed cost is GPU time. An eager fixed cost that is the host's
launch overhead does not shrink with the GPU, so the RTX's eager per-call costs may be up to 1.87x
the scaled ones; and sm_120's tensor cores are slower per SM than sm_90's, which would matter to
the scoring slope only near its tf32 floor.

``measured_profile`` replaces a node profile's kernel terms by the scaled fit:
``attn_call_us`` and ``attn_us_per_ktok`` from attention, ``index_call_us`` the sum of scoring's
and top-k's fixed costs (one scoring and one selection per Full layer per step; the engine's fused
``indexer_topk_rows`` was measured only at a prefill shape), ``index_ns_per_token`` the sum of
their slopes. Everything else (links, collectives, exchange, the path-independent base) stays the
profile's.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, replace

from sparkinfer.core.costmodel import NodeProfile

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "benchmarks", "results", "gpu")


@dataclass(frozen=True)
class Gpu:
    name: str  # part of the CUDA device name
    sms: int
    clock_MHz: float  # boost clock
    hbm_GBps: float  # datasheet memory bandwidth

    @property
    def issue(self) -> float:
        """SM count x clock: the scale of per-call and issue-bound times."""
        return self.sms * self.clock_MHz


GPUS = {
    "h200": Gpu("H200", 132, 1980.0, 4800.0),
    "rtx_pro_6000": Gpu("RTX PRO 6000", 188, 2600.0, 1790.0),
}

# term -> how its slope scales (its fixed cost always scales by issue); module docstring
SLOPE_SCALING = {"attention": "bandwidth", "scoring": "issue", "topk": "bandwidth"}
# how far (%) a fitted line may miss a point it was fitted on: the scatter of the run of 2026-12-04
# (attention: eager calls flat in the batch, 151-173 us at 4-32 rows between two benchmarks; top-k:
# select_topk at 4 rows and 64K took 504 us against 330 us at 256K)
TOLERANCE_PCT = {"attention": 20.0, "scoring": 20.0, "topk": 45.0}
ATTN_FORMAT = "nvfp4_368"  # the main record format: the cost model's attention term is per row per token
ATTN_HEADS, ATTN_TOPK = 16, 2048  # heads per rank at TP4 and GLM-5.2's top-k: the selected / DCP1 attention


@dataclass(frozen=True)
class Point:
    """One measured time: ``rows`` query rows over ``tokens`` tokens each (listed records for
    attention, scored positions for the indexer)."""

    term: str
    rows: int
    tokens: int
    us: float
    timing: str  # eager | graph
    source: str  # file and stage

    @property
    def units(self) -> float:
        """The slope's unit count: rows x 1024 tokens for attention, rows x tokens otherwise."""
        return self.rows * self.tokens / (1024.0 if self.term == "attention" else 1.0)


@dataclass(frozen=True)
class TermFit:
    term: str
    fixed_us: float
    per_unit_us: float
    timing: str
    points: tuple

    def predict(self, p: Point) -> float:
        return self.fixed_us + self.per_unit_us * p.units

    def residuals_pct(self) -> list[float]:
        return [(self.predict(p) / p.us - 1.0) * 100.0 for p in self.points]


def gpu_of(device: str) -> str:
    """The ``GPUS`` key whose name is part of ``device`` (a CUDA device name)."""
    for key, g in GPUS.items():
        if g.name.lower() in device.lower():
            return key
    raise ValueError(f"no GPU facts for device {device!r}; known: {[g.name for g in GPUS.values()]}")


def _kernel_shape(r: dict) -> tuple[str, int, int] | None:
    """(term, rows, tokens) of a ``kernels`` stage row at a decode shape, or None: from its
    ``params`` (the kernel report's, recorded since issue 33), else from its shape text (run 1)."""
    p, shape = r.get("params"), r["shape"]
    if r["kernel"] == f"sparse_mla_decode[{ATTN_FORMAT}]":  # not stock's 64 heads over a quarter nor a union
        if p is not None:  # read once: every row reads its own top-k at 16 heads
            own = (p["H"], p["K"], p["listed"], p["gathered"] / p["M"]) == (ATTN_HEADS,) + (ATTN_TOPK,) * 3
            return ("attention", p["M"], ATTN_TOPK) if own else None
        m = (re.fullmatch(rf"selected: (\d+) req x (\d+) rows, {ATTN_HEADS} heads/rank, top-{ATTN_TOPK}", shape)
             or re.fullmatch(rf"batch (1): (\d+) rows, {ATTN_HEADS} heads/rank, top-{ATTN_TOPK}", shape))
        return ("attention", int(m[1]) * int(m[2]), ATTN_TOPK) if m else None
    if r["kernel"] != "indexer_scores" or not shape.startswith("decode"):
        return None
    if p is not None:  # a batched decode step is M rows over the requests' contexts end to end: the same units
        return "scoring", p["M"], p["T"]
    m = re.fullmatch(r"decode: one request, (\d+) rows, (\d+)K context", shape)
    if m:
        return "scoring", int(m[1]), int(m[2]) * 1024
    m = re.fullmatch(r"decode step: (\d+) req x (\d+) rows at (\d+)K each \(one batched launch\)", shape)
    return ("scoring", int(m[1]) * int(m[2]), int(m[3]) * 1024) if m else None  # rows score their own context


def _kernel_points(rows: list, source: str) -> list[Point]:
    """Decode-shape points of the ``kernels`` stage (benchmarks/device/kernel_timing.py rows)."""
    out = []
    for r in rows:
        shape = _kernel_shape(r) if "measured_us" in r else None
        if shape is not None:
            timing, us = ("graph", r["graph_us"]) if "graph_us" in r else ("eager", r["measured_us"])
            out.append(Point(*shape, us, timing, source))
    return out


def _attention_points(lines: list, source: str) -> list[Point]:
    """The 368-byte rows of ``benchmarks/attention_bench.py``'s table (eager, ``do_bench``)."""
    out, ok = [], False
    for line in lines:
        head = re.search(r"H=(\d+) K=(\d+) .*valid=([\d.]+)", line)
        if head:
            ok = (int(head[1]), int(head[2]), float(head[3])) == (ATTN_HEADS, ATTN_TOPK, 1.0)
            continue
        f = line.split()
        if ok and len(f) == 11 and f[0].endswith("-368") and f[1].isdigit():
            out.append(Point("attention", int(f[2]), ATTN_TOPK, float(f[3]), "eager", source))
    return out


def _indexer_points(lines: list, source: str) -> list[Point]:
    """``benchmarks/indexer_bench.py``'s table: T, M, score us, topk us, total us, ... (eager)."""
    out = []
    for line in lines:
        f = line.split()
        if len(f) == 7 and f[0].isdigit() and f[1].isdigit():
            t, m = int(f[0]), int(f[1])
            out.append(Point("scoring", m, t, float(f[2]), "eager", source))
            out.append(Point("topk", m, t, float(f[3]), "eager", source))
    return out


def load_points(paths: list[str]) -> dict[str, list[Point]]:
    """{GPUS key: points} of every run in ``paths`` (a run without a stage contributes nothing)."""
    by_gpu: dict[str, list[Point]] = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        name = os.path.basename(path)
        pts = []
        if doc.get("kernel_timing") and not doc["kernel_timing"].get("smoke"):
            pts += _kernel_points(doc["kernel_timing"]["rows"], f"{name}:kernels")
        pts += _attention_points(doc.get("attention") or [], f"{name}:attention")
        pts += _indexer_points(doc.get("indexer") or [], f"{name}:indexer")
        if pts:
            by_gpu.setdefault(gpu_of(doc["device"] or ""), []).extend(pts)
    return by_gpu


def fit_line(points: list[Point]) -> tuple[float, float]:
    """(fixed, slope) of us against units, least squares on the relative residuals (weights 1/us^2):
    the points span 50 us to 2 ms, and an absolute fit would leave the small ones far off."""
    n = len(points)
    w = [1.0 / (p.us * p.us) for p in points]
    sw = sum(w)
    mx = sum(wi * p.units for wi, p in zip(w, points)) / sw
    my = sum(wi * p.us for wi, p in zip(w, points)) / sw
    sxx = sum(wi * (p.units - mx) ** 2 for wi, p in zip(w, points))
    if n < 2 or sxx == 0:
        raise ValueError(f"a line needs points at two sizes, got {n} point(s) of {points[0].term if n else '?'}")
    slope = sum(wi * (p.units - mx) * (p.us - my) for wi, p in zip(w, points)) / sxx
    return my - slope * mx, slope


def fit_terms(points: list[Point]) -> dict[str, TermFit]:
    """One ``TermFit`` per term of ``SLOPE_SCALING``: graph-timed points where a term has any."""
    out = {}
    for term in SLOPE_SCALING:
        pts = [p for p in points if p.term == term]
        if not pts:
            raise ValueError(f"no measured points for {term}")
        timing = "graph" if any(p.timing == "graph" for p in pts) else "eager"
        pts = tuple(p for p in pts if p.timing == timing)
        fixed, slope = fit_line(list(pts))
        out[term] = TermFit(term, fixed, slope, timing, pts)
    return out


def scale_term(fit: TermFit, src: Gpu, dst: Gpu) -> tuple[float, float]:
    """(fixed us, per-unit us) on ``dst`` of a term measured on ``src`` (module docstring)."""
    issue = src.issue / dst.issue
    slope = src.hbm_GBps / dst.hbm_GBps if SLOPE_SCALING[fit.term] == "bandwidth" else issue
    return fit.fixed_us * issue, fit.per_unit_us * slope


def result_paths(where: str | None = None) -> list[str]:
    """The run JSONs of a folder (default ``RESULTS_DIR``) or one file."""
    where = where or RESULTS_DIR
    paths = sorted(glob.glob(os.path.join(where, "*.json"))) if os.path.isdir(where) else [where]
    if not paths or not all(os.path.isfile(p) for p in paths):
        raise ValueError(f"no GPU result JSON at {where!r} (benchmarks/results/gpu/ in a checkout)")
    return paths


@dataclass(frozen=True)
class MeasuredKernels:
    profile: NodeProfile
    source_gpu: str
    target_gpu: str
    fits: dict  # term -> TermFit on the source GPU
    scaled: dict  # term -> (fixed us, per-unit us) on the target


def measured_profile(profile: NodeProfile, where: str | None = None, target: str | None = None) -> MeasuredKernels:
    """``profile`` with its kernel terms from the fit of the runs at ``where`` (``result_paths``),
    measured on the target GPU if a run there has the points, else on the first of ``GPUS`` that
    has, scaled. ``target``: a ``GPUS`` key (default: the profile's ``gpu``)."""
    target = target or gpu_of(profile.gpu)
    by_gpu = load_points(result_paths(where))
    if not by_gpu:
        raise ValueError(f"no kernel timings in the runs at {where or RESULTS_DIR!r}")
    src = target if target in by_gpu else next(k for k in GPUS if k in by_gpu)
    fits = fit_terms(by_gpu[src])
    scaled = {t: scale_term(f, GPUS[src], GPUS[target]) for t, f in fits.items()}
    (a0, a1), (s0, s1), (k0, k1) = scaled["attention"], scaled["scoring"], scaled["topk"]
    runs = sorted({p.source.split(":")[0] for f in fits.values() for p in f.points})
    source = (f"{profile.name}'s profile with its kernel terms fitted to sparkinfer's kernels measured on "
              f"{GPUS[src].name} ({', '.join(runs)}; {fits['attention'].timing} timing)"
              + (f", scaled to {GPUS[target].name} (sparkinfer/core/kernel_fit.py)" if src != target else ""))
    p = replace(profile, name=f"{profile.name}+measured", source=source, attn_call_us=a0, attn_us_per_ktok=a1,
                index_call_us=s0 + k0, index_ns_per_token=(s1 + k1) * 1e3)
    return MeasuredKernels(p, src, target, fits, scaled)
