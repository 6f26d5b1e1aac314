"""The demo's model state, derived from the seed alone so every rank builds identical copies.

Shapes (L = 79 layers, F = Full layers, B requests, T context, M = B * (1 + mtp) rows):
    main     uint8 [L, B, T, W]      main records in the chosen format (the unsharded cache)
    index    uint8 [F, B, T, 132]    indexer keys (replicated: every rank holds all of them)
    q_nope   float32 [L, M, H, 512]  absorbed queries; q_rope float32 [L, M, H, 64]
    iq       float32 [F, M, Hi, 128] indexer queries, iw float32 [F, M, Hi] head weights
    pos      int64 [M]               row b * R + r sits at position T - R + r (causal bound)
The MTP rows of one request share a base query plus noise, so their top-k sets overlap as adjacent
rows' do in trained models, which is what the per-request union exploits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.core.layouts import INDEX_DIM, LATENT_DIM, ROPE_DIM
from sparkinfer.formats import get_format

from .config import DemoConfig


@dataclass
class DemoInputs:
    main: torch.Tensor
    index: torch.Tensor
    q_nope: torch.Tensor
    q_rope: torch.Tensor
    iq: torch.Tensor
    iw: torch.Tensor
    pos: torch.Tensor
    full_slot: dict  # Full layer id -> index into ``index`` / ``iq``


def _related_rows(g, cfg: DemoConfig, *tail) -> torch.Tensor:
    """[M, *tail]: per request a base vector, per MTP row base + 0.35 * noise."""
    R = 1 + cfg.mtp
    base = torch.randn(cfg.batch, 1, *tail, generator=g)
    return (base + 0.35 * torch.randn(cfg.batch, R, *tail, generator=g)).reshape(cfg.rows, *tail)


def save_inputs(cfg: DemoConfig, path: str) -> None:
    """``build_inputs(cfg)`` to ``path`` (the ranks load it memory-mapped)."""
    torch.save(vars(build_inputs(cfg)), path)


def build_inputs(cfg: DemoConfig) -> DemoInputs:
    g = torch.Generator().manual_seed(cfg.seed)
    pat = cfg.pattern
    L, B, T, H = pat.num_layers, cfg.batch, cfg.context, cfg.heads
    fmt, ifmt = get_format(cfg.fmt), get_format("indexer_fp8")
    latent = torch.randn(L * B * T, LATENT_DIM, generator=g)
    rope = torch.randn(L * B * T, ROPE_DIM, generator=g)
    main = fmt.encode(latent, rope, backend="host").view(L, B, T, fmt.record_bytes)
    fulls = pat.full_layers
    keys = torch.randn(len(fulls) * B * T, INDEX_DIM, generator=g)
    index = ifmt.encode(keys, backend="host").view(len(fulls), B, T, ifmt.record_bytes)
    q_nope = _related_rows(g, cfg, L, H, LATENT_DIM).transpose(0, 1).contiguous()
    q_rope = _related_rows(g, cfg, L, H, ROPE_DIM).transpose(0, 1).contiguous()
    iq = _related_rows(g, cfg, len(fulls), cfg.index_heads, INDEX_DIM).transpose(0, 1).contiguous()
    iw = torch.rand(len(fulls), cfg.rows, cfg.index_heads, generator=g) + 0.1
    R = 1 + cfg.mtp
    pos = (T - R + torch.arange(R)).repeat(B).to(torch.int64)
    return DemoInputs(main, index, q_nope, q_rope, iq, iw, pos, {f: i for i, f in enumerate(fulls)})
