"""The demo's model state, derived from the seed alone so every rank builds identical copies.

Shapes (L = 79 layers, F = Full layers, B requests, P = ``cfg.max_len`` cache positions,
S steps, R = 1 + mtp rows per request, M = B * R rows):
    main        uint8 [L, B, P, W]       final (committed) main records in the chosen format
    junk        uint8 [S, L, B, R, W]    what step s writes at a draft position it then rejects
    index       uint8 [F, B, P, 132]     final indexer keys (replicated: every rank holds all)
    junk_index  uint8 [S, F, B, R, 132]  indexer keys of rejected drafts
    iq          float32 [S, F, M, Hi, 128] indexer queries, a slow random walk over the steps
    iw          float32 [F, M, Hi]       indexer head weights
    accept      int64 [S, B]             drafts accepted by step s (a prefix: 0..mtp)
    start       int64 [B]                committed length before step 0 (context - R)
    fresh       uint8 [L, P, W]          final records of the request that replaces request 0 at
                                         ``cfg.restart_step`` (empty [0, P, W] without a restart)
    fresh_index uint8 [F, P, 132]        its indexer keys
Step s of request b runs rows at positions n .. n + mtp (n = committed length) and writes their
records; positions <= n + accept[s, b] become committed, the rest hold ``junk`` until the next
step overwrites them. Attention queries (not stored: large, cheap to regenerate) come from
``step_queries``. The MTP rows of one request share a base query plus noise, so their top-k sets
overlap as adjacent rows' do in trained models (the per-request union), and the indexer queries
drift slowly across steps, so consecutive steps' top-k sets overlap (cross-step reuse).
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
    junk: torch.Tensor
    index: torch.Tensor
    junk_index: torch.Tensor
    iq: torch.Tensor
    iw: torch.Tensor
    accept: torch.Tensor
    start: torch.Tensor
    fresh: torch.Tensor
    fresh_index: torch.Tensor
    full_slot: dict  # Full layer id -> index into ``index`` / ``iq``


def _related_rows(g, cfg: DemoConfig, *tail) -> torch.Tensor:
    """[M, *tail]: per request a base vector, per MTP row base + 0.35 * noise."""
    R = 1 + cfg.mtp
    base = torch.randn(cfg.batch, 1, *tail, generator=g)
    return (base + 0.35 * torch.randn(cfg.batch, R, *tail, generator=g)).reshape(cfg.rows, *tail)


def save_inputs(cfg: DemoConfig, path: str) -> None:
    """``build_inputs(cfg)`` to ``path`` (the ranks load it memory-mapped)."""
    torch.save(vars(build_inputs(cfg)), path)


def _records(fmt, n: int, g) -> torch.Tensor:
    latent = torch.randn(n, LATENT_DIM, generator=g)
    rope = torch.randn(n, ROPE_DIM, generator=g)
    return fmt.encode(latent, rope, backend="host")


def build_inputs(cfg: DemoConfig) -> DemoInputs:
    g = torch.Generator().manual_seed(cfg.seed)
    pat = cfg.pattern
    L, B, P, S, R = pat.num_layers, cfg.batch, cfg.max_len, cfg.steps, 1 + cfg.mtp
    fmt, ifmt = get_format(cfg.fmt), get_format("indexer_fp8")
    F = len(pat.full_layers)
    main = _records(fmt, L * B * P, g).view(L, B, P, fmt.record_bytes)
    junk = _records(fmt, S * L * B * R, g).view(S, L, B, R, fmt.record_bytes)
    index = ifmt.encode(torch.randn(F * B * P, INDEX_DIM, generator=g), backend="host").view(F, B, P, -1)
    junk_index = ifmt.encode(torch.randn(S * F * B * R, INDEX_DIM, generator=g), backend="host").view(S, F, B, R, -1)
    iq = [_related_rows(g, cfg, F, cfg.index_heads, INDEX_DIM).transpose(0, 1)]
    for _ in range(1, S):
        iq.append(iq[-1] + cfg.drift * torch.randn(iq[-1].shape, generator=g))
    iw = torch.rand(F, cfg.rows, cfg.index_heads, generator=g) + 0.1
    # accepted drafts: the prefix of independent Bernoulli(accept) trials before the first failure
    ok = torch.rand(S, B, cfg.mtp, generator=g) < cfg.accept
    accept = torch.cumprod(ok.to(torch.int64), dim=2).sum(dim=2)
    start = torch.full((B,), cfg.context - R, dtype=torch.int64)
    n_fresh = L if cfg.restart_step >= 0 else 0  # drawn last: a restart leaves the rest unchanged
    fresh = _records(fmt, n_fresh * P, g).view(n_fresh, P, fmt.record_bytes)
    fresh_index = ifmt.encode(torch.randn(F * P if n_fresh else 0, INDEX_DIM, generator=g), backend="host")
    fresh_index = fresh_index.view(F if n_fresh else 0, P, ifmt.record_bytes)
    return DemoInputs(main, junk, index, junk_index, torch.stack(iq).contiguous(), iw, accept, start, fresh,
                      fresh_index, {f: i for i, f in enumerate(pat.full_layers)})


def final_records(inp: DemoInputs, restarted: bool):
    """(main uint8 [L, B, P, W], index uint8 [F, B, P, 132]): every position's final record, with
    request 0's replaced by the new request's once it ``restarted``."""
    if not restarted:
        return inp.main, inp.index
    main, index = inp.main.clone(), inp.index.clone()
    main[:, 0], index[:, 0] = inp.fresh, inp.fresh_index
    return main, index


def committed_lens(inp: DemoInputs) -> torch.Tensor:
    """int64 [S + 1, B]: committed length before each step (and after the last)."""
    return torch.cat([inp.start[None], inp.start[None] + torch.cumsum(inp.accept + 1, dim=0)])


def step_writes(inp: DemoInputs, step: int, n: torch.Tensor, final=None):
    """What step ``step`` writes, per request b: positions n[b] + r and, per r, either the final
    record (an accepted draft or the step's first row; from ``final`` = ``final_records(...)``,
    default the original requests') or the step's junk (a rejected draft).

    Returns (pos int64 [B, R], main uint8 [L, B, R, W], index uint8 [F, B, R, 132])."""
    main_f, index_f = final if final is not None else (inp.main, inp.index)
    B, R = inp.junk.shape[2], inp.junk.shape[3]
    pos = n[:, None] + torch.arange(R)[None, :]
    keep = torch.arange(R)[None, :] <= inp.accept[step][:, None]  # [B, R]
    b = torch.arange(B)[:, None]
    main = torch.where(keep[None, :, :, None], main_f[:, b, pos], inp.junk[step])
    index = torch.where(keep[None, :, :, None], index_f[:, b, pos], inp.junk_index[step])
    return pos, main, index


def step_queries(cfg: DemoConfig, step: int, layers: int, rank: int):
    """Attention queries of rank ``rank``'s heads in a step: (q_nope float32 [L, M, h, 512], q_rope
    float32 [L, M, h, 64]), bf16 values (a bf16 model's queries) held in float32. Each rank draws
    only its own heads (seeded by step and rank); stock DCP all-gathers the others'."""
    g = torch.Generator().manual_seed((cfg.seed * 7919 + 1 + step) * 64 + rank)
    h = cfg.local_heads
    q_nope = _related_rows(g, cfg, layers, h, LATENT_DIM).transpose(0, 1)
    q_rope = _related_rows(g, cfg, layers, h, ROPE_DIM).transpose(0, 1)
    return q_nope.to(torch.bfloat16).float().contiguous(), q_rope.to(torch.bfloat16).float().contiguous()
