"""The replicated-indexer invariant across processes (torch.distributed gloo, 4 ranks).

Every rank builds the same inputs, writes every token's key into its own
ReplicatedIndexerCache and computes the top-k alone (each rank with a
different CPU thread count, so nothing may depend on it). The ranks then
all-gather their top-k and check that
  1. every rank's top-k is identical (the invariant that lets ranks skip any
     indexer communication), and
  2. it equals upstream's sharded computation: each rank scores only the tokens
     it owns under DCP placement (owner(t) = (t // I) % D), and the merged
     per-rank candidates give the global top-k.
Run through the Triton kernel (interpreter on CPU) and the torch reference.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
T, M, HI, K, INTERLEAVE = 160, 4, 4, 24, 2
INDEXER_LAYERS = (0, 1, 2, 6)


def _inputs():
    g = torch.Generator().manual_seed(1234)
    keys = {layer: torch.randn(T, 128, generator=g) for layer in INDEXER_LAYERS}
    q = torch.randn(M, HI, 128, generator=g)
    w = torch.randn(M, HI, generator=g)
    pos = torch.tensor([T - 1, T - 2, T // 3, 5])
    return keys, q, w, pos


def _worker(rank: int, port: int):
    torch.set_num_threads(1 + rank % 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        for backend in ("triton", "torch"):
            _check_invariants(rank, backend)
    finally:
        dist.destroy_process_group()


def _check_invariants(rank: int, backend: str):
    from sparkinfer.indexer import ReplicatedIndexerCache, merge_candidates, shard_candidates

    keys, q, w, pos = _inputs()
    cache = ReplicatedIndexerCache(INDEXER_LAYERS, capacity=T)
    for layer in INDEXER_LAYERS:
        cache.write(layer, torch.arange(T), keys[layer])
    layer = 6
    mine = cache.topk(layer, q, w, pos, K, backend=backend)

    gathered = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(gathered, mine)
    for other in gathered:
        assert torch.equal(other, mine), f"rank {rank}: top-k differs between ranks"

    tokens = torch.arange(T)
    owned = tokens[(tokens // INTERLEAVE) % WORLD == rank]
    scores, ids = shard_candidates(q, w, cache.layer_records(layer)[owned], owned, pos, K, backend=backend)
    all_scores = [torch.empty_like(scores) for _ in range(WORLD)]
    all_ids = [torch.empty_like(ids) for _ in range(WORLD)]
    dist.all_gather(all_scores, scores)
    dist.all_gather(all_ids, ids)
    merged = merge_candidates(torch.stack(all_scores), torch.stack(all_ids), K)
    assert torch.equal(merged, mine), f"rank {rank}: sharded merge differs from the replicated top-k"
    assert (mine[0] >= 0).all() and (mine[3, 6:] == -1).all()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiproc
def test_replicated_topk_identical_on_all_ranks_and_equal_to_sharded():
    # Children inherit TRITON_INTERPRET from conftest, so the kernel runs interpreted off-GPU.
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD, join=True)
