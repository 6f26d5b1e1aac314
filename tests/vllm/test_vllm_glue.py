"""sparkinfer's vLLM-facing glue on its own (no vllm needed): cache dtypes and the configuration."""

import argparse

import pytest
import torch

from sparkinfer import config as sc
from sparkinfer.formats import get_format
from sparkinfer.vllm import cache_dtypes as cd


def test_cache_dtype_names_and_sizes():
    assert cd.canonical_cache_dtype("nvfp4_368") == "nvfp4_ds_mla:fp8-rope-368"
    assert cd.canonical_cache_dtype("nvfp4_432") == "nvfp4_ds_mla:bf16-rope-432"
    assert cd.canonical_cache_dtype("nvfp4_ds_mla:bf16-rope-432") == "nvfp4_ds_mla:bf16-rope-432"
    for stock in ("auto", "fp8", "fp8_ds_mla", "nvfp4_ds_mla", "nvfp4"):
        assert cd.canonical_cache_dtype(stock) == stock  # vLLM's own names pass through
        assert cd.record_bytes(stock) is None and not cd.is_sparkinfer_cache_dtype(stock)
    assert [cd.record_bytes(n) for n in cd.ACCEPTED_NAMES] == [368, 432, 368, 432]
    # The record sizes the spec states, from the format objects (an independent statement of them).
    assert [get_format(n).record_bytes for n in cd.CACHE_DTYPES] == [368, 432]


def test_backend_read_check():
    cd.check_backend_reads("ANY", ["auto"], "fp8")  # stock dtypes are vLLM's business
    cd.check_backend_reads("SPARKINFER", list(cd.CACHE_DTYPES), "nvfp4_368")  # short name, full list
    cd.check_backend_reads("SPARKINFER", ["nvfp4_432"], "nvfp4_ds_mla:bf16-rope-432")
    with pytest.raises(ValueError, match="FLASHMLA_SPARSE cannot read it.*fp8_ds_mla"):
        cd.check_backend_reads("FLASHMLA_SPARSE", ["auto", "fp8_ds_mla", "nvfp4_ds_mla"], "nvfp4_368")
    with pytest.raises(ValueError, match="nvfp4_ds_mla:fp8-rope-368"):
        cd.check_backend_reads("SPARKINFER", ["nvfp4_432"], "nvfp4_ds_mla:fp8-rope-368")


@pytest.mark.parametrize("name", ["nvfp4_368", "nvfp4_ds_mla:bf16-rope-432"])
def test_write_records_matches_encode_at_slots(name):
    g = torch.Generator().manual_seed(0)
    fmt = get_format(name)
    num_blocks, block_size, n = 3, 4, 6
    cache = torch.full((num_blocks, block_size, fmt.record_bytes), 0xAB, dtype=torch.uint8)
    latent = torch.randn(n + 2, 512, generator=g)  # vLLM may pass rows beyond the slot mapping
    rope = torch.randn(n + 2, 1, 64, generator=g)  # MLA's k_pe arrives as [T, 1, 64]
    slots = torch.tensor([5, 0, -1, 11, 3, 8])
    cd.write_records(name, latent, rope, cache, slots)
    ref = fmt.encode(latent[:n], rope[:n, 0])
    flat = cache.view(-1, fmt.record_bytes)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], ref[i]), f"slot {s}"
    untouched = sorted(set(range(num_blocks * block_size)) - set(slots.tolist()))
    assert bool((flat[untouched] == 0xAB).all())  # padding (-1) and other slots are left alone


def test_write_records_rejects_a_wrong_cache():
    with pytest.raises(ValueError, match=r"\[\.\.\., 368\]"):
        cd.write_records("nvfp4_368", torch.randn(2, 512), torch.randn(2, 64),
                         torch.zeros(2, 4, 432, dtype=torch.uint8), torch.tensor([0, 1]))


