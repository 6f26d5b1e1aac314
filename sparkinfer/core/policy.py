"""Per-step choice between stock DCP and selected records, and the prefetch depth (torch-free).

``StepPolicy`` turns the cost model (``core/costmodel.py``) into a few
precomputed coefficients per (profile, model, parallel sizes, record format),
so one decision is a handful of float operations on values every rank has
(request rows, context lengths, union sizes, reuse fractions): it is
deterministic and identical on every rank, and cheap enough for every step
(``benchmarks/policy_bench.py`` measures it).

The comparison leaves out what both paths pay equally in sparkinfer (the
replicated indexer and the attention FLOPs): only communication and exchange
costs differ. Ties go to stock DCP (the oracle), then to the shallower
prefetch ring (less memory). ``mode`` forces a path: ``stock`` always, and
``selected`` whenever it is feasible (its workspace fits), else stock with the
reason logged.

Amortised reuse (``auto`` only). A cold reuse pool makes the first selected
step pay for every remote record, so a per-step comparison can rate it slower
than stock forever and the pool never warms. Given ``horizon`` H (the decode
steps left to amortise over, e.g. the batch's smallest remaining budget) and
a ``steady_fraction`` (the share of the remote union a warm pool still misses:
the tracker's observed warm miss rate, or the configured ``prior_new_fraction``),
``decide`` compares two plans the model prices in full:

    stock plan     H * stock
    selected plan  selected(now, current new fraction)
                   + (H - 1) * selected(best depth, steady fraction)

and picks the cheaper (ties to stock). The warm-up step's extra cost is thus
charged against the saving of the steps after it. With H = 1 (or no steady
fraction) it is the per-step rule; ``mode`` stock/selected ignore H.

Replica records (``core/replicas.py``). ``decide(..., held_fraction=...)`` gives, per request, the
share of its remote union that the replica store holds (local on every rank). The reuse pool's
``new_fraction`` / ``steady_fraction`` then apply to the rest: the share that moves is
``(1 - held) * new`` (``costmodel.moving_fraction``). A step whose remote union is entirely
replica-held runs no exchange (zero fixed cost), so it costs only the replica writes, which both
paths pay, and is strictly cheaper than stock: ``auto`` takes it (depth 0, no ring). Without
``held_fraction`` every decision is the one before replicas, bit for bit.

Mode sources, later wins: the profile's ``mode``, the environment variable
``VLLM_SPARKINFER_MODE`` (``sparkinfer.config``), an explicit argument.
"""

from __future__ import annotations

import logging
import operator
import os
from typing import NamedTuple, Sequence

from sparkinfer.core import accounting as acc
from sparkinfer.core import costmodel as cm
from sparkinfer.core.geometry import GLM52, ModelGeometry
from sparkinfer.core.layouts import layout as record_layout

log = logging.getLogger(__name__)


def resolve_mode(profile: cm.NodeProfile, env=None, override: str | None = None) -> str:
    """auto | stock | selected from the profile, then the environment, then ``override``."""
    from sparkinfer.config import MODES, env_var

    env = os.environ if env is None else env
    mode, source = profile.mode, f"profile {profile.name!r}"
    if env.get(env_var("mode")):
        mode, source = env[env_var("mode")].strip().lower(), env_var("mode")
    if override is not None:
        mode, source = override, "argument"
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r} (from {source})")
    return mode


class Decision(NamedTuple):
    path: str  # "stock" or "selected"
    depth: int  # prefetch depth (0 for stock)
    stock_us: float  # modelled path-dependent time of each path (communication part)
    selected_us: float
    reason: str
    plan_stock_us: float = 0.0  # the two plans over the amortisation horizon (= the per-step costs at H = 1)
    plan_selected_us: float = 0.0
    horizon: int = 1


