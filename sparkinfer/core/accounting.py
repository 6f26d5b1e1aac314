"""Exact PCIe byte accounting of one decode step, per path (torch-free).

Three ways to give every rank of a DCP group of size ``D`` what its attention
needs for one layer:

* **stock DCP** (vLLM 0.32, ``vllm/v1/attention/ops/dcp.py``): the CKV stays
  where it is; query heads are all-gathered, each rank attends its shard with
  all gathered heads, and the partial outputs are combined by LSE weight.
* **selected records**: every destination receives, from each token's owner,
  the records of the per-request union of the rows' top-k (TP4/DCP4: every rank
  runs its local heads over the whole union), so ``(D-1)/D`` of the union
  crosses a link once per destination.
* **selected records with reuse**: as above, minus the records a destination
  already holds from earlier steps (``held`` mask, see ``core/reuse.py``).

Every function returns a :class:`LinkBytes`: an int64 matrix ``[D_src, D_dst]``
of bytes sent over PCIe from ``src`` to ``dst`` (diagonal zero; a rank's own
records are a local copy, counted in ``local``), plus how many separate
communication operations and point-to-point copies the path issues. The
physical link of a GPU is its PCIe x16 port: ``tx[r]`` is what leaves rank
``r`` (its upstream direction), ``rx[r]`` what enters it.

Collectives are accounted as their logical point-to-point payloads. A ring
(NCCL) moves the same bytes through every port (each rank sends and receives
``(D-1)`` chunks), so ``tx``/``rx`` per rank and the total are exact for ring
and direct algorithms alike; only which pair carries a chunk differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LSE_BYTES = 4  # forward_mqa returns an fp32 LSE
TOPK_CANDIDATE_BYTES = 8  # (fp32 score, fp32-packed global id) per candidate


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one exchange (or a sum of them) moves inside a DCP group.

    matrix  int64 [D, D]: matrix[s, d] = bytes s sends to d over PCIe; diagonal 0.
    local   int64 [D]: bytes rank r copies from its own shard (no link crossed).
    ops     separate communication operations (collective calls or exchanges).
    copies  point-to-point copies with a non-zero payload (per-copy overheads).
    """

    matrix: np.ndarray
    local: np.ndarray
    ops: int = 0
    copies: int = 0

    def __post_init__(self):
        m = np.asarray(self.matrix)
        if m.ndim != 2 or m.shape[0] != m.shape[1]:
            raise ValueError(f"LinkBytes.matrix must be [D, D], got shape {m.shape}")
        if np.any(np.diag(m) != 0):
            raise ValueError("LinkBytes.matrix diagonal must be 0 (local copies go in .local)")
        if np.asarray(self.local).shape != (m.shape[0],):
            raise ValueError(f"LinkBytes.local must be [{m.shape[0]}], got {np.asarray(self.local).shape}")

    @property
    def world_size(self) -> int:
        return self.matrix.shape[0]

    @property
    def total(self) -> int:
        """Bytes crossing PCIe, all pairs together."""
        return int(self.matrix.sum())

    @property
    def tx(self) -> np.ndarray:
        """int64 [D]: bytes leaving each rank."""
        return self.matrix.sum(axis=1)

    @property
    def rx(self) -> np.ndarray:
        """int64 [D]: bytes entering each rank."""
        return self.matrix.sum(axis=0)

    @property
    def max_link(self) -> int:
        """The busiest port direction: it bounds the transfer time."""
        return int(max(self.tx.max(initial=0), self.rx.max(initial=0)))

    def __add__(self, other: "LinkBytes") -> "LinkBytes":
        if other.world_size != self.world_size:
            raise ValueError(f"cannot add LinkBytes of world sizes {self.world_size} and {other.world_size}")
        return LinkBytes(self.matrix + other.matrix, self.local + other.local,
                         self.ops + other.ops, self.copies + other.copies)

    def times(self, n: int) -> "LinkBytes":
        """The same exchange repeated ``n`` times (e.g. over ``n`` layers)."""
        return LinkBytes(self.matrix * n, self.local * n, self.ops * n, self.copies * n)


def empty(world_size: int) -> LinkBytes:
    return LinkBytes(np.zeros((world_size, world_size), np.int64), np.zeros(world_size, np.int64))


def _uniform(world_size: int, per_pair: int, ops: int) -> LinkBytes:
    """Every rank sends ``per_pair`` bytes to every other rank."""
    m = np.full((world_size, world_size), per_pair, np.int64)
    np.fill_diagonal(m, 0)
    copies = ops * world_size * (world_size - 1) if per_pair > 0 else 0
    return LinkBytes(m, np.zeros(world_size, np.int64), ops if per_pair > 0 else 0, copies)


def _check_nonneg_int(**kw):
    for k, v in kw.items():
        if int(v) != v or v < 0:
            raise ValueError(f"{k} must be a non-negative integer, got {v!r}")


