"""KV capacity of a serving profile: bytes per token per rank and tokens that fit (torch-free).

Accounting (``../shared/spec/record-formats.md``, "Sizes that follow"):

* Main records: every cached layer (78 target + the MTP layer when MTP is on)
  stores one record per token on the token's DCP owner, so a rank pays
  ``layers * record_bytes`` per *local* token, on average
  ``layers * record_bytes / dcp`` per token of the sequence.
* Indexer keys (132 B): every Full layer (+ the MTP layer) stores one per token.
  ``replicated``: on every rank for every token (no top-k merge across ranks);
  ``sharded``: on the owner only, like the main records (vLLM's default under DCP).
* TP does not change per-GPU bytes: the MLA latent is shared by all heads, so
  TP ranks outside one DCP group hold copies. vLLM requires dcp to divide tp.

Tokens that fit: the largest sequence length ``N`` whose fullest rank fits the
per-GPU KV budget, ``max_local_len(N) * per_local + N * per_replicated <= budget``,
with ``N`` a whole number of scheduler blocks (``block_size * dcp`` tokens;
vLLM's sparse-MLA caches use 64-token pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sparkinfer.core.geometry import GLM52, ModelGeometry
from sparkinfer.core.layouts import INDEXER_FP8, MAIN_LAYOUTS, layout
from sparkinfer.core.topology import DcpLayout

INDEXER_MODES = ("replicated", "sharded")
GIB = 1 << 30


@dataclass(frozen=True)
class CapacityProfile:
    """A serving configuration to size (one GPU per TP rank, no pipeline parallelism)."""

    tp: int
    dcp: int
    mtp: int  # speculative tokens; > 0 adds the MTP layer's caches
    record_format: str  # main record format, full or short name or width
    indexer: str  # "replicated" or "sharded"
    kv_bytes: int  # KV cache budget per GPU
    interleave: int = 1
    block_size: int = 64
    geometry: ModelGeometry = field(default=GLM52)

    def __post_init__(self):
        for name in ("tp", "dcp", "interleave", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.mtp, bool) or not isinstance(self.mtp, int) or self.mtp < 0:
            raise ValueError(f"mtp must be an int >= 0 (speculative tokens), got {self.mtp!r}")
        if self.tp % self.dcp:
            raise ValueError(f"dcp ({self.dcp}) must divide tp ({self.tp}): DCP ranks are TP ranks")
        if self.indexer not in INDEXER_MODES:
            raise ValueError(f"indexer must be one of {INDEXER_MODES}, got {self.indexer!r}")
        if layout(self.record_format) not in MAIN_LAYOUTS:
            raise ValueError(f"{self.record_format!r} is not a main record format; expected one "
                             f"of {[lay.name for lay in MAIN_LAYOUTS]}")
        if isinstance(self.kv_bytes, bool) or not isinstance(self.kv_bytes, int) or self.kv_bytes < 0:
            raise ValueError(f"kv_bytes must be an int >= 0, got {self.kv_bytes!r}")


@dataclass(frozen=True)
class CapacityPlan:
    profile: CapacityProfile
    record_format: str  # canonical name
    record_bytes: int
    main_layers: int
    indexer_layers: int
    main_bytes_per_local_token: int  # on the token's owner
    indexer_bytes_per_local_token: int  # sharded indexer; 0 when replicated
    indexer_bytes_per_token: int  # replicated indexer, paid for every token; 0 when sharded
    kv_tokens: int  # sequence length that fits, whole scheduler blocks
    local_tokens: int  # tokens the fullest rank holds at kv_tokens
    bytes_used: int  # on the fullest rank at kv_tokens

    @property
    def main_bytes_per_token(self) -> float:
        """Average per rank per token of the sequence (7,268 B for 368 records at DCP4 + MTP)."""
        return self.main_bytes_per_local_token / self.profile.dcp

    @property
    def indexer_bytes_per_token_avg(self) -> float:
        return self.indexer_bytes_per_token + self.indexer_bytes_per_local_token / self.profile.dcp

    @property
    def bytes_per_token(self) -> float:
        return self.main_bytes_per_token + self.indexer_bytes_per_token_avg


def freed_tokens(plan: CapacityPlan, nbytes: int) -> int:
    """Tokens of context ``nbytes`` per rank costs: how many more whole scheduler blocks of sequence
    would fit were those bytes given back to ``plan``'s KV budget (what ``sparkinfer plan`` prints
    beside each reservation: a buffer's price in the capacity DCP is run for)."""
    return capacity_plan(replace(plan.profile, kv_bytes=plan.profile.kv_bytes + nbytes)).kv_tokens - plan.kv_tokens


