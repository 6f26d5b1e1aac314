"""Where the DSA indexer cache lives under DCP: replicated or sharded (called from patch 0003).

Upstream vLLM shards the indexer keys like the main records (token t on rank owner(t)), so every
rank scores only its own tokens and the per-rank top-k candidates are merged across the DCP group
(``_merge_dcp_topk_global``). sparkinfer replicates the indexer instead: every rank writes every
token's 132-byte key and computes the same global top-k itself, so there is no merge and every rank
knows every selected token (what the selected-record exchange plans from). On GLM-5.2 that costs
22 x 132 = 2,904 B per token per rank against ~7-13 KB of sharded main records.

The indexer is replicated when all of these hold:
  * DCP > 1 (with DCP = 1 both layouts are the same);
  * the main MLA cache uses a sparkinfer record format, which only the sparkinfer backend reads, so
    stock backends (FlashMLA sparse on H100/H200, FlashInfer SM120) keep upstream behaviour exactly;
  * the sparkinfer mode is not ``stock`` (``stock`` is the oracle: upstream sharding and merge).
Then the indexer's cache spec is not DCP-sharded and the indexer runs with DCP = 1 semantics
(global sequence lengths, no cross-rank top-k merge); the main records stay sharded.
"""

from __future__ import annotations

from sparkinfer.config import from_additional_config
from sparkinfer.vllm.cache_dtypes import is_sparkinfer_cache_dtype


def indexer_replicated(vllm_config) -> bool:
    """True when the indexer cache is replicated on every DCP rank (see the module docstring)."""
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    cache_dtype = vllm_config.cache_config.cache_dtype
    mode = from_additional_config(vllm_config.additional_config).mode
    return dcp > 1 and is_sparkinfer_cache_dtype(cache_dtype) and mode != "stock"


def indexer_dcp_world_size(vllm_config) -> int:
    """The DCP world size the indexer (its op and its metadata) runs with: 1 when replicated."""
    if indexer_replicated(vllm_config):
        return 1
    return vllm_config.parallel_config.decode_context_parallel_size
