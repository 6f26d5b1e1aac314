"""The attention arena's layout: every buffer a layer's sparse-MLA attention (and the sparkinfer
indexer's q quantization) writes and consumes inside the layer, in one device allocation (torch-free).

Why an arena made at engine start: vLLM measures the memory a forward takes in its profile run,
and there the attention returns before any kernel (no metadata). Whatever the attention allocates
inside a forward is in no memory vLLM measured; sized by the step's rows, at GLM-5.2's main profile
(8,192 tokens x 64 heads, k 2,048) one prefill chunk's output and scratch came to ~1.7 GiB per rank
on top of the KV cache. So the bytes are laid out here, reserved out of the KV budget
(``sparkinfer.vllm.reservations``: ``attention_workspace``), allocated once by the worker at
engine start (``sparkinfer.decode.layer_buffers.AttentionArena.reserve``) and handed out as views.

The output and LSE cover a step's rows; the decode kernel's scratch covers one block (the forward
attends a larger step block by block), which is what keeps the scratch independent of the chunk
size. A block is bounded twice: at most ``BLOCK_ROWS`` rows (its top-k rows and compacted indices,
16 B per row and index), and at most ``BLOCK_PROGRAMS`` decode programs (row x head block of
``HEAD_BLOCK`` x split), whose fp32 partials it keeps (33 KiB per program of 16 heads). The
partials are needed for splits (a small block: the kernel splits each row's keys to fill one wave
of the GPU; the last split of a row and head block merges them, counted by its ticket); 512
programs are 2.7 waves of an RTX PRO 6000's 188 SMs and 3.9 of an H200's 132, so a block still
fills the GPU while its partials stay 16 MiB whatever the heads (they were 1,024 rows x H heads:
128 MiB at 64 heads). A step of 2,048 rows at 64 heads is then 16 blocks of 128 rows, a few
launches each; prefill runs eagerly, where a launch's host cost (~5 us) is below the GPU time of
a block's 512 programs. Segments, each from a 256-byte boundary (M = ``rows``, H = ``heads``,
K = ``topk``, B = ``min(M, BLOCK_ROWS)``, P = ``BLOCK_PROGRAMS x min(H, HEAD_BLOCK)``, N = ``rows x
index_heads``):

==============  ========================================================================
out             [M, H, 512], bf16 for a bf16 model (the decode kernel rounds into it), else fp32
lse             float32 [M, H]
topk_rows       int64 [B, K]: a block's cache rows of its top-k (``triton_paging.topk_rows``)
indices         int64 [B, K]: the decode kernel's compacted indices (cache rows of a strided
                view pass 2^31: ``triton_decode``'s index widths)
partial_out     float32 [S, m, h, 512] with S x m x h <= P: the S splits' partial outputs of an
                m-row block of h <= H heads (S x m x ceil(h / HEAD_BLOCK) <= BLOCK_PROGRAMS)
partial_lse     float32 [S, m, h], S x m x h <= P
tickets         int32 [m, ceil(h / HEAD_BLOCK)] of a block with S > 1: the splits' merge tickets,
                zero at allocation (``ZEROED``) and left zero by every call (``triton_decode``)
indexer_q       float8 [N, index_dim]: the indexer's quantized q (vLLM quantizes it per head row)
indexer_scales  float32 [N, index_dim / index_group]
==============  ========================================================================

A cache write stages nothing: its one kernel reads the model's bf16 or fp32 rows and encodes them
straight into the paged cache (``paged_sparse_mla.forward_write_records``).

Heads: stock DCP replicates the queries over the DCP group (vLLM all-gathers them), so a rank
attends ``heads per TP rank x DCP`` heads; the selected path attends its own, fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_ROWS = 256  # most rows one decode launch takes: its top-k scratch is sized by it, not by the step
BLOCK_PROGRAMS = 512  # most decode programs (row x head block x split) one launch keeps partials of
HEAD_BLOCK = 16  # heads per decode program (``attention.triton_decode.BLOCK_H``)
ZEROED = ("tickets",)  # segments that must hold zeros when the arena is allocated
ALIGN = 256
LATENT_DIM = 512


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class AttentionWorkspace:
    rows: int  # the most query rows one layer attends in a step
    heads: int  # query heads a rank attends (stock DCP: heads per TP rank x DCP)
    topk: int
    out_bytes: int  # 2: a bf16 model's output; 4: fp32
    index_heads: int = 0  # the sparkinfer indexer's q rows per token (0: vLLM's own indexer serves)
    index_dim: int = 128
    index_group: int = 128  # the quantization group of the indexer's q (vLLM's is its head dim)

    def __post_init__(self):
        for name in ("rows", "heads", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"AttentionWorkspace.{name} must be >= 1, got {getattr(self, name)}")
        if self.out_bytes not in (2, 4):
            raise ValueError(f"AttentionWorkspace.out_bytes must be 2 (bf16) or 4 (fp32), got {self.out_bytes}")
        if self.index_heads and self.index_dim % self.index_group:
            raise ValueError(f"index_dim {self.index_dim} is not a multiple of index_group {self.index_group}")

    @property
    def block_rows(self) -> int:
        return min(BLOCK_ROWS, self.rows)

    def segments(self) -> dict[str, int]:
        """Bytes of every segment, in arena order (the table above)."""
        m, h, k, b = self.rows, self.heads, self.topk, self.block_rows
        n, p = m * self.index_heads, BLOCK_PROGRAMS * min(h, HEAD_BLOCK)
        return {"out": m * h * LATENT_DIM * self.out_bytes, "lse": 4 * m * h, "topk_rows": 8 * b * k,
                "indices": 8 * b * k, "partial_out": 4 * p * LATENT_DIM,
                "partial_lse": 4 * p, "tickets": 4 * BLOCK_PROGRAMS, "indexer_q": n * self.index_dim,
                "indexer_scales": 4 * n * (self.index_dim // self.index_group)}

    @property
    def nbytes(self) -> int:
        return arena_bytes(self.segments())


def head_blocks(h: int) -> int:
    """Decode programs per row and split: heads in blocks of ``HEAD_BLOCK``."""
    return -(-h // HEAD_BLOCK)


def block_rows(h: int) -> int:
    """Rows of one decode launch at H heads: at most ``BLOCK_ROWS``, and at most ``BLOCK_PROGRAMS``
    programs of one split."""
    return max(1, min(BLOCK_ROWS, BLOCK_PROGRAMS // head_blocks(h)))


def call_plan(m: int, h: int, k: int, out_bytes: int, splits_for) -> tuple[dict[str, int], list[tuple[int, int, int]]]:
    """({segment: bytes} one attention call of M rows, H heads and K indices needs, [(a, b, S)]: its
    blocks [a, b) of at most ``block_rows(H)`` rows and their splits). ``splits_for(n)`` is the
    decode kernel's choice for n rows (one wave of the GPU); a block of n rows takes at most
    ``BLOCK_PROGRAMS // (n x head_blocks(H))``, so its partials and tickets fit the layout's. Partials
    and tickets are used for S > 1 only."""
    blocks, size, hb = [], block_rows(h), head_blocks(h)
    for a in range(0, m, size):
        n = min(m, a + size) - a
        blocks.append((a, a + n, max(1, min(splits_for(n), BLOCK_PROGRAMS // (n * hb)))))
    rows = max((b - a for a, b, _ in blocks), default=0)
    partial = max(((b - a) * s for a, b, s in blocks if s > 1), default=0)
    ticketed = max(((b - a) * hb for a, b, s in blocks if s > 1), default=0)
    return ({"out": m * h * LATENT_DIM * out_bytes, "lse": 4 * m * h, "topk_rows": 8 * rows * k,
             "indices": 8 * rows * k, "partial_out": 4 * partial * h * LATENT_DIM,
             "partial_lse": 4 * partial * h, "tickets": 4 * ticketed}, blocks)


def offsets(segments: dict[str, int]) -> dict[str, tuple[int, int]]:
    """{segment: (byte offset, bytes)} of an arena holding ``segments`` in order, every offset a
    multiple of ``ALIGN``."""
    at, out = 0, {}
    for name, size in segments.items():
        out[name] = (at, size)
        at += _up(size)
    return out


def arena_bytes(segments: dict[str, int]) -> int:
    return sum(_up(size) for size in segments.values())