def test_config_defaults_and_precedence():
    assert sc.resolve({}, {}) == sc.SparkinferConfig("auto", 3, 512, "auto")
    env = {"VLLM_SPARKINFER_MODE": "Selected", "VLLM_SPARKINFER_PREFETCH_DEPTH": " 1 ",
           "VLLM_SPARKINFER_FABRIC": "host"}
    assert sc.resolve({}, env) == sc.SparkinferConfig("selected", 1, 512, "host")
    cli = {"mode": "stock", "prefetch_depth": None, "pool_mb": "64", "fabric": None}
    assert sc.resolve(cli, env) == sc.SparkinferConfig("stock", 1, 64, "host")  # CLI wins, None defers
    assert sc.resolve({}, {"VLLM_SPARKINFER_MODE": ""}).mode == "auto"  # empty = unset


@pytest.mark.parametrize("cli,env,match", [
    ({"mode": "fast"}, {}, r"mode \(from --sparkinfer-mode\): expected one of auto, stock, selected"),
    ({}, {"VLLM_SPARKINFER_PREFETCH_DEPTH": "9"}, r"prefetch_depth \(from VLLM_SPARKINFER_PREFETCH_DEPTH\).*\[0, 8\]"),
    ({}, {"VLLM_SPARKINFER_PREFETCH_DEPTH": "-1"}, r"prefetch_depth .*got -1"),
    ({"pool_mb": "1.5"}, {}, r"pool_mb \(from --sparkinfer-pool-mb\): expected an integer"),
    ({"pool_mb": 0}, {}, r"pool_mb .*\[1, 65536\], got 0"),
    ({"pool_mb": 2.5}, {}, r"pool_mb .*got 2\.5"),
    ({"pool_mb": True}, {}, r"pool_mb .*got True"),
    ({"fabric": "nvlink"}, {}, r"fabric .*auto, host, cuda"),
    ({"modes": "stock"}, {}, r"unknown configuration field\(s\) \['modes'\]"),
    ({}, {"VLLM_SPARKINFER_DEPTH": "2"}, r"unknown environment variable\(s\) \['VLLM_SPARKINFER_DEPTH'\]"),
])
def test_config_errors_name_the_field(cli, env, match):
    with pytest.raises(ValueError, match=match):
        sc.resolve(cli, env)


def test_config_roundtrip_and_cli_flags():
    cfg = sc.SparkinferConfig("selected", 0, 128, "cuda")
    assert sc.from_additional_config({"sparkinfer": cfg.as_dict(), "other": 1}) == cfg
    assert sc.from_additional_config(None) == sc.SparkinferConfig()
    with pytest.raises(ValueError, match="mode"):
        sc.from_additional_config({"sparkinfer": {"mode": "bogus"}})
    parser = argparse.ArgumentParser()
    sc.add_cli_args(parser)
    args = parser.parse_args(["--sparkinfer-mode", "stock", "--sparkinfer-prefetch-depth", "2"])
    assert (args.sparkinfer_mode, args.sparkinfer_prefetch_depth, args.sparkinfer_pool_mb) == ("stock", "2", None)
    getters = sc.env_getters()
    assert sorted(getters) == sorted(sc.env_var(f) for f in sc.FIELD_NAMES)


def _vllm_config(dcp, cache_dtype, mode=None, device="cuda"):
    import types
    extra = {} if mode is None else {"sparkinfer": {"mode": mode}}
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(decode_context_parallel_size=dcp),
                                 cache_config=types.SimpleNamespace(cache_dtype=cache_dtype),
                                 device_config=types.SimpleNamespace(device_type=device),
                                 additional_config=extra)


