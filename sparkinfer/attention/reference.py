"""Torch reference of sparse MLA decode: decode the selected records, then fp32 softmax.

Keys are [latent ; rope] (576 wide), values are the latent (512 wide). For row
m and head h with selected records j (indices[m, k] >= 0):

    s_j   = scale * (q_nope[m,h] . latent_j + q_rope[m,h] . rope_j)
    lse   = log sum_j exp(s_j)                (natural log; -inf if no j)
    out   = sum_j exp(s_j - lse) * latent_j   (zeros if no j)
"""

from __future__ import annotations

import torch

from sparkinfer.core.layouts import LATENT_DIM, ROPE_DIM
from sparkinfer.formats import get_format

from .validate import check_decode_inputs


def sparse_mla_decode_torch(q_nope, q_rope, records, fmt, indices, scale, check_indices: bool = True):
    """Same contract as ``sparkinfer.attention.sparse_mla_decode``, computed with torch ops in fp32."""
    check_decode_inputs(q_nope, q_rope, records, fmt, indices, scale, check_indices)
    codec = get_format(fmt)  # keeps the options of a format object (the 432 outer scale)
    m, k = indices.shape
    valid = indices >= 0
    rows = indices.clamp(min=0).reshape(-1).long()
    latent, rope = codec.decode(records.index_select(0, rows))
    latent = latent.view(m, k, LATENT_DIM).float()
    rope = rope.view(m, k, ROPE_DIM).float()
    s = torch.einsum("mhd,mkd->mhk", q_nope.float(), latent) + torch.einsum("mhd,mkd->mhk", q_rope.float(), rope)
    s = (s * scale).masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    anchor = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - anchor[..., None])
    out = torch.einsum("mhk,mkd->mhd", p, latent)
    return out, lse
