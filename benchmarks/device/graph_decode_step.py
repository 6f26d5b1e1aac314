"""A whole GLM-5.2 decode step through the engine's own forward code, captured in ONE CUDA graph.

    python benchmarks/device/graph_decode_step.py --json graph_decode_step.json   # on a GPU
    python benchmarks/device/graph_decode_step.py --smoke                         # CPU: tiny, eager only

One rank (one GPU) at GLM-5.2 decode shapes: 16 requests x 4 query rows (MTP3's verify pass), 16
heads (64 over TP4), top-2,048, nvfp4_368 records in paged caches (64-token blocks, permuted),
``--context`` tokens per request; the 78 target layers (``FFFSSS`` + ``FSSS`` x 18: 21 Full) and the
MTP layer (78, Full) run three draft passes (16 x 4 rows, then 16 x 1 twice; each runs the MTP layer's
indexer: ``index_share_for_mtp_iteration`` would let passes 1-2 reuse pass 0's top-k, so an upper bound). No vLLM: a layer does
what the sparkinfer backend's ``do_kv_cache_update`` / ``forward_mqa`` and the indexer op call, with
the buffers the builders would hand them (a ``WorkerRuntime`` with its arena reserved, a
``ForwardStep`` and a ``ReplicatedIndexerMetadata`` per pass, over persistent step-plan buffers):

    every layer   forward_write_records(step, fmt, cache, slots, latent, rope)       # the cache write
    Full layers   q8, s = group_quant_fp8(q_idx, 128, out=arena views)               # quant_q_fp8's kernel
                  w = w_in * s                                                       # vLLM folds q's scales
                  run_indexer(index_cache, md, q8, keys, w, topk_buffer, 2048)       # key write, checks, paged top-k
    local path    attend(step, q_nope, q_rope, cache, fmt, topk, scale, 0, 1)        # top-k rows + fused decode
    selected path records = fmt.encode(latent, rope, checks=...)                     # selected_runtime.stash
                  SelectedDecode.begin_step / full_layer(F, topk) / attend(l, ...)   # plan, exchange, decode

Paths (``--paths``):

* ``local``: DCP1, every record on this rank (what a replica or DCP1 step attends): the stock forward.
* ``selected``: the selected-record executor (``SelectedDecode``) of a one-rank DCP group over the CUDA
  fabric (``CudaFabric``, device-sized exchange) on the target layers; the MTP passes take the stock
  forward, as ``build_for_drafting`` makes them. It covers, per Full layer, the union and plan
  kernels, the exchange's own-record move into the prefetch ring (``direct``), the ring's host
  bookkeeping, the workspace patch (``copy_rows``) and the fused decode over workspace slots; with
  one rank nothing is packed for a peer, unpacked, flagged across processes or sent over PCIe
  (``graph_exchange`` measures those between two processes).

Each path runs eagerly on three input sets (Triton compiles on the first), is captured whole with
``torch.cuda.graph`` (one graph: every layer and draft pass), and replays on the three input sets
copied into the captured buffers in another order: every layer's output, LSE and every Full layer's
top-k must equal the eager step's bit for bit (``all_equal``), and no device check may have fired.
Eager and replay times (median of ``--iters``) are of a second capture without the result copies;
``floor_us`` sums the kernels' floors, from ``benchmarks/kernel_report.py``'s roofline functions at
the step's shapes (the H200's figures, the RTX PRO 6000's on one), and ``kernels`` lists them.

The caches are put back before each step as they were before the last one wrote its own tokens
(``Model.load``), so a step on an input set reads the same caches whenever it runs.

``--smoke`` runs both paths eagerly at tiny shapes on the CPU (one request, ``FSSS`` + the MTP layer;
Triton interpreted, the GPU implementations forced, the host fabric): the same calls, checked
deterministic, and replay-safe as far as a CPU can tell: steps on other inputs make the same launches
(``sparkinfer.testing.launches``: kernels, pointers, shapes, scalars; the selected path's two steps
apart, its fabric alternating two slab slots). ``run_gpu_checks.sh --dry-run`` runs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATTERN = "FFFSSS" + "FSSS" * 18  # GLM-5.2's 78 target layers (spec: 21 Full, 57 Shared)
FMT, BLOCK, R, DRAFTS, INDEX_DIM = "nvfp4_368", 64, 4, 3, 128
SHAPES = {"full": dict(b=16, h=16, hi=32, k=2048, pattern=PATTERN),  # hi: index heads
          "smoke": dict(b=1, h=16, hi=4, k=16, t=64, pattern="FSSS")}


def _report_module():
    spec = importlib.util.spec_from_file_location("kernel_report", os.path.join(REPO, "benchmarks/kernel_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Model:
    """The rank's caches, block table, per-pass step plans and per-layer inputs (persistent buffers: a
    graph replays the addresses it captured; ``load`` copies a new step's values into them)."""

    def __init__(self, dev, b: int, h: int, hi: int, k: int, t: int, pattern: str):
        import torch

        from sparkinfer.core.attention_workspace import AttentionWorkspace
        from sparkinfer.core.indexer_tiles import engine_workspace_bytes, paged_tile
        from sparkinfer.decode.forward_step import ForwardStep
        from sparkinfer.decode.impls import kernel_backend
        from sparkinfer.decode.runtime import WorkerRuntime
        from sparkinfer.formats import get_format, native

        self.dev, self.b, self.h, self.hi, self.k, self.t, self.pattern = dev, b, h, hi, k, t, pattern
        self.fmt, self.idx_fmt = get_format(FMT), get_format("indexer_fp8")
        self.layers = len(pattern)
        self.full = [i for i, c in enumerate(pattern) if c == "F"] + [self.layers]  # + the MTP layer
        m = b * R
        nb = b * (-(-(t + R + DRAFTS) // BLOCK)) + 1  # block 0: vLLM's null block, no request's
        perm = torch.randperm(nb - 1, generator=torch.Generator().manual_seed(0))
        self.table = (perm[: (nb - 1) // b * b] + 1).view(b, -1).to(torch.int32).to(dev)
        self.table_host = self.table.cpu().long()
        g = torch.Generator(device=dev).manual_seed(0)  # values made on the device: 4 GB of records at 8K
        self.caches, self.index_caches = [], {}
        n = nb * BLOCK
        for _ in range(self.layers + 1):  # the target layers' records and the MTP layer's
            c = torch.zeros(nb, BLOCK, self.fmt.record_bytes, dtype=torch.uint8, device=dev)
            native.encode(self.fmt, torch.randn(n, 512, generator=g, device=dev),
                          torch.randn(n, 64, generator=g, device=dev), c.view(n, -1), None)
            self.caches.append(c)
        for layer in self.full:
            keys = torch.randn(n, INDEX_DIM, generator=g, device=dev)
            self.index_caches[layer] = self.idx_fmt.encode(keys).view(nb, BLOCK, -1)
        self.runtime = WorkerRuntime(dev)
        self.runtime.arena.reserve(AttentionWorkspace(rows=m, heads=h, topk=k, out_bytes=2,
                                                      index_heads=hi).segments())
        self.backend = kernel_backend(dev)
        bound = t + R + DRAFTS + 1  # the context bound of the engine (max_model_len + drafts + 1)
        self.workspace = self.runtime.topk_workspace_of(engine_workspace_bytes(m, k, bound))
        self.paged_tile = paged_tile(bound) if self.backend == "triton" else None
        self.topk = torch.full((m, k), -1, dtype=torch.int32, device=dev)  # vLLM's topk_indices_buffer
        self.context = torch.zeros(b, dtype=torch.int64, device=dev)  # tokens before the step
        # the passes: the target's verify rows, then the drafts (b x 4 rows, then b x 1 twice)
        self.passes = []
        for name, rows in [("target", R), ("mtp0", R)] + [(f"mtp{i}", 1) for i in range(1, DRAFTS)]:
            pm = b * rows
            token_req = torch.arange(b, device=dev).repeat_interleave(rows)
            p = {"name": name, "rows": rows, "m": pm, "token_req": token_req,
                 "pos": torch.zeros(pm, dtype=torch.int64, device=dev),
                 "slots": torch.zeros(pm, dtype=torch.int64, device=dev),
                 "step": ForwardStep(self.backend, self.runtime.checks, self.runtime.arena, token_req=token_req,
                                     block_table=self.table)}
            p["md"] = self._indexer_md(p)
            self.passes.append(p)
        # per-layer inputs: the target's 78 layers, then one set per draft pass of the MTP layer
        self.inputs = [self._layer_inputs(self.passes[0]["m"], layer in self.full) for layer in range(self.layers)]
        self.inputs += [self._layer_inputs(p["m"], True) for p in self.passes[1:]]
        self.w_folded = [torch.zeros(p["m"], hi, device=dev) for p in self.passes]
        self._undo: list = []  # (cache rows, slots, their bytes before the step wrote them)

    def _layer_inputs(self, m: int, full: bool) -> dict:
        import torch

        bf = dict(dtype=torch.bfloat16, device=self.dev)
        x = {"q_nope": torch.zeros(m, self.h, 512, **bf), "q_rope": torch.zeros(m, self.h, 64, **bf),
             "latent": torch.zeros(m, 512, **bf), "rope": torch.zeros(m, 64, **bf)}
        if full:
            x.update(q_idx=torch.zeros(m * self.hi, INDEX_DIM, **bf), keys=torch.zeros(m, INDEX_DIM, **bf),
                     w=torch.zeros(m, self.hi, device=self.dev))
        return x

    def _indexer_md(self, p):
        import torch

        from sparkinfer.vllm.replicated_indexer import ReplicatedIndexerMetadata

        seq_lens = torch.full((self.b,), self.t + R + DRAFTS, dtype=torch.int64)  # host bound (the paged path reads the device's)
        return ReplicatedIndexerMetadata(p["m"], self.b, p["token_req"].cpu(), p["pos"], seq_lens, self.table,
                                         p["slots"], step=p["step"], workspace=self.workspace, row_req=p["token_req"],
                                         paged_tile=self.paged_tile)

    def load(self, seed: int) -> None:
        """A new step: contexts, the passes' positions and slots, every layer's activations. The caches are
        first put back as they were before the last step wrote its tokens' records and keys: every
        step then reads the same caches, so a step on an input set gives the same output whenever
        it runs (the replays' check against eager steps)."""
        import torch

        for rows, slots, saved in reversed(self._undo):
            rows[slots] = saved
        self._undo = []
        g = torch.Generator().manual_seed(seed)
        context = torch.randint(self.t // 2, self.t - R, (self.b,), generator=g)
        self.context.copy_(context.to(self.dev))
        for i, p in enumerate(self.passes):  # the verify rows at context + r; draft pass i one token further
            first = context if p["rows"] == R else context + R - 2 + i
            pos = (first[:, None] + torch.arange(p["rows"])).flatten()
            slots = self.table_host[torch.arange(self.b).repeat_interleave(p["rows"]), pos // BLOCK] * BLOCK \
                + pos % BLOCK
            p["pos"].copy_(pos.to(self.dev))
            p["slots"].copy_(slots.to(self.dev))
            target = p["name"] == "target"
            layers = range(self.layers) if target else [self.layers]
            for c in [self.caches[l] for l in layers] + [self.index_caches[l] for l in self.full if l in layers]:
                rows = c.view(-1, c.shape[-1])
                self._undo.append((rows, p["slots"].clone(), rows[p["slots"]]))
        gd = torch.Generator(device=self.dev).manual_seed(seed)
        for x in self.inputs:
            for name, tns in x.items():
                v = torch.randn(tns.shape, generator=gd, device=self.dev)
                tns.copy_(v.abs() if name == "w" else v)

    # ---- the forward's calls --------------------------------------------------------------------
    def write(self, p, layer: int, x) -> None:
        from sparkinfer.decode.paged_sparse_mla import forward_write_records

        forward_write_records(p["step"], self.fmt, self.caches[layer], p["slots"], x["latent"], x["rope"])

    def indexer(self, p, layer: int, x, w) -> None:
        """What vLLM's indexer does around sparkinfer's op: q quantized per head (``quant_q_fp8``'s kernel
        into the arena), the scales folded into the head weights, then the op (``run_indexer``)."""
        import torch

        from sparkinfer.decode.layer_buffers import indexer_q_buffers
        from sparkinfer.indexer.triton_quant import group_quant_fp8
        from sparkinfer.vllm.replicated_indexer import quant_q_fp8, run_indexer

        m = p["m"]
        if self.backend == "triton":
            q8, scales = group_quant_fp8(x["q_idx"], INDEX_DIM, True,
                                         out=indexer_q_buffers(self.runtime.arena, m * self.hi, INDEX_DIM,
                                                               INDEX_DIM))
        else:
            q8, scales = quant_q_fp8(x["q_idx"], INDEX_DIM, use_ue8m0=True)
        torch.mul(x["w"], scales.view(m, self.hi), out=w)
        run_indexer(self.index_caches[layer], p["md"], q8.view(m, self.hi, INDEX_DIM), x["keys"], w, self.topk,
                    self.k)

    def attend_local(self, p, layer: int, x):
        from sparkinfer.decode.paged_sparse_mla import attend

        return attend(p["step"], x["q_nope"], x["q_rope"], self.caches[layer], self.fmt, self.topk[: p["m"]],
                      576 ** -0.5, 0, 1)


def make_selected(model: "Model"):
    """The selected executor of a one-rank DCP group: the fabric the engine builds on this device
    (``impls.fabric_kind``: CUDA IPC slabs on a GPU, the host fabric on CPU), device-sized on a GPU."""
    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.core.slab import SlabLayout
    from sparkinfer.core.topology import DcpLayout, IndexSharePattern
    from sparkinfer.decode.impls import exchange_sizing, fabric_kind
    from sparkinfer.decode.selected_decode import SelectedDecode

    if fabric_kind("auto", model.dev) == "cuda":
        from sparkinfer.comm.cuda_fabric import CudaFabric as Fabric
    else:
        from sparkinfer.comm.host_fabric import HostFabric as Fabric
    depth = 3  # F and its three Shared layers in one exchange
    layout = SlabLayout(1, model.fmt.record_bytes, capacity=model.b * R * model.k, max_layers=depth + 1, depth=2)
    fabric = Fabric(layout, timeout_s=30)
    dec = SelectedDecode(SelectedExchange(fabric, exchange_sizing(model.dev)), model.fmt, DcpLayout(1, 1),
                         IndexSharePattern(model.pattern), max_batch=model.b, rows=R, topk=model.k, depth=depth,
                         scale=576 ** -0.5, backend=model.backend, checks=model.runtime.checks,
                         arena=model.runtime.arena)
    return dec, fabric


def step_fn(model: Model, path: str, decoder=None, results=None):
    """The step as one callable (every layer, then the draft passes); with ``results`` each layer's
    output, LSE and each Full layer's top-k are copied there (the equality check)."""
    target = model.passes[0]
    full = set(model.full)

    def keep(i, out, lse, topk):
        if results is not None:
            results["out"][i].copy_(out)
            results["lse"][i].copy_(lse)
            if topk is not None:
                results["topk"][topk].copy_(model.topk[: out.shape[0]])

    def step():
        if path == "selected":
            decoder.begin_step([c.view(-1, c.shape[-1]) for c in model.caches[: model.layers]], model.table, BLOCK,
                               model.context)
        for layer in range(model.layers):
            x = model.inputs[layer]
            model.write(target, layer, x)
            records = model.fmt.encode(x["latent"], x["rope"], checks=model.runtime.checks) \
                if path == "selected" else None  # selected_runtime.stash: the step's own records
            if layer in full:
                model.indexer(target, layer, x, model.w_folded[0])
            if path == "selected":
                if layer in full:
                    decoder.full_layer(layer, model.topk)
                out, lse = decoder.attend(layer, x["q_nope"], x["q_rope"], records)
            else:
                out, lse = model.attend_local(target, layer, x)
            keep(layer, out, lse, model.full.index(layer) if layer in full else None)
        for i, p in enumerate(model.passes[1:]):  # the MTP layer's draft passes: the stock forward
            layer, x = model.layers, model.inputs[model.layers + i]
            model.write(p, layer, x)
            model.indexer(p, layer, x, model.w_folded[1 + i])
            out, lse = model.attend_local(p, layer, x)
            keep(model.layers + i, out, lse, len(model.full) - 1 + i)

    return step


def result_buffers(model: Model):
    import torch

    outs = [p["m"] for p in model.passes]
    sizes = [outs[0]] * model.layers + outs[1:]
    topk_rows = [outs[0]] * (len(model.full) - 1) + outs[1:]  # the target's Full layers, then the drafts
    return {"out": [torch.zeros(m, model.h, 512, dtype=torch.bfloat16, device=model.dev) for m in sizes],
            "lse": [torch.zeros(m, model.h, device=model.dev) for m in sizes],
            "topk": [torch.zeros(m, model.k, dtype=torch.int32, device=model.dev) for m in topk_rows]}


def snapshot(results) -> dict:
    return {k: [t.clone() for t in v] for k, v in results.items()}


def equal(a, b) -> bool:
    import torch

    return all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))


def floors(kr, model: Model, path: str, gpu: str) -> dict:
    """The step's kernels and the sum of their floors (us) on ``gpu``, from kernel_report's roofline
    functions: ``_mla`` (the decode), ``_indexer`` (the paged top-k: its scorer's floor), ``_move``
    (the own-record move), and its main-profile rows (16 x 4 rows) scaled by rows where a kernel's
    bytes follow the rows (the write, q quantization, the checks, top-k rows, the workspace patch)."""
    main = {r["kernel"]: r for r in kr.roofline()}
    mb = kr.B * kr.R  # the main rows' query rows

    def scaled(name, m):
        return kr._times(main[name]["bytes"] * m / mb, 0, "none")[gpu]["floor_us"]

    t, b, h, k = model.t, model.b, model.h, model.k
    kernels = {}

    def add(name, n, us):
        have = kernels.setdefault(name, [0, 0.0])
        have[0] += n
        have[1] += n * us

    n_full = len(model.full) - 1
    for p in model.passes:
        m, rows = p["m"], p["rows"]
        layers, fulls = (model.layers, n_full) if p["name"] == "target" else (1, 1)
        add(f"records_write_paged[{m} rows]", layers + fulls, scaled("records_write_paged[nvfp4_368]", m))
        add(f"indexer_q_quant[{m} rows]", fulls, scaled("indexer_q_quant", m))
        add(f"paging_flag_nonfinite[{m} rows]", fulls, scaled("paging_flag_nonfinite", m))
        add("fill_topk(-1)", fulls, kr.LAUNCH_US)
        add(f"paged_topk[{b} req x {rows} rows at {t}]", fulls,
            kr._indexer(rows, b * t, "")["times"][gpu]["floor_us"])
        mla = kr._mla(FMT, m, h, k, "")["times"][gpu]["floor_us"]
        if path == "selected" and p["name"] == "target":
            add(f"records_encode (stash)[{m} rows]", layers, scaled("records_write_paged[nvfp4_368]", m))
            add("union+plan_patch+plan_planes", fulls, main["union"]["times"][gpu]["floor_us"]
                + main["plan_patch+plan_planes"]["times"][gpu]["floor_us"])
            add(f"direct (own records, {b} x {kr.U} x F+3S)", fulls,
                kr._move("direct", b * kr.U, "")["times"][gpu]["floor_us"])
            add(f"paging_copy_rows[{m} rows]", layers, scaled("paging_copy_rows", m))
            add(f"sparse_mla_decode[{m} rows, {h} heads, workspace slots]", layers, mla)
        else:
            add(f"paging_topk_rows[{m} rows]", layers, scaled("paging_topk_rows", m))
            add(f"sparse_mla_decode[{m} rows, {h} heads]", layers, mla)
    rows = [{"kernel": name, "launches": n, "floor_us": round(us, 2)} for name, (n, us) in kernels.items()]
    return {"floor_us": round(sum(r["floor_us"] for r in rows), 1), "launches": sum(r["launches"] for r in rows),
            "kernels": rows}


def _median_us(fn, sync, n):
    ts = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e6, 1)


def run_path(model: Model, path: str, smoke: bool, iters: int, warm: bool = False) -> dict:
    import torch

    doc = {"path": path, "captured": False, "all_equal": False}
    decoder = fabric = None
    try:
        if path == "selected":
            decoder, fabric = make_selected(model)
        results = result_buffers(model)
        checked = step_fn(model, path, decoder, results)
        sync = (lambda: None) if smoke else torch.cuda.synchronize

        def eager(seed):
            model.load(seed)
            checked()
            sync()
            return snapshot(results)

        ref = {s: eager(s) for s in ((1,) if smoke or warm else (1, 2, 3))}
        if warm:  # compiled and run once: what the timed run will not wait for
            doc["note"] = "warm-up: one eager step"
            return doc
        doc["checks_clear"] = not bool(model.runtime.checks.flags.any())
        doc["finite"] = all(bool(torch.isfinite(o.float()).all()) for o in results["out"])
        if smoke:  # no capture on a CPU: the step is deterministic, and steps on other inputs make the same
            # launches (kernels, pointers, shapes, scalars: ``testing.launches``), what a replay needs. The
            # selected path's fabric alternates its two slab slots from one exchange to the next
            # (``SlabLayout.depth``), so its steps repeat every other step (a smoke step makes one
            # exchange): compared two apart
            from sparkinfer.testing import launches

            seeds = (2, 1) if path == "local" else (2, 3, 1)
            recs = []
            for s in seeds:
                model.load(s)
                with launches.record() as rec:
                    checked()
                recs.append(rec)
            doc["all_equal"] = equal(snapshot(results), ref[1])
            diff = launches.first_difference(recs[:1], recs[-1:])
            doc["replay_safe"] = diff is None
            doc["compared_steps_apart"] = len(seeds) - 1
            if diff is not None:
                doc["launch_difference"] = diff[:400]
            doc["launches_recorded"] = recs[0].kernels
            doc["note"] = "CPU smoke: eager only; the launches of steps on other inputs compared"
            return doc
        bare = step_fn(model, path, decoder)  # the step without the result copies: what is timed
        doc["eager_us"] = _median_us(bare, sync, iters)
        graphs = {}
        for name, fn in (("checked", checked), ("bare", bare)):
            model.load(1)
            sync()
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn()
        doc["captured"] = True
        same = []
        for s in (3, 1, 2):  # another order than the eager runs: the replay reads the new inputs
            model.load(s)
            graphs["checked"].replay()
            sync()
            same.append(equal(snapshot(results), ref[s]))
        doc["replays_equal"] = same
        doc["all_equal"] = all(same)
        doc["checks_clear"] = doc["checks_clear"] and not bool(model.runtime.checks.flags.any())
        doc["replay_us"] = _median_us(graphs["bare"].replay, sync, iters)
    except Exception as e:  # what broke (the capture: a host read or an allocation in the step) is the finding
        doc["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    finally:
        if fabric is not None:
            fabric.close()
    return doc


def _rank(rank, world, args):
    """One rank (the selected path's fabric needs a process group): build the model, run the paths."""
    import torch

    smoke = args["smoke"]
    dev = torch.device("cpu" if smoke else "cuda")
    shape = dict(SHAPES["smoke" if smoke else "full"])
    shape.setdefault("t", args["context"])
    if args["pattern"]:
        shape["pattern"] = args["pattern"]
    t0 = time.perf_counter()
    model = Model(dev, shape["b"], shape["h"], shape["hi"], shape["k"], shape["t"], shape["pattern"])
    kr = _report_module()
    name = "cpu (smoke)" if smoke else torch.cuda.get_device_name(dev)
    gpu = "rtx_pro_6000" if "RTX PRO 6000" in name else "h200"
    doc = {"device": name, "figures": gpu, "smoke": smoke, "requests": model.b, "rows": R, "heads": model.h, "index_heads": model.hi,
           "topk": model.k, "context": model.t, "layers": model.layers + 1, "full_layers": len(model.full),
           "draft_passes": DRAFTS, "format": FMT, "backend": model.backend, "setup_s": round(time.perf_counter() - t0, 1),
           "paths": {}}
    if not smoke and gpu == "h200" and "H200" not in name:  # an H100's 3.35 TB/s: every memory floor ~1.4x longer
        doc["figures_note"] = f"floors are the H200's, the device is {name}"
    for path in args["paths"]:
        t1 = time.perf_counter()
        res = run_path(model, path, smoke, args["iters"], args["warm"])
        res.update(floors(kr, model, path, gpu))
        res["wall_s"] = round(time.perf_counter() - t1, 1)
        doc["paths"][path] = res
        print(f"[graph_step] {path}: " + json.dumps({k: v for k, v in res.items() if k != "kernels"}), file=sys.stderr,
              flush=True)
        if args["json"]:  # path by path: a run stopped at its deadline keeps the paths it finished
            _write(doc, args["json"])
    return doc


def _summarize(doc: dict) -> dict:
    paths = doc["paths"].values()
    doc["all_equal"] = bool(paths) and all(p["all_equal"] for p in paths)
    doc["captured"] = doc["smoke"] or (bool(paths) and all(p["captured"] for p in paths))
    return doc


def _write(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(_summarize(doc), indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, eager only, on the CPU")
    ap.add_argument("--paths", default="local,selected")
    ap.add_argument("--context", type=int, default=8192, help="tokens per request before the step")
    ap.add_argument("--iters", type=int, default=20, help="timed eager steps and replays (median)")
    ap.add_argument("--pattern", default=None, help="the target layers' IndexShare pattern (default: GLM-5.2's; "
                    "--smoke: FSSS)")
    ap.add_argument("--warm", action="store_true",
                    help="one eager step per path, nothing timed or captured: Triton's compiles, cached for the timed run")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds the run has (default 110 on a GPU, the stage's limit less 10; 900 for --smoke)")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        os.environ.setdefault("SPARKINFER_FORCE_GPU_IMPLS", "1")  # the GPU's kernels, interpreted
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    sys.path.insert(0, REPO)
    from sparkinfer.comm.launch import run_ranks

    args = {"smoke": a.smoke, "paths": a.paths.split(","), "context": a.context, "iters": a.iters, "warm": a.warm,
            "json": a.json, "pattern": a.pattern}
    timeout = a.timeout or (900.0 if a.smoke else 110.0)
    try:
        doc = _summarize(run_ranks(_rank, 1, args, timeout_s=timeout, pg_timeout_s=max(10.0, timeout - 10))[0])
    except Exception as e:  # the rank failed or ran out of time: what it finished is in the JSON
        print(f"{type(e).__name__}: {str(e)[-2000:]}", file=sys.stderr)
        if not (a.json and os.path.exists(a.json)):
            return 1
        with open(a.json) as f:
            doc = json.load(f)
        doc["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
        print(json.dumps(doc, indent=1))
        _write(doc, a.json)
        return 1
    print(json.dumps(doc, indent=1))
    if a.json:
        _write(doc, a.json)
    if a.warm:
        return 0 if not any("error" in p for p in doc["paths"].values()) else 1
    ok = doc["all_equal"] and doc["captured"] and all(p.get("checks_clear") for p in doc["paths"].values())
    ok = ok and (not a.smoke or all(p.get("replay_safe") for p in doc["paths"].values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