@pytest.mark.parametrize("dcp,dtype,mode,device,replicated", [
    (4, "nvfp4_ds_mla:fp8-rope-368", None, "cuda", True),  # default mode auto
    (4, "nvfp4_ds_mla:bf16-rope-432", "selected", "cuda", True),
    (4, "nvfp4_432", "auto", "cuda", True),
    (4, "nvfp4_ds_mla:fp8-rope-368", "stock", "cuda", False),  # stock: the upstream oracle
    (4, "fp8_ds_mla", "selected", "cuda", False),  # stock backends keep upstream sharding
    (4, "auto", None, "cuda", False),
    (1, "nvfp4_ds_mla:fp8-rope-368", "selected", "cuda", False),  # DCP 1: nothing to replicate
    (2, "auto", "stock", "cpu", True),  # CPU: upstream's top-k merge is CUDA-only, always replicated
    (2, "nvfp4_368", None, "cpu", True),
    (1, "auto", None, "cpu", False),
])
def test_indexer_layout(dcp, dtype, mode, device, replicated):
    from sparkinfer.vllm.indexer_layout import indexer_block_size, indexer_dcp_world_size, indexer_replicated

    cfg = _vllm_config(dcp, dtype, mode, device)
    assert indexer_replicated(cfg) is replicated
    assert indexer_dcp_world_size(cfg) == (1 if replicated else dcp)
    assert indexer_block_size(cfg, 64) == (64 * dcp if replicated else 64)


def _spec(block_size, sharded, role="sparse"):
    return argparse.Namespace(block_size=block_size, dcp_sharded=sharded, cache_role=role)


@pytest.mark.parametrize("specs,uniform", [
    ([_spec(64, True), _spec(64, True)], True),  # vLLM's own rule
    ([_spec(64, False, "indexer"), _spec(64, False, "indexer")], True),
    ([_spec(64, True), _spec(128, True)], False),
    ([_spec(64, True), _spec(256, False, "indexer")], True),  # sparkinfer: 64-token local pages, DCP 4
    ([_spec(64, True), _spec(256, False, "indexer"), _spec(64, True)], True),
    ([_spec(64, True), _spec(64, False, "indexer")], False),  # 64 local vs 64 global tokens
    ([_spec(64, True), _spec(96, False, "indexer")], False),  # not whole pages
    ([_spec(64, True), _spec(256, False)], False),  # only the indexer is replicated
    ([_spec(64, True), _spec(256, False, "indexer"), _spec(512, False, "indexer")], False),
    ([_spec(64, True), _spec(128, True), _spec(256, False, "indexer")], False),
])
def test_tokens_per_block_uniform(specs, uniform):
    from sparkinfer.vllm.indexer_layout import tokens_per_block_uniform

    assert tokens_per_block_uniform(specs) is uniform


def test_sharded_first():
    from sparkinfer.vllm.indexer_layout import sharded_first

    mixed = {"i0": _spec(256, False, "indexer"), "a0": _spec(64, True), "i1": _spec(256, False, "indexer"),
             "a1": _spec(64, True)}
    assert list(sharded_first(mixed)) == ["a0", "a1", "i0", "i1"]
    assert sharded_first(mixed)["i1"] is mixed["i1"]
    same = {"b": _spec(64, True), "a": _spec(64, True)}
    assert list(sharded_first(same)) == ["b", "a"]


def test_env_getters_read_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_SPARKINFER_POOL_MB", "77")
    assert sc.env_getters()["VLLM_SPARKINFER_POOL_MB"]() == "77"
    monkeypatch.delenv("VLLM_SPARKINFER_POOL_MB")
    assert sc.env_getters()["VLLM_SPARKINFER_POOL_MB"]() is None


def test_layer_kernel_block_size():
    """A replicated indexer page (64 x DCP tokens) scales the group's kernel block by DCP; others keep it."""
    from sparkinfer.vllm.indexer_layout import layer_kernel_block_size

    assert layer_kernel_block_size(64, 64, _spec(128, False, "indexer")) == 128  # no split: the whole page
    assert layer_kernel_block_size(32, 64, _spec(256, False, "indexer")) == 128  # group split in two
    assert layer_kernel_block_size(64, 64, _spec(64, True)) == 64
    assert layer_kernel_block_size(16, 64, _spec(64, False)) == 16  # DCP 1: a replicated group as vLLM's
    assert layer_kernel_block_size(None, 64, _spec(128, False, "indexer")) is None
    with pytest.raises(ValueError, match="whole manager blocks"):
        layer_kernel_block_size(64, 64, _spec(96, False, "indexer"))
