"""The fused decode (compaction, split-K and the merge by each row's last split, one launch) replayed in
a CUDA graph: the merge tickets are reset by the last split of every call, so replay after replay on new
queries equals the eager call bit for bit. Its CPU twin, interpreted: ``test_attention.py``'s
``test_split_merge_in_one_launch_is_replay_safe`` (the tickets are zero after a call, the same workspace
gives the same output again)."""

import pytest
import torch

from sparkinfer.attention import sparse_mla_decode
from sparkinfer.attention.triton_decode import DecodeWorkspace
from sparkinfer.formats import get_format


@pytest.mark.gpu
@pytest.mark.parametrize("listed_dtype", [torch.int32, torch.int64])
def test_gpu_fused_decode_replays_equal_eager(listed_dtype):
    """64 rows x 16 heads x 2,048 listed (some -1, one row empty), 4 splits; 20 replays, each on new
    queries and indices copied into the captured inputs, against an eager call on the same inputs."""
    dev = torch.device("cuda")
    fmt = get_format("nvfp4_368")
    m, h, k, pool, splits = 64, 16, 2048, 65536, 4
    g = torch.Generator().manual_seed(5)
    records = fmt.encode(torch.randn(pool, 512, generator=g), torch.randn(pool, 64, generator=g)).to(dev)

    def inputs():
        idx = torch.randint(0, pool, (m, k), generator=g)
        idx[torch.rand(m, k, generator=g) < 0.2] = -1
        idx[7] = -1
        return (torch.randn(m, h, 512, generator=g).to(dev, torch.bfloat16),
                torch.randn(m, h, 64, generator=g).to(dev, torch.bfloat16), idx.to(dev, listed_dtype))

    q_nope, q_rope, idx = inputs()
    ws = DecodeWorkspace.allocate(m, h, k, splits, dev)
    out = torch.empty(m, h, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(m, h, device=dev)

    def call():
        return sparse_mla_decode(q_nope, q_rope, records, fmt, idx, 576 ** -0.5, backend="triton",
                                 check_indices=False, out=out, lse=lse, workspace=ws)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(20):
        new = inputs()
        for dst, src in zip((q_nope, q_rope, idx), new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone(), lse.clone()
        assert not ws.tickets.any()
        want = call()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.isfinite(got[0].float()).all() and bool((got[1][7] == -torch.inf).all())
