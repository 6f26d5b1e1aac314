"""The serve profiles (profiles/serve/*.toml) as vLLM sees them: the command `sparkinfer serve
--dry-run` prints, parsed by vLLM 0.32's own `vllm serve` argument parser (patched: the
--sparkinfer-* flags), has the profile's values; every profile also validates against the tiny
GLM-5.2-shaped model's config. Runs in the vLLM venv (CI: .venv-vllm/bin/python); skips where
vllm / transformers are not importable. Also the Dockerfile's serve example."""

import contextlib
import io
import json
import shlex
from pathlib import Path

import pytest

from sparkinfer import config as sc
from sparkinfer.cli import main as cli_main
from sparkinfer.cli import serve

REPO = Path(__file__).parents[2]
NAMES = sorted(p.stem for p in (REPO / "profiles" / "serve").glob("*.toml"))
GLM52_PATTERN = "FFFSSS" + "FSSS" * 18


@pytest.fixture(scope="module")
def glm52_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm52")
    (d / "config.json").write_text(json.dumps({
        "model_type": "glm_moe_dsa", "num_hidden_layers": 78, "num_attention_heads": 64, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
        "index_topk_pattern": GLM52_PATTERN, "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "indexer_rope_interleave": True}))
    return d


@pytest.fixture(scope="module")
def vllm_parser():
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def dry_run_command(name: str, model: Path) -> list[str]:
    """The command line `sparkinfer serve --dry-run` prints (its last line), as the shell splits it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["serve", "--dry-run", "--profile", name, str(model)]) == 0
    argv = shlex.split(out.getvalue().strip().splitlines()[-1])
    assert argv[:3] == ["vllm", "serve", str(model)]
    return argv[2:]


@pytest.fixture(scope="module", params=NAMES)
def parsed(request, vllm_parser, glm52_dir):
    """One parse per profile: (profile data, vLLM's namespace)."""
    return serve.load_profile(request.param), vllm_parser.parse_args(dry_run_command(request.param, glm52_dir))


@pytest.mark.vllm
def test_vllm_parses_the_profile_values(parsed, glm52_dir):
    from vllm.config.cache import CacheConfig
    from vllm.engine.arg_utils import EngineArgs

    data, args = parsed
    v = data["vllm"]
    assert args.model_tag == str(glm52_dir)
    assert args.tensor_parallel_size == v["tensor_parallel_size"] == 4
    assert args.decode_context_parallel_size == v["decode_context_parallel_size"]
    assert args.kv_cache_dtype == v["kv_cache_dtype"]
    assert (args.block_size, args.max_model_len, args.max_num_seqs) == (64, v["max_model_len"], v["max_num_seqs"])
    assert args.speculative_config == v.get("speculative_config")  # None for MTP0
    comp = args.compilation_config
    want_mode = v["compilation_config"].get("cudagraph_mode")
    assert (comp.cudagraph_mode.name if comp.cudagraph_mode is not None else None) == want_mode
    # unset at every DCP size: vLLM's default, FULL_AND_PIECEWISE; FULL decode graphs of whole requests
    assert comp.cudagraph_mode is None
    rows = 1 + (v.get("speculative_config") or {}).get("num_speculative_tokens", 0)
    assert all(size % rows == 0 for size in comp.cudagraph_capture_sizes)
    for key in ("max_cudagraph_capture_size", "cudagraph_capture_sizes"):  # what the profile sets
        assert getattr(comp, key) == v["compilation_config"].get(key), key
    for f in sc.FIELD_NAMES:  # the flags of patch 0002, one per sparkinfer.config field
        assert getattr(args, f"sparkinfer_{f}") == str(data["sparkinfer"][f])
    e = EngineArgs.from_cli_args(args)
    assert (e.tensor_parallel_size, e.decode_context_parallel_size) == (4, v["decode_context_parallel_size"])
    assert sc.resolve({f: getattr(e, f"sparkinfer_{f}") for f in sc.FIELD_NAMES}, environ={}).as_dict() == \
        sc.resolve(data["sparkinfer"], environ={}).as_dict()  # what patched vLLM validates at start-up
    fmt = {"nvfp4_368": "nvfp4_ds_mla:fp8-rope-368", "nvfp4_432": "nvfp4_ds_mla:bf16-rope-432"}[v["kv_cache_dtype"]]
    assert CacheConfig(cache_dtype=e.kv_cache_dtype, block_size=64).cache_dtype == fmt


@pytest.mark.vllm
def test_vllm_parser_rejects_what_it_does_not_know(vllm_parser, glm52_dir):
    argv = dry_run_command(NAMES[0], glm52_dir)
    with pytest.raises(SystemExit):
        vllm_parser.parse_args([*argv, "--decode-context-parallel-sizes", "4"])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny GLM-5.2-shaped checkpoint: 4 heads for TP4, one MTP layer, 256 positions."""
    pytest.importorskip("transformers")
    from sparkinfer.testing.tiny_model import build_tiny_glm

    return build_tiny_glm(tmp_path_factory.mktemp("tiny_glm_tp4"), heads=4)


@pytest.mark.parametrize("name", NAMES)
def test_profile_validates_against_the_tiny_model(name, tiny_dir):
    """With the context set to what the tiny model has; its 262,144 tokens are refused."""
    cfg = json.loads((tiny_dir / "config.json").read_text())
    data = serve.load_profile(name)
    serve.apply_set(data, "vllm.max_model_len=256")
    checked = serve.validate(data, cfg, environ={})
    assert checked.plan.kv_tokens >= 256 and checked.plan.profile.geometry.num_layers == cfg["num_hidden_layers"]
    with pytest.raises(serve.ProfileError, match="max_position_embeddings") as e:
        serve.validate(serve.load_profile(name), cfg, environ={})
    assert e.value.field == "vllm.max_model_len"


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES)
def test_vllm_builds_the_engine_config(name, tiny_dir, vllm_parser, monkeypatch):
    """Past the parser: patched vLLM's EngineArgs.create_engine_config (model, parallel, cache,
    speculative and sparkinfer configuration; no engine start) accepts the dry-run command for the
    tiny model, with the CPU machine's overrides (256 positions; fabric auto, which the dry run judges
    for the GPU node the profile is for and this CPU engine resolves to the host fabric)."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["serve", "--dry-run", "--profile", name, str(tiny_dir), "--set", "max_model_len=256",
                         "--set", "sparkinfer.fabric=auto", "--", "--dtype", "float32"]) == 0
    args = vllm_parser.parse_args(shlex.split(out.getvalue().strip().splitlines()[-1])[2:])
    args.model = args.model_tag  # what `vllm serve` does before it builds the engine arguments
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    data = serve.load_profile(name)
    v = data["vllm"]
    assert cfg.parallel_config.decode_context_parallel_size == v["decode_context_parallel_size"]
    assert cfg.model_config.max_model_len == 256
    k = v.get("speculative_config", {}).get("num_speculative_tokens")
    assert (cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else None) == k
    want = sc.resolve({**data["sparkinfer"], "fabric": "auto"}, environ={}).as_dict()
    assert cfg.additional_config[sc.ADDITIONAL_CONFIG_KEY] == want


def test_dockerfile_serves_a_shipped_profile():
    """The image's serve example names a profile that ships (its pins: tests/house/test_image_build.py)."""
    import re

    text = (REPO / "docker" / "Dockerfile").read_text()
    profiles = re.findall(r"sparkinfer serve --profile (\S+)", text)
    assert profiles and set(profiles) <= set(NAMES)
    assert "profiles/serve/" not in text.replace("profiles/serve/*.toml", "")  # no script path left
