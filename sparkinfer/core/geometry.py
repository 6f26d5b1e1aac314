"""Model geometry the planning core needs (torch-free).

Only the shapes that decide record counts, sizes and attention work live here;
the numbers are GLM-5.2's (``../shared/spec/glm52-and-hardware.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from sparkinfer.core.layouts import INDEX_DIM, LATENT_DIM, ROPE_DIM
from sparkinfer.core.topology import GLM52_NUM_LAYERS, GLM52_PATTERN, IndexSharePattern


@dataclass(frozen=True)
class ModelGeometry:
    """Attention geometry of a DSA model with an optional MTP head.

    The MTP layer has its own MLA cache and indexer cache and always runs the
    indexer, so with MTP enabled it adds one main record and one indexer key
    per token on top of the target layers.
    """

    name: str
    num_layers: int  # target decoder layers
    num_mtp_layers: int  # extra MTP layers that exist in the checkpoint
    num_heads: int  # MLA query heads
    kv_lora_rank: int  # latent width
    rope_dim: int
    index_heads: int
    index_dim: int
    topk: int  # tokens selected per query row
    index_share: str  # one F/S character per target layer

    def __post_init__(self):
        # parse() raises when the pattern does not match the layer count
        IndexSharePattern.parse(self.index_share, self.num_layers)
        for field in ("num_layers", "num_heads", "kv_lora_rank", "rope_dim", "index_heads",
                      "index_dim", "topk"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be >= 1")
        if self.num_mtp_layers < 0:
            raise ValueError(f"{self.name}: num_mtp_layers must be >= 0")

    @classmethod
    def from_hf_config(cls, hf) -> "ModelGeometry":
        """The geometry of a served DSA model from its Hugging Face config (vLLM's ``hf_config``:
        ``index_topk_pattern`` as vLLM reads IndexShare, else every layer Full)."""
        layers = hf.num_hidden_layers
        return cls(name=getattr(hf, "model_type", "dsa"), num_layers=layers,
                   num_mtp_layers=getattr(hf, "num_nextn_predict_layers", 0) or 0,
                   num_heads=hf.num_attention_heads, kv_lora_rank=hf.kv_lora_rank, rope_dim=hf.qk_rope_head_dim,
                   index_heads=hf.index_n_heads, index_dim=hf.index_head_dim, topk=hf.index_topk,
                   index_share=getattr(hf, "index_topk_pattern", None) or "F" * layers)

    @cached_property
    def pattern(self) -> IndexSharePattern:
        return IndexSharePattern.parse(self.index_share, self.num_layers)

    def cached_layers(self, mtp: bool) -> int:
        """Layers that store a main (MLA) record per token."""
        return self.num_layers + (self.num_mtp_layers if mtp else 0)

    def indexer_layers(self, mtp: bool) -> int:
        """Layers that store an indexer key per token: Full target layers (+ MTP layers)."""
        return len(self.pattern.full_layers) + (self.num_mtp_layers if mtp else 0)


GLM52 = ModelGeometry(
    name="GLM-5.2",
    num_layers=GLM52_NUM_LAYERS,
    num_mtp_layers=1,
    num_heads=64,
    kv_lora_rank=LATENT_DIM,
    rope_dim=ROPE_DIM,
    index_heads=32,
    index_dim=INDEX_DIM,
    topk=2048,
    index_share=GLM52_PATTERN,
)
