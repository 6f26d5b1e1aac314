"""DCP token placement and the IndexShare layer pattern (torch-free).

Placement follows vLLM's decode-context-parallel rule for DCP size ``D`` and
interleave ``I`` (``cp_kv_cache_interleave_size``): tokens are dealt to ranks in
runs of ``I``, round robin::

    owner(t) = (t // I) % D
    local(t) = (t // (D * I)) * I + t % I      # ordinal of t in its owner's shard

Only ``//`` and ``%`` are used, so the same code runs on Python ints, numpy
arrays and torch tensors (CPU or CUDA) without importing torch here.

IndexShare (GLM-5.2's DSA): only "Full" layers run the lightning indexer;
each "Shared" layer reuses the top-k of the last Full layer before it. The
pattern is one character per target layer, ``F`` or ``S``. A wrong or truncated
pattern silently degrades output, so parsing checks it against the layer count.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from numbers import Integral


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


@dataclass(frozen=True)
class DcpLayout:
    """Where each token of a sequence lives in a DCP group of ``world_size`` ranks."""

    world_size: int
    interleave: int = 1

    def __post_init__(self):
        _check_int("world_size", self.world_size, 1)
        _check_int("interleave", self.interleave, 1)

    @property
    def period(self) -> int:
        """Tokens after which the placement repeats (``world_size * interleave``)."""
        return self.world_size * self.interleave

    def owner_and_local(self, tokens):
        """(owner rank, local ordinal) of token ids ``tokens`` (int, numpy array or torch tensor).

        Tokens must be >= 0: -1 pads have no owner, mask them before calling.
        A Python int is checked; arrays are not (that would force a device sync),
        and the result has the input's type and shape.
        """
        if isinstance(tokens, Integral):
            _check_int("token", tokens, 0)
        i, d = self.interleave, self.world_size
        owner = (tokens // i) % d
        local = (tokens // (d * i)) * i + tokens % i
        return owner, local

    def token_of(self, rank, local):
        """Inverse of ``owner_and_local``: the token id held by ``rank`` at ordinal ``local``."""
        if isinstance(rank, Integral):
            self._check_rank(rank)
        if isinstance(local, Integral):
            _check_int("local ordinal", local, 0)
        i = self.interleave
        return (local // i) * self.period + rank * i + local % i

    def local_len(self, seq_len: int, rank: int) -> int:
        """Number of the tokens ``0 .. seq_len-1`` that ``rank`` holds."""
        _check_int("seq_len", seq_len, 0)
        self._check_rank(rank)
        full, rem = divmod(seq_len, self.period)
        tail = min(max(rem - rank * self.interleave, 0), self.interleave)
        return full * self.interleave + tail

    def max_local_len(self, seq_len: int) -> int:
        """Tokens on the fullest rank (rank 0 always holds at least as many as any other)."""
        return self.local_len(seq_len, 0)

    def _check_rank(self, rank) -> None:
        _check_int("rank", rank, 0)
        if rank >= self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")


GLM52_PATTERN = "FFFSSS" + "FSSS" * 18
GLM52_NUM_LAYERS = 78


@dataclass(frozen=True)
class IndexSharePattern:
    """Which target layers run the indexer (``F``) and which reuse a top-k (``S``)."""

    pattern: str

    def __post_init__(self):
        bad = sorted(set(self.pattern) - {"F", "S"})
        if bad:
            raise ValueError(f"IndexShare pattern may contain only 'F' (Full) and 'S' (Shared); "
                             f"found {bad!r}")
        if not self.pattern:
            raise ValueError("IndexShare pattern is empty")
        if self.pattern[0] != "F":
            raise ValueError("IndexShare pattern must start with 'F': layer 0 has no earlier "
                             "Full layer whose top-k it could share")

    @classmethod
    def parse(cls, text: str, num_layers: int) -> "IndexSharePattern":
        """Pattern from ``text`` (surrounding whitespace ignored), checked against ``num_layers``."""
        if not isinstance(text, str):
            raise ValueError(f"IndexShare pattern must be a str, got {type(text).__name__}")
        _check_int("num_layers", num_layers, 1)
        text = text.strip()
        if len(text) != num_layers:
            raise ValueError(f"IndexShare pattern has {len(text)} characters but the model has "
                             f"{num_layers} layers; a truncated pattern silently degrades output")
        return cls(text)

    @classmethod
    def glm52(cls) -> "IndexSharePattern":
        """GLM-5.2: ``FFFSSS`` + ``FSSS`` * 18 (21 Full, 57 Shared layers)."""
        return cls.parse(GLM52_PATTERN, GLM52_NUM_LAYERS)

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @cached_property
    def full_layers(self) -> list[int]:
        return [i for i, c in enumerate(self.pattern) if c == "F"]

    @cached_property
    def _source(self) -> tuple[int, ...]:
        src, last = [], 0
        for i, c in enumerate(self.pattern):
            if c == "F":
                last = i
            src.append(last)
        return tuple(src)

    def is_full(self, layer: int) -> bool:
        self._check_layer(layer)
        return self.pattern[layer] == "F"

    def topk_source(self, layer: int) -> int:
        """The Full layer whose top-k ``layer`` uses (itself for a Full layer)."""
        self._check_layer(layer)
        return self._source[layer]

    def prefetch_targets(self, layer: int, depth: int) -> list[int]:
        """The Shared layers that follow Full ``layer`` and reuse its top-k, at most ``depth``."""
        self._check_layer(layer)
        _check_int("depth", depth, 0)
        if self.pattern[layer] != "F":
            raise ValueError(f"layer {layer} is Shared; prefetch targets follow a Full layer "
                             f"(its source is layer {self._source[layer]})")
        out = []
        for nxt in range(layer + 1, min(self.num_layers, layer + 1 + depth)):
            if self.pattern[nxt] == "F":
                break
            out.append(nxt)
        return out

    def _check_layer(self, layer) -> None:
        _check_int("layer", layer, 0)
        if layer >= self.num_layers:
            raise ValueError(f"layer {layer} out of range for a {self.num_layers}-layer pattern")
