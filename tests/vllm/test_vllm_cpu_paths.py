"""sparkinfer's CPU paths for vLLM's DSA model: the indexer glue (no vllm needed) and the float-cache
attention of the CPU sparse backend (needs vllm). References: Python loops and float64 torch."""

import math

import pytest
import torch

from sparkinfer.formats import get_format
from sparkinfer.indexer import indexer_topk_torch
from sparkinfer.vllm.replicated_indexer import ReplicatedIndexerMetadata, quant_q_fp8, run_indexer, token_layout


def test_token_layout():
    # request 0: 3 new tokens of 7 (prefill continuing), request 1: 1 decode token of 5, request 2: 2 of 2
    token_req, pos = token_layout(torch.tensor([0, 3, 4, 6]), torch.tensor([7, 5, 2]), 6)
    assert token_req.tolist() == [0, 0, 0, 1, 2, 2]
    assert pos.tolist() == [4, 5, 6, 4, 0, 1]


def test_quant_q_fp8_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 128, generator=g) * torch.tensor([0.01, 30.0])[None, :, None]
    q, s = quant_q_fp8(x.view(-1, 128), 128, use_ue8m0=True)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (10, 1)
    for row, (xr, sr) in enumerate(zip(x.view(-1, 128), s[:, 0])):
        scale = torch.tensor(max(xr.abs().max().item(), 1e-4), dtype=torch.float32) / 448.0
        assert sr.item() == 2.0 ** math.ceil(math.log2(scale.item())), row  # float64 log2: exact at the edges
    assert torch.equal(q.float(), (x.view(-1, 128) / s).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    with pytest.raises(ValueError, match="multiple of group_size"):
        quant_q_fp8(torch.zeros(2, 100), 128)


def test_run_indexer_matches_reference_per_request():
    g = torch.Generator().manual_seed(1)
    bs, heads, topk = 4, 2, 3
    seq_lens = torch.tensor([6, 3])
    qsl = torch.tensor([0, 6, 7])  # request 0 prefills 6 tokens, request 1 decodes its 3rd
    n = 7
    block_table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    token_req, pos = token_layout(qsl, seq_lens, n)
    slot = [int(block_table[r, p // bs]) * bs + p % bs for r, p in zip(token_req.tolist(), pos.tolist())]
    cache = torch.zeros(4, bs, 132, dtype=torch.uint8)
    fmt = get_format("indexer_fp8")
    old_keys = torch.randn(2, 128, generator=g)  # request 1's first two tokens, written earlier
    fmt.write(cache, torch.tensor([8, 9]), old_keys)
    k = torch.randn(n, 128, generator=g)
    q = torch.randn(n, heads, 128, generator=g)
    w = torch.rand(n, heads, generator=g)
    md = ReplicatedIndexerMetadata(n, 2, token_req, pos, seq_lens, block_table, torch.tensor(slot))
    buf = torch.full((10, topk), 99, dtype=torch.int32)
    run_indexer(cache, md, q, k, w, buf, topk)
    keys = [k[:6], torch.cat([old_keys, k[6:7]])]  # each request's tokens in position order
    for m in range(n):
        r = int(token_req[m])
        want = indexer_topk_torch(q[m:m + 1], w[m:m + 1], fmt.encode(keys[r]), pos[m:m + 1], min(topk, len(keys[r])))
        got = buf[m, : want.shape[1]]
        assert torch.equal(got, want[0].to(got.dtype)), m
    assert bool((buf[n:] == 99).all())  # rows beyond the step are left alone


@pytest.mark.parametrize("sharded", [False, True])
def test_the_step_rows_plan_makes_the_same_device_ops_for_any_request_count(sharded):
    """The builder's plan of the indexer's lists (``_step_rows``) is fixed device work, whatever the
    requests: 2 and 16 decode requests make the same allocations (a per-request loop made ~8 each),
    and each request's list is its prefix's cache slots (replicated) or the slots of the positions this
    rank owns (sharded, rank 1 of 2)."""
    from sparkinfer.core.topology import DcpLayout
    from sparkinfer.testing import host_reads
    from sparkinfer.vllm.indexer_scoring import ShardedScoring
    from sparkinfer.vllm.replicated_indexer import _step_rows

    bs, layout = 4, DcpLayout(2, 1)
    share = ShardedScoring(1, layout, None) if sharded else None
    made = {}
    for reqs in (2, 16):
        seq_lens = torch.arange(reqs) % 5 + 3
        qsl = torch.arange(reqs + 1)
        token_req, pos = token_layout(qsl, seq_lens, reqs)
        table = torch.arange(reqs * 2, dtype=torch.int32).flip(0).view(reqs, 2)
        cache = torch.zeros(reqs * 2, bs, 132, dtype=torch.uint8)
        md = ReplicatedIndexerMetadata(reqs, reqs, token_req, pos, seq_lens, table, torch.zeros(reqs, dtype=torch.int64))
        with host_reads.count_allocations() as allocs:
            _, lists = _step_rows(cache, md, share)
        made[reqs] = sum(v for k, v in allocs.items() if "|alloc|" in k)
        for r in range(reqs):
            owned = [p for p in range(int(seq_lens[r])) if not sharded or layout.owner_and_local(p)[0] == 1]
            at, n = int(lists.row_start[r]), int(lists.row_len[r])
            assert lists.token_slots[at:at + n].tolist() == [int(table[r, p // bs]) * bs + p % bs for p in owned]
            assert lists.token_ids is None if not sharded else lists.token_ids[at:at + n].tolist() == owned
    assert made[2] == made[16] > 0, made


def test_float_cache_attention_matches_float64():
    pytest.importorskip("vllm")
    from sparkinfer.vllm.sparse_mla_backend import float_cache_attention

    g = torch.Generator().manual_seed(2)
    cache = torch.randn(3, 4, 576, generator=g)
    slots = torch.tensor([[0, 5, 11, -1], [-1, -1, -1, -1], [7, 2, 3, 1]])
    q_nope, q_rope = torch.randn(3, 2, 512, generator=g) * 0.05, torch.randn(3, 2, 64, generator=g) * 0.05
    out, lse = float_cache_attention(q_nope, q_rope, cache, slots, 0.1)
    flat = cache.view(-1, 576).double()
    for m in range(3):
        sel = [s for s in slots[m].tolist() if s >= 0]
        if not sel:
            assert torch.equal(out[m], torch.zeros_like(out[m])) and bool(torch.isneginf(lse[m]).all())
            continue
        rows = flat[sel]
        s = 0.1 * (q_nope[m].double() @ rows[:, :512].T + q_rope[m].double() @ rows[:, 512:].T)
        torch.testing.assert_close(out[m].double(), torch.softmax(s, -1) @ rows[:, :512], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[m].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)
