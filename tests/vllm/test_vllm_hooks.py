"""Patched vLLM 0.32.0 calls sparkinfer where the series says it does (patches 0001 and 0002).

Runs in the venv that ``vllm_patches/install_cpu.sh`` builds (``.venv-vllm/bin/python -m pytest``);
skips where vllm is not importable. An importable vllm without the series is a failure, not a skip.
"""

import types

import pytest

vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

FULL_368, FULL_432 = "nvfp4_ds_mla:fp8-rope-368", "nvfp4_ds_mla:bf16-rope-432"


@pytest.fixture(scope="module", autouse=True)
def patched():
    from pathlib import Path

    from vllm_patches import engine
    from vllm_patches.series import load_series

    assert vllm.__version__ == "0.32.0", f"vllm {vllm.__version__} is not the pinned 0.32.0"
    probe = engine.probe(Path(vllm.__file__).parent.parent, load_series())
    assert probe.state == "applied", (f"vllm at {vllm.__file__} does not carry the sparkinfer series "
                                      f"({probe.state}); run vllm_patches/install_cpu.sh")


def test_cache_dtype_names():
    import pydantic
    from vllm.config.cache import CacheConfig

    assert CacheConfig(cache_dtype="nvfp4_368").cache_dtype == FULL_368
    assert CacheConfig(cache_dtype="nvfp4_432").cache_dtype == FULL_432
    assert CacheConfig(cache_dtype=FULL_432).cache_dtype == FULL_432
    assert CacheConfig(cache_dtype="fp8_ds_mla").cache_dtype == "fp8_ds_mla"
    with pytest.raises(pydantic.ValidationError):
        CacheConfig(cache_dtype="nvfp4_999")


def test_dtype_and_quant_mode():
    import torch
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode, is_quantized_kv_cache

    for name in (FULL_368, FULL_432, "nvfp4_368", "nvfp4_432"):
        assert kv_cache_dtype_str_to_dtype(name, None) == torch.uint8
        assert get_kv_quant_mode(name) == KVQuantMode.NVFP4_DS_MLA
        assert is_quantized_kv_cache(name)
    assert get_kv_quant_mode("nvfp4") == KVQuantMode.NVFP4  # the stock prefix rule is untouched


