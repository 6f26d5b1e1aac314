"""Every device buffer of the selected path, sized at engine start and reserved out of vLLM's KV
memory (sparkinfer/core/reservations.py, sparkinfer/vllm/reservations.py, patch 0008). The numbers are counted by hand
here from the buffer table; the engine test that the KV cache is the budget less their sum is
tests/vllm/test_vllm_replicas.py."""

import io
import json
import types
from contextlib import redirect_stdout

import pytest

from sparkinfer.cli import main as cli_main
from sparkinfer.config import SparkinferConfig
from sparkinfer.core.reservations import SelectedSizing, exchange_bytes
from sparkinfer.vllm import replica_budget, reservations

MIB = 2**20


def _align(n):
    return -(-n // 256) * 256


def _plan_json(*argv):
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main(["plan", *argv, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_main_profile_buffers_by_hand_and_the_exchange_bound():
    """glm52-tp4-dcp4-mtp3-368, counted from the profile's knobs (its ring ``pool_mb`` and vLLM's
    ``max_num_batched_tokens``) and the layouts' block constants: the ring holds B requests of
    R 4 x K 2048 union rows per slot (4 slots, depth 3), B x 8,192 rows per destination in a shared
    receive region per slot (2 slots x 4 layers), a send slab of 1/16 per pair (gathered steps only:
    device sizing on the GPU). Everything but the replica store stays <= 512 MiB per GPU (issue 34),
    the exchange buffers too (issue 16)."""
    from sparkinfer.cli.serve import load_profile
    from sparkinfer.core.attention_workspace import BLOCK_PROGRAMS, BLOCK_ROWS
    from sparkinfer.core.indexer_tiles import ENGINE_TILE_BYTES, INDEXER_ROWS, PAGED_PROGRAMS, PAGED_TILE

    prof = load_profile("glm52-tp4-dcp4-mtp3-368")
    pool, tokens = prof["sparkinfer"]["pool_mb"] * MIB, prof["vllm"]["max_num_batched_tokens"]
    d = _plan_json("--profile", "glm52-tp4-dcp4-mtp3-368")
    res = d["reservations"]
    slot = pool // (4 * 368)  # ring rows per slot
    batch = min(16, slot // (4 * 2048))
    cap = batch * 4 * 2048
    flags = (3 + 4) * 4 * 64  # arrive, ack, abort and a landed flag per layer (4), per peer, one 64 B line each
    assert res["exchange_recv"] == _align(flags) + 2 * _align(4 * cap * 368)
    assert res["exchange_send"] == 2 * 4 * _align(4 * (cap // 16) * 368)
    assert res["exchange_index"] == 8 * cap
    assert res["prefetch_ring"] == 4 * slot * 368
    # the attention arena: a step of vLLM's batched tokens, 64 heads (16 per TP rank, gathered over DCP4),
    # bf16 output [M, H, 512] and its LSE; a block of BLOCK_ROWS rows' top-k rows and compacted indices
    # (both int64: cache rows pass 2^31), the fp32 partials [512 + 1] of BLOCK_PROGRAMS programs of 16
    # heads and their int32 merge tickets; the indexer's fp8 q (32 heads x 128) and its scales (a cache write stages
    # nothing: one kernel encodes the model's rows straight into the cache)
    assert res["attention_workspace"] == (tokens * 64 * 512 * 2 + tokens * 64 * 4 + BLOCK_ROWS * 2048 * (8 + 8)
                                          + 4 * BLOCK_PROGRAMS + BLOCK_PROGRAMS * 16 * 513 * 4 + tokens * 32 * (128 + 4))
    # a gathered step holds up to vLLM's batched tokens
    assert res["stashed_records"] == tokens * 368
    # the top-k workspace of the engine's INDEXER_ROWS-row blocks, k 2048, a pass of ENGINE_TILE_BYTES /
    # (8 B x rows) positions: the work buffer, top + topk's indices (fewer rows take wider passes in no
    # more bytes), or the paged top-k's if larger: at INDEXER_ROWS rows PAGED_PROGRAMS / rows splits, each a
    # work row of k + PAGED_TILE keys and a head of k, and the rows' sorted k (the most of any row count)
    tile = ENGINE_TILE_BYTES // (8 * INDEXER_ROWS)
    tiled = 8 * INDEXER_ROWS * (2048 + tile) + 2 * 8 * INDEXER_ROWS * 2048
    paged = 8 * PAGED_PROGRAMS * (2048 + PAGED_TILE + 2048) + 8 * INDEXER_ROWS * 2048
    assert res["indexer_workspace"] == max(tiled, paged)
    # the sharded merge of a decode step's 16 x 4 rows or a block of a prefill chunk, k 2048 int64 keys:
    # this rank's, the 4 ranks' gathered and side by side, topk's values and indices
    assert res["indexer_merge"] == 8 * max(64, INDEXER_ROWS) * 2048 * (1 + 4 + 4 + 2)
    # a Full layer's group plan over e = cap entries: union, remap, slots, new / store rows int32, own
    # and kept bool, the union kernel's scratch (a 16,384-slot table, two columns) per request, counts,
    # sends [B, 4], the planes (req / local / slot per source) and their counts
    e = cap
    assert res["group_plan"] == (4 * (5 * e + batch * (2 * 16384 + 2 * 8192) + batch + batch * 4 + 3 * 4 * e + 16)
                                 + 2 * e)
    assert d["reserved_bytes"] == sum(res.values())
    assert d["exchange_bytes"] == res["exchange_recv"] + res["exchange_send"] + res["exchange_index"]
    assert d["exchange_bytes"] <= 512 * MIB
    assert sum(v for k, v in res.items() if k != "replica_store") <= 512 * MIB
    # before issue 16: B x R x K from every peer including itself, receive and send
    assert d["exchange_bytes"] < 2 * 2 * 4 * _align(4 * cap * 368) / 6
    # the replica store (auto) takes a fifth of what the buffers left
    left = d["kv_budget_bytes"] - sum(v for k, v in res.items() if k != "replica_store")
    assert res["replica_store"] == left // 5


@pytest.mark.parametrize("m, k, n, tile_bytes", [(8, 16, 200, None), (4, 32, 1000, 8 * 4 * 128), (3, 64, 70, None)])
def test_indexer_workspace_is_what_a_topk_call_allocates(m, k, n, tile_bytes):
    """``topk_rows_bytes`` against the bytes one Triton ``indexer_topk_rows`` call allocates besides its
    int32 ids, counted by the allocation probe (``host_reads.count_allocations``; the interpreted
    kernel's own work is not counted, a GPU kernel allocates nothing): equal. Given a workspace of
    ``workspace_bytes`` for its rows and an output, a call (and one of fewer rows, a shorter list or a
    smaller k) allocates nothing and gives the same ids."""
    import torch

    from sparkinfer.core.indexer_tiles import TILE_BYTES, topk_rows_bytes, workspace_bytes
    from sparkinfer.indexer.tiled import TopkWorkspace, indexer_topk_rows, one_list
    from sparkinfer.testing import host_reads

    g = torch.Generator().manual_seed(m)
    q, w = torch.randn(m, 2, 128, generator=g), torch.randn(m, 2, generator=g)
    records = torch.randint(0, 256, (n, 132), dtype=torch.uint8, generator=g)
    tile_bytes = TILE_BYTES if tile_bytes is None else tile_bytes

    def call(rows, n_list, kk, **kw):
        pos, lists = torch.full((rows,), n_list - 1), one_list(rows, n_list, "cpu")
        return lambda: indexer_topk_rows(q[:rows], w[:rows], records, pos, kk, backend="triton", check_values=False,
                                         tile_bytes=tile_bytes, **lists, **kw)

    fresh = call(m, n, k)
    with host_reads.count_allocations() as made:
        fresh()
    measured = sum(v for key, v in made.items() if key.split("|")[1] == "alloc_bytes")
    assert measured == topk_rows_bytes(m, k, n, tile_bytes) + 4 * m * k
    ws = TopkWorkspace(workspace_bytes(m, k, n, tile_bytes), "cpu")
    for rows, n_list, kk in ((m, n, k), (1, n, k), (m, n // 2, k), (m, n, k // 2)):
        out = torch.full((m, 2 * k), 7, dtype=torch.int32)
        into = call(rows, n_list, kk, workspace=ws, out=out[:rows, :kk])
        with host_reads.count_allocations() as made:
            into()
        assert not made, dict(made)
        assert torch.equal(out[:rows, :kk], call(rows, n_list, kk)()) and bool((out[:, kk:] == 7).all())
    with pytest.raises(ValueError, match="workspace_bytes"):
        call(m, n, 2 * k, workspace=ws)()


@pytest.mark.parametrize("m, k, tile, programs", [(4, 16, 64, 256), (5, 8, 128, 1)])  # several splits a row; one
def test_paged_workspace_is_what_a_paged_call_allocates(monkeypatch, m, k, tile, programs):
    """``paged_workspace_bytes`` against the bytes one paged top-k call (``triton_paged``) allocates
    given its output, counted by the allocation probe: equal, with its split counters when it has
    several splits; given the engine's workspace
    (``engine_workspace_bytes`` for a context of ``tile`` and at least m rows) it allocates nothing
    and gives the same ids."""
    import torch

    from sparkinfer.core import indexer_tiles
    from sparkinfer.core.indexer_tiles import engine_workspace_bytes, paged_splits, paged_workspace_bytes
    from sparkinfer.indexer.tiled import TopkWorkspace
    from sparkinfer.indexer.triton_paged import paged_topk_rows
    from sparkinfer.testing import host_reads

    monkeypatch.setattr(indexer_tiles, "PAGED_PROGRAMS", programs)
    g = torch.Generator().manual_seed(m)
    q, w = torch.randn(m, 2, 128, generator=g), torch.randn(m, 2, generator=g)
    cache = torch.randint(0, 256, (4, 16, 132), dtype=torch.uint8, generator=g)
    cache[..., 128:] = 0  # scales of 0: finite scores
    table, req, pos = torch.arange(4, dtype=torch.int32).view(1, 4), torch.zeros(m, dtype=torch.int64), torch.arange(m)
    call = lambda out, ws=None: paged_topk_rows(q, w, cache, table, req, pos, k, tile=tile, out=out, workspace=ws)
    want = torch.zeros(m, k, dtype=torch.int32)
    with host_reads.count_allocations() as made:
        call(want)
    counters = 4 * indexer_tiles.paged_split_rows() if paged_splits(m) > 1 else 0  # made once, beside it
    assert sum(v for key, v in made.items() if key.split("|")[1] == "alloc_bytes") == \
        paged_workspace_bytes(m, k, tile) + counters
    assert (paged_splits(m) > 1) == (programs > 1)
    ws = TopkWorkspace(engine_workspace_bytes(m, k, tile), "cpu")
    got = torch.zeros(m, k, dtype=torch.int32)
    call(got, ws)  # the first call of several splits makes the counters
    with host_reads.count_allocations() as made:
        call(got, ws)
    assert not made, dict(made)
    assert torch.equal(got, want)
    assert ws.counts is None or not ws.counts.any()  # every row's count back at 0


def test_only_the_attention_arena_is_reserved_without_a_selected_path():
    """DCP1 and a sharded indexer: no selected path, and vLLM's own indexer op (no indexer q in the
    arena); the arena's heads are a TP rank's 16 at DCP1, the gathered 64 under DCP4 (a cache write
    stages nothing)."""
    from sparkinfer.cli.serve import load_profile
    from sparkinfer.core.attention_workspace import BLOCK_PROGRAMS, BLOCK_ROWS

    tokens = load_profile("glm52-tp4-dcp4-mtp3-368")["vllm"]["max_num_batched_tokens"]
    for argv, heads in ((["--dcp", "1"], 16), (["--indexer", "sharded"], 64)):
        d = _plan_json("--profile", "glm52-tp4-dcp4-mtp3-368", *argv)
        want = (tokens * heads * (512 * 2 + 4) + BLOCK_ROWS * 2048 * (8 + 8) + 4 * BLOCK_PROGRAMS
                + BLOCK_PROGRAMS * 16 * 513 * 4)
        assert d["reservations"] == {"attention_workspace": want} and d["reserved_bytes"] == want


def _config(mode="auto", dcp=4, dtype="nvfp4_368", seqs=16, window="auto", device="cuda", pool_mb=512, depth=3):
    ns = types.SimpleNamespace
    cfg = SparkinferConfig(mode=mode, replica_window=window, pool_mb=pool_mb, prefetch_depth=depth)
    return ns(parallel_config=ns(decode_context_parallel_size=dcp, tensor_parallel_size=4),
              cache_config=ns(cache_dtype=dtype), additional_config={"sparkinfer": cfg.as_dict()},
              device_config=ns(device_type=device), scheduler_config=ns(max_num_seqs=seqs, max_num_batched_tokens=8192),
              speculative_config=ns(num_speculative_tokens=3),
              model_config=ns(max_model_len=1 << 20, dtype="bfloat16",
                              hf_config=ns(num_hidden_layers=78, num_attention_heads=64, index_topk=2048,
                                           index_n_heads=32, index_head_dim=128)))


@pytest.mark.parametrize("kwargs", [dict(dcp=1), dict(mode="stock")])
def test_engine_reserves_only_the_arena_where_the_selected_path_cannot_run(kwargs):
    cfg = _config(**kwargs)
    arena = reservations.attention_workspace(cfg)
    assert reservations.reservations(cfg, 10 << 30) == {"attention_workspace": arena.nbytes}
    assert arena.index_heads == 0  # vLLM's own indexer op quantizes its q


def test_engine_reserves_nothing_without_a_record_format():
    assert reservations.reserved_bytes(_config(dtype="auto"), 10 << 30) == 0


def test_engine_reservations_are_the_buffers_then_the_store_of_the_rest():
    cfg = _config()
    mem = 10 << 30
    res = reservations.reservations(cfg, mem)
    buffers = {"attention_workspace": reservations.attention_workspace(cfg).nbytes, **reservations.sizing(cfg).buffers()}
    assert {k: v for k, v in res.items() if k != "replica_store"} == buffers
    assert res["replica_store"] == replica_budget.reserved_bytes(cfg, mem - sum(buffers.values()))
    assert reservations.reserved_bytes(cfg, mem) == sum(res.values())
    # host sizing (the CPU host fabric): decode steps use the send slab, as large as the receive region
    host = reservations.sizing(_config(device="cpu")).slab()
    assert host.send_capacity == host.capacity and reservations.sizing(cfg).slab().send_capacity == host.capacity // 16
    # replicas off: the buffers alone
    assert reservations.reservations(_config(window=0), mem) == buffers


def test_buffers_that_do_not_fit_name_what_to_lower():
    with pytest.raises(ValueError, match="pool_mb"):
        reservations.reserved_bytes(_config(), 600 * MIB)


def test_a_step_larger_than_the_ring_caps_the_batch():
    """max_batch = ring slot rows // (R x K): a 16 MiB pool holds 2 requests of 4 x 2048 rows per
    slot at depth 0 (a larger decode step runs stock), and the slab capacity follows it."""
    s = SelectedSizing(dcp=4, record_bytes=368, max_num_seqs=16, rows=4, topk=2048, prefetch_depth=0, pool_mb=16,
                       sizing="device")
    assert s.slot_rows == 16 * MIB // 368 and s.max_batch == 5 and s.slab().capacity == 5 * 8192
    assert exchange_bytes(s.buffers()) == s.slab().segment_bytes + s.slab().send_bytes + 8 * 5 * 8192


def test_a_fabric_that_cannot_reach_the_caches_is_refused():
    from sparkinfer.decode.impls import fabric_problem

    assert "host fabric moves CPU tensors" in fabric_problem("host", "cuda")
    assert "CUDA fabric needs GPUs" in fabric_problem("cuda", "cpu")
    assert [fabric_problem(s, d) for s, d in (("auto", "cuda"), ("auto", "cpu"), ("cuda", "cuda"), ("host", "cpu"))] \
        == [None] * 4