class StepPolicy:
    """Decides each step; built once per engine configuration.

    max_depth        deepest prefetch ring allowed (config ``prefetch_depth``)
    workspace_bytes  per-rank bytes for received records; a step whose union
                     records x (depth + 1) do not fit cannot go selected
    prior_new_fraction  steady-state share of the remote union a warm pool misses, used
                     when ``decide`` gets a horizon but no observed steady fraction
                     (None: no prior, the per-step rule then)
    """

    def __init__(self, profile: cm.NodeProfile, geom: ModelGeometry = GLM52, *, tp: int = 4,
                 dcp: int | None = None, record_format: str = "nvfp4_368", backend: str = "ag_rs",
                 q_replicated: bool = False, max_depth: int = 3, workspace_bytes: int | None = None,
                 mode: str | None = None, env=None, prior_new_fraction: float | None = None):
        dcp = profile.world_size if dcp is None else dcp
        if dcp != profile.world_size:
            raise ValueError(f"dcp={dcp} but profile {profile.name!r} describes {profile.world_size} GPUs")
        if max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {max_depth}")
        if prior_new_fraction is not None and not 0.0 <= prior_new_fraction <= 1.0:
            raise ValueError(f"prior_new_fraction must be in [0, 1], got {prior_new_fraction}")
        self.prior_new_fraction = prior_new_fraction
        self.profile, self.geom, self.dcp, self.max_depth = profile, geom, dcp, max_depth
        self.mode = resolve_mode(profile, env, mode)
        self.record_bytes = record_layout(record_format).record_bytes
        self.workspace_bytes = workspace_bytes
        p = profile
        # stock: per layer ops * collective + link time, linear in query rows
        one = acc.stock_dcp_layer(acc.StockDcpShape(rows=1, num_heads=geom.num_heads, tp=tp, dcp=dcp,
                                                    backend=backend, q_replicated=q_replicated))
        self._stock_fixed = one.ops * (p.collective_us + p.link_latency_us)
        self._stock_per_row = float(cm.link_us(one.tx.max(), one.rx.max(), (one.tx + one.rx).max(), p))
        # selected: link time per union record per layer (even spread over owners), fixed costs
        self._sel_per_record = float(
            cm.matrix_link_us(acc.expected_missing([1.0], dcp, 1.0) * self.record_bytes, p)[0])
        self._copies_us = dcp * (dcp - 1) * p.copy_us
        self._tables = {}
        for mtp in (False, True):
            groups = cm.pattern_groups(geom, mtp)
            counts = cm.group_counts(groups)
            terms = tuple(cm.chunk_terms(counts, d) for d in range(max_depth + 1))
            self._tables[mtp] = (sum(groups) + len(groups), terms)
        # Per-call constants for ``decide``, hoisted here so a call does no attribute chasing or
        # per-call allocation. ``decide`` evaluates the same expressions as ``costs`` in the same
        # order, so its floats equal ``costs``' bit for bit (tests/core/test_policy.py checks it on a
        # randomized grid); a reassociated closed form (e.g. per-piece slopes of the piecewise
        # linear exposed time) would change the last bits, hence decisions at exact ties.
        self._lat, self._exchange = p.link_latency_us, p.exchange_us
        self._base_us, self._base_row_us = p.base_us, p.base_row_us
        self._depths = range(max_depth + 1)
        self._fast = {mtp: (n_layers, _compile_exposed(terms)) for mtp, (n_layers, terms) in self._tables.items()}

    def costs(self, rows: int, union_records: float, mtp: bool, *, all_local: bool = False,
              replicas: bool = False) -> tuple[float, list[float]]:
        """(stock us, [selected us at depth 0..max_depth]) for a step with ``rows`` query rows in
        total and ``union_records`` union records to move per layer (reuse already applied).
        ``replicas``: a replica store is written (both paths pay ``replica_write_us``);
        ``all_local``: it holds every remote record, so the selected path runs no exchange.
        The straightforward evaluation through ``costmodel``; ``decide`` inlines the same arithmetic."""
        p = self.profile
        n_layers, terms = self._tables[mtp]
        stock = n_layers * (self._stock_fixed + rows * self._stock_per_row)
        moving = union_records > 0
        x = p.link_latency_us + union_records * self._sel_per_record if moving else 0.0
        section = self._copies_us if moving else 0.0  # nothing moved: no copies
        fixed = p.exchange_us + section
        c = cm.layer_compute_us(p, rows, n_layers)
        sel = cm.exposed_us(x, fixed, section, c, terms)
        if not (replicas or all_local):
            return stock, sel
        write = cm.replica_write_us(rows, self.record_bytes, self.geom.num_layers, p)  # target layers only
        if all_local:
            return stock + write, [write] * len(terms)
        return stock + write, [s + write for s in sel]

    def _exposed(self, moved: float, c: float, exposed) -> tuple:
        """Selected cost per depth for ``moved`` records per layer: ``costs``' second value."""
        if moved > 0:
            return exposed(self._lat + moved * self._sel_per_record, self._exchange + self._copies_us,
                           self._copies_us, c)
        return exposed(0.0, self._exchange + 0.0, 0.0, c)  # nothing moved: no link time, no copies

    def _pick(self, sels: tuple, slot_bytes: float | None) -> tuple[int, float]:
        """(cheapest depth whose ring of ``slot_bytes`` x (depth + 1) fits the workspace, or -1;
        its cost). ``slot_bytes`` None: every depth fits. Ties keep the shallower ring, as ``min``
        (first of equal values) does; ``index`` finds that same first entry."""
        if slot_bytes is None:
            us = min(sels)
            return sels.index(us), us
        ws, best, us = self.workspace_bytes, -1, 0.0
        for d in self._depths:
            if slot_bytes * (d + 1) <= ws and (best < 0 or sels[d] < us):
                best, us = d, sels[d]
        return best, us

    def decide(self, rows: Sequence[int], contexts: Sequence[int], union: Sequence[float] | None = None,
               new_fraction: Sequence[float] | None = None, horizon: int = 1,
               steady_fraction: Sequence[float] | None = None,
               held_fraction: Sequence[float] | None = None) -> Decision:
        """The path for one step.

        rows             query rows per request (1 + speculative tokens)
        contexts         context length per request
        union            union records per request per layer (default: min(context + rows, topk))
        new_fraction     share of each request's remote union not yet held (default 1: no reuse);
                         with ``held_fraction``, of the part the replica store does not hold
        horizon          decode steps to amortise a selected plan over (1: per-step rule)
        steady_fraction  per request, the share a warm pool still misses (default: the prior)
        held_fraction    per request, the share of the remote union held by the replica store
                         (None: no replica store; all 1.0: nothing remote, no exchange)
        """
        b = len(rows)
        if len(contexts) != b or (union is not None and len(union) != b) or (
                new_fraction is not None and len(new_fraction) != b) or (
                steady_fraction is not None and len(steady_fraction) != b) or (
                held_fraction is not None and len(held_fraction) != b):
            raise ValueError("rows, contexts, union, new_fraction, steady_fraction and held_fraction need one "
                             "entry per request")
        if held_fraction is not None:
            return self._decide_replicas(rows, contexts, union, new_fraction, horizon, steady_fraction,
                                         held_fraction)
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"horizon must be an int >= 1, got {horizon!r}")
        total_rows = sum(rows)
        if union is None:
            k = self.geom.topk
            if b and min(contexts) + min(rows) >= k:  # every request saturates (long contexts): all k
                union = [k] * b
            else:
                union = [k if k < c + r else c + r for c, r in zip(contexts, rows)]  # = min(c + r, k)
        records = sum(union)
        moved = records if new_fraction is None else sum(map(operator.mul, union, new_fraction))
        if total_rows == 0:
            return Decision("stock", 0, 0.0, 0.0, "empty step")
        mtp = total_rows > b
        n_layers, exposed = self._fast[mtp]
        stock = n_layers * (self._stock_fixed + total_rows * self._stock_per_row)
        c = (self._base_us + self._base_row_us * (total_rows - 1)) / n_layers  # cm.layer_compute_us
        sels = self._exposed(moved, c, exposed)
        slot = None if self.workspace_bytes is None else records * self.record_bytes
        return self._choose(b, stock, sels, slot, horizon, steady_fraction,
                            lambda ss: self._exposed(sum(map(operator.mul, union, ss)), c, exposed))

    def _choose(self, b: int, stock: float, sels: tuple, slot, horizon: int, steady_fraction, steady_sels,
                local: bool = False) -> Decision:
        """The rule once the costs are known: ``sels`` per depth, ``steady_sels(fractions)`` the
        per-depth costs of a warm step, ``local`` a step without remote records."""
        mode = self.mode
        if mode == "stock":
            return Decision("stock", 0, stock, min(sels), "mode=stock", stock, min(sels))
        depth, sel = self._pick(sels, slot)
        if depth < 0:
            min_sel = min(sels)
            log.info("selected records do not fit the %d-byte workspace; using stock DCP", self.workspace_bytes)
            return Decision("stock", 0, stock, min_sel, "workspace too small", stock, min_sel)
        if mode == "selected":
            return Decision("selected", depth, stock, sel, "mode=selected", stock, sel)
        if local:  # no remote record: no exchange, strictly cheaper than stock's collectives
            return Decision("selected", depth, stock, sel, "model: every record local (replicas), no exchange",
                            stock, sel)
        if steady_fraction is None and horizon != 1 and self.prior_new_fraction is not None:
            steady_fraction = [self.prior_new_fraction] * b
        if horizon == 1 or steady_fraction is None:
            if sel < stock:
                return Decision("selected", depth, stock, sel, "model: selected faster", stock, sel)
            return Decision("stock", 0, stock, sel, "model: stock faster or equal", stock, sel)
        for f in steady_fraction:
            if not 0.0 <= f <= 1.0:
                raise ValueError(f"steady_fraction entries must be in [0, 1], got {list(steady_fraction)}")
        steady = self._pick(steady_sels(steady_fraction), slot)[1]
        plan_stock = horizon * stock
        plan_sel = sel + (horizon - 1) * steady
        if plan_sel < plan_stock:
            return Decision("selected", depth, stock, sel, f"model: selected faster over {horizon} steps at steady "
                            "reuse", plan_stock, plan_sel, horizon)
        return Decision("stock", 0, stock, sel, f"model: stock faster or equal over {horizon} steps at steady reuse",
                        plan_stock, plan_sel, horizon)

    def _decide_replicas(self, rows, contexts, union, new_fraction, horizon, steady_fraction, held_fraction):
        """``decide`` with a replica store: the same rule, with the held share local, a step
        without remote records priced with no exchange, and the store's writes on both paths."""
        b = len(rows)
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"horizon must be an int >= 1, got {horizon!r}")
        for name, fr in (("held_fraction", held_fraction), ("new_fraction", new_fraction),
                         ("steady_fraction", steady_fraction)):
            if fr is not None and any(not 0.0 <= f <= 1.0 for f in fr):
                raise ValueError(f"{name} entries must be in [0, 1], got {list(fr)}")
        total_rows = sum(rows)
        if total_rows == 0:
            return Decision("stock", 0, 0.0, 0.0, "empty step")
        if union is None:
            union = [min(c + r, self.geom.topk) for c, r in zip(contexts, rows)]
        records = sum(union)
        outside = [u * (1.0 - h) for u, h in zip(union, held_fraction)]  # not replica-held
        local = sum(outside) == 0  # the replica store holds every remote record
        moved = sum(outside) if new_fraction is None else sum(map(operator.mul, outside, new_fraction))
        mtp = total_rows > b
        # the arithmetic of ``costs(..., all_local=local, replicas=True)``, through the compiled form
        n_layers, exposed = self._fast[mtp]
        write = cm.replica_write_us(total_rows, self.record_bytes, self.geom.num_layers, self.profile)
        stock = n_layers * (self._stock_fixed + total_rows * self._stock_per_row) + write
        c = (self._base_us + self._base_row_us * (total_rows - 1)) / n_layers
        sels = (write,) * len(self._depths) if local else tuple(s + write for s in self._exposed(moved, c, exposed))
        slot = None if self.workspace_bytes is None else records * self.record_bytes
        return self._choose(b, stock, sels, slot, horizon, steady_fraction,
                            lambda ss: tuple(s + write for s in self._exposed(
                                sum(map(operator.mul, outside, ss)), c, exposed)), local)


def _compile_exposed(terms_by_depth: tuple):
    """``cm.exposed_us(x, fixed, section, c, terms_by_depth)`` as straight-line code for one
    pattern: ``f(x, fixed, section, c) -> (cost at depth 0, 1, ...)``.

    The chunk terms are constants of (geometry, max depth), so unrolling them removes the
    per-call loops and tuple unpacking; every expression is the one ``cm.chunk_exposed_us``
    evaluates, in the same order and with the same int/float operands, so the results are bit
    for bit equal.
    """
    lines = ["def exposed(x, fixed, section, c):", "    v = x + section - c", "    h = v if v > 0.0 else 0.0  # max(0.0, v)"]
    for d, terms in enumerate(terms_by_depth):
        lines.append(f"    t{d} = 0.0")
        for mult, size in terms:
            lines.append(f"    t{d} += {mult!r} * (fixed + x + {size - 1!r} * h)")
    lines.append(f"    return ({''.join(f't{d}, ' for d in range(len(terms_by_depth)))})")
    namespace = {}
    exec("\n".join(lines), namespace)  # noqa: S102 - source built above from ints and fixed text
    return namespace["exposed"]