@dataclass(frozen=True)
class StockDcpShape:
    """What stock DCP's decode exchange depends on, for one attention layer.

    rows        query rows in the step, all requests together (B x (1 + MTP) in a pure decode)
    num_heads   attention heads of the model (GLM-5.2: 64)
    tp, dcp     tensor-parallel and DCP sizes; a rank holds ``num_heads // tp``
                heads and, after the query all-gather, attends ``dcp`` times that many
    backend     ``ag_rs`` (vLLM default) or ``a2a`` (``dcp_comm_backend``)
    q_bytes     query element size (bf16: 2; vLLM sends fp8 queries only for a quantized
                cache other than fp8_ds_mla whose backend accepts quantized queries)
    out_bytes   partial-output element size (model dtype, bf16: 2)
    q_dim       absorbed query width (kv_lora 512 + rope 64)
    out_dim     partial output width (kv_lora 512)
    q_replicated  ``dcp_q_replicate``: every rank computes every head's query itself, so nothing
                is gathered (vLLM 0.32's default for GLM-MoE-DSA is this with ``a2a``:
                ``GlmMoeDsaForCausalLMConfig`` calls ``set_dcp_defaults(comm_backend="a2a",
                q_replicate=True)``)
    """

    rows: int
    num_heads: int = 64
    tp: int = 4
    dcp: int = 4
    backend: str = "ag_rs"
    q_bytes: int = 2
    out_bytes: int = 2
    q_dim: int = 576
    out_dim: int = 512
    q_replicated: bool = False

    def __post_init__(self):
        _check_nonneg_int(rows=self.rows, num_heads=self.num_heads, tp=self.tp, dcp=self.dcp,
                        q_bytes=self.q_bytes, out_bytes=self.out_bytes)
        if self.backend not in ("ag_rs", "a2a"):
            raise ValueError(f"backend must be 'ag_rs' or 'a2a' (vLLM dcp_comm_backend), got {self.backend!r}")
        if self.tp < 1 or self.dcp < 1 or self.num_heads % self.tp:
            raise ValueError(f"num_heads {self.num_heads} must divide by tp {self.tp} (tp, dcp >= 1)")
        if self.out_bytes not in (2, 4) and self.backend == "a2a":
            raise ValueError("a2a packs the fp32 LSE into the output dtype: out_bytes must be 2 or 4")

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp


def stock_dcp_layer(s: StockDcpShape) -> LinkBytes:
    """Bytes of stock DCP's decode exchange for one layer.

    Following vLLM 0.32 (``MLAAttention.forward_impl`` in
    ``model_executor/layers/attention/mla_attention.py`` and ``v1/attention/ops/dcp.py``):

    * query: ``MLADCPManager._gather_query`` all-gathers ``mqa_q`` ``[rows, h, 576]``
      along heads (``h = num_heads / tp``), so each rank sends ``rows*h*576*q_bytes``
      to each other rank.
    * ``ag_rs`` (``cp_lse_ag_out_rs``): ``_cp_lse_common`` all-gathers the fp32 LSE
      ``[rows, D*h]``, then ``reduce_scatter(out, dim=1)`` of ``[rows, D*h, 512]``
      leaves each rank its ``h`` heads: ``rows*D*h*4`` + ``rows*h*512*out_bytes``
      per pair.
    * ``a2a`` (``dcp_a2a_lse_reduce``): one ``all_to_all_single`` of
      ``[D, rows, h, 512 + p]`` in the output dtype, the LSE bit-packed into
      ``p = 4 / out_bytes`` trailing elements (``_dcp_a2a_lse_pack_dim``):
      ``rows*h*(512 + p)*out_bytes`` per pair.
    """
    d, h, r = s.dcp, s.local_heads, s.rows
    if d == 1 or r == 0:
        return empty(d)
    q = empty(d) if s.q_replicated else _uniform(d, r * h * s.q_dim * s.q_bytes, 1)
    if s.backend == "ag_rs":
        lse = _uniform(d, r * d * h * LSE_BYTES, 1)
        out = _uniform(d, r * h * s.out_dim * s.out_bytes, 1)
        return q + lse + out
    pack = LSE_BYTES // s.out_bytes
    return q + _uniform(d, r * h * (s.out_dim + pack) * s.out_bytes, 1)


def sharded_topk_merge(rows: int, topk: int, dcp: int) -> LinkBytes:
    """Bytes of upstream's global top-k merge under a sharded indexer, per Full layer.

    ``_merge_dcp_topk_global`` (``model_executor/layers/sparse_attn_indexer.py``)
    packs each rank's local top-k as fp32 pairs ``[rows, topk, 2]`` and all-gathers
    them over the DCP group. A replicated indexer needs no merge (0 bytes).
    """
    _check_nonneg_int(rows=rows, topk=topk, dcp=dcp)
    if dcp == 1 or rows == 0:
        return empty(dcp)
    return _uniform(dcp, rows * topk * TOPK_CANDIDATE_BYTES, 1)


def _owners(layout, tokens: np.ndarray) -> np.ndarray:
    owner, _ = layout.owner_and_local(np.asarray(tokens, dtype=np.int64))
    return np.asarray(owner, dtype=np.int64)


