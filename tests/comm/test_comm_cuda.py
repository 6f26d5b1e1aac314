"""CUDA fabric: the same exchange scenarios on GPUs (skipped without CUDA).

Ranks share the available devices round robin, so this also runs on a single lent GPU (four
processes on one device still go through IPC handles, copy streams and device flags)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]


def _device_case(case, rank, dev):
    from sparkinfer.comm.pack import Shard

    sh, p = case.shard(rank), case.planes
    shard = Shard(sh.cache.to(dev), sh.block_table.to(dev), sh.block_size)
    planes = type(p)(p.count.to(dev), p.req.to(dev), p.local.to(dev), p.slot.to(dev), p.overflow)
    return shard, planes


def _rank_main(rank, world, width, sizing):
    import torch

    from sparkinfer.comm.cuda_fabric import CudaFabric
    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.core.slab import SlabLayout
    from sparkinfer.comm.synthetic import make_case

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    fabric = CudaFabric(SlabLayout(world, width, capacity=48, max_layers=3, depth=2), timeout_s=10)
    try:
        ex = SelectedExchange(fabric, sizing)
        layers = [1, 2, 3]
        results = []
        for seed in (1, 2, 3):  # three exchanges: slots wrap, sequence words advance
            case = make_case(world, width, seed=seed, held_frac=0.2)
            shard, planes = _device_case(case, rank, dev)
            ws = torch.zeros(3, case.full.shape[1] * case.union.shape[1], width, dtype=torch.uint8, device=dev)
            ex.exchange(planes, shard, torch.tensor(layers, dtype=torch.int32, device=dev), ws)
            fabric.check()  # syncs, then the fabric's wait and move error words
            rows = case.delivered(rank)
            results.append(bool(torch.equal(ws.cpu()[:, rows], case.expected_workspace(rank, layers)[:, rows])))
        return results
    finally:
        fabric.close()


@pytest.mark.parametrize("sizing", ["host", "device"])
@pytest.mark.parametrize("width", [368, 656, 37])
def test_cuda_fabric_exchange_matches_gather(width, sizing):
    from sparkinfer.comm.launch import run_ranks

    assert run_ranks(_rank_main, 4, width, sizing, timeout_s=180) == [[True] * 3] * 4


def _graph_rank_main(rank, world, width):
    """One eager device-sized exchange, then capture it in a CUDA graph and replay it on new plans
    copied into the same buffers (the decode step's pattern)."""
    import torch

    from sparkinfer.comm.cuda_fabric import CudaFabric
    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.core.slab import SlabLayout
    from sparkinfer.comm.synthetic import make_case

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    fabric = CudaFabric(SlabLayout(world, width, capacity=48, max_layers=2, depth=2), timeout_s=10)
    try:
        ex = SelectedExchange(fabric, "device")
        layers = torch.tensor([0, 3], dtype=torch.int32, device=dev)
        cases = [make_case(world, width, seed=s, held_frac=0.2) for s in (11, 12, 13, 14)]
        shard, planes = _device_case(cases[0], rank, dev)  # the static buffers
        ws = torch.zeros(2, cases[0].full.shape[1] * cases[0].union.shape[1], width, dtype=torch.uint8, device=dev)

        def load_and_check(case, run):
            s, p = _device_case(case, rank, dev)
            for dst, src in ((shard.cache, s.cache), (shard.block_table, s.block_table), (planes.count, p.count),
                             (planes.req, p.req), (planes.local, p.local), (planes.slot, p.slot)):
                dst.copy_(src)
            ws.zero_()
            torch.cuda.synchronize()
            run()
            fabric.check()
            # every move kernel that published a flag set its CTA counter back to zero, or the next
            # replay's last CTA would never see the count reach the grid and never publish
            assert not fabric._arrive_counters.any()
            rows = case.delivered(rank)
            return bool(torch.equal(ws.cpu()[:, rows], case.expected_workspace(rank, [0, 3])[:, rows]))

        out = [load_and_check(cases[0], lambda: ex.exchange(planes, shard, layers, ws))]  # eager
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ex.exchange(planes, shard, layers, ws)
        out += [load_and_check(c, graph.replay) for c in cases[1:]]
        return out
    finally:
        fabric.close()


@pytest.mark.parametrize("width", [368, 37])
def test_cuda_graph_replays_device_sized_exchange(width):
    from sparkinfer.comm.launch import run_ranks

    assert run_ranks(_graph_rank_main, 4, width, timeout_s=180) == [[True] * 4] * 4