def rank_bytes(dcp_layout: DcpLayout, seq_len: int, per_local: int, per_token: int) -> int:
    """Bytes on the fullest rank for ``seq_len`` tokens: ``per_local`` for each token it
    owns plus ``per_token`` (replicated data) for every token of the sequence."""
    return dcp_layout.max_local_len(seq_len) * per_local + seq_len * per_token


def capacity_plan(profile: CapacityProfile) -> CapacityPlan:
    geo = profile.geometry
    fmt = layout(profile.record_format)
    mtp_on = profile.mtp > 0
    main_layers = geo.cached_layers(mtp_on)
    idx_layers = geo.indexer_layers(mtp_on)
    main_local = main_layers * fmt.record_bytes
    idx = idx_layers * INDEXER_FP8.record_bytes
    idx_local, idx_token = (0, idx) if profile.indexer == "replicated" else (idx, 0)
    lay = DcpLayout(profile.dcp, profile.interleave)
    granule = profile.block_size * profile.dcp

    def fits(blocks: int) -> bool:
        return rank_bytes(lay, blocks * granule, main_local + idx_local, idx_token) <= profile.kv_bytes

    # Exponential then binary search over whole scheduler blocks (bytes grow with length).
    hi = 1
    while fits(hi):
        hi *= 2
    lo = hi // 2  # fits(lo) holds (lo == 0 trivially)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    n = lo * granule
    return CapacityPlan(
        profile=profile, record_format=fmt.name, record_bytes=fmt.record_bytes,
        main_layers=main_layers, indexer_layers=idx_layers,
        main_bytes_per_local_token=main_local, indexer_bytes_per_local_token=idx_local,
        indexer_bytes_per_token=idx_token, kv_tokens=n, local_tokens=lay.max_local_len(n),
        bytes_used=rank_bytes(lay, n, main_local + idx_local, idx_token),
    )


@dataclass(frozen=True)
class ReplicaCapacity:
    """Where a replica store (``core/replicas.py``) makes every record local, for one profile and
    batch. The store is counted inside the KV budget, so DCP with replicas fits less context."""

    profile: CapacityProfile  # kv_bytes: the whole KV budget per GPU, store included
    batch: int  # requests decoding together (one ring each)
    rows: int  # positions a decode step writes per request (1 + mtp)
    store_budget: int  # bytes per rank given to the store
    window: int  # ring positions per request
    store_bytes: int  # bytes per rank the store takes (window x batch x layers x record bytes)
    local_context: int  # longest context whose decode steps move no record (capped at replica_max_context)
    dcp1_max_context: int  # per request, DCP1 (same TP, same budget)
    dcp_max_context: int  # per request, this DCP without a store
    replica_max_context: int  # per request, this DCP with the store inside the budget

    @property
    def store_bytes_per_request(self) -> int:
        return self.store_bytes // self.batch


def _per_request(plan: CapacityPlan, batch: int) -> int:
    """Per-request context when ``batch`` requests share the cache (whole scheduler blocks)."""
    granule = plan.profile.block_size * plan.profile.dcp
    return plan.kv_tokens // batch // granule * granule


def replica_capacity(profile: CapacityProfile, batch: int, store_budget: int) -> ReplicaCapacity:
    """The context up to which every record is local with a replica store of ``store_budget`` bytes
    per rank taken from ``profile.kv_bytes``, next to DCP1's and this DCP's max context.

    A request of context ``c`` writes ``[c, c + rows)`` in a step; every rank then holds its
    positions ``[c + rows - window, c)``, so the step is all local iff ``c + rows <= window``.
    """
    from sparkinfer.core.replicas import store_bytes, window_for_budget

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if isinstance(store_budget, bool) or not isinstance(store_budget, int) or not 0 <= store_budget <= profile.kv_bytes:
        raise ValueError(f"store_budget must be an int in [0, kv_bytes={profile.kv_bytes}], got {store_budget!r}")
    fmt = layout(profile.record_format)
    # the engine's store holds the target layers only (the MTP layer's records are not planned),
    # as sparkinfer/vllm/replica_budget.py sizes it
    layers = profile.geometry.num_layers
    window = window_for_budget(store_budget, batch, layers, fmt.record_bytes)
    used = store_bytes(window, batch, layers, fmt.record_bytes)
    rows = 1 + profile.mtp
    dcp = _per_request(capacity_plan(profile), batch)
    dcp1 = _per_request(capacity_plan(replace(profile, dcp=1, interleave=1)), batch)
    rep = _per_request(capacity_plan(replace(profile, kv_bytes=profile.kv_bytes - used)), batch)
    return ReplicaCapacity(profile=profile, batch=batch, rows=rows, store_budget=store_budget, window=window,
                           store_bytes=used, local_context=min(max(0, window - rows), rep),
                           dcp1_max_context=dcp1, dcp_max_context=dcp, replica_max_context=rep)
