"""`sparkinfer plan` against vLLM 0.32's own KV sizing (issue 3's cross-check; marker vllm).

Runs in the venv of ``vllm_patches/install_cpu.sh`` (``.venv-vllm/bin/python -m pytest``); skips
where vllm is not importable. The KV cache specs are built the way the patched model builds them:
one ``MLAAttentionSpec`` per cached layer (78 target + the MTP layer) with ``state_content_bytes``
= the record width and ``dcp_sharded`` (mla_attention.py), and one per indexer layer (the 21 Full
layers + MTP) with 132 uint8 bytes per token, ``cache_role=INDEXER`` and ``dcp_sharded`` false when
sparkinfer replicates the indexer, then with block_size 64 x DCP (deepseek_v2.py after patch
0003: one indexer page per sharded main page's tokens). vLLM then sizes them with
``kv_cache_utils.estimate_max_model_len`` (what it reports as the maximum model length that fits)
and, where its allocator can group the specs, ``get_kv_cache_groups`` +
``get_kv_cache_config_from_groups`` (the blocks it really allocates).
"""

import types

import pytest

from sparkinfer.core.capacity import GIB, CapacityProfile, capacity_plan
from sparkinfer.core.geometry import GLM52

vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

FORMATS = {"nvfp4_368": ("nvfp4_ds_mla:fp8-rope-368", 368), "nvfp4_432": ("nvfp4_ds_mla:bf16-rope-432", 432),
           "fp8_ds_mla": ("fp8_ds_mla", 656)}
BLOCK, DCP, TP = 64, 4, 4


def glm52_specs(fmt: str, indexer: str, mtp: bool) -> dict:
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    cache_dtype, record = FORMATS[fmt]
    full = set(GLM52.pattern.full_layers) | ({GLM52.num_layers} if mtp else set())
    specs = {}
    for layer in range(GLM52.cached_layers(mtp)):
        if layer in full:  # the model registers a layer's indexer cache before its attention
            specs[f"model.layers.{layer}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=BLOCK if indexer == "sharded" else BLOCK * DCP, num_kv_heads=1, max_tp_shards=1,
                head_size=132, dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER,
                dcp_sharded=indexer == "sharded")
        specs[f"model.layers.{layer}.self_attn.attn"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
            cache_dtype_str=cache_dtype, state_content_bytes=record, is_index_group_leader=layer in full)
    return specs


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import CacheConfig, ParallelConfig, VllmConfig

    cfg = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=TP, decode_context_parallel_size=DCP),
                     cache_config=CacheConfig(block_size=BLOCK))
    cfg.cache_config.kv_cache_layout = "LBHNC"  # resolved by the engine core normally; 1 head, no effect
    # No checkpoint here: only max_model_len is read, and estimate_max_model_len searches below it.
    object.__setattr__(cfg, "model_config", types.SimpleNamespace(max_model_len=1 << 24,
                                                                  original_max_model_len=1 << 24))
    assert cfg.parallel_config.decode_context_parallel_size == DCP
    return cfg


def plan(fmt, indexer, mtp, kv_bytes):
    return capacity_plan(CapacityProfile(tp=TP, dcp=DCP, mtp=3 if mtp else 0, record_format=fmt, indexer=indexer,
                                         kv_bytes=kv_bytes))


CASES = [(fmt, indexer, mtp, kv) for fmt in FORMATS for indexer in ("replicated", "sharded")
         for mtp in (True, False) for kv in (10 * GIB, 8 * GIB + 12345, GIB // 3)]


@pytest.mark.parametrize("fmt,indexer,mtp,kv", CASES)
def test_max_tokens_match_vllm_estimate(vllm_config, fmt, indexer, mtp, kv):
    from vllm.v1.core.kv_cache_utils import estimate_max_model_len

    specs = glm52_specs(fmt, indexer, mtp)
    p = plan(fmt, indexer, mtp, kv)
    # bytes per token per rank, from vLLM's page sizes (a page holds block_size tokens of this rank)
    local = sum(s.page_size_bytes / s.block_size for s in specs.values() if s.dcp_sharded)
    every = sum(s.page_size_bytes / s.block_size for s in specs.values() if not s.dcp_sharded)
    assert local == p.main_bytes_per_local_token + p.indexer_bytes_per_local_token
    assert every == p.indexer_bytes_per_token
    # plan counts whole scheduler blocks (BLOCK x DCP tokens); vLLM's search is per token
    est = estimate_max_model_len(vllm_config, specs, kv)
    assert est // (BLOCK * DCP) * BLOCK * DCP == p.kv_tokens, (est, p.kv_tokens)


def allocate(vllm_config, specs, layout, kv_bytes):
    """(KV cache config, max model length) from vLLM's allocator with a given physical layout."""
    from vllm.v1.core.kv_cache_utils import (_estimate_max_model_len_from_groups,
                                             get_kv_cache_config_from_groups, get_kv_cache_groups)

    vllm_config.cache_config.kv_cache_layout = layout
    try:
        groups = get_kv_cache_groups(vllm_config, specs)
        return (get_kv_cache_config_from_groups(vllm_config, groups, kv_bytes),
                _estimate_max_model_len_from_groups(vllm_config, groups, kv_bytes))
    finally:
        vllm_config.cache_config.kv_cache_layout = "LBHNC"


# Layer-outer (LBHNC) and block-outermost (BLHNC) physical layouts: the engine core picks one from
# what the attention backends declare; they group mixed page sizes differently.
LAYOUTS = ("LBHNC", "BLHNC")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sharded_indexer_matches_vllm_allocation(vllm_config, fmt, layout):
    """With every cache DCP-sharded the allocator makes one group and allocates exactly what plan says."""
    specs = glm52_specs(fmt, "sharded", True)
    conf, max_len = allocate(vllm_config, specs, layout, 10 * GIB)
    p = plan(fmt, "sharded", True, 10 * GIB)
    assert len(conf.kv_cache_groups) == 1 and conf.num_blocks * BLOCK * DCP == p.kv_tokens == max_len
    assert conf.num_blocks * sum(s.page_size_bytes for s in specs.values()) == p.bytes_used


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_replicated_indexer_matches_vllm_allocation(vllm_config, fmt, layout):
    """Patched (0001 + 0003): the replicated indexer's 64 x DCP-token pages join the sharded records'
    group, one block per 64 x DCP tokens, and vLLM allocates exactly plan's tokens and bytes.

    Unpatched vLLM 0.32 refused the layer-outer layout (the 64 x 132 B indexer page does not divide
    the main page, MLA pages are never padded) and, block-outermost, spent a whole main-sized block
    per 64 indexer tokens: 295,424 tokens in 10 GiB for 368 B + MTP instead of 1,055,488.
    """
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    specs = glm52_specs(fmt, "replicated", True)
    conf, max_len = allocate(vllm_config, specs, layout, 10 * GIB)
    p = plan(fmt, "replicated", True, 10 * GIB)
    assert len(conf.kv_cache_groups) == 1 and conf.num_blocks * BLOCK * DCP == p.kv_tokens == max_len
    assert resolve_kv_cache_block_sizes(conf, vllm_config)[0] == BLOCK * DCP  # scheduler block
    assert conf.num_blocks * sum(s.page_size_bytes for s in specs.values()) == p.bytes_used
