"""The serve profiles under profiles/serve/: the script's argv and environment, the sparkinfer
settings against sparkinfer.config, and (in the vLLM venv, marker vllm) every flag against vLLM
0.32's own `vllm serve` argument parser."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from sparkinfer import config as sc

PROFILES = Path(__file__).parent.parent / "profiles" / "serve"
SCRIPTS = sorted(PROFILES.glob("*.sh"))


def read_env(path: Path) -> dict:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and key.isidentifier() and value == value.strip(), f"{path.name}: {line!r}"
            env[key] = value
    return env


def print_args(script: Path, **env) -> list[str]:
    r = subprocess.run(["bash", str(script), "--print-args"], capture_output=True, text=True, check=True,
                       env={**os.environ, **env})
    return r.stdout.splitlines()


def flags(argv: list[str]) -> dict:
    assert len(argv) % 2 == 0 and all(a.startswith("--") for a in argv[::2]), argv
    return dict(zip(argv[::2], argv[1::2]))


def test_there_are_profiles_with_their_env():
    assert SCRIPTS
    for s in SCRIPTS:
        assert s.with_suffix(".env").is_file(), s
        assert os.access(s, os.X_OK), f"{s.name} is not executable"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_env_is_valid_sparkinfer_configuration(script):
    env = read_env(script.with_suffix(".env"))
    assert env and all(k.startswith(sc.ENV_PREFIX) for k in env)
    assert set(env) == {sc.env_var(f) for f in sc.FIELD_NAMES}  # every setting stated, none invented
    cfg = sc.resolve(environ=env)
    assert (cfg.mode, cfg.fabric) == ("auto", "cuda")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_profile_is_tp4_dcp4_mtp3(script):
    f = flags(print_args(script))
    assert f["--tensor-parallel-size"] == "4" and f["--decode-context-parallel-size"] == "4"
    assert json.loads(f["--speculative-config"]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert f["--kv-cache-dtype"] == "nvfp4_368"
    assert f["--host"] == "127.0.0.1"
    assert flags(print_args(script, KV_CACHE_DTYPE="nvfp4_432"))["--kv-cache-dtype"] == "nvfp4_432"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_execs_vllm_serve_with_the_env(script, tmp_path):
    """A fake `vllm` on the PATH records what the profile would run."""
    fake = tmp_path / "vllm"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT/argv"\nenv | grep ^VLLM_SPARKINFER_ | sort '
                    '> "$OUT/env"\n')
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(sc.ENV_PREFIX)}
    env = {**base, "PATH": f"{tmp_path}:{os.environ['PATH']}", "OUT": str(tmp_path),
           "VLLM_SPARKINFER_POOL_MB": "1024"}  # the caller's value wins over the profile's
    subprocess.run(["bash", str(script), "/models/glm", "--max-num-seqs", "8"], env=env, check=True)
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv == ["serve", "/models/glm", *print_args(script), "--max-num-seqs", "8"]
    got = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines())
    assert got == {**read_env(script.with_suffix(".env")), "VLLM_SPARKINFER_POOL_MB": "1024"}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


@pytest.mark.vllm
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_flag_exists_in_vllm_serve(script):
    pytest.importorskip("vllm")
    from vllm.config.cache import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    argv = print_args(script)
    with pytest.raises(SystemExit):  # the parser does reject what it does not know
        parser.parse_args(["/models/glm", *argv, "--decode-context-parallel-sizes", "4"])
    args = parser.parse_args(["/models/glm", *argv])
    assert args.model_tag == "/models/glm"
    e = EngineArgs.from_cli_args(args)
    assert (e.tensor_parallel_size, e.decode_context_parallel_size, e.block_size) == (4, 4, 64)
    assert e.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    assert CacheConfig(cache_dtype=e.kv_cache_dtype, block_size=64).cache_dtype == "nvfp4_ds_mla:fp8-rope-368"
    sc.resolve(environ=read_env(script.with_suffix(".env")))  # what patched vLLM validates at start-up


def test_dockerfile_pins_and_patch_commands():
    """The image builds the release the series is for, with commands the patch tool accepts."""
    import re
    import shlex

    from vllm_patches.__main__ import build_parser
    from vllm_patches.series import PINNED_VERSION

    text = (Path(__file__).parent.parent / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_REF=v(\S+)$", text, re.M).group(1) == PINNED_VERSION
    assert f"SETUPTOOLS_SCM_PRETEND_VERSION={PINNED_VERSION}" in text
    assert 'TORCH_CUDA_ARCH_LIST="12.0"' in text and "SPARKINFER_CUDA_ARCHS=120 " in text
    calls = re.findall(r"python -m vllm_patches ([^\n&\\]+)", text)
    assert calls
    for call in calls:
        build_parser().parse_args(shlex.split(call))  # SystemExit on an unknown subcommand or flag
