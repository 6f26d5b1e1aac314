"""A decode step's attention path captured in one CUDA graph and replayed on new inputs (issue #16).

    python benchmarks/device/graph_decode_step.py --json graph_decode_step.json   # on a GPU
    python benchmarks/device/graph_decode_step.py --smoke                         # CPU: eager only, tiny

One rank at GLM-5.2 decode shapes (DCP1 on one GPU): 16 requests x 4 query rows (MTP3), a Full layer
and its three Shared layers (one indexer top-k shared by four sparse-MLA layers), 16 heads, 368-byte
records in a paged cache (block size 64, permuted blocks), 8,192-token contexts. The step, per request
(the wrappers' public entry points, no host-side checks):

    scores = indexer_scores(q_idx[b], w[b], index_keys, pos[b], token_slots[b])     # Triton
    ids    = select_topk(scores, 2048)                                             # torch
    slots  = block_table[b][ids // 64] * 64 + ids % 64   (-1 stays -1)             # torch, fixed shape
    for each of the 4 layers: out, lse = sparse_mla_decode(q[l], ..., cache[l], slots)  # Triton

It runs once eagerly (Triton compiles there), is captured with ``torch.cuda.graph``, then for three
new sets of queries and positions copied into the captured inputs, the replay's outputs must equal
an eager run's on the same inputs bit for bit (``all_equal``). A host read or a data-dependent shape
anywhere in the step makes the capture fail, which the JSON reports with the error (``captured``
false). Eager and replay step times (median of 20) show what the host costs per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, R, K, J, H, BLOCK, FMT = 16, 4, 2048, 4, 16, 64, "368"


def build(dev, smoke: bool):
    """Static inputs (records encoded from random values: finite outputs) and the step function."""
    import torch

    from sparkinfer.attention import sparse_mla_decode
    from sparkinfer.formats import get_format, native
    from sparkinfer.indexer import indexer_scores, select_topk

    b, r, k, t = (2, 4, 16, 128) if smoke else (B, R, K, 8192)
    fmt = get_format(FMT)
    g = torch.Generator(device="cpu").manual_seed(0)
    n_blocks = b * t // BLOCK
    bt = torch.randperm(n_blocks, generator=g).view(b, t // BLOCK).to(torch.int32).to(dev)
    caches = []
    for _ in range(J):
        c = torch.zeros(n_blocks * BLOCK, fmt.record_bytes, dtype=torch.uint8, device=dev)
        native.encode(fmt, torch.randn(n_blocks * BLOCK, 512, generator=g).to(dev),
                      torch.randn(n_blocks * BLOCK, 64, generator=g).to(dev), c, None)
        caches.append(c)
    keys = torch.zeros(n_blocks * BLOCK, 132, dtype=torch.uint8, device=dev)
    keys[:, :128] = torch.randint(0, 0x70, (n_blocks * BLOCK, 128), generator=g, dtype=torch.uint8).to(dev)
    keys[:, 128:] = torch.ones(n_blocks * BLOCK, dtype=torch.float32).view(torch.uint8).view(-1, 4).to(dev)
    col = torch.arange(t, device=dev)
    token_slots = (bt.long()[:, col // BLOCK] * BLOCK + col % BLOCK).contiguous()  # [b, t] int64
    inputs = {
        "q_idx": torch.zeros(b, r, 32, 128, device=dev), "w": torch.zeros(b, r, 32, device=dev),
        "pos": torch.zeros(b, r, dtype=torch.int64, device=dev),
        "q_nope": torch.zeros(J, b * r, H, 512, dtype=torch.bfloat16, device=dev),
        "q_rope": torch.zeros(J, b * r, H, 64, dtype=torch.bfloat16, device=dev),
    }
    outs = {"out": torch.zeros(J, b * r, H, 512, device=dev), "lse": torch.zeros(J, b * r, H, device=dev)}

    def step():
        slots = []
        for i in range(b):
            scores = indexer_scores(inputs["q_idx"][i], inputs["w"][i], keys, inputs["pos"][i], token_slots[i],
                                    backend="triton", check_values=False)
            ids = select_topk(scores, k).long()
            phys = bt.long()[i][ids.clamp(min=0) // BLOCK] * BLOCK + ids.clamp(min=0) % BLOCK
            slots.append(torch.where(ids >= 0, phys, -1))
        slots = torch.cat(slots).to(torch.int32)
        for j in range(J):
            o, l = sparse_mla_decode(inputs["q_nope"][j], inputs["q_rope"][j], caches[j], fmt, slots, 0.04,
                                     backend="triton", check_indices=False)
            outs["out"][j].copy_(o)
            outs["lse"][j].copy_(l)

    def load(seed: int):
        gg = torch.Generator(device="cpu").manual_seed(seed)
        for name, tns in inputs.items():
            if name == "pos":  # rows see the causal prefix of their request: the last r positions
                last = torch.randint(t // 2, t - r, (b, 1), generator=gg)
                tns.copy_((last + torch.arange(r)).to(dev))
            else:
                tns.copy_(torch.randn(tns.shape, generator=gg).to(dev, tns.dtype))

    return step, load, outs, {"requests": b, "rows": r, "topk": k, "context": t}


def _median_us(fn, sync, n=20):
    ts = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e6, 1)


def run(smoke: bool) -> dict:
    import torch

    dev = torch.device("cpu" if smoke else "cuda")
    step, load, outs, dims = build(dev, smoke)
    sync = (lambda: None) if smoke else torch.cuda.synchronize
    doc = {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(dev), **dims, "layers": J, "heads": H,
           "format": FMT, "smoke": smoke, "captured": False, "all_equal": False}

    def eager(seed):
        load(seed)
        step()
        sync()
        return {k: v.clone() for k, v in outs.items()}

    ref = {s: eager(s) for s in ((1,) if smoke else (1, 2, 3))}
    if smoke:  # no capture on a CPU: the plumbing, and that the step is deterministic
        doc["all_equal"] = all(torch.equal(eager(1)[k], ref[1][k]) for k in outs)
        doc["note"] = "CPU smoke: eager only"
        return doc
    doc["eager_us"] = _median_us(step, sync)
    graph = torch.cuda.CUDAGraph()
    try:
        load(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            step()
        doc["captured"] = True
    except Exception as e:  # what broke the capture is the finding
        doc["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        return doc
    equal = []
    for s in (3, 1, 2):  # a different order than the eager runs: the replay reads the new inputs
        load(s)
        graph.replay()
        torch.cuda.synchronize()
        equal.append(all(torch.equal(outs[k], ref[s][k]) for k in outs))
    doc["replays_equal"] = equal
    doc["all_equal"] = all(equal)
    doc["replay_us"] = _median_us(graph.replay, sync)
    doc["finite"] = bool(torch.isfinite(outs["out"]).all())
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, eager only, on the CPU")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    sys.path.insert(0, REPO)
    doc = run(a.smoke)
    print(json.dumps(doc))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if doc["all_equal"] and (a.smoke or doc["captured"]) else 1


if __name__ == "__main__":
    sys.exit(main())
