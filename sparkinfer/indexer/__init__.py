"""The replicated DSA indexer: scoring, deterministic top-k, the replicated cache.

    ids = indexer_topk(q, w, records, pos, k)      # int32 [M, k], -1 padded

q float32/bf16 [M, Hi, 128], w float32 [M, Hi], records uint8 [T, 132]
(indexer_fp8), pos int64 [M] (row m may select tokens 0..pos[m]). Scores are
sum_h w[m,h] * relu(q[m,h] . key_t); ids are ordered by score descending,
then token id ascending (the tie rule).

backend: "triton" (the kernel + torch.topk; on CPU it needs TRITON_INTERPRET=1
set before import), "torch" (float64 reference), "auto" (Triton on a GPU or
under the interpreter, else the reference, logged once).

Selection runs tiled in bounded memory (``tiled.py``); a step's requests go in one batched call:

    plan = plan_rows([(rows_r, slots_r, ids_r), ...], M).to(device)   # host, once per step
    ids = indexer_topk_rows(q, w, records, pos, k, **plan.kwargs(), check_values=False)

or, on the Triton backend, straight from the requests' pages, shaped by the rows alone (what a CUDA
graph replays; ``triton_paged``):

    paged_topk_rows(q, w, kv_cache, block_table, row_req, pos, k, tile=..., workspace=ws, out=ids)
"""

from __future__ import annotations

from sparkinfer.attention.dispatch import pick_backend

from .cache import ReplicatedIndexerCache
from .reference import indexer_scores_torch, indexer_topk_torch
from .sharded import MergeBuffers, all_gather_merge, merge_candidates, shard_candidates
from .tiled import RowLists, TopkWorkspace, indexer_topk, indexer_topk_rows, plan_rows
from .topk import select_topk
from .validate import check_index_inputs


def indexer_scores(q, w, records, pos=None, token_slots=None, *, backend: str = "auto", check_values: bool = True):
    """float32 scores [M, T] (the reference's float64 scores rounded when backend resolves to torch)."""
    if pick_backend(backend, q.is_cuda, "indexer") == "torch":
        return indexer_scores_torch(q, w, records, pos, token_slots, check_values).float()
    check_index_inputs(q, w, records, pos, token_slots, check_values)
    from .triton_scores import indexer_scores_triton

    return indexer_scores_triton(q, w, records, pos, token_slots)


__all__ = ["indexer_topk", "indexer_topk_rows", "plan_rows", "RowLists", "TopkWorkspace", "indexer_scores", "indexer_topk_torch",
           "indexer_scores_torch", "select_topk", "ReplicatedIndexerCache", "shard_candidates", "merge_candidates", "all_gather_merge",
           "MergeBuffers"]
