"""What each of the four demo ranks runs, step after step: policy, selected records with reuse,
the plain selected exchange, stock DCP, the reference, and the byte checks.

Per step (every rank, identical decisions from identical data):
  write the step's records (rows n .. n + mtp; rejected drafts get junk, overwritten next step)
  into the unsharded cache and this rank's shard -> policy decision (path, prefetch depth) ->
  per Full layer F (and the Shared layers that reuse its top-k):
    indexer top-k on the replicated keys (and again by sharded scoring: each rank its own
    positions, one candidate all-gather; it must give the same top-k) -> per-request MTP union ->
    reuse tracker ``held`` (AND over the group's layers: one destination map) ->
    planes without and with ``held`` ->
    plain selected exchange (synchronous; bytes and workspace checked) ->
    reuse exchange through the prefetch ring in chunks of depth + 1 layers, held rows filled
    from the pool; workspace == gather from the unsharded cache, bit for bit ->
    replica exchange (synchronous): planes without what the replica store holds (the rule's window
    plus the step's own rows, which every rank computed) or the reuse pool holds; a group with
    nothing remote runs no exchange; workspace from the exchange, the pool and the store == the
    gather, bit for bit, and its attention against the reference too ->
    sparse MLA decode of this rank's heads over the workspace;
    float64 reference;
  stock DCP (ag_rs over gloo, bytes counted) for all layers of the step.
  measured bytes per (src, dst) of the three exchanges == ``sparkinfer.core.accounting``;
  acceptance -> if the step went selected, ``tracker.commit`` and received records into the pool.
With ``restart_step``, request 0 ends before that step (``drop_request``) and a new request takes
its slot and blocks. After the last step every request ends: ``drop_request`` must empty every pool.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist

from sparkinfer.attention import sparse_mla_decode
from sparkinfer.comm.exchange import SelectedExchange
from sparkinfer.comm.host_fabric import HostFabric
from sparkinfer.comm.ring import PrefetchRing
from sparkinfer.core.slab import SlabLayout
from sparkinfer.comm.synthetic import build_shard
from sparkinfer.core import accounting as acc
from sparkinfer.core.costmodel import load_profile
from sparkinfer.core.geometry import ModelGeometry
from sparkinfer.core.policy import StepPolicy
from sparkinfer.core.replicas import ReplicaWindow
from sparkinfer.core.reuse import ReuseTracker
from sparkinfer.core.topology import GLM52_PATTERN, DcpLayout
from sparkinfer.formats import get_format
from sparkinfer.indexer import MergeBuffers, all_gather_merge, indexer_topk, shard_candidates
from sparkinfer.indexer.topk import pack_keys
from sparkinfer.plan import build_planes, mtp_union, workspace_slots

from .config import DemoConfig
from .inputs import DemoInputs, committed_lens, final_records, step_queries, step_writes
from .pool import ReusePool
from .stock import SentBytes, stock_dcp_step

# The host fabric runs on CPU tensors: the torch attention path, never the Triton interpreter
# (which TRITON_INTERPRET=1, set by the test suite, would otherwise select: far too slow here).
ATTN_BACKEND = "torch"


class _Timer:
    def __init__(self):
        self.s = defaultdict(float)

    def __call__(self, name):
        timer = self

        class _Span:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.s[name] += time.perf_counter() - self.t
        return _Span()


def reference(cfg: DemoConfig, cache: torch.Tensor, fmt, topk: torch.Tensor, q_nope, q_rope) -> torch.Tensor:
    """float64 [M, h, 512]: each row's attention over its own top-k of the unsharded records
    ``cache`` uint8 [B, P, W] of one layer; q_nope [M, h, 512], q_rope [M, h, 64]."""
    B, R, K = topk.shape
    tok = topk.reshape(B * R, K).long()
    valid = tok >= 0
    b = (torch.arange(B * R) // R)[:, None].expand(-1, K)
    lat, rope = fmt.decode(cache[b, tok.clamp_min(0)].reshape(B * R * K, -1), backend="host")
    lat, rope = lat.double().view(B * R, K, -1), rope.double().view(B * R, K, -1)
    s = cfg.scale * (torch.einsum("mhd,mkd->mhk", q_nope.double(), lat)
                     + torch.einsum("mhd,mkd->mhk", q_rope.double(), rope))
    p = torch.softmax(s.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("mhk,mkd->mhd", p, lat)


def demo_geometry(cfg: DemoConfig) -> ModelGeometry:
    """GLM-5.2's layer pattern and MTP layer at the demo's scaled-down heads and top-k."""
    return ModelGeometry(name="demo", num_layers=len(GLM52_PATTERN), num_mtp_layers=1, num_heads=cfg.heads,
                         kv_lora_rank=512, rope_dim=64, index_heads=cfg.index_heads, index_dim=128,
                         topk=cfg.topk, index_share=GLM52_PATTERN)


def _write(shard, cache, index, dcp, rank, b, pos, main_w, index_w):
    """Store records of requests ``b`` int64 [N] at positions ``pos`` int64 [N] (main_w uint8
    [L, N, W], index_w uint8 [F, N, 132]): everywhere in the unsharded copies, this rank's own in
    its shard (through the request's block table)."""
    cache[:, b, pos] = main_w
    index[:, b, pos] = index_w
    owner, local = dcp.owner_and_local(pos)
    mine = owner == rank
    bs = shard.block_size
    rows = shard.block_table.long()[b[mine], local[mine] // bs] * bs + local[mine] % bs
    shard.cache[:, rows] = main_w[:, mine]


def _chunks(layers: list[int], size: int) -> list[list[int]]:
    return [layers[i:i + size] for i in range(0, len(layers), size)]


def _same_on_all_ranks(obj, world: int) -> bool:
    got: list = [None] * world
    dist.all_gather_object(got, obj)
    return all(g == got[0] for g in got)


def _sharded_topk(q, w, keys, pos, k: int, dcp: DcpLayout, rank: int, world: int) -> torch.Tensor:
    """The request's top-k as sharded scoring computes it: this rank scores the positions it owns
    of ``keys`` uint8 [P, 132], and one all-gather of every rank's candidates merges them."""
    owned = dcp.token_of(rank, torch.arange(dcp.local_len(keys.shape[0], rank)))
    scores, ids = shard_candidates(q, w, keys[owned], owned, pos, k, backend="torch")
    views = MergeBuffers(world, q.shape[0], k, q.device).take(q.shape[0])
    views.mine.copy_(pack_keys(scores, ids.clamp(min=0)))  # -inf (padding) packs to INT64_MIN
    return all_gather_merge(views, lambda out, x: dist.all_gather_single(out, x))


def _gather_rows(rows: list[list[int]], world: int) -> np.ndarray:
    """int64 [K, D_src, D_dst] from each rank's K rows of bytes sent to each dst."""
    mine = torch.tensor(rows, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return torch.stack(out, dim=1).numpy()


def run_rank(rank: int, world: int, cfg: DemoConfig, inputs_path: str) -> dict:
    """One rank of the run; ``inputs_path``: ``build_inputs(cfg)`` saved by the parent (built once,
    memory-mapped by every rank instead of regenerated four times)."""
    tm = _Timer()
    with tm("inputs"):
        inp = DemoInputs(**torch.load(inputs_path, mmap=True))
        fmt = get_format(cfg.fmt)
        W = fmt.record_bytes
        dcp = DcpLayout(world, cfg.interleave)
        pat = cfg.pattern
        cache, index = inp.main.clone(), inp.index.clone()  # the unsharded state, as the steps write it
        shard = build_shard(cache, dcp, rank, cfg.block_size, torch.Generator().manual_seed(cfg.seed * 131 + rank))
        if cfg.corrupt_rank == rank:
            shard.cache[:, :, :8] ^= 0x5A  # corrupt the first latent codes of every record this rank owns
    B, R, K, U, M, h = cfg.batch, 1 + cfg.mtp, cfg.topk, cfg.union_width, cfg.rows, cfg.local_heads
    req_ids = list(range(B))
    lens = committed_lens(inp)
    groups_of = {f: [f] + pat.prefetch_targets(f, pat.num_layers) for f in pat.full_layers}
    tol = 1e-4  # selected records: fp32 attention over the exact records
    tol_stock = 2e-2  # stock DCP: bf16 partial outputs summed in bf16 (vLLM's dtypes): ~4 bf16 roundings
    policy = StepPolicy(load_profile(cfg.profile), demo_geometry(cfg), tp=world, dcp=world, record_format=cfg.fmt,
                        max_depth=cfg.depth, mode=cfg.mode, prior_new_fraction=cfg.reuse_prior)
    # per-layer quotas: layers are visited cyclically, a shared LRU pool below their total union thrashes
    tracker = ReuseTracker(dcp, cfg.reuse_capacity, num_layers=pat.num_layers)
    pool = ReusePool(rank, cfg.reuse_capacity, W)
    slab = SlabLayout(world, W, capacity=B * U, max_layers=cfg.depth + 1, depth=2)
    fab_reuse = HostFabric(slab, timeout_s=30)
    fab_plain = HostFabric(slab, timeout_s=30)
    fab_rep = HostFabric(slab, timeout_s=30)
    # replica store: every rank keeps every request's last ``window`` positions, written at each write
    rule = ReplicaWindow(cfg.window, B) if cfg.window else None
    rep_store = torch.zeros(pat.num_layers, B * max(cfg.window, 1), W, dtype=torch.uint8)

    def keep(step_rep, b, pos, main_w):
        """Write the records main_w [L, N, W] of requests b [N] at positions pos [N] into the store."""
        rows = torch.from_numpy(step_rep.write_rows())
        order = torch.from_numpy(np.lexsort((pos.numpy(), b.numpy())))  # write_rows is request-major
        ok = rows >= 0
        rep_store[:, rows[ok]] = main_w[:, order][:, ok]

    if rule is not None:  # the prefill wrote every cached position
        n0 = lens[0]
        keep(rule.begin_step(req_ids, [0] * B, n0.tolist()), torch.arange(B).repeat_interleave(n0),
             torch.cat([torch.arange(int(c)) for c in n0]), cache[:, torch.arange(B).repeat_interleave(n0),
                                                                   torch.cat([torch.arange(int(c)) for c in n0])])
    sent_stock = SentBytes(rank, world)
    steps, topks = [], []
    prev_union: dict = {}
    new_fraction = union_prev = None
    final = final_records(inp, False)
    try:
        ring = PrefetchRing(SelectedExchange(fab_reuse), cfg.depth, rows=B * U)
        plain = SelectedExchange(fab_plain)
        rep_x = SelectedExchange(fab_rep)
        scratch = torch.zeros(cfg.depth + 1, B * U, W, dtype=torch.uint8)
        for s in range(cfg.steps):
            n = lens[s]
            restart = None
            if s == cfg.restart_step:
                with tm("request end + new request"):
                    # request 0 ends; a new request (new id, new prompt of the same length) takes
                    # its batch slot and KV blocks: its prefill rewrites every position
                    dropped = 0 if cfg.forget_drop else tracker.drop_request(req_ids[0])
                    if rule is not None and not cfg.forget_drop:
                        rule.drop(req_ids[0])
                    restart = {"ended": req_ids[0], "new": max(req_ids) + 1, "dropped": dropped}
                    req_ids[0] = restart["new"]
                    final = final_records(inp, True)
                    P = cache.shape[2]
                    _write(shard, cache, index, dcp, rank, torch.zeros(P, dtype=torch.int64), torch.arange(P),
                           final[0][:, 0], final[1][:, 0])
                    prev_union = {k: v for k, v in prev_union.items() if k[1] != 0}
                    if rule is not None:  # the new request's prefill
                        keep(rule.begin_step([restart["new"]], [0], [P]), torch.zeros(P, dtype=torch.int64),
                             torch.arange(P), final[0][:, 0])
            with tm("cache writes + queries"):
                pos, main_w, index_w = step_writes(inp, s, n, final)
                bb = torch.arange(B)[:, None].expand(B, R).reshape(-1)
                _write(shard, cache, index, dcp, rank, bb, pos.reshape(-1), main_w.flatten(1, 2), index_w.flatten(1, 2))
                step_rep = None
                if rule is not None:
                    step_rep = rule.begin_step(req_ids, n.tolist(), [R] * B)
                    keep(step_rep, bb, pos.reshape(-1), main_w.flatten(1, 2))
                q_nope, q_rope = step_queries(cfg, s, pat.num_layers, rank)  # [L, M, h, *]: this rank's heads
                row_pos = pos.reshape(M)
            with tm("policy"):
                # what every rank knows at step start: rows, contexts, the previous step's union
                # sizes, the share of remote union records its pools did not hold, the steps left
                # (amortisation horizon) and the warm-pool miss share the tracker observed so far
                steady = [tracker.steady_new_fraction(r, cfg.reuse_prior) for r in req_ids]
                # replicas: the share of each request's context the store holds (1: every record local)
                held_fraction = None if step_rep is None else (step_rep.held_counts / n.numpy()).tolist()
                d = policy.decide([R] * B, n.tolist(), union=union_prev, new_fraction=new_fraction,
                                  horizon=cfg.steps - s, steady_fraction=steady, held_fraction=held_fraction)
            decision_agreed = _same_on_all_ranks(tuple(d), world)
            chunk = (d.depth if d.path == "selected" else cfg.depth) + 1
            base = [list(fab_plain.copied_bytes), list(fab_reuse.copied_bytes), list(sent_stock.to),
                    list(fab_plain.copies), list(fab_reuse.copies), list(fab_rep.copied_bytes), list(fab_rep.copies)]
            acc_plain = acc.empty(world)
            acc_reuse = acc.empty(world)
            acc_rep = acc.empty(world)
            rep_exchanges = rep_skipped = 0
            err_sel = err_stock = 0.0
            ws_ok = True
            remote = hits = 0
            sharded_equal = True
            union_sum = overlap_num = overlap_den = 0
            new_num, new_den, union_b = np.zeros(B), np.zeros(B), np.zeros(B)
            kept, unions, topk_of, refs, rep_out = {}, {}, {}, {}, {}
            for f, layers in groups_of.items():
                fi = inp.full_slot[f]
                with tm("indexer top-k"):
                    topk = torch.stack([indexer_topk(inp.iq[s, fi, b * R:(b + 1) * R], inp.iw[fi, b * R:(b + 1) * R],
                                                     index[fi, b], row_pos[b * R:(b + 1) * R], K, backend="torch")
                                        for b in range(B)])  # int32 [B, R, K]
                topks.append(topk)
                topk_of[f] = topk
                with tm("sharded scoring"):  # indexer_scoring = sharded: each rank its own positions
                    sharded_equal &= all(torch.equal(_sharded_topk(inp.iq[s, fi, b * R:(b + 1) * R],
                                                                   inp.iw[fi, b * R:(b + 1) * R], index[fi, b],
                                                                   row_pos[b * R:(b + 1) * R], K, dcp, rank, world),
                                                     topk[b]) for b in range(B))
                with tm("union + reuse + planes"):
                    union, remap, counts = mtp_union(topk)
                    un, cn = union.numpy(), counts.numpy()
                    unions[f] = (un, cn)
                    held = tracker.held_group(layers, req_ids, un, cn)
                    planes_plain = build_planes(union, counts, dcp, B * U)
                    planes_reuse = build_planes(union, counts, dcp, B * U, held=torch.from_numpy(held))
                    slots = workspace_slots(remap, U)
                    live = np.arange(U)[None, :] < cn[:, None]
                    owner = np.asarray(dcp.owner_and_local(np.where(live, un, 0))[0])
                    rem = live[None] & (owner[None] != np.arange(world)[:, None, None])  # [D, B, U]
                    remote += rem.sum() * len(layers)
                    hits += (rem & held).sum() * len(layers)
                    new_num += (rem & ~held).sum(axis=(0, 2))
                    new_den += rem.sum(axis=(0, 2))
                    union_sum += int(cn.sum())
                    union_b += cn
                    for b in range(B):
                        if (f, b) in prev_union:
                            overlap_num += len(prev_union[(f, b)] & set(un[b, :cn[b]].tolist()))
                            overlap_den += int(cn[b])
                    live_rows = torch.from_numpy(np.nonzero(live.reshape(-1))[0])
                    tok_live = torch.from_numpy(un[live]).long()
                    b_live = live_rows // U
                    miss_plain = acc.missing_counts(un, cn, dcp)
                    miss_reuse = acc.missing_counts(un, cn, dcp, held)
                    # replicas: the window and the step's own rows are local on every rank; the pool adds its own
                    local = (step_rep.held_mask(un, cn) | ((un >= n.numpy()[:, None]) & live)) if step_rep is not None \
                        else np.zeros_like(live)
                    held_rep = held | local[None]
                    planes_rep = build_planes(union, counts, dcp, B * U, held=torch.from_numpy(held_rep))
                    miss_rep = acc.missing_counts(un, cn, dcp, held_rep)
                    moves = bool(planes_rep.count.any())
                    if local.any():
                        lb, lu = np.nonzero(local)
                        local_ws = torch.from_numpy(lb * U + lu)
                        local_src = torch.from_numpy(step_rep.rows(lb, un[lb, lu]))
                for part in _chunks(layers, chunk):
                    acc_plain = acc_plain + acc.selected_grouped([miss_plain] * len(part), W)
                    acc_reuse = acc_reuse + acc.selected_grouped([miss_reuse] * len(part), W)
                    with tm("exchange (replicas)"):
                        if moves:
                            acc_rep = acc_rep + acc.selected_grouped([miss_rep] * len(part), W)
                            rep_x.exchange(planes_rep, shard, part, scratch[:len(part)])
                            rep_exchanges += 1
                        else:  # every record local: no pack, no copy, no barrier
                            rep_skipped += 1
                        for j, layer in enumerate(part):
                            pool.fill(scratch[j], tracker.slots(layer, req_ids, un, cn)[rank],
                                      held[rank] & live & ~local)
                            if local.any():
                                scratch[j, local_ws] = rep_store[layer, local_src]
                            ws_ok &= torch.equal(scratch[j, live_rows], cache[layer, b_live, tok_live])
                            out, _ = sparse_mla_decode(q_nope[layer], q_rope[layer], scratch[j], fmt, slots,
                                                       cfg.scale, backend=ATTN_BACKEND)
                            rep_out[layer] = out
                    with tm("exchange (plain selected)"):
                        plain.exchange(planes_plain, shard, part, scratch[:len(part)])
                    for j, layer in enumerate(part):
                        ws_ok &= torch.equal(scratch[j, live_rows], cache[layer, b_live, tok_live])
                    with tm("exchange (selected + reuse)"):
                        ring.prefetch(planes_reuse, shard, part)
                    for layer in part:
                        with tm("exchange (selected + reuse)"):
                            ws = ring.get(layer)
                            pool.fill(ws, tracker.slots(layer, req_ids, un, cn)[rank], held[rank] & live)
                            ws_ok &= torch.equal(ws[live_rows], cache[layer, b_live, tok_live])
                            if d.path == "selected":  # its received records go to the pool after acceptance
                                kept[layer] = ws.clone()
                        with tm("attention (selected)"):
                            out, _ = sparse_mla_decode(q_nope[layer], q_rope[layer], ws, fmt, slots,
                                                       cfg.scale, backend=ATTN_BACKEND)
                        ring.release(layer)
                        with tm("reference (float64)"):
                            ref = reference(cfg, cache[layer], fmt, topk, q_nope[layer], q_rope[layer])
                        refs[layer] = ref
                        scale = 1.0 + float(ref.abs().max())
                        err_sel = max(err_sel, float((out.double() - ref).abs().max()) / scale,
                                      float((rep_out.pop(layer).double() - ref).abs().max()) / scale)
            with tm("stock DCP (ag_rs)"):
                out_stock = stock_dcp_step(sent_stock, q_nope, q_rope, shard, fmt, dcp,
                                           [(layers, topk_of[f]) for f, layers in groups_of.items()], h, cfg.scale,
                                           ATTN_BACKEND)
            for layer, ref in refs.items():
                scale = 1.0 + float(ref.abs().max())
                err_stock = max(err_stock, float((out_stock[layer].double() - ref).abs().max()) / scale)
            with tm("byte check"):
                dist.barrier()  # every copy of the step has landed (its counter was bumped before arrival)
                now = [list(fab_plain.copied_bytes), list(fab_reuse.copied_bytes), list(sent_stock.to),
                       list(fab_plain.copies), list(fab_reuse.copies), list(fab_rep.copied_bytes), list(fab_rep.copies)]
                measured = _gather_rows([[a - b for a, b in zip(x, y)] for x, y in zip(now, base)], world)
                acc_stock = acc.stock_dcp_layer(acc.StockDcpShape(rows=M, num_heads=cfg.heads, tp=world, dcp=world,
                                                                  q_bytes=2, out_bytes=2)).times(pat.num_layers)
                # vLLM's default for GLM-MoE-DSA (replicated queries, one all-to-all): accounted, not run
                stock_qrep = acc.stock_dcp_layer(acc.StockDcpShape(
                    rows=M, num_heads=cfg.heads, tp=world, dcp=world, backend="a2a", q_replicated=True,
                    q_bytes=2, out_bytes=2)).times(pat.num_layers).total
            with tm("reuse commit"):
                after = lens[s + 1].numpy()
                # rejected drafts (positions >= the new committed length) are overwritten next step:
                # drop whatever a pool holds there; only committed positions are ever stored, so
                # nothing may be found (a non-zero count is a tracker invariant broken)
                spec_dropped = sum(tracker.invalidate_from(req, int(after[i])) for i, req in enumerate(req_ids))
                if d.path == "selected":  # a stock step moved no records: nothing new to hold
                    for f, layers in groups_of.items():
                        un, cn = unions[f]
                        for layer in layers:
                            res = tracker.commit(layer, req_ids, un, cn, after)
                            pool.store(kept[layer], res.stored[rank], U)
            new_fraction = (new_num / np.maximum(new_den, 1)).tolist()
            union_prev = (union_b / len(groups_of)).tolist()
            prev_union = {(f, b): set(un[b, :cn[b]].tolist()) for f, (un, cn) in unions.items() for b in range(B)}
            steps.append({
                "step": s, "path": d.path, "depth": d.depth, "stock_us": d.stock_us, "selected_us": d.selected_us,
                "horizon": d.horizon, "plan_stock_us": d.plan_stock_us, "plan_selected_us": d.plan_selected_us,
                "reason": d.reason, "decision_agreed": decision_agreed,
                "measured": {"stock": measured[2].tolist(), "selected": measured[0].tolist(),
                             "reuse": measured[1].tolist(), "replica": measured[5].tolist()},
                "stock_qrep": int(stock_qrep),
                "accounted": {"stock": acc_stock.matrix.tolist(), "selected": acc_plain.matrix.tolist(),
                              "reuse": acc_reuse.matrix.tolist(), "replica": acc_rep.matrix.tolist()},
                "copies": {"selected": (int(measured[3].sum()), acc_plain.copies),
                           "reuse": (int(measured[4].sum()), acc_reuse.copies),
                           "replica": (int(measured[6].sum()), acc_rep.copies)},
                "replica_exchanges": (rep_exchanges, rep_skipped),
                "replica_held": int(step_rep.held_counts.sum()) if step_rep is not None else 0,
                "union_ratio": union_sum / (len(groups_of) * B * K),
                "overlap": overlap_num / overlap_den if overlap_den else None,
                "hit_rate": hits / remote if remote else 0.0,
                "accepted": inp.accept[s].tolist(), "committed": lens[s + 1].tolist(),
                "pool_rows": int(tracker.occupancy()[rank]), "spec_dropped": spec_dropped, "restart": restart,
                "err_selected": err_sel, "err_stock": err_stock, "workspace_exact": bool(ws_ok),
                "sharded_equal": bool(sharded_equal),
            })
        for req in req_ids:
            tracker.drop_request(req)  # every request ends: its entries must all go
        pools_empty = bool((tracker.occupancy() == 0).all())
    finally:
        fab_reuse.close()
        fab_plain.close()
        fab_rep.close()
    digest = hashlib.sha256(torch.cat([t.flatten() for t in topks]).numpy().tobytes()).hexdigest()
    return {"rank": rank, "steps": steps, "times": dict(tm.s), "tol": tol, "tol_stock": tol_stock,
            "topk_identical": _same_on_all_ranks(digest, world), "pools_empty": pools_empty}
