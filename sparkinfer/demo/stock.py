"""Stock DCP decode as vLLM's ``ag_rs`` backend runs it, over gloo, counting the bytes it sends.

For each layer (vLLM 0.32 ``MLAAttention.forward_impl`` + ``cp_lse_ag_out_rs``): all-gather the
absorbed queries ``[M, h, 576]`` along heads, attend this rank's shard with all ``D * h`` heads,
all-gather the fp32 LSE ``[M, D * h]``, rescale the partial output by ``exp(lse - lse_global)``
and reduce-scatter ``[M, D * h, 512]`` over heads, which leaves this rank its ``h`` heads merged.

The demo issues each kind of collective once per step for all layers (``[L, ...]`` stacked)
instead of once per layer (gloo calls are slow on a loaded CPU): the bytes on every pair are the
same (what ``sparkinfer.core.accounting.stock_dcp_layer`` counts), only the call count differs.
Dtypes as in vLLM with a bf16 model: queries and partial outputs travel as bf16, the LSE as fp32
(the accounting's ``q_bytes = out_bytes = 2``). The demo's queries are bf16 values already
(``inputs.step_queries``), so only the bf16 partial outputs and their bf16 sum lose precision.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparkinfer.attention import sparse_mla_decode


class SentBytes:
    """Bytes this rank's collectives send to each peer: a collective is counted as its logical
    point-to-point payloads (an all-gather sends the input to every peer, a reduce-scatter sends
    chunk d to rank d), the accounting's convention."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.to = [0] * world

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        for d in range(self.world):
            if d != self.rank:
                self.to[d] += t.numel() * t.element_size()
        return out

    def reduce_scatter(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        out = torch.empty_like(chunks[self.rank])
        dist.reduce_scatter(out, chunks)
        for d, c in enumerate(chunks):
            if d != self.rank:
                self.to[d] += c.numel() * c.element_size()
        return out


def stock_dcp_step(sent: SentBytes, q_nope, q_rope, shard, fmt, dcp, groups: list, local_heads: int,
                   scale: float, backend: str) -> dict:
    """{layer: float32 [M, h, 512]}: this rank's heads of every layer in ``groups`` by stock DCP.

    q_nope [L, M, h, 512], q_rope [L, M, h, 64]: this rank's heads' queries (the others' arrive);
    groups: (layers, topk int32 [B, R, K] token ids, -1 pad) pairs, a top-k shared by its layers;
    shard: this rank's records."""
    r, D, h = sent.rank, sent.world, local_heads
    layers = [l for ls, _ in groups for l in ls]
    mine = torch.cat([q_nope[layers], q_rope[layers]], dim=-1)
    q = torch.cat(sent.all_gather(mine.to(torch.bfloat16).contiguous()), dim=2).float()  # [J, M, D*h, 576]
    bs = shard.block_size
    outs, lses = [], []
    for ls, topk in groups:
        B, R, K = topk.shape
        tok = topk.reshape(B * R, K).long()
        owner, local = dcp.owner_and_local(tok.clamp_min(0))
        b = (torch.arange(B * R) // R)[:, None]
        row = shard.block_table.long()[b, local // bs] * bs + local % bs
        idx = torch.where((tok >= 0) & (owner == r), row, -1).to(torch.int32)
        for layer in ls:
            j = len(outs)
            o, lse = sparse_mla_decode(q[j, ..., :512].contiguous(), q[j, ..., 512:].contiguous(), shard.cache[layer],
                                       fmt, idx, scale, backend=backend)
            outs.append(o)
            lses.append(lse)
    out, lse = torch.stack(outs), torch.stack(lses)  # [J, M, D*h, 512], [J, M, D*h]
    glob = torch.logsumexp(torch.stack(sent.all_gather(lse)), dim=0)
    # a rank without any of a row's tokens has lse = -inf and a zero partial: weight 0
    w = torch.where(torch.isfinite(lse), torch.exp(lse - glob), torch.zeros_like(lse))
    scaled = (out * w[..., None]).to(torch.bfloat16)
    merged = sent.reduce_scatter([scaled[:, :, d * h:(d + 1) * h].contiguous() for d in range(D)])
    return dict(zip(layers, merged.float()))
