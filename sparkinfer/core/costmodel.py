"""Cost model of one decode step's path-dependent time on a node (torch-free).

The model prices what differs between stock DCP and selected records; the
rest of a step (MoE, dense projections, sampling) is one path-independent term
``base`` that only matters to predict tokens/s.

Per attention layer, with ``x`` the layer's link time for its bytes:

* link time of an exchange: the busiest port direction, or the busiest port's
  two directions together against the bidirectional rate, whichever is longer::

      link_us = max(max(tx), max(rx)) / bw_dir  |  max(tx + rx) / bw_bidir

* **stock DCP**: every collective is on the critical path (query gather before
  attention, combine after): ``n_collectives * (collective_us + link_latency_us) + link_us``.
* **selected records**: each exchange costs ``fixed = exchange_us + copies*copy_us``
  (pack + unpack launches, arrive/wait, one packed copy per pair). A Full layer F
  and the ``n`` Shared layers after it (they reuse its top-k) travel in chunks of
  ``d + 1`` layers with a prefetch ring of depth ``d`` (``comm/ring.py``: F's chunk
  is issued at F, right after its indexer; the next one when the ring is free again,
  i.e. right before its first layer). Within a chunk of ``J`` layers every layer
  has its own arrival (``comm/exchange.py``): its sections land in layer order, one
  link time ``x`` each (``x`` includes one ``link_latency_us``), plus ``s =
  copies*copy_us`` per section after the first (one more copy and signal per pair),
  and layer ``j`` waits only for section ``j`` while the layers before it compute
  (``c`` each). Layer ``j`` then starts at ``max(start_{j-1} + c, fixed + (j+1)x +
  j s)``, so the chunk's exposed time (its end less the ``J`` layers' compute) is::

      chunk(J)        = fixed + x + (J - 1) * max(0, x + s - c)     (overlap)
      chunk_packed(J) = fixed + J * x                               (one arrival: F waits for all)
      group(n, d)     = sum over the chunks of the n + 1 layers of chunk(J)

  Depth 0 exposes every layer (``(n + 1) * (fixed + x)``). Deeper rings save fixed
  costs (fewer exchanges); once the link is the bottleneck (``x + s > c``) each
  layer after the first still exposes ``x + s - c``, so depth stops helping, which
  matches the published observation that deeper rings only cost memory.
  ``chunk <= chunk_packed`` whenever ``s <= c`` (a section's issue cost below one
  layer's compute: ~24 us against ~120 us on the shipped profiles).
* **indexer**: scoring per Full layer costs ``index_call_us`` (the calls' fixed cost, 0 for floor
  kernels) plus ``index_ns_per_token`` per scored token per query row. ``replicated`` scoring:
  every rank scores the whole context alone (no collective). ``sharded`` scoring: every rank scores the
  ``1/D`` of the context it owns and the ranks all-gather their top-k candidates
  (upstream's sharded indexer does this over its sharded keys; sparkinfer does it
  over its replicated keys, with the same merged top-k on every rank, so either
  path can follow). The scoring is its own per-step choice, the same for both
  paths, so it cancels out of the stock/selected comparison: ``choose_indexer``
  takes the cheaper (``scoring_saving_us``).
* **attention**: ``attn_call_us`` per layer (the call's fixed cost, 0 for floor kernels) plus
  ``attn_us_per_ktok`` per layer per 1024 selected tokens per row, the same for both paths (stock
  DCP attends the same top-k, split over ranks). ``core/kernel_fit.py`` fits both kernel terms to
  sparkinfer's kernels measured on a GPU (``sparkinfer plan --kernels measured``).
* **replica records** (``StepSpec.held_fraction``, ``core/replicas.py``): the share of the remote
  union a rank holds in its replica store is local like its own shard; the reuse pool's
  ``new_fraction`` applies to the rest, so the share that moves is
  ``(1 - held_fraction) * new_fraction`` (``moving_fraction``). A step whose remote union is
  entirely replica-held runs no exchange at all (no pack, copy or barrier: zero fixed cost), so
  the selected path costs its attention alone. The store is written at every step whatever the
  path (every rank writes every new token's record of every layer into its ring), priced on both
  paths as HBM bytes: ``rows * layers * record_bytes / hbm`` (``replica_write_us``; 65 ns for 4
  rows of 368-byte records on the RTX profile, assuming the ring write rides the cache-write
  kernel, i.e. no launch of its own).

Parameters come from a node profile (``sparkinfer/hw_profiles/*.json``).
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields

from sparkinfer.core import accounting as acc
from sparkinfer.core.geometry import GLM52, ModelGeometry
from sparkinfer.core.indexer_tiles import INDEXER_ROWS
from sparkinfer.core.layouts import layout as record_layout
from sparkinfer.core.replicas import write_hbm_bytes

PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hw_profiles")


@dataclass(frozen=True)
class NodeProfile:
    """One node's parameters. Times in microseconds, rates in GB/s (1e9 B/s)."""

    name: str
    description: str
    world_size: int  # GPUs in the DCP group
    bw_dir_GBps: float  # one direction of one port, the other idle
    bw_bidir_GBps: float  # both directions of one port together
    link_latency_us: float
    collective_us: float  # fixed cost of one collective call (launch + protocol)
    exchange_us: float  # fixed cost of one selected-record exchange (pack, unpack, arrive)
    copy_us: float  # CPU cost of issuing one packed copy
    hbm_GBps: float
    index_ns_per_token: float  # indexer scoring per token, per Full layer, per query row
    attn_us_per_ktok: float  # sparse attention per layer per 1024 selected tokens per row
    base_us: float  # path-independent step time, batch 1, 1 row (MoE, projections, ...)
    base_row_us: float  # added per extra query row in the step
    mode: str = "auto"  # auto | stock | selected (environment VLLM_SPARKINFER_MODE overrides)
    source: str = ""  # where the numbers come from
    gpu: str = ""  # part of the CUDA device name that auto applies it to ("": none, e.g. an estimate)
    attn_call_us: float = 0.0  # fixed cost of one layer's sparse-attention call per step (0: floor kernels)
    index_call_us: float = 0.0  # fixed cost of one Full layer's scoring + top-k per step (0: floor kernels)

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "float" and (not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"profile {self.name!r}: {f.name} must be a number >= 0, got {v!r}")
        if self.bw_dir_GBps <= 0 or self.bw_bidir_GBps <= 0:
            raise ValueError(f"profile {self.name!r}: link bandwidths must be > 0")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"profile {self.name!r}: world_size must be an int >= 1")
        from sparkinfer.config import MODES
        if self.mode not in MODES:
            raise ValueError(f"profile {self.name!r}: mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "NodeProfile":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown profile fields {unknown}; expected {sorted(names)}")
        missing = sorted(f.name for f in fields(cls) if f.name not in d and f.default is MISSING)
        if missing:
            raise ValueError(f"profile is missing fields {missing}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def load_profile(name_or_path: str) -> NodeProfile:
    """A profile by name (``rtx_pro_6000_x4``, ``h200_x4``) or by JSON path."""
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        have = sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
        raise ValueError(f"no profile {name_or_path!r}: not a file and not one of {have}")
    with open(path) as f:
        return NodeProfile.from_dict(json.load(f))


def find_profile(device_name: str, world_size: int) -> NodeProfile | None:
    """The shipped profile for ``world_size`` GPUs named like ``device_name`` (its ``gpu`` is part
    of the name, case-insensitive), or None: a node without one is not modelled."""
    for f in sorted(os.listdir(PROFILE_DIR)):
        if f.endswith(".json"):
            p = load_profile(os.path.join(PROFILE_DIR, f))
            if p.gpu and p.gpu.lower() in device_name.lower() and p.world_size == world_size:
                return p
    return None


@dataclass(frozen=True)
class StepSpec:
    """A decode step as the model sees it (uniform over requests).

    batch         requests decoding
    rows          query rows per request (1 + speculative tokens)
    context       tokens in each request's context
    union_ratio   per-request union of the rows' top-k, in units of min(context, topk)
                  (1.0 for one row; ~1.75 measured for 4 MTP rows)
    new_fraction  share of the remote union a destination does not hold yet (1.0 = no reuse);
                  with replicas, of the part the replica store does not hold
    held_fraction share of the remote union held by the replica store (None: no replica store;
                  1.0: every remote record is local and the step runs no exchange)
    record_format main record format name or width
    tp, dcp       parallel sizes
    backend       stock DCP's combine: ag_rs | a2a
    q_replicated  stock DCP computes every head's query on every rank instead of gathering it
                  (vLLM 0.32's default for GLM-MoE-DSA, with a2a)
    indexer       scoring: replicated (every rank scores the whole context) | sharded (a 1/D
                  share each, plus the candidate all-gather; ``choose_indexer``)
    """

    batch: int = 1
    rows: int = 1
    context: int = 65536
    union_ratio: float = 1.0
    new_fraction: float = 1.0
    record_format: str = "nvfp4_368"
    tp: int = 4
    dcp: int = 4
    backend: str = "ag_rs"
    q_replicated: bool = False
    indexer: str = "replicated"
    held_fraction: float | None = None

    def __post_init__(self):
        for k in ("batch", "rows", "tp", "dcp"):
            if int(getattr(self, k)) != getattr(self, k) or getattr(self, k) < 1:
                raise ValueError(f"{k} must be an int >= 1, got {getattr(self, k)!r}")
        if self.context < 0:
            raise ValueError(f"context must be >= 0, got {self.context}")
        if not 1.0 <= self.union_ratio <= self.rows:
            raise ValueError(f"union_ratio must be in [1, rows={self.rows}], got {self.union_ratio}")
        if not 0.0 <= self.new_fraction <= 1.0:
            raise ValueError(f"new_fraction must be in [0, 1], got {self.new_fraction}")
        if self.held_fraction is not None and not 0.0 <= self.held_fraction <= 1.0:
            raise ValueError(f"held_fraction must be in [0, 1] or None (no replica store), got {self.held_fraction}")
        if self.indexer not in ("replicated", "sharded"):
            raise ValueError(f"indexer must be 'replicated' or 'sharded', got {self.indexer!r}")
        record_layout(self.record_format)


@dataclass(frozen=True)
class PathCost:
    """Predicted path-dependent time of one step (us) and the bytes behind it."""

    path: str
    depth: int
    comm_us: float  # exposed communication + fixed exchange costs
    indexer_us: float
    attn_us: float
    rx_bytes_per_rank: float  # bytes entering the busiest port, whole step
    total_bytes: float  # bytes over PCIe, all ports, whole step
    write_us: float = 0.0  # replica-store writes (HBM), 0 without a replica store

    @property
    def total_us(self) -> float:
        return self.comm_us + self.indexer_us + self.attn_us + self.write_us  # + 0.0 without replicas: same float


def link_us(tx_max: float, rx_max: float, txrx_max: float, p: NodeProfile) -> float:
    """Transfer time of an exchange whose busiest port sends ``tx_max``, receives ``rx_max``."""
    return max(max(tx_max, rx_max) / (p.bw_dir_GBps * 1e3), txrx_max / (p.bw_bidir_GBps * 1e3))


def lb_link_us(lb: acc.LinkBytes, p: NodeProfile) -> float:
    """Link time of a LinkBytes: one link latency per operation plus the transfer."""
    if lb.total == 0:
        return 0.0
    return lb.ops * p.link_latency_us + link_us(float(lb.tx.max()), float(lb.rx.max()),
                                                float((lb.tx + lb.rx).max()), p)


def pattern_groups(geom: ModelGeometry, mtp: bool) -> list[int]:
    """Shared-layer count after each Full layer (the MTP layer is a group of its own)."""
    out = []
    for c in geom.index_share:
        if c == "F":
            out.append(0)
        else:
            out[-1] += 1
    return out + ([0] * geom.num_mtp_layers if mtp else [])


def selected_tokens(step: StepSpec, geom: ModelGeometry = GLM52) -> float:
    """Union records per request per layer."""
    return step.union_ratio * min(step.context + step.rows, geom.topk)


def moving_fraction(new_fraction: float, held_fraction: float | None) -> float:
    """Share of the remote union that must move: what neither the replica store (``held_fraction``,
    None: no store) nor the reuse pool (``new_fraction`` of the rest missing) holds."""
    if held_fraction is None:
        return new_fraction
    return (1.0 - held_fraction) * new_fraction


def all_local(step: StepSpec) -> bool:
    """The replica store holds the step's whole remote union: the selected path moves nothing."""
    return step.held_fraction is not None and step.held_fraction >= 1.0


def replica_write_us(rows_total: int, record_bytes: int, layers: int, p: NodeProfile) -> float:
    """HBM time of one step's replica writes on one rank: every row's record at every layer."""
    return rows_total * write_hbm_bytes(record_bytes, layers) / (p.hbm_GBps * 1e3)


def step_bytes(step: StepSpec, geom: ModelGeometry = GLM52) -> dict:
    """Bytes of one attention layer per path: ``stock`` is the exact LinkBytes; ``selected`` and
    ``reuse`` are float [D_src, D_dst] byte matrices (diagonal: local) for a union spread evenly
    over owners (``accounting.expected_missing``); ``reuse`` moves ``moving_fraction`` of the
    remote union (replicas, then the reuse pool)."""
    d = step.dcp
    rec = record_layout(step.record_format).record_bytes
    stock = acc.stock_dcp_layer(acc.StockDcpShape(rows=step.batch * step.rows, num_heads=geom.num_heads,
                                                  tp=step.tp, dcp=d, backend=step.backend,
                                                  q_replicated=step.q_replicated))
    u = selected_tokens(step, geom) * step.batch
    sel = acc.expected_missing([u], d, 1.0) * rec
    reuse = acc.expected_missing([u], d, moving_fraction(step.new_fraction, step.held_fraction)) * rec
    return {"stock": stock, "selected": sel, "reuse": reuse, "record_bytes": rec}


def matrix_link_us(m, p: NodeProfile) -> tuple[float, float, float]:
    """(transfer us without latency, busiest rx, total) of one exchange's float [D, D] byte
    matrix (diagonal local)."""
    d = len(m)
    tx = [sum(m[s][t] for t in range(d) if t != s) for s in range(d)]
    rx = [sum(m[s][t] for s in range(d) if s != t) for t in range(d)]
    txrx = max(a + b for a, b in zip(tx, rx)) if d else 0.0
    total = sum(tx)
    return (link_us(max(tx), max(rx), txrx, p) if total else 0.0), max(rx), total


def layer_compute_us(p: NodeProfile, rows_total: int, n_layers: int) -> float:
    """Compute time of one layer that a prefetch can hide behind (the path-independent step
    time spread evenly over the layers): ``c`` of ``chunk_exposed_us``."""
    return (p.base_us + p.base_row_us * (rows_total - 1)) / n_layers


def predict(step: StepSpec, p: NodeProfile, path: str, depth: int = 1,
            geom: ModelGeometry = GLM52) -> PathCost:
    """Path-dependent time of one decode step: ``path`` is ``stock`` or ``selected``.

    ``selected`` uses ``step.new_fraction`` (set it below 1 for reuse) and ``step.held_fraction``
    (replicas); with a replica store both paths pay its writes (``PathCost.write_us``).
    """
    if step.dcp != p.world_size:
        raise ValueError(f"step has dcp={step.dcp} but profile {p.name!r} describes {p.world_size} GPUs")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    mtp = step.rows > 1
    groups = pattern_groups(geom, mtp)
    n_layers = sum(groups) + len(groups)
    n_full = len(groups)
    rows_total = step.batch * step.rows
    k_eff = min(step.context + step.rows, geom.topk)
    attn = n_layers * (p.attn_call_us + p.attn_us_per_ktok * rows_total * k_eff / 1024.0)
    scored = step.context if step.indexer == "replicated" else step.context / step.dcp
    index = n_full * (p.index_call_us + rows_total * scored * p.index_ns_per_token * 1e-3)
    b = step_bytes(step, geom)
    d = step.dcp
    # the store takes the target layers' records (the MTP layer's are not replicated)
    write = 0.0 if step.held_fraction is None else replica_write_us(rows_total, b["record_bytes"], geom.num_layers, p)
    # the candidate all-gather of sharded scoring, once per Full layer, on either path
    merge = acc.sharded_topk_merge(rows_total, geom.topk, d) if step.indexer == "sharded" else acc.empty(d)
    comm = n_full * merge_us(merge, p)
    rx, total = float(merge.rx.max()) * n_full, float(merge.total) * n_full
    if path == "stock":
        if depth:
            raise ValueError("stock DCP has no prefetch depth (pass depth=0)")
        lb = b["stock"]
        comm += n_layers * (lb.ops * p.collective_us + lb_link_us(lb, p))
        rx, total = rx + float(lb.rx.max()) * n_layers, total + float(lb.total) * n_layers
        return PathCost("stock", 0, comm, index, attn, rx, total, write)
    if path != "selected":
        raise ValueError(f"path must be 'stock' or 'selected', got {path!r}")
    if all_local(step):  # no exchange: no pack, copy, barrier or link time
        return PathCost("selected", depth, comm, index, attn, rx, total, write)
    m = b["reuse"]
    x, rx1, tot1 = matrix_link_us(m, p)
    x += p.link_latency_us if tot1 else 0.0
    section = d * (d - 1) * p.copy_us if tot1 else 0.0  # one copy per pair: per exchange, per extra section
    comm += selected_comm_us(x, p.exchange_us + section, section, layer_compute_us(p, rows_total, n_layers),
                             group_counts(groups), depth)
    return PathCost("selected", depth, comm, index, attn, rx + rx1 * n_layers, total + tot1 * n_layers, write)


def merge_us(merge: acc.LinkBytes, p: NodeProfile) -> float:
    """One candidate all-gather of sharded scoring (0 for an empty LinkBytes: replicated scoring)."""
    return merge.ops * p.collective_us + lb_link_us(merge, p)


def scoring_saving_us(p: NodeProfile, rows_context: float, rows_total: int, dcp: int,
                      geom: ModelGeometry = GLM52) -> float:
    """Per Full layer, what sharded scoring saves over replicated scoring (us; > 0: sharded pays).

    rows_context  sum over the step's query rows of the tokens each row scores (its causal prefix)
    rows_total    query rows of the step (the candidate all-gather carries k per row)
    Scoring a ``1/dcp`` share saves ``(1 - 1/dcp)`` of the scoring time and costs the candidates'
    all-gather: one per ``INDEXER_ROWS`` rows (the engine merges a larger step block by block in
    its reserved buffers, ``replicated_indexer.run_indexer``), the bytes the same.
    """
    if dcp == 1 or rows_total == 0:
        return 0.0
    saved = rows_context * (1.0 - 1.0 / dcp) * p.index_ns_per_token * 1e-3
    blocks = -(-rows_total // INDEXER_ROWS)
    return saved - merge_us(acc.sharded_topk_merge(rows_total, geom.topk, dcp), p) - (blocks - 1) * p.collective_us


def choose_indexer(p: NodeProfile, rows_context: float, rows_total: int, dcp: int,
                   geom: ModelGeometry = GLM52) -> str:
    """``sharded`` where it is strictly cheaper (``scoring_saving_us`` > 0), else ``replicated``."""
    return "sharded" if scoring_saving_us(p, rows_context, rows_total, dcp, geom) > 0 else "replicated"


def sharded_scoring_from(p: NodeProfile, batch: int, rows: int, dcp: int, geom: ModelGeometry = GLM52) -> int | None:
    """The least context at which ``choose_indexer`` scores a step of ``batch`` requests of ``rows``
    query rows each (row i of a request at context c scores c + i + 1 tokens) sharded; None at
    DCP 1. The saving is linear in the context, so this solves it, then steps to the exact edge."""
    if dcp == 1:
        return None
    total = batch * rows
    offset = batch * rows * (rows + 1) / 2  # the rows' own positions past the context

    def pays(c: int) -> bool:
        return choose_indexer(p, total * c + offset, total, dcp, geom) == "sharded"

    per_token = total * (1.0 - 1.0 / dcp) * p.index_ns_per_token * 1e-3
    c = max(0, int((merge_us(acc.sharded_topk_merge(total, geom.topk, dcp), p) / per_token) - offset / total))
    while c > 0 and pays(c - 1):
        c -= 1
    while not pays(c):
        c += 1
    return c


def group_counts(groups: list[int]) -> tuple:
    """((shared layers n, how many Full layers have n), ...) sorted by n."""
    counts = {}
    for n in groups:
        counts[n] = counts.get(n, 0) + 1
    return tuple(sorted(counts.items()))


def chunk_terms(counts: tuple, depth: int) -> tuple:
    """The exchanges of a pattern at prefetch ``depth``: ((how many, layers per exchange J), ...).

    A Full layer and its ``n`` Shared layers go in chunks of ``depth + 1`` layers:
    ``(n + 1) // (depth + 1)`` of them and one of the remainder (depth 0: every layer alone).
    Precomputed once per pattern and depth by the policy.
    """
    terms = {}
    for n, count in counts:
        full, rem = divmod(n + 1, depth + 1)
        for mult, size in ((full, depth + 1), (1, rem)):
            if mult and size:
                terms[size] = terms.get(size, 0) + mult * count
    return tuple((mult, size) for size, mult in sorted(terms.items()))


def chunk_exposed_us(J: int, x: float, fixed: float, section: float, c: float, overlap: bool = True) -> float:
    """Exposed time of one exchange of ``J`` layers (module docstring): ``overlap`` (per-layer
    arrival, what ``comm.exchange`` runs) or one arrival for the whole region (F waits for all).

    x  link time of one layer's records     fixed    cost of one exchange (one copy per pair)
    c  compute of one layer                 section  cost of each further section (its copies)
    """
    if not overlap:
        return fixed + J * x
    return fixed + x + (J - 1) * max(0.0, x + section - c)


def exposed_us(x: float, fixed: float, section: float, c: float, terms_by_depth: tuple) -> list:
    """Exposed time of a step's selected-record exchanges, one value per entry of
    ``terms_by_depth`` (``chunk_terms`` per prefetch depth): the sum of ``chunk_exposed_us``."""
    out = []
    for terms in terms_by_depth:
        total = 0.0
        for mult, size in terms:
            total += mult * chunk_exposed_us(size, x, fixed, section, c)
        out.append(total)
    return out


def selected_comm_us(x: float, fixed: float, section: float, c: float, counts: tuple, depth: int) -> float:
    """``exposed_us`` for the ``group_counts`` of a pattern at prefetch ``depth``."""
    return exposed_us(x, fixed, section, c, (chunk_terms(counts, depth),))[0]


def step_time_us(step: StepSpec, p: NodeProfile, path: str, depth: int = 1, geom: ModelGeometry = GLM52) -> float:
    """Whole step: path-independent base plus the path's predicted time."""
    base = p.base_us + p.base_row_us * (step.batch * step.rows - 1)
    return base + predict(step, p, path, depth, geom).total_us


# ---------------------------------------------------------------- published numbers

# prior-art.md, second team, TP4/DCP4, 432-byte records, single stream (tokens/s).
# (label, rows, context, path, tokens/s)
PUBLISHED = (
    ("MTP0 ctx 0", 1, 0, "stock", 57.7), ("MTP0 ctx 64K", 1, 65536, "stock", 56.3),
    ("MTP0 ctx 256K", 1, 262144, "stock", 55.6),
    ("MTP0 ctx 0", 1, 0, "selected", 51.2), ("MTP0 ctx 64K", 1, 65536, "selected", 48.8),
    ("MTP0 ctx 256K", 1, 262144, "selected", 46.5),
    ("MTP3 ctx 0", 4, 0, "stock", 107.4), ("MTP3 ctx 64K", 4, 65536, "stock", 102.8),
    ("MTP3 ctx 0", 4, 0, "selected", 92.1), ("MTP3 ctx 64K", 4, 65536, "selected", 88.1),
)
MTP_ACCEPT = 0.6  # per draft token (prior-art: 0.57-0.66); chain acceptance of 3 drafts
UNION_RATIO_MTP3 = 1.75  # prior-art: union of 4 adjacent rows ~1.75 k


def tokens_per_step(rows: int, accept: float = MTP_ACCEPT) -> float:
    return sum(accept ** i for i in range(rows))


def published_step(rows: int, context: int, path: str) -> StepSpec:
    """The published runs as steps: upstream's stock path used a sharded indexer."""
    return StepSpec(batch=1, rows=rows, context=context, record_format="nvfp4_432",
                    union_ratio=UNION_RATIO_MTP3 if rows > 1 else 1.0,
                    indexer="sharded" if path == "stock" else "replicated")


def residual_table(p: NodeProfile, geom: ModelGeometry = GLM52) -> list[dict]:
    """Predicted vs published tokens/s for every published point (prefetch depth 3)."""
    out = []
    for label, rows, ctx, path, tps in PUBLISHED:
        step = published_step(rows, ctx, path)
        t = step_time_us(step, p, path, 0 if path == "stock" else 3, geom)
        pred = tokens_per_step(rows) / t * 1e6
        out.append({"point": label, "path": path, "published": tps, "predicted": pred,
                    "residual_pct": (pred / tps - 1) * 100})
    return out
