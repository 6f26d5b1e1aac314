"""What each of the four demo ranks runs: the selected-record path, stock DCP, the reference.

Per Full layer F (and the Shared layers after it, ``decode_groups``):
  indexer top-k on the replicated keys -> per-request MTP union -> transport planes ->
  one layered exchange of F's group into the prefetch ring -> per layer: sparse MLA decode of this
  rank's heads over the gathered workspace.
Per layer, on the same inputs, stock DCP: all-gather the queries, attend the local shard with all
heads, all-gather (partial out, LSE) and merge this rank's heads (torch.distributed gloo).
Both are compared with a float64 dense reference: attention of every row over its own top-k on
the unsharded records.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from sparkinfer.attention import merge_lse, sparse_mla_decode
from sparkinfer.comm.exchange import SelectedExchange
from sparkinfer.comm.host_fabric import HostFabric
from sparkinfer.comm.ring import PrefetchRing, decode_groups
from sparkinfer.comm.slab import SlabLayout
from sparkinfer.comm.synthetic import build_shard
from sparkinfer.core.topology import DcpLayout
from sparkinfer.formats import get_format
from sparkinfer.indexer import indexer_topk
from sparkinfer.plan import build_planes, mtp_union

from .config import DemoConfig
from .inputs import DemoInputs


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


def reference(cfg: DemoConfig, inp: DemoInputs, fmt, layer: int, topk: torch.Tensor, heads: slice) -> torch.Tensor:
    """float64 [M, h, 512]: each row's attention over its own top-k of the unsharded records."""
    R = 1 + cfg.mtp
    out = torch.zeros(cfg.rows, heads.stop - heads.start, 512, dtype=torch.float64)
    for b in range(cfg.batch):
        for r in range(R):
            m = b * R + r
            tok = topk[b, r][topk[b, r] >= 0].long()
            lat, rope = fmt.decode(inp.main[layer, b, tok], backend="host")
            lat, rope = lat.double(), rope.double()
            s = cfg.scale * (inp.q_nope[layer, m, heads].double() @ lat.T + inp.q_rope[layer, m, heads].double() @ rope.T)
            out[m] = torch.softmax(s, dim=-1) @ lat
    return out


def stock_dcp(cfg, inp, fmt, shard, dcp, rank, layer, topk, heads):
    """Stock DCP decode for this rank's heads: query all-gather, local partial, LSE merge."""
    R, K = 1 + cfg.mtp, cfg.topk
    qs = [torch.empty(cfg.rows, cfg.local_heads, 576) for _ in range(cfg.world)]
    mine_q = torch.cat([inp.q_nope[layer, :, heads], inp.q_rope[layer, :, heads]], dim=-1).contiguous()
    dist.all_gather(qs, mine_q)
    q = torch.cat(qs, dim=1)  # [M, H, 576]: heads of rank 0, 1, ... (this rank's own are in there)
    tok = topk.view(cfg.rows, K).long()
    owner, local = dcp.owner_and_local(tok.clamp_min(0))
    b = (torch.arange(cfg.rows) // R)[:, None]
    bs = shard.block_size
    row = shard.block_table.long()[b, local // bs] * bs + local % bs
    idx = torch.where((tok >= 0) & (owner == rank), row, -1).to(torch.int32)
    out, lse = sparse_mla_decode(q[..., :512].contiguous(), q[..., 512:].contiguous(), shard.cache[layer], fmt,
                                 idx, cfg.scale, backend=ATTN_BACKEND)
    part = torch.cat([out, lse[..., None]], dim=-1).contiguous()  # [M, H, 513]: LSE rides along
    parts = [torch.empty_like(part) for _ in range(cfg.world)]
    dist.all_gather(parts, part)
    p = torch.stack(parts)[:, :, heads]
    merged, _ = merge_lse(p[..., :512], p[..., 512])
    return merged


def run_rank(rank: int, world: int, cfg: DemoConfig, inputs_path: str) -> dict:
    """One rank of the step; ``inputs_path``: ``build_inputs(cfg)`` saved by the parent (built once,
    memory-mapped by every rank instead of regenerated four times)."""
    tm = _Timer()
    with tm("inputs"):
        inp = DemoInputs(**torch.load(inputs_path, mmap=True))
        fmt = get_format(cfg.fmt)
        dcp = DcpLayout(world, cfg.interleave)
        shard = build_shard(inp.main, dcp, rank, cfg.block_size, torch.Generator().manual_seed(cfg.seed * 131 + rank))
        if cfg.corrupt_rank == rank:
            shard.cache[:, :, :8] ^= 0x5A  # corrupt the first latent codes of every record this rank owns
    B, R, K, U, M = cfg.batch, 1 + cfg.mtp, cfg.topk, cfg.union_width, cfg.rows
    heads = slice(rank * cfg.local_heads, (rank + 1) * cfg.local_heads)
    tol = 1e-4
    fabric = HostFabric(SlabLayout(world, fmt.record_bytes, capacity=B * U, max_layers=cfg.depth + 1, depth=2),
                        timeout_s=30)
    groups, topks = [], []
    try:
        ring = PrefetchRing(SelectedExchange(fabric), cfg.depth, rows=B * U)
        for group in decode_groups(cfg.pattern, cfg.depth):
            fi = inp.full_slot[group[0]]
            with tm("indexer top-k"):
                topk = torch.stack([indexer_topk(inp.iq[fi, b * R:(b + 1) * R], inp.iw[fi, b * R:(b + 1) * R],
                                                 inp.index[fi, b], inp.pos[b * R:(b + 1) * R], K, backend="torch")
                                    for b in range(B)])  # int32 [B, R, K]
            topks.append(topk)
            with tm("union + planes"):
                union, remap, counts = mtp_union(topk)
                planes = build_planes(union, counts, dcp, B * U)
                slots = torch.where(remap >= 0, remap + (torch.arange(B) * U)[:, None, None], -1)
                slots = slots.view(M, K).to(torch.int32)
            with tm("exchange"):
                pending = ring.prefetch(planes, shard, group)
            err_sel = err_stock = 0.0
            for layer in group:
                with tm("exchange"):
                    ws = ring.get(layer)
                with tm("attention (selected)"):
                    out, _ = sparse_mla_decode(inp.q_nope[layer, :, heads].contiguous(),
                                               inp.q_rope[layer, :, heads].contiguous(), ws, fmt, slots, cfg.scale,
                                               backend=ATTN_BACKEND)
                ring.release(layer)
                with tm("stock DCP (gather+attn+merge)"):
                    out_stock = stock_dcp(cfg, inp, fmt, shard, dcp, rank, layer, topk, heads)
                with tm("reference (float64)"):
                    ref = reference(cfg, inp, fmt, layer, topk, heads)
                scale = 1.0 + float(ref.abs().max())
                err_sel = max(err_sel, float((out.double() - ref).abs().max()) / scale)
                err_stock = max(err_stock, float((out_stock.double() - ref).abs().max()) / scale)
            st = pending.stats
            groups.append({"layers": group, "records_sent": st.records_sent, "bytes_sent": st.bytes_sent,
                           "records_local": st.records_local,
                           "union_ratio": float(counts.float().mean()) / K, "err_selected": err_sel,
                           "err_stock": err_stock})
    finally:
        fabric.close()
    digest = hashlib.sha256(torch.cat([t.flatten() for t in topks]).numpy().tobytes()).hexdigest()
    digests: list = [None] * world
    dist.all_gather_object(digests, digest)
    return {"rank": rank, "groups": groups, "times": dict(tm.s), "tol": tol,
            "topk_identical": len(set(digests)) == 1}
