"""CUDA fabric: the same exchange scenarios on GPUs (skipped without CUDA).

Ranks share the available devices round robin, so this also runs on a single lent GPU (four
processes on one device still go through IPC handles, copy streams and device flags)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]


def _rank_main(rank, world, width):
    import torch

    from sparkinfer.comm.cuda_fabric import CudaFabric
    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.comm.pack import Shard, check_cuda_errors
    from sparkinfer.comm.slab import SlabLayout
    from sparkinfer.comm.synthetic import make_case

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    fabric = CudaFabric(SlabLayout(world, width, capacity=48, max_layers=3, depth=2), timeout_s=10)
    try:
        ex = SelectedExchange(fabric)
        layers = [1, 2, 3]
        results = []
        for seed in (1, 2, 3):  # three exchanges: slots wrap, sequence words advance
            case = make_case(world, width, seed=seed, held_frac=0.2)
            sh = case.shard(rank)
            shard = Shard(sh.cache.to(dev), sh.block_table.to(dev), sh.block_size)
            p = case.planes
            planes = type(p)(p.count.to(dev), p.req.to(dev), p.local.to(dev), p.slot.to(dev), p.overflow)
            ws = torch.zeros(3, case.full.shape[1] * case.union.shape[1], width, dtype=torch.uint8, device=dev)
            ex.exchange(planes, shard, torch.tensor(layers, dtype=torch.int32, device=dev), ws)
            torch.cuda.synchronize()
            check_cuda_errors(dev)
            rows = case.delivered(rank)
            results.append(bool(torch.equal(ws.cpu()[:, rows], case.expected_workspace(rank, layers)[:, rows])))
        return results
    finally:
        fabric.close()


@pytest.mark.parametrize("width", [368, 656, 37])
def test_cuda_fabric_exchange_matches_gather(width):
    from sparkinfer.comm.launch import run_ranks

    assert run_ranks(_rank_main, 4, width, timeout_s=180) == [[True] * 3] * 4