@pytest.mark.parametrize("dtype,record", [(FULL_368, 368), (FULL_432, 432), ("fp8_ds_mla", 656)])
def test_mla_spec_sizing(dtype, record):
    """MLAAttention.get_kv_cache_spec (the patched method itself) sizes a page as block_size records."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = types.SimpleNamespace(kv_cache_dtype=dtype, head_size=576, sliding_window=None, indexer=None,
                                  non_causal_multi_token_decode=False)
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=64), model_config=None)
    spec = MLAAttention.get_kv_cache_spec(layer, config)
    assert spec.state_content_bytes == record
    assert spec.page_size_bytes == 64 * record


def test_stock_backends_refuse_record_formats():
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    from sparkinfer.vllm.cache_dtypes import check_backend_reads

    with pytest.raises(ValueError, match="CPU_MLA cannot read it"):
        check_backend_reads(CPUMLABackend.get_name(), CPUMLABackend.supported_kv_cache_dtypes, "nvfp4_368")


def test_engine_args_flags_and_env(monkeypatch):
    import vllm.envs as envs
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--sparkinfer-mode", "selected", "--sparkinfer-pool-mb", "64",
                              "--kv-cache-dtype", "nvfp4_368"])
    ea = EngineArgs.from_cli_args(args)
    assert (ea.sparkinfer_mode, ea.sparkinfer_pool_mb, ea.kv_cache_dtype) == ("selected", "64", "nvfp4_368")
    monkeypatch.setenv("VLLM_SPARKINFER_FABRIC", "host")
    assert envs.VLLM_SPARKINFER_FABRIC == "host"  # known to vllm.envs, so vLLM does not warn about it


def test_engine_config_validates_at_start(tmp_path, monkeypatch):
    """create_engine_config resolves flags over env and stores them; a bad value names its field."""
    import json

    from vllm.engine.arg_utils import EngineArgs

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 1, "vocab_size": 128, "max_position_embeddings": 256}))
    monkeypatch.setenv("VLLM_SPARKINFER_PREFETCH_DEPTH", "2")
    cfg = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, sparkinfer_mode="selected",
                     sparkinfer_replica_window=64, dtype="float32").create_engine_config()
    assert cfg.additional_config["sparkinfer"] == {"mode": "selected", "prefetch_depth": 2, "pool_mb": 512,
                                                   "fabric": "auto", "replica_window": 64,
                                                   "indexer_scoring": "auto"}
    with pytest.raises(ValueError, match=r"fabric \(from --sparkinfer-fabric\)"):
        EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, sparkinfer_fabric="nvlink",
                   dtype="float32").create_engine_config()
    monkeypatch.setenv("VLLM_SPARKINFER_MODE", "fastest")
    with pytest.raises(ValueError, match=r"mode \(from VLLM_SPARKINFER_MODE\)"):
        EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32").create_engine_config()


@pytest.mark.parametrize("dcp,dtype,mode,sharded", [
    (4, FULL_368, "selected", False), (4, FULL_368, "stock", True), (4, "fp8_ds_mla", "auto", True),
    (1, FULL_432, "auto", True)])
def test_indexer_cache_spec_replication(dcp, dtype, mode, sharded):
    """DeepseekV32IndexerCache.get_kv_cache_spec (patched) replicates the 132-byte keys under sparkinfer."""
    import torch
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    layer = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=64), head_dim=132,
                                  dtype=torch.uint8)
    config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=dcp),
        cache_config=types.SimpleNamespace(cache_dtype=dtype),
        additional_config={"sparkinfer": {"mode": mode}})
    spec = DeepseekV32IndexerCache.get_kv_cache_spec(layer, config)
    assert spec.dcp_sharded is sharded
    # a replicated page covers the tokens of one sharded main page: 64 x DCP
    assert spec.block_size == (64 if sharded else 64 * dcp)
    assert spec.page_size_bytes == spec.block_size * 132


@pytest.mark.parametrize("indexer_first", [True, False])
@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC"])
def test_allocator_groups_replicated_indexer_with_sharded_records(layout, indexer_first):
    """With patches 0001 + 0003 vLLM's planner keeps the replicated indexer keys (64 x DCP-token pages)
    in one group with the DCP-sharded records (64-token local pages): one block table, one block per
    64 x DCP tokens, under a block-outer or a layer-outer KV cache layout, whichever spec comes first."""
    import torch
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.v1.core import kv_cache_utils

    vc = VllmConfig()
    vc.parallel_config.decode_context_parallel_size = 4
    vc.cache_config.block_size = 64
    vc.cache_config.cache_dtype = FULL_368
    vc.cache_config.kv_cache_layout = layout
    vc.additional_config = {"sparkinfer": {"mode": "auto"}}
    mla = types.SimpleNamespace(kv_cache_dtype=FULL_368, head_size=576, sliding_window=None, indexer=object(),
                                non_causal_multi_token_decode=False)
    idx = types.SimpleNamespace(cache_config=vc.cache_config, head_dim=132, dtype=torch.uint8)
    specs = {}
    for layer, full in enumerate("FSSF"):
        if full == "F" and indexer_first:
            specs[f"model.layers.{layer}.self_attn.indexer.k_cache"] = DeepseekV32IndexerCache.get_kv_cache_spec(idx, vc)
        specs[f"model.layers.{layer}.self_attn.attn"] = MLAAttention.get_kv_cache_spec(mla, vc)
        if full == "F" and not indexer_first:
            specs[f"model.layers.{layer}.self_attn.indexer.k_cache"] = DeepseekV32IndexerCache.get_kv_cache_spec(idx, vc)
    groups = kv_cache_utils.get_kv_cache_groups(vc, specs)
    assert len(groups) == 1 and sorted(groups[0].layer_names) == sorted(specs)
    per_layer = groups[0].kv_cache_spec.kv_cache_specs
    assert {per_layer[n].dcp_sharded for n in specs if "indexer" in n} == {False}
    assert {per_layer[n].block_size for n in specs if "indexer" in n} == {64 * 4}
    assert {per_layer[n].block_size for n in specs if "indexer" not in n} == {64}
    assert groups[0].kv_cache_spec.block_size == 64 and groups[0].kv_cache_spec.dcp_sharded
    scheduler_block, _ = kv_cache_utils.resolve_kv_cache_block_sizes(types.SimpleNamespace(kv_cache_groups=groups), vc)
    assert scheduler_block == 64 * 4
