"""Selected-record decode (sparkinfer.decode.selected_decode) on four host-fabric ranks.

Every rank holds a DCP shard of the records in which this step's own positions are still junk
(vLLM writes them at the layer's forward, after the group's prefetch), gets the replicated top-k
and its two heads' queries, and runs a 5-layer FSSFS step with MTP rows (R = 4). The property:
each rank's output and LSE equal attention over each row's own top-k read directly from the
unsharded, fully written cache (the same torch attention, so bit for bit), for host- and
device-sized exchanges and prefetch depths 0, 1 and 3 (one, two and three chunks per group).

Gathered steps (the prefill side): a batch of a chunked prefill (context 24, 9 new rows), a cold
prefill (13 rows, nothing cached) and a decode row; every layer's whole prefix travels, the new
tokens are patched in, and each row attends over its own top-k of its causal prefix. Same
property, depths 0 and 2, plus a cold-prefill-only step that moves no record at all.
"""

import pytest
import torch

WORLD = 4
PATTERN = "FSSFS"
B, R, K, P, H, BLOCK = 2, 4, 8, 48, 2, 4
CONTEXT = [40, 29]
FMT = "nvfp4_ds_mla:fp8-rope-368"
SCALE = 0.07

pytestmark = pytest.mark.multiproc


def _inputs(rank: int):
    """The step as every rank sees it (shared parts from seed 0, this rank's heads from seed 1 + rank)."""
    from sparkinfer.comm.synthetic import build_shard
    from sparkinfer.core.topology import DcpLayout
    from sparkinfer.formats import get_format

    fmt = get_format(FMT)
    L = len(PATTERN)
    g = torch.Generator().manual_seed(0)
    full = fmt.encode(torch.randn(L * B * P, 512, generator=g), torch.randn(L * B * P, 64, generator=g),
                      backend="host").view(L, B, P, -1)
    stale = full.clone()
    for b, n in enumerate(CONTEXT):
        stale[:, b, n:n + R] = 0xAB  # not written yet when the group's exchange runs
    shard = build_shard(stale, DcpLayout(WORLD, 1), rank, BLOCK, torch.Generator().manual_seed(7))
    topk = {}
    for layer, c in enumerate(PATTERN):
        if c == "F":
            t = torch.full((B * R, K), -1, dtype=torch.int32)
            for b, n in enumerate(CONTEXT):
                for r in range(R):
                    visible = n + r + 1  # causal: row r sees positions 0 .. n + r
                    pick = torch.randperm(visible, generator=g)[:int(torch.randint(K // 2, K + 1, (1,), generator=g))]
                    t[b * R + r, :len(pick)] = pick.to(torch.int32)
            topk[layer] = t
    gq = torch.Generator().manual_seed(1 + rank)
    q_nope = torch.randn(L, B * R, H, 512, generator=gq)
    q_rope = torch.randn(L, B * R, H, 64, generator=gq)
    rows = torch.tensor([n + r for n in CONTEXT for r in range(R)])
    new_records = full[:, torch.arange(B).repeat_interleave(R), rows]  # [L, B*R, W]
    return fmt, full, shard, topk, q_nope, q_rope, new_records


GATHER_CONTEXT, GATHER_QUERY = [24, 0, 30], [9, 13, 1]


def _gather_inputs(rank: int, context, query):
    """A gathered step: shards with the step's positions stale, per-layer top-k of each row's causal
    prefix (Shared layers reuse their Full layer's), this rank's queries and the step's own records."""
    from sparkinfer.comm.synthetic import build_shard
    from sparkinfer.core.topology import DcpLayout
    from sparkinfer.formats import get_format

    fmt = get_format(FMT)
    L, Bg = len(PATTERN), len(context)
    g = torch.Generator().manual_seed(3)
    full = fmt.encode(torch.randn(L * Bg * P, 512, generator=g), torch.randn(L * Bg * P, 64, generator=g),
                      backend="host").view(L, Bg, P, -1)
    stale = full.clone()
    for b, (c, q) in enumerate(zip(context, query)):
        stale[:, b, c:c + q] = 0xAB
    shard = build_shard(stale, DcpLayout(WORLD, 2), rank, BLOCK, torch.Generator().manual_seed(8))
    n = sum(query)
    req = torch.repeat_interleave(torch.arange(Bg), torch.tensor(query))
    pos = torch.cat([torch.arange(c, c + q) for c, q in zip(context, query)])
    topk = {}
    for layer, ch in enumerate(PATTERN):
        if ch == "F":
            t = torch.full((n, K), -1, dtype=torch.int32)
            for i in range(n):
                pick = torch.randperm(int(pos[i]) + 1, generator=g)[:K]
                t[i, :len(pick)] = pick.to(torch.int32)
            topk[layer] = t
        else:
            topk[layer] = topk[layer - 1]  # a Shared layer reuses the Full layer before it
    gq = torch.Generator().manual_seed(11 + rank)
    q_nope, q_rope = torch.randn(L, n, H, 512, generator=gq), torch.randn(L, n, H, 64, generator=gq)
    new_records = full[:, req, pos]  # [L, n, W]
    return fmt, full, shard, topk, q_nope, q_rope, new_records, req


def _gathered_step(dec, rank, context, query):
    """Run one gathered step through ``dec``; per layer, whether out/LSE equal the unsharded reference."""
    from sparkinfer.attention import sparse_mla_decode_torch

    fmt, full, shard, topk, q_nope, q_rope, new_records, req = _gather_inputs(rank, context, query)
    dec.begin_step(shard.cache, shard.block_table, shard.block_size, torch.tensor(context),
                   torch.tensor(query))
    dec.gather()
    same = []
    for layer in range(len(PATTERN)):
        out, lse = dec.attend(layer, q_nope[layer], q_rope[layer], new_records[layer], topk[layer])
        idx = torch.where(topk[layer] >= 0, topk[layer] + (req * P)[:, None], -1).to(torch.int32)
        ref_out, ref_lse = sparse_mla_decode_torch(q_nope[layer], q_rope[layer],
                                                   full[layer].reshape(-1, fmt.record_bytes), fmt, idx, SCALE)
        same.append(bool(torch.equal(out, ref_out) and torch.equal(lse, ref_lse)))
    return same


def _decode_step(dec, rank, caches, replicas=None):
    """Run one decode step of ``_inputs(rank)`` through ``dec``; per layer, whether out/LSE equal
    attention over each row's top-k read from the unsharded, fully written cache."""
    from sparkinfer.attention import sparse_mla_decode_torch
    from sparkinfer.core.topology import IndexSharePattern

    fmt, full, shard, topk, q_nope, q_rope, new_records = _inputs(rank)
    pattern = IndexSharePattern.parse(PATTERN, len(PATTERN))
    W = fmt.record_bytes
    dec.begin_step(caches, shard.block_table, shard.block_size, torch.tensor(CONTEXT), replicas=replicas)
    same = []
    for layer in range(len(PATTERN)):
        src = pattern.topk_source(layer)
        if src == layer:
            dec.full_layer(layer, topk[layer])
        out, lse = dec.attend(layer, q_nope[layer], q_rope[layer], new_records[layer])
        idx = torch.where(topk[src] >= 0, topk[src] + (torch.arange(B * R) // R * P)[:, None], -1)
        ref_out, ref_lse = sparse_mla_decode_torch(q_nope[layer], q_rope[layer], full[layer].reshape(B * P, W), fmt,
                                                   idx.to(torch.int32), SCALE)
        same.append(bool(torch.equal(out, ref_out) and torch.equal(lse, ref_lse)))
    return same


def _rank_main(rank, world):
    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.comm.host_fabric import HostFabric
    from sparkinfer.core.slab import SlabLayout
    from sparkinfer.core.topology import DcpLayout, IndexSharePattern
    from sparkinfer.decode.selected_decode import SelectedDecode

    fmt, full, shard, topk, q_nope, q_rope, new_records = _inputs(rank)
    pattern = IndexSharePattern.parse(PATTERN, len(PATTERN))
    W = fmt.record_bytes
    results = {}
    for depth, sizing in ((0, "host"), (1, "device"), (3, "host")):
        fabric = HostFabric(SlabLayout(world, W, capacity=B * R * K, max_layers=depth + 1, depth=2), timeout_s=20)
        try:
            dec = SelectedDecode(SelectedExchange(fabric, sizing), fmt, DcpLayout(world, 1), pattern, max_batch=B,
                                 rows=R, topk=K, depth=depth, scale=SCALE, backend="torch")
            # depth 1 also takes vLLM's layout: one separately allocated cache tensor per layer
            caches = [t.clone() for t in shard.cache] if depth == 1 else shard.cache
            results[(depth, sizing)] = _decode_step(dec, rank, caches)
            errors = []
            for call in (lambda: dec.attend(0, q_nope[0], q_rope[0], new_records[0]),  # no plan for it
                         lambda: dec.full_layer(1, topk[0]),  # a Shared layer
                         lambda: dec.full_layer(0, topk[0][:-1])):  # wrong row count
                try:
                    call()
                    errors.append("no error")
                except ValueError as e:
                    errors.append(str(e))
            results[("errors", depth)] = errors
        finally:
            fabric.close()
    for window in (64, 16):  # replica stores: every position local; the last 16 only
        fabric = HostFabric(SlabLayout(world, W, capacity=B * R * K, max_layers=2, depth=2), timeout_s=20)
        try:
            dec = SelectedDecode(SelectedExchange(fabric, "host"), fmt, DcpLayout(world, 1), pattern, max_batch=B,
                                 rows=R, topk=K, depth=1, scale=SCALE, backend="torch")
            replicas = _replicas(full, window)
            same = _decode_step(dec, rank, shard.cache, replicas)
            results[("replicas", window)] = (same, dec.step_stats().records_recv, dec.exchanges, dec.skipped,
                                             replicas.lo.tolist())
        finally:
            fabric.close()
    for depth in (0, 2):  # gathered steps only (no decode batch fits), pairs over the capacity: several rounds
        fabric = HostFabric(SlabLayout(world, W, capacity=5, max_layers=depth + 1, depth=2), timeout_s=20)
        try:
            dec = SelectedDecode(SelectedExchange(fabric, "device"), fmt, DcpLayout(world, 2), pattern, max_batch=0,
                                 rows=R, topk=K, depth=depth, scale=SCALE, backend="torch", gather_rows=3 * P)
            results[("gather", depth)] = _gathered_step(dec, rank, GATHER_CONTEXT, GATHER_QUERY)
            results[("gather_recv", depth)] = dec.step_stats().records_recv
            results[("gather_slots", depth)] = dec.ring.buf.shape[0]  # 3 x 33 rows pass a slot of 3P / 3
            results[("cold", depth)] = _gathered_step(dec, rank, [0, 0], [7, 12])
            results[("cold_slots", depth)] = dec.ring.buf.shape[0]  # 2 x 12 rows fit a slot
            results[("cold_moved", depth)] = dec.step_stats().records_sent + dec.step_stats().records_recv
            try:
                dec.full_layer(0, topk[0])
                results[("gather_full", depth)] = "no error"
            except RuntimeError as e:
                results[("gather_full", depth)] = str(e)
        finally:
            fabric.close()
    return results


def _replicas(full, window):
    """A replica store holding positions [context - window + R, context) of each request (what the
    rule keeps after a decode step of R rows), every other row junk."""
    from sparkinfer.decode.selected_decode import LocalReplicas

    L, W = full.shape[0], full.shape[-1]
    lo = torch.tensor([max(0, c + R - window) for c in CONTEXT])
    base = torch.arange(B) * window
    store = [torch.full((B * window, W), 0xCD, dtype=torch.uint8) for _ in range(L)]
    for layer in range(L):
        for b, c in enumerate(CONTEXT):
            pos = torch.arange(int(lo[b]), c)
            store[layer][base[b] + pos % window] = full[layer, b, pos]
    return LocalReplicas(store, lo, base, window)


@pytest.fixture(scope="module")
def outcomes():
    from sparkinfer.comm.launch import run_ranks

    return run_ranks(_rank_main, WORLD, timeout_s=240, pg_timeout_s=60)


@pytest.mark.parametrize("depth, sizing", [(0, "host"), (1, "device"), (3, "host")])
def test_every_rank_equals_attention_over_the_unsharded_cache(outcomes, depth, sizing):
    for rank, res in enumerate(outcomes):
        assert res[(depth, sizing)] == [True] * len(PATTERN), f"rank {rank}: {res[(depth, sizing)]}"


def test_bad_calls_say_what_is_wrong(outcomes):
    for res in outcomes:
        for depth in (0, 1, 3):
            no_plan, shared, rows = res[("errors", depth)]
            assert "has no plan" in no_plan and "Shared" in shared and f"int32 [{B * R}, {K}]" in rows


def test_step_positions_really_are_stale_in_the_shards():
    """Guards the test itself: without the local patch the exchange would deliver junk."""
    fmt, full, shard, *_ = _inputs(0)
    assert (shard.cache == 0xAB).all(dim=2).any()


@pytest.mark.parametrize("depth", [0, 2])
def test_gathered_step_equals_attention_over_the_unsharded_cache(outcomes, depth):
    for rank, res in enumerate(outcomes):
        assert res[("gather", depth)] == [True] * len(PATTERN), f"rank {rank}: {res[('gather', depth)]}"
        assert res[("cold", depth)] == [True] * len(PATTERN), f"rank {rank}: {res[('cold', depth)]}"
        assert res[("cold_moved", depth)] == 0  # a cold prefill is all own tokens: nothing travels
        # at depth 2 the first step passes a slot's P rows: the whole ring as one slot, a layer at a time
        assert (res[("gather_slots", depth)], res[("cold_slots", depth)]) == (1, depth + 1)
        assert "gathered step" in res[("gather_full", depth)]


def test_gathered_step_receives_every_remote_context_token(outcomes):
    """Per layer, rank d receives the context tokens (positions < context) that the other ranks own."""
    from sparkinfer.core.topology import DcpLayout

    lay = DcpLayout(WORLD, 2)
    for rank, res in enumerate(outcomes):
        remote = sum(c - lay.local_len(c, rank) for c in GATHER_CONTEXT)
        for depth in (0, 2):
            assert res[("gather_recv", depth)] == remote * len(PATTERN)


def test_replicas_held_locally_move_only_the_records_outside_the_window(outcomes):
    """Window 64 holds every context position: no group runs an exchange. Window 16: each rank
    receives, per layer, exactly the remote union tokens below the window (counted from the top-k)."""
    from sparkinfer.core.topology import DcpLayout, IndexSharePattern

    lay = DcpLayout(WORLD, 1)
    pattern = IndexSharePattern.parse(PATTERN, len(PATTERN))
    _, _, _, topk, *_ = _inputs(0)
    for rank, res in enumerate(outcomes):
        same, recv, exchanges, skipped, _ = res[("replicas", 64)]
        assert same == [True] * len(PATTERN) and recv == 0 and exchanges == 0 and skipped == 3  # chunks [0, 1], [2], [3, 4]
        same, recv, exchanges, skipped, lo = res[("replicas", 16)]
        assert same == [True] * len(PATTERN), f"rank {rank}: {same}"
        expected = 0
        for f in pattern.full_layers:
            group = 1 + len(pattern.prefetch_targets(f, len(PATTERN)))
            for b in range(B):
                toks = {int(t) for t in topk[f][b * R:(b + 1) * R].flatten() if t >= 0}
                expected += group * sum(1 for t in toks if t < lo[b] and int(lay.owner_and_local(t)[0]) != rank)
        assert recv == expected and expected > 0
