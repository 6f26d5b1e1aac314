"""Selected-record decode and gathered prefill steps inside vLLM's sparse-MLA backend at DCP > 1
(driven by ``sparse_mla_backend``; patch 0001 skips vLLM's DCP query gather and LSE combine of such
a step, patch 0008 starts the runtime at engine start).

One ``SelectedRuntime`` per worker process, held by the worker's runtime (``WorkerRuntime.selected``,
``sparkinfer.decode.runtime``; made at engine start by ``create``; None when the engine can never
take the selected path: DCP 1, mode stock, a cache dtype that is not a record format (368, 432,
656 B), or a sharded indexer). The backend calls it at three points of a step:

* metadata build (``choose``): the ``StepPath`` gates on the step's rows and contexts; identical
  on every rank (the scheduler output is), so every rank of the DCP group takes the same path;
* cache write (``stash``): the step's own records of the layer, encoded for all tokens (vLLM
  writes only this rank's tokens into the shard, and only at this layer's forward: after the
  group's exchange was issued at its Full layer, see ``selected_decode.py``); with replicas on,
  every target step (stock ones too) also writes them into the replica store;
* attention (``attend``): the first layer of a step starts it (``begin_step`` with every DSA
  layer's cache; a gathered step plans every layer there), a Full layer of a decode step plans and
  prefetches its group from the replicated indexer's top-k, every layer attends with this rank's
  heads over the fetched records, and the last one books the step in the ``PathLedger``.

Replica records (``replica_window``, ``sparkinfer.core.replicas``): every rank keeps the last
``window`` positions of each request in a per-layer ring, keyed by the request's id (recorded by
patch 0008, ``step_requests``; vLLM never gives two requests one id, and a preempted request
restarts below its run, which starts a new one). ``choose`` advances the rule from the step's rows; the planes then treat
the window as held everywhere, a group with nothing remote runs no exchange, and a step whose
requests hold their whole context goes selected even under ``auto`` (it moves nothing).

Patched ``MLAAttention.forward`` skips the query all-gather and the LSE combine of a selected
step: each rank's heads already saw every selected record. The fabric is the host fabric over the
DCP group's gloo group (the CUDA fabric when the caches are on a GPU: not run yet), built at
engine start with every buffer (``start``, from ``engine_start``; sizes from ``reservations``, the
same that patch 0008 took out of the KV memory) and proven there with a real exchange.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from vllm.forward_context import get_forward_context

from sparkinfer.config import from_additional_config
from sparkinfer.core.accounting import StockDcpShape, stock_dcp_layer
from sparkinfer.core.replicas import ReplicaWindow
from sparkinfer.decode import graph_paths, impls, step_plan
from sparkinfer.vllm import replica_budget, reservations
from sparkinfer.core.topology import DcpLayout, IndexSharePattern
from sparkinfer.vllm.cache_dtypes import canonical_cache_dtype
from sparkinfer.decode.paged_sparse_mla import copy_rows
from sparkinfer.decode.step_path import StepPath

log = logging.getLogger(__name__)

def _layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


def _replica_writes(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(store rows, token rows, taken int64 0/1), one entry per token row of the step, from
    ``ReplicaStep.write_rows`` (-1: the token is not kept): a fixed shape whatever the step keeps,
    so the layers' copies replay from a graph. An entry not kept repeats the step's first kept write
    (same source, same row, same bytes: a write every copy may make); with none kept, every entry
    is masked off (row 0 rewritten with itself by the torch twin)."""
    kept = np.flatnonzero(rows >= 0)
    first = kept[0] if kept.size else 0
    src = np.where(rows >= 0, np.arange(rows.shape[0]), first)
    dst = np.where(rows >= 0, rows, max(rows[first], 0) if rows.size else 0)
    return dst, src, np.full(rows.shape[0], int(kept.size > 0), dtype=np.int64)