def _validate_union(union, counts, held, world_size):
    union = np.asarray(union)
    counts = np.asarray(counts)
    if union.ndim != 2:
        raise ValueError(f"union must be int [B, U], got shape {union.shape}")
    if counts.shape != (union.shape[0],):
        raise ValueError(f"counts must be int [B={union.shape[0]}], got shape {counts.shape}")
    if np.any(counts < 0) or np.any(counts > union.shape[1]):
        raise ValueError(f"counts must lie in [0, U={union.shape[1]}], got {counts.tolist()}")
    valid = np.arange(union.shape[1])[None, :] < counts[:, None]
    if np.any(union[valid] < 0):
        raise ValueError("union entries before counts[b] must be token ids >= 0")
    if held is not None:
        held = np.asarray(held, dtype=bool)
        if held.shape != (world_size,) + union.shape:
            raise ValueError(f"held must be bool [D={world_size}, B, U]={((world_size,) + union.shape)}, "
                             f"got {held.shape}")
    return union, counts, valid, held


def missing_counts(union, counts, layout, held=None) -> np.ndarray:
    """int64 [D_src, D_dst]: union records ``src`` must send ``dst`` for one layer.

    union   int [B, U] token ids in union order; entries at ``u >= counts[b]`` ignored
    counts  int [B]
    layout  a DCP layout with ``world_size`` and ``owner_and_local(tokens)``
    held    optional bool [D_dst, B, U]: ``dst`` already holds that record (reuse);
            a rank's own tokens are always local, whatever ``held`` says.
    The diagonal counts each rank's own union records (local copies).
    """
    d = layout.world_size
    union, counts, valid, held = _validate_union(union, counts, held, d)
    n = np.zeros((d, d), np.int64)
    if not valid.any():
        return n
    owner = _owners(layout, np.where(valid, union, 0))
    for dst in range(d):
        need = valid if held is None else valid & ~held[dst]
        need = need | (valid & (owner == dst))
        n[:, dst] = np.bincount(owner[need], minlength=d)
    return n


def selected_layer(missing: np.ndarray, record_bytes: int) -> LinkBytes:
    """Bytes of one selected-record exchange from ``missing_counts`` (``[D_src, D_dst]``).

    One packed copy per (src, dst) pair with a non-zero count; the diagonal is local.
    """
    m = np.asarray(missing, dtype=np.int64)
    _check_nonneg_int(record_bytes=record_bytes)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or np.any(m < 0):
        raise ValueError(f"missing must be non-negative int [D, D], got shape {m.shape}")
    local = np.diag(m).copy() * record_bytes
    link = m * record_bytes
    np.fill_diagonal(link, 0)
    copies = int(np.count_nonzero(link))
    return LinkBytes(link, local, 1 if copies else 0, copies)


def selected_grouped(missing_per_layer, record_bytes: int) -> LinkBytes:
    """Layered exchange: several layers sharing one top-k moved as one exchange.

    ``missing_per_layer`` is a sequence of ``[D, D]`` counts (one per layer of the
    group, e.g. a Full layer's S1/S2/S3 prefetched together). Bytes add up; the
    group issues one operation and one copy per (src, dst) pair.
    """
    ms = [np.asarray(m, dtype=np.int64) for m in missing_per_layer]
    if not ms:
        raise ValueError("selected_grouped needs at least one layer")
    return selected_layer(sum(ms[1:], ms[0].copy()), record_bytes)


def gathered_layer(contexts, layout, record_bytes: int) -> LinkBytes:
    """Bytes of one layer of a gathered step (the prefill side of selected records).

    Every rank receives each request's cached prefix (positions ``0 .. contexts[b] - 1``) from the
    tokens' owners (``layout``: a ``DcpLayout``); the step's own tokens are computed on every rank
    (hidden states are replicated over TP) and never travel, so a cold prefill moves nothing.
    The diagonal counts each rank's own cached records (local copies).
    """
    d = layout.world_size
    owned = np.array([sum(layout.local_len(int(c), s) for c in contexts) for s in range(d)], np.int64)
    return selected_layer(np.repeat(owned[:, None], d, axis=1), record_bytes)


def expected_missing(union_counts, world_size: int, new_fraction: float = 1.0) -> np.ndarray:
    """float64 [D, D]: the planning estimate of ``missing_counts`` from counts alone.

    Tokens spread evenly over owners (vLLM's interleaved placement), so each
    owner holds ``U/D`` of a request's union; ``new_fraction`` of the remote ones
    are not yet held by the destination. This is what the cost model and the
    policy use before the union is known; ``missing_counts`` is the exact count.
    """
    if not 0.0 <= new_fraction <= 1.0:
        raise ValueError(f"new_fraction must be in [0, 1], got {new_fraction}")
    u = float(np.sum(np.asarray(union_counts, dtype=np.float64)))
    per_owner = u / world_size
    m = np.full((world_size, world_size), per_owner * new_fraction)
    np.fill_diagonal(m, per_owner)
    return m