class SelectedRuntime:
    def __init__(self, vllm_config, runtime):
        from sparkinfer.formats import get_format

        hf = vllm_config.model_config.hf_config
        spec = vllm_config.speculative_config
        self.vllm_config = vllm_config
        self.runtime = runtime  # the worker's (decode.runtime.WorkerRuntime): its arena, its device checks
        self.config = from_additional_config(vllm_config.additional_config)
        self.dcp = vllm_config.parallel_config.decode_context_parallel_size
        self.interleave = vllm_config.parallel_config.cp_kv_cache_interleave_size
        self.fmt = get_format(canonical_cache_dtype(vllm_config.cache_config.cache_dtype))
        self.num_layers = hf.num_hidden_layers
        self.pattern = IndexSharePattern.parse(hf.index_topk_pattern, self.num_layers)
        self.rows = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        self.topk = hf.index_topk
        # every buffer's size, as patch 0008 reserved it out of the KV memory (reservations)
        self.sizing = reservations.sizing(vllm_config)
        self.gather_rows = self.sizing.gather_rows
        self.max_batch = self.sizing.max_batch
        par = vllm_config.parallel_config
        itemsize = vllm_config.model_config.dtype.itemsize
        stock = StockDcpShape(rows=0, num_heads=hf.num_attention_heads, tp=par.tensor_parallel_size, dcp=self.dcp,
                              backend=par.dcp_comm_backend or "ag_rs", q_bytes=itemsize, out_bytes=itemsize,
                              q_replicated=bool(par.dcp_q_replicate))
        self.path = StepPath(self.config, dcp=self.dcp, record_format=True, rows=self.rows,
                             max_batch=self.max_batch, policy=self._policy(hf, stock), gather_rows=self.gather_rows,
                             layout=DcpLayout(self.dcp, self.interleave), record_bytes=self.fmt.record_bytes,
                             stock=stock)
        self.decoder = None
        self.checks = None  # the exchange's device error words, read one step late (comm.errors)
        self._records: dict[int, torch.Tensor] = {}  # kv_cache data_ptr -> uint8 [T, W] of this step
        self._step = None  # forward context of the step in progress
        self._charge: PathLedger | None = None  # the ledger of the step in progress
        self._layers: dict[int, object] | None = None
        # stock DCP's bytes are linear in the rows: one row's, all layers, priced once
        self._stock_bytes_per_row = int(stock_dcp_layer(replace(stock, rows=1)).rx.max()) * self.num_layers
        self.ledger = {"selected": PathLedger(), "gather": PathLedger()}
        self.selected = False  # the step being built / run takes the selected or gathered path
        self.keep_records = False  # the step's cache writes are stashed (selected) or kept (replicas)
        self.replicas: ReplicaWindow | None = None  # built at the first step (auto needs the caches)
        self.replicas_on = self.config.replica_window != 0  # the rule runs (``use`` may turn it off)
        self._replica_store: list[torch.Tensor] | None = None  # per layer uint8 [slots * window, W]
        # ((store rows, token rows, taken) of the step's writes, the executor's LocalReplicas) of the step
        # being built (None: no replicas this step); the writes in fixed shape, one per token row
        # (``_replica_writes``), in persistent buffers: a captured graph replays them
        self._step_replicas = None
        self._replica_uploads = None
        self._taken: torch.Tensor | None = None
        self._layer_of: dict[int, int] | None = None  # kv_cache data_ptr -> model layer
    def _policy(self, hf, stock: StockDcpShape):
        """``auto``'s cost model for decode steps when a shipped profile describes this node (GPU
        name and DCP size, ``costmodel.find_profile``), with stock DCP priced as vLLM will run it;
        None otherwise: ``auto`` decode steps then stay stock (``StepPath``). Not run yet: needs a GPU."""
        if self.config.mode != "auto" or not torch.cuda.is_available():
            return None
        from sparkinfer.core.costmodel import find_profile
        from sparkinfer.core.geometry import ModelGeometry
        from sparkinfer.core.policy import StepPolicy

        profile = find_profile(torch.cuda.get_device_name(), self.dcp)
        if profile is None:
            return None
        log.info("sparkinfer: auto decides each decode step with the %s profile", profile.name)
        return StepPolicy(profile, ModelGeometry.from_hf_config(hf), tp=stock.tp, dcp=self.dcp,
                          record_format=self.fmt.name, backend=stock.backend, q_replicated=stock.q_replicated,
                          max_depth=self.config.prefetch_depth, workspace_bytes=self.config.pool_mb * 2**20,
                          mode="auto", env={})

    @classmethod
    def create(cls, vllm_config, runtime) -> "SelectedRuntime | None":
        """Engine start: the runtime of ``runtime``'s worker (``WorkerRuntime.selected``), None where
        the engine can never take the selected path. Until then (profiling runs) steps are stock."""
        # every rank must compute the same top-k (replicated indexer) to plan the same exchange
        eligible = replica_budget.selected_path_possible(vllm_config)
        runtime.selected = cls(vllm_config, runtime) if eligible else None
        return runtime.selected

    def _kv_bytes(self) -> int:
        """Bytes of every KV cache this worker allocated (all attention and indexer layers)."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        caches = [getattr(m, "kv_cache", None) for m in ctx.values()]
        return sum(c.numel() * c.element_size() for c in caches if isinstance(c, torch.Tensor))

    def _replica_rule(self) -> ReplicaWindow | None:
        """The replica rule and store, built at the first step (the window comes from the KV bytes
        vLLM gave this worker after patch 0008 reserved the store's share, ``replica_budget``)."""
        if self.replicas is None and self.config.replica_window != 0:
            window = replica_budget.window(self.vllm_config, self._kv_bytes())
            if window > 0:
                slots = self.vllm_config.scheduler_config.max_num_seqs
                self.replicas = ReplicaWindow(window, slots)
                cache = self._dsa_layers()[0].kv_cache
                self._replica_store = [torch.zeros(slots * window, self.fmt.record_bytes, dtype=torch.uint8,
                                                   device=cache.device) for _ in range(self.num_layers)]
                log.info("sparkinfer: replica store of %d positions x %d requests x %d layers (%.1f MiB per rank)",
                         window, slots, self.num_layers, slots * window * self.num_layers * self.fmt.record_bytes / 2**20)
        return self.replicas

    def choose(self, query_lens: list[int], contexts: list[int], keys: list[int] | None = None,
               path: str | None = None, padded: int = 0) -> str:
        """The target model step's path (``StepPath``: one of ``step_path.PATHS``); ``selected``
        remembers whether it is not stock, so that only those steps pay for stashing their records.
        ``keys``: each real request's id (the replica rule's key; None: no replicas this step);
        ``path``: taken instead of the host's choice (a CUDA graph's capture run, ``capture_path``);
        ``padded``: the last requests are vLLM's padding of a FULL graph's batch (``step_plan.batch_rows``:
        rows of their own, context 0, no key): the rule and the replica store never see them, they
        hold nothing and their rows write nothing."""
        if self.checks is not None:  # the previous steps' device checks, before planning this one
            self.checks.poll()
        rule = self._replica_rule() if keys is not None and self.replicas_on else None
        all_local, fetched_below = False, None
        self._step_replicas = None
        if rule is not None:
            real = len(query_lens) - padded
            step = rule.begin_step(keys, contexts[:real], query_lens[:real])
            pad_rows = sum(query_lens[real:])
            # the padded requests: nothing held (lo = their context 0), no slot, their rows not kept
            step = replace(step, slot=np.pad(step.slot, (0, padded), constant_values=-1),
                           lo=np.pad(step.lo, (0, padded)), start=np.pad(step.start, (0, padded)),
                           n=np.pad(step.n, (0, padded)))
            writes = np.pad(step.write_rows(), (0, pad_rows), constant_values=-1)
            dst, src, taken = _replica_writes(writes)
            if self._replica_uploads is None:
                sched = self.vllm_config.scheduler_config
                dev = self._replica_store[0].device
                self._replica_uploads = step_plan.Uploads(dev, 2 * sched.max_num_seqs + 3 * sched.max_num_batched_tokens)
                self._taken = torch.empty(sched.max_num_batched_tokens, dtype=torch.bool, device=dev)
            # the rows this step writes and the window's bounds reach the device in one copy, here
            lo, base, dst, src, taken = self._replica_uploads(step.lo, step.slot.clip(min=0) * step.window, dst, src,
                                                              taken)
            mask = torch.ne(taken, 0, out=self._taken[: taken.shape[0]])
            from sparkinfer.decode.selected_decode import LocalReplicas

            self._step_replicas = ((dst, src, mask),
                                   LocalReplicas(self._replica_store, lo, base, step.window, bool(step.all_local)))
            all_local, fetched_below = step.all_local, step.lo.tolist()
        if path is None:
            path = self.path.choose(query_lens, contexts, all_local=all_local, fetched_below=fetched_below).path
        self.selected = path != "stock"
        self.keep_records = self.selected or self._step_replicas is not None
        return path

    def capture_path(self, num_reqs: int) -> str:
        """The path a FULL CUDA graph of ``num_reqs`` uniform decode requests is captured on: the
        host's choice at the engine's longest context (``graph_paths.capture_path``)."""
        longest = self.vllm_config.model_config.max_model_len - self.rows
        return graph_paths.capture_path(self.path, num_reqs, max(longest, 0))

    def use(self, mode: str, replicas: bool) -> None:
        """Which paths the following steps may take (``worker_runtime.use_paths``, on every rank alike):
        ``mode`` as the engine's ``sparkinfer_mode`` decides (``stock``: every step stock DCP;
        ``auto``: the cost model this engine started with, stock where it started without one);
        ``replicas``: the replica rule runs (its writes and its all-local steps). The buffers stay
        what the engine reserved at start, so replicas need an engine started with a window. A
        toggle of the replicas starts a fresh rule: a request in flight then holds no replicas below
        its next position and fetches those records, as a request seen for the first time does."""
        if mode not in ("stock", "selected", "auto"):
            raise ValueError(f"sparkinfer mode must be stock, selected or auto, got {mode!r}")
        if replicas and self.config.replica_window == 0:
            raise ValueError("replicas: this engine started without a replica store (sparkinfer_replica_window 0); "
                             "start it with a window to switch them on")
        self.config = replace(self.config, mode=mode)
        self.path.config = self.config
        if replicas != self.replicas_on:
            self.replicas_on = bool(replicas)
            if self.replicas is not None:
                self.replicas = ReplicaWindow(self.replicas.window, self.replicas.slots)

    def stash(self, kv_cache: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, num_tokens: int) -> None:
        """The step's own records of the layer whose cache is ``kv_cache`` (all tokens, every rank):
        kept for a selected step's attention and written into the replica store."""
        if self._layer_of is None:
            self._layer_of = {layer.kv_cache.data_ptr(): i for i, layer in self._dsa_layers().items()}
        idx = self._layer_of.get(kv_cache.data_ptr())
        if idx is None:  # not a target model layer (the MTP layer): its records are not planned
            return
        k_pe = k_pe.squeeze(1) if k_pe.dim() == 3 else k_pe
        records = self.fmt.encode(kv_c_normed[:num_tokens], k_pe[:num_tokens], checks=self.runtime.checks)
        if self.selected:
            self._records[kv_cache.data_ptr()] = records
        if self._step_replicas is not None:
            dst, src, mask = self._step_replicas[0]
            copy_rows(self._replica_store[idx], records, src, mask, dst_rows=dst)

    def _dsa_layers(self) -> dict[int, object]:
        """Model layer index -> attention layer (its ``kv_cache`` is the layer's record cache)."""
        if self._layers is None:
            ctx = self.vllm_config.compilation_config.static_forward_context
            self._layers = {}
            for name, module in ctx.items():
                if getattr(module, "kv_cache", None) is None or not hasattr(module, "impl"):
                    continue
                if getattr(module.impl, "is_sparse", False) and name.endswith(".attn"):
                    idx = _layer_index(name)
                    if idx < self.num_layers:
                        self._layers[idx] = module
            missing = sorted(set(range(self.num_layers)) - set(self._layers))
            if missing:
                raise RuntimeError(f"selected decode: no sparse-MLA attention layer found for model layer(s) {missing}")
        return self._layers

    def start(self) -> bool:
        """Engine start (``engine_start``, after the KV caches exist; a collective of the DCP group):
        the replica store, the ring and the fabric, then a real exchange that proves the fabric
        moves records between every pair (``comm.proof``). False, with one log line naming the fix,
        when the node has no working P2P or the proof failed on some rank: every rank then drops
        the selected path and the engine serves stock DCP from the first request."""
        from vllm.distributed.parallel_state import get_dcp_group

        from sparkinfer.comm.errors import StepChecks
        from sparkinfer.comm.fabric import PeerAccessError
        from sparkinfer.comm.proof import agreed_proof

        device = self._dsa_layers()[0].kv_cache.device  # a fabric that cannot reach it: refused by engine_start
        kind = impls.fabric_kind(self.config.fabric, device)
        group = get_dcp_group()
        if self.config.replica_window != 0:
            self._replica_rule()
        try:  # a rank missing from the construction raises FabricError on every rank: start fails
            self.decoder = self._build_decoder(self._dsa_layers()[0].impl.scale, device, kind)
        except PeerAccessError as e:  # every rank alike, before any IPC setup
            self.drop()
            log.warning("sparkinfer: no P2P between the GPUs (%s); serving stock DCP from the first request. Run "
                        "`sparkinfer preflight` on this node for the fix.", e)
            return False
        proven, failed = agreed_proof(self.decoder.ring.exchange, group.cpu_group)  # times out, never hangs
        if not failed:
            self.checks = StepChecks(self.decoder.ring.exchange.fabric)
            log.info("sparkinfer: the %s fabric passed its start-up proof (%s-sized exchanges between all %d ranks)",
                     kind, " and ".join(proven), group.world_size)
            return True
        self.decoder.ring.exchange.fabric.close()
        self.drop()
        log.warning("sparkinfer: the %s fabric failed at engine start on rank(s) %s (%s); serving stock DCP from the "
                    "first request. Run `sparkinfer preflight` on this node for the fix.", kind, sorted(failed),
                    next(iter(failed.values())))
        return False

    def drop(self) -> None:
        """Take the selected path out of this engine: the worker's runtime holds none from now on."""
        if self.runtime.selected is self:
            self.runtime.selected = None
        self.decoder = self.checks = self.replicas = self._replica_store = None

    def _build_decoder(self, scale: float, device: torch.device, kind: str):
        """The executor over the configured fabric (``auto``: ``cuda`` for caches on a GPU, copy
        engines and IPC slabs; ``host`` otherwise, the shared-memory stand-in); slab layout from
        the same ``sizing`` patch 0008 reserved; exchange sizing and attention kernel from ``impls``
        (device-sized and Triton on a GPU or when forced)."""
        from vllm.distributed.parallel_state import get_dcp_group

        from sparkinfer.comm.exchange import SelectedExchange
        from sparkinfer.decode.selected_decode import SelectedDecode

        group = get_dcp_group()
        depth = self.config.prefetch_depth
        layout = self.sizing.slab()
        if kind == "cuda":
            from sparkinfer.comm.cuda_fabric import CudaFabric as fabric_cls
        else:
            from sparkinfer.comm.host_fabric import HostFabric as fabric_cls
        fabric = fabric_cls(layout, group=group.cpu_group, timeout_s=60)
        sizing, backend = self.sizing.sizing, impls.kernel_backend(device)
        log.info("sparkinfer: selected-record decode on the %s fabric (%s-sized, %s attention), DCP %d, R %d, "
                 "top-k %d, depth %d", fabric.kind, sizing, backend, group.world_size, self.rows, self.topk, depth)
        exchange = SelectedExchange(fabric, sizing)
        return SelectedDecode(exchange, self.fmt, DcpLayout(group.world_size, self.interleave), self.pattern,
                              max_batch=self.max_batch, rows=self.rows, topk=self.topk, depth=depth, scale=scale,
                              backend=backend, gather_rows=self.gather_rows, checks=self.runtime.checks,
                              arena=self.runtime.arena)

    def attend(self, layer, q_nope: torch.Tensor, q_rope: torch.Tensor, topk_buffer: torch.Tensor, md):
        """(out [T, H, 512], lse [T, H]) of this rank's heads at ``layer`` (an MLAAttention)."""
        if self.decoder is None:
            raise RuntimeError("selected decode: the fabric is built at engine start (patch 0008 calls "
                               "sparkinfer.vllm.engine_start.start); this vLLM never called it")
        idx = _layer_index(layer.layer_name)
        n = q_nope.shape[0]
        gathered = md.sparkinfer_gather
        step = get_forward_context()  # one per model forward; layers may carry different metadata objects
        if step is not self._step:  # the step's first DSA layer
            layers = self._dsa_layers()
            cache = layers[0].kv_cache
            self.decoder.begin_step([layers[i].kv_cache for i in range(self.num_layers)], md.block_table,
                                    cache.shape[1], md.context, md.query_lens if gathered else None,
                                    None if self._step_replicas is None else self._step_replicas[1])
            if gathered:
                self.decoder.gather()
            self._step = step
            self._charge = self.ledger["gather" if gathered else "selected"]
            self._charge.start(n, n * self._stock_bytes_per_row)
            self._exchanges = (self.decoder.exchanges, self.decoder.skipped)
        if not gathered and self.pattern.is_full(idx):
            self.decoder.full_layer(idx, topk_buffer[:n].to(torch.int32))
        records = self._records.pop(layer.kv_cache.data_ptr(), None)
        if records is None:
            raise RuntimeError(f"selected decode: layer {idx} attends before its cache write stashed the step's records")
        out = self.decoder.attend(idx, q_nope, q_rope, records, topk_buffer[:n] if gathered else None)
        if idx == self.num_layers - 1:  # the step's exchanges are all complete
            self.checks.end_step()
            self._charge.finish(self.decoder.step_stats().records_recv, self.fmt.record_bytes,
                                self.decoder.exchanges - self._exchanges[0], self.decoder.skipped - self._exchanges[1])
        return out


@dataclass
class PathLedger:
    """What one path's steps moved into this rank, beside what stock DCP would have moved for the
    same rows (``StockDcpShape`` as vLLM runs it, all layers): the per-engine comparison."""

    steps: int = 0
    rows: int = 0  # query rows of those steps
    records_recv: int = 0  # records the exchanges delivered to this rank (measured)
    bytes_recv: int = 0
    stock_bytes: int = 0  # stock DCP's bytes into this rank for the same rows (accounting)
    exchanges: int = 0  # layered exchanges run (each: pack, one copy per pair, one barrier)
    exchanges_skipped: int = 0  # groups whose records were all local (replicas): nothing ran

    def start(self, rows: int, stock_bytes: int) -> None:
        self.steps += 1
        self.rows += rows
        self.stock_bytes += stock_bytes

    def finish(self, records_recv: int, record_bytes: int, exchanges: int = 0, skipped: int = 0) -> None:
        self.records_recv += records_recv
        self.bytes_recv += records_recv * record_bytes
        self.exchanges += exchanges
        self.exchanges_skipped += skipped


def worker_selected(worker) -> "SelectedRuntime | None":
    """The selected runtime (``WorkerRuntime.selected``) of ``worker``'s engine (the vLLM worker
    ``collective_rpc`` passes the probes below); None without one."""
    from sparkinfer.vllm import worker_runtime

    runtime = worker_runtime.of_engine(worker.vllm_config)
    return None if runtime is None else runtime.selected


def transport_ledger(worker) -> dict:
    """This worker's ``PathLedger`` per path (``selected``, ``gather``), as dicts; empty when the
    engine never takes those paths (``LLM.collective_rpc(transport_ledger)`` asks every worker)."""
    rt = worker_selected(worker)
    return {} if rt is None else {path: asdict(led) for path, led in rt.ledger.items()}


def replica_memory(worker) -> dict:
    """This worker's KV cache bytes and replica store (window, bytes), for
    ``LLM.collective_rpc(replica_memory)``; empty without a runtime."""
    rt = worker_selected(worker)
    if rt is None:
        return {}
    store = rt._replica_store or []
    return {"kv_bytes": rt._kv_bytes(), "window": rt.replicas.window if rt.replicas else 0,
            "store_bytes": sum(t.numel() for t in store)}


def engine_memory(worker) -> dict:
    """This worker's KV cache bytes, the buffers patch 0008 reserved for it (``reserved``: name ->
    bytes, from ``reservations``; the replica store as allocated) and what the worker actually
    holds (``held``: measured from its tensors, the attention arena's included), for
    ``LLM.collective_rpc(engine_memory)``; empty without a runtime."""
    rt = worker_selected(worker)
    if rt is None or rt.decoder is None:
        return {}
    store = sum(t.numel() for t in rt._replica_store or [])
    exchange = rt.decoder.ring.exchange
    held = {"attention_workspace": rt.runtime.arena.held_bytes(),
            "prefetch_ring": rt.decoder.ring.buf.numel(), **exchange.fabric.held_bytes(),
            "exchange_index": exchange.index_bytes(), "group_plan": rt.decoder.plan.nbytes}
    reserved = {"attention_workspace": reservations.attention_workspace(rt.vllm_config).nbytes, **rt.sizing.buffers()}
    if store:
        held["replica_store"] = reserved["replica_store"] = store
    return {"kv_bytes": rt._kv_bytes(), "reserved": reserved, "held": held}
