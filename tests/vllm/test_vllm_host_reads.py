"""No host read in a layer's forward, at most 8 per decode step (issue 16), counted inside vLLM.

The probe (``sparkinfer.testing.host_reads``) books every tensor read back to Python and every op
with a data-dependent output shape against the innermost sparkinfer frame that made it, per decode
step, inside each TP worker. The engines run the GPU implementations forced on CPU
(``SPARKINFER_FORCE_GPU_IMPLS=1``, Triton under ``TRITON_INTERPRET=1``: the code a GPU node runs) on
the tiny GLM-5.2-shaped model at TP2/DCP2, nvfp4_368 records and MTP3, in stock mode, selected mode
with replicas off and with replicas on (``FSSF``: CI time, the Triton kernels interpreted). The
three modes share one engine, started in mode selected with the replicas' window, that takes each in
turn (``worker_runtime.use_paths`` between requests, the probes reset), stock last: its planted read
stays in the layers (one engine start instead of three). The sparkinfer count must be 0 under a
layer's forward in every mode, at most 8 per step. What a layer costs is measured per layer inside
the engine (``host_reads`` books each read and allocation against the decoder layer whose forward
makes it, the MTP layer included): every layer of the model ran in every decode step and none made a
sparkinfer read or allocation, so a deeper model costs no more per step (this replaces a second
stock engine at ``FSSFSSFS`` whose step count had to equal ``FSSF``'s; a read made once per layer by
the step's own code, outside every layer's forward, is not booked to a layer, and counts against the
step's 8). Reads of vLLM's host copies (``host_array``: pinned host memory on a GPU node, no sync)
are reported apart.

Allocations after warm-up (``host_reads`` books them like the reads, docs/design/selected-decode.md):
no layer's forward makes one, in any mode; the builders' per-step work allocates. The test holds each
path's measured count per decode step as a ceiling, and none under a layer, so a change that adds
temporaries is seen.

The same engine holds the decode steps to CUDA-graph replay (``sparkinfer.testing.launches``,
docs/design/cuda-graphs.md): two decode steps of one shape and path must make the same launches,
pointers, shapes, scalars and grids, in every forward (the indexer included: its rows score their
requests' pages, ``indexer.triton_paged``); the replicas run compares its local steps (every
record in the window, no exchange) and its selected steps apart (``REPLICAS``). One more engine, at
``indexer_scoring = sharded`` (fixed per engine, so not one of the shared engine's paths), holds a
sharded indexer step to the same (``test_a_sharded_indexer_step_replays``): each rank's paged top-k
over its positions, the all-gather and the merge. The probe's own tests are
tests/decode/test_replay_safety.py.

The probe can fail: a read planted into the layers of a running engine (``_plant``) is counted
in each layer's own forward, and the unit test below catches the validated (direct-call) forms'
reads at their sites.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from sparkinfer.testing import host_reads, launches
from sparkinfer.vllm.worker_runtime import forward_counts

_spec = importlib.util.spec_from_file_location(
    "host_overhead", Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

PROMPT = bench.PROMPT
MAX_TOKENS = 4
# the planted read's request: one decode step after its prefill runs every layer (MTP's included) once
PLANTED_TOKENS = 2
# The replicas engine's window and tokens: decode steps at contexts 12-14 hold every record in the
# window of 18 positions (with their 4 rows), "local", and those at 15-17 exchange, "selected": three
# of each, so the probe compares steps of both paths (the first of each is warm-up).
REPLICAS = {"window": 18, "tokens": 7}
BUDGET = 8  # sparkinfer host reads per decode step, whatever the layer count
# sparkinfer allocations per decode step after warm-up at FSSF, measured (selected-decode.md) plus ~5%,
# in all and under a layer's forward. Measured 81 / 81 / 83, under a layer 0 / 0 / 0 (161 / 161 / 163
# before the indexer's builder stopped planning host lists for the Triton path's paged top-k; 161 / 314 /
# 339 and 0 / 153 / 176 before the group plan's kernels and buffers; 296 / 455 / 496 and 207 / 366 /
# 405 before the indexer's workspace, the layer buffers and the row-copy patch; 821 / 874 / 915 before
# the paging and q-quantization kernels)
ALLOC_CEILING = {"stock": 85, "selected": 85, "replicas": 87}
LAYER_ALLOC_CEILING = {"stock": 0, "selected": 0, "replicas": 0}
PATTERN = "FSSF"


def _paged_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    from sparkinfer.formats import get_format

    fmt = get_format("nvfp4_368")
    backing = torch.zeros(6, 16, 368 + 132, dtype=torch.uint8)
    cache = backing[:, :, :368]  # strided like vLLM's block-outermost layer views
    slots = torch.arange(16, 16 + 40)
    from sparkinfer.decode.paged_sparse_mla import write_cache_records

    write_cache_records(fmt, cache, slots, torch.randn(40, 512, generator=g), torch.randn(40, 64, generator=g))
    topk = torch.randint(-1, 40, (3, 8), generator=g, dtype=torch.int32)
    table = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    q = torch.randn(3, 2, 512, generator=g), torch.randn(3, 2, 64, generator=g)
    return cache, topk, table, q


def test_probe_counts_the_checked_forms_and_not_the_hot_path(monkeypatch):
    """The validated direct-call forms read back (ranges, a unique, boolean masks) and the probe books
    them at their sparkinfer sites; the forward's forms (``attend``) give the same output with none."""
    monkeypatch.setenv("SPARKINFER_FORCE_GPU_IMPLS", "1")
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.paged_sparse_mla import attend, compact_pages, paged_sparse_mla
    from sparkinfer.decode.runtime import WorkerRuntime
    from sparkinfer.formats import get_format

    cache, topk, table, q = _paged_inputs()
    token_req = torch.zeros(3, dtype=torch.int64)
    with host_reads.count_reads() as checked:
        want = paged_sparse_mla(*q, cache, "nvfp4_368", topk, token_req, table, 0.1, 0, 2, 1)
        compact_pages(cache, torch.tensor([17, -1, 40]))
    sites = {k.split("|")[2] for k in checked}
    assert "sparkinfer:decode/paged_sparse_mla.py:_check_topk_inputs:__int__" in sites
    assert "sparkinfer:decode/paged_sparse_mla.py:_check_topk_inputs:__bool__" in sites
    assert "sparkinfer:decode/paged_sparse_mla.py:compact_pages:unique" in sites
    assert "sparkinfer:attention/validate.py:check_decode_inputs:__int__" in sites
    step, fmt = ForwardStep.of(WorkerRuntime("cpu"), token_req=token_req, block_table=table), get_format("nvfp4_368")
    with host_reads.count_reads() as hot:
        got = attend(step, *q, cache, fmt, topk, 0.1, 0, 2)
    assert not hot, dict(hot)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with host_reads.count_reads() as planted:  # and a read in the block is seen too
        int(topk.max())
    assert sum(planted.values()) == 1


def test_the_forward_form_allocates_nothing_within_the_reserved_arena(monkeypatch, caplog):
    """With the GPU implementations forced and the attention arena reserved for a step of 3 rows, a
    layer's attention (``attend``, the forward's form) allocates nothing: the output and LSE,
    the decode kernel's scratch and the top-k's rows are views of the arena, for that step, a smaller
    one and, with blocks of 2 rows (``BLOCK_ROWS`` patched), a step attended block by block. Each
    equals the direct (validated, allocating) form. A step larger than the arena still runs, in a
    larger arena, and says once that those bytes are outside the KV budget."""
    monkeypatch.setenv("SPARKINFER_FORCE_GPU_IMPLS", "1")
    from sparkinfer.core import attention_workspace
    from sparkinfer.core.attention_workspace import AttentionWorkspace
    from sparkinfer.decode import layer_buffers
    from sparkinfer.decode.device_checks import DeviceChecks
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.paged_sparse_mla import attend, paged_sparse_mla
    from sparkinfer.formats import get_format

    cache, topk, table, q = _paged_inputs()
    token_req, fmt = torch.zeros(3, dtype=torch.int64), get_format("nvfp4_368")
    arenas = layer_buffers.AttentionArena(torch.device("cpu"))
    step = ForwardStep("triton", DeviceChecks("cpu"), arenas, token_req=token_req, block_table=table)

    def both(rows):
        want = paged_sparse_mla(q[0][:rows], q[1][:rows], cache, "nvfp4_368", topk[:rows], token_req[:rows], table,
                                0.1, 0, 2, 1)
        with host_reads.count_allocations() as made:
            got = attend(step, q[0][:rows], q[1][:rows], cache, fmt, topk[:rows], 0.1, 0, 2)
        return want, got, made

    layout = AttentionWorkspace(rows=3, heads=2, topk=8, out_bytes=4)
    arena = arenas.reserve(layout.segments())
    assert arenas.held_bytes() == layout.nbytes == arena.buf.numel()
    for rows, block in ((3, 1024), (2, 1024), (3, 2)):
        monkeypatch.setattr(attention_workspace, "BLOCK_ROWS", block)
        want, got, made = both(rows)
        assert not made, (rows, block, dict(made))
        assert got[0].data_ptr() == arena.buf.data_ptr()  # the output is the arena's first segment
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (rows, block)
    monkeypatch.setattr(attention_workspace, "BLOCK_ROWS", 1024)
    caplog.set_level("WARNING", logger=layer_buffers.__name__)
    arenas.reserve(AttentionWorkspace(rows=2, heads=2, topk=8, out_bytes=4).segments())
    want, got, made = both(3)
    assert made and all(torch.equal(a, b) for a, b in zip(got, want))
    assert "outside the KV budget" in caplog.text
    caplog.clear()
    assert not both(3)[2] and not caplog.text  # the grown arena holds it from then on


def test_device_checks_raise_a_step_later_naming_the_check():
    """A bad top-k position in the forward's form sets the flag without raising; the next poll but
    one (the copy issued at a poll is read at the following one) raises naming the check."""
    from sparkinfer.decode.device_checks import DeviceCheckError, DeviceChecks
    from sparkinfer.decode.paged_sparse_mla import topk_slots, topk_to_slots

    checks = DeviceChecks("cpu")
    checks.poll()
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    with host_reads.count_reads() as reads:
        slots, bad = topk_slots(torch.tensor([[3, 40, -1]]), torch.zeros(1, dtype=torch.int64), table, 4)
        checks.flag("topk_position", bad)
    assert not reads
    assert slots.tolist() == [[7, -1, -1]]  # the position past the 2 blocks maps to -1, flagged
    with pytest.raises(ValueError, match="beyond the request's 2 blocks"):  # the direct call still refuses it
        topk_to_slots(torch.tensor([[3, 40, -1]]), torch.zeros(1, dtype=torch.int64), table, 4)
    checks.poll()  # issues the copy of the set word
    with pytest.raises(DeviceCheckError, match="topk_position: a top-k position lies beyond"):
        checks.poll()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_contiguous_cache_write_in_the_forwards_form_allocates_nothing(device):
    """A contiguous cache (DCP1, or a layer's own tensor) is written in place by the forward's one
    launch (``forward_write_records``): no read and no temporary (a bool mask per write before; the
    first GPU run found it). An out-of-range slot is skipped, on the host twin as in the CUDA kernel,
    and the check raises a step later."""
    from sparkinfer.formats import get_format
    from sparkinfer.decode.device_checks import DeviceCheckError
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.paged_sparse_mla import forward_write_records
    from sparkinfer.decode.runtime import WorkerRuntime

    g = torch.Generator().manual_seed(4)
    fmt = get_format("indexer_fp8")
    cache = torch.zeros(6, 16, 132, dtype=torch.uint8, device=device)
    want = cache.clone()
    keys = torch.randn(5, 128, generator=g).to(device)
    slots = torch.tensor([17, 30, -1, 95, 40], device=device)
    fmt.write(want, slots, keys)  # the direct call: checked on the host
    step = ForwardStep.of(WorkerRuntime(device))
    checks = step.checks
    checks.poll()
    with host_reads.count_reads() as reads, host_reads.count_allocations() as made:
        forward_write_records(step, fmt, cache, slots, keys)
    assert not reads and not {k: v for k, v in made.items() if "|alloc|" in k}, (reads, made)
    assert torch.equal(cache, want)
    checks.poll()
    checks.poll()  # nothing flagged
    forward_write_records(step, fmt, cache, torch.tensor([17, 96], device=device), keys[:2])  # 96: one past the cache
    assert torch.equal(cache, want)  # slot 17 rewritten with its own bytes, 96 skipped
    checks.poll()
    with pytest.raises(DeviceCheckError, match="cache_slots"):
        checks.poll()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_bf16_write_into_a_strided_cache_allocates_nothing(monkeypatch, device):
    """The forward's write of a bf16 model's latent and rope into a strided (DCP) cache view reads the
    bf16 rows in its kernel: no fp32 copy and no encoded rows staged or allocated (the first GPU run
    found the encoder's output allocated per layer), and the bytes are the direct call's on the fp32
    values."""
    from sparkinfer.formats import get_format
    from sparkinfer.decode import impls
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.paged_sparse_mla import forward_write_records, write_cache_records
    from sparkinfer.decode.runtime import WorkerRuntime

    monkeypatch.setenv(impls.FORCE_ENV, "1")
    g = torch.Generator().manual_seed(6)
    fmt = get_format("nvfp4_368")
    backing = torch.randint(0, 256, (5, 8, 368 + 100), generator=g, dtype=torch.uint8).to(device)
    want = backing.clone()
    slots = torch.tensor([9, -1, 30, 12, 39], device=device)
    lat = torch.randn(5, 512, generator=g).to(device, torch.bfloat16)
    rope = torch.randn(5, 1, 64, generator=g).to(device, torch.bfloat16)[:, 0]  # a view, as vLLM's k_pe
    write_cache_records(fmt, want[:, :, :368], slots, lat.float(), rope.float())
    step = ForwardStep.of(WorkerRuntime(device))
    with host_reads.count_allocations() as made:
        forward_write_records(step, fmt, backing[:, :, :368], slots, lat, rope)
    assert not {k: v for k, v in made.items() if "|alloc|" in k}, made
    assert torch.equal(backing, want)


def test_strided_write_in_place_equals_the_page_copy():
    """``forward_write_records`` into a strided view (forward_scatter_rows: -1 rows rewrite the null block's
    first record with itself) gives exactly the bytes of writing contiguous copies of the pages."""
    from sparkinfer.formats import get_format
    from sparkinfer.decode.forward_step import ForwardStep
    from sparkinfer.decode.paged_sparse_mla import forward_write_records
    from sparkinfer.decode.runtime import WorkerRuntime

    g = torch.Generator().manual_seed(2)
    fmt = get_format("nvfp4_368")
    backing = torch.randint(0, 256, (5, 8, 368 + 100), generator=g, dtype=torch.uint8)
    view = backing[:, :, :368]
    want = backing.clone()
    slots = torch.tensor([9, -1, 30, 12, -1, 39])
    lat, rope = torch.randn(6, 512, generator=g), torch.randn(6, 64, generator=g)
    pages = want[:, :, :368].contiguous()
    fmt.write(pages, slots, lat, rope)
    want[:, :, :368] = pages
    step = ForwardStep.of(WorkerRuntime("cpu"))
    with host_reads.count_reads() as reads:
        forward_write_records(step, fmt, view, slots, lat, rope)
    assert not reads
    assert torch.equal(backing, want)


# --- inside vLLM ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("transformers")
    from sparkinfer.testing.tiny_model import build_tiny_glm

    return build_tiny_glm(tmp_path_factory.mktemp(f"tiny_{PATTERN}"), pattern=PATTERN)


def _plant(worker=None):
    """A host read in every stock attention layer of this worker: the probe must see it per layer."""
    from sparkinfer.decode import paged_sparse_mla
    from sparkinfer.vllm import sparse_mla_backend

    orig = paged_sparse_mla.attend

    def planted(step, q_nope, q_rope, kv_cache, fmt, topk, scale, dcp_rank, dcp_world):
        paged_sparse_mla._check_topk_inputs(topk, step.token_req[:topk.shape[0]], step.block_table, kv_cache.shape[1],
                                            dcp_rank, dcp_world, step.interleave)
        return orig(step, q_nope, q_rope, kv_cache, fmt, topk, scale, dcp_rank, dcp_world)

    sparse_mla_backend.attend = planted
    return True


# The paths in the order the one engine takes them (``use_paths(mode, replicas)``); stock last, since
# ``_plant`` leaves its read in the stock layers.
ORDER = {"selected": ("selected", False), "replicas": ("selected", True), "stock": ("stock", False)}


def _serve(model_dir, monkeypatch) -> dict:
    """Per path of ``bench.PATHS``: (tokens, per-worker decode summaries[, the same after a planted
    read, stock only], per-worker launch comparisons of its decode steps (``launches.report``)), from
    one engine of the benchmark's configuration (the Triton kernels interpreted) started in mode
    selected with the replicas' window (``bench.PATHS["replicas"]``, window ``REPLICAS``), which takes
    the paths in the order of ``ORDER``: before each, ``use_paths``, the prefix cache emptied and both
    probes reset, so each path's request prefills afresh and its steps are counted and compared alone."""
    import gc

    from vllm import SamplingParams

    from sparkinfer.vllm.worker_runtime import use_paths

    assert set(ORDER) == set(bench.PATHS) and bench.PATHS["replicas"][0] == "selected"
    for k, v in bench.ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SPARKINFER_TEST_SPAWN", "1")  # minutes of interpreted kernels: faster spawned (worker_processes)
    monkeypatch.setitem(bench.PATHS, "replicas", (bench.PATHS["replicas"][0], REPLICAS["window"]))
    llm = bench.make_llm(model_dir, "replicas")
    try:
        llm.collective_rpc(host_reads.install)
        llm.collective_rpc(launches.install)
        served = {}
        for name, (mode, replicas) in ORDER.items():
            assert llm.collective_rpc(use_paths, args=(mode, replicas)) == [{"mode": mode, "replicas": replicas}] * 2
            assert llm.reset_prefix_cache()
            llm.collective_rpc(host_reads.reset)
            llm.collective_rpc(launches.reset)
            params = SamplingParams(max_tokens=_tokens(name), temperature=0, ignore_eos=True)
            out = llm.generate([{"prompt_token_ids": PROMPT}], params)
            runs = [[host_reads.summarize(steps) for steps in llm.collective_rpc(host_reads.report)]]
            replays = llm.collective_rpc(launches.report)
            if name == "stock":  # the planted read, counted over both requests' steps
                llm.collective_rpc(_plant)
                llm.generate([{"prompt_token_ids": PROMPT}],
                             SamplingParams(max_tokens=PLANTED_TOKENS, temperature=0, ignore_eos=True))
                runs.append([host_reads.summarize(steps) for steps in llm.collective_rpc(host_reads.report)])
            served[name] = list(out[0].outputs[0].token_ids), runs, replays
        return served
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def served(model):
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _serve(model, monkeypatch)


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(bench.PATHS))
def test_no_host_read_per_layer_and_few_per_step(served, name):
    tokens, runs, replays = served[name]
    assert len(tokens) == _tokens(name)
    _check_replays(name, replays)
    for w in runs[0]:
        print(f"{name} {PATTERN} worker: {w['steps']} decode steps, per step sparkinfer {w['sparkinfer']:.1f} "
              f"(under a layer {w['layer']:.1f}), vLLM {w['vllm']:.1f}, vLLM host copies {w['host']:.1f}; "
              f"sites {w['sites']}; allocations after warm-up {w['alloc']:.0f} (under a layer "
              f"{w['layer_alloc']:.0f}, {w['alloc_bytes'] / 1024:.0f} KiB), vLLM {w['vllm_alloc']:.0f}; "
              f"per model layer {({k: (v['calls'], v['reads'], v['alloc']) for k, v in w['per_layer'].items()})}")
        _check_layers(w)
        assert w["alloc_steps"] >= 1 and 0 < w["alloc"] <= ALLOC_CEILING[name], w["alloc_sites"]
        assert w["layer_alloc"] <= LAYER_ALLOC_CEILING[name], w["alloc_sites"]
    if len(runs) > 1:  # the planted read: booked in each stock attention layer's own forward, the MTP layer's too
        for w in runs[1]:
            planted = {k: row["reads"] for k, row in _model_layers(w).items()}
            print(f"planted reads per layer and step: {planted}")
            assert all(v > 0 for v in planted.values()), planted
            assert w["layer"] >= len(PATTERN), w["sites"]


def _check_layers(w: dict, staged: tuple = ()) -> None:
    """A worker's decode steps (``host_reads.summarize``): no sparkinfer read under a layer's forward, at
    most ``BUDGET`` a step, and no read or allocation in any layer of the model but at the ``staged``
    sites (``GLOO_GATHER``)."""
    assert w["steps"] >= 1
    assert w["layer"] == 0, w["sites"]
    assert w["sparkinfer"] <= BUDGET, w["sites"]
    layers = _model_layers(w)
    for row in layers.values():  # more layers, the same reads and allocations: none of them is per layer
        assert row["reads"] == 0 and row["alloc"] == sum(row["alloc_sites"].get(s, 0) for s in staged), layers


# The one allocation a sharded indexer layer makes on CPU: torch's gloo all-gather stages its output in a
# flat temporary (ProcessGroupGloo's allgather, then a copy into ``out``), inside the collective; NCCL's
# gathers into ``out`` itself. The probe books it at the gather's sparkinfer frame.
GLOO_GATHER = "sparkinfer:vllm/indexer_scoring.py:all_gather_into:empty"


@pytest.fixture(scope="module")
def sharded_served(model):
    """(tokens, per-worker decode summaries, per-worker launch comparisons, per-worker indexer calls per
    scoring) of one more engine, the benchmark's in mode selected with ``indexer_scoring = sharded``:
    the scoring is fixed per engine (``IndexerScoring``), so ``_serve``'s engine cannot take it."""
    pytest.importorskip("vllm")
    import gc

    from vllm import SamplingParams

    with pytest.MonkeyPatch.context() as monkeypatch:
        for k, v in bench.ENV.items():
            monkeypatch.setenv(k, v)
        llm = bench.make_llm(model, "selected", sparkinfer_indexer_scoring="sharded")
        try:
            llm.collective_rpc(host_reads.install)
            llm.collective_rpc(launches.install)
            out = llm.generate([{"prompt_token_ids": PROMPT}],
                               SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
            return (list(out[0].outputs[0].token_ids),
                    [host_reads.summarize(steps) for steps in llm.collective_rpc(host_reads.report)],
                    llm.collective_rpc(launches.report), llm.collective_rpc(forward_counts))
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


@pytest.mark.vllm
def test_a_sharded_indexer_step_replays(sharded_served):
    """Every indexer call scored sharded (each rank its owned positions with the paged top-k, then one
    all-gather and merge, ``replicated_indexer.run_indexer``), and decode steps of one shape make the
    same launches in every forward, the merge's included, with no read in a layer and no allocation but
    the CPU collective's own (``GLOO_GATHER``): what lets ``graph_paths`` hold an engine at
    ``indexer_scoring = sharded`` replay-safe."""
    tokens, workers, replays, scored = sharded_served
    assert len(tokens) == MAX_TOKENS
    assert all({k for k in c if k.startswith("indexer:")} == {"indexer:sharded"} and c["indexer:sharded"] > 0
               for c in scored), scored
    _check_replays("selected", replays)
    for w in replays:  # the compared target forwards ran the sharded op: its candidates and its merge
        for r in w:
            sites = {site for _, site, _ in r["breakdown"][0]}
            assert any(s.startswith("indexer/sharded.py:") for s in sites), sorted(sites)
    for w in workers:
        print(f"sharded worker: {w['steps']} decode steps, per step sparkinfer {w['sparkinfer']:.1f} "
              f"(under a layer {w['layer']:.1f}); allocations after warm-up {w['alloc']:.0f} "
              f"(under a layer {w['layer_alloc']:.0f})")
        _check_layers(w, staged=(GLOO_GATHER,))


# The target forward's path in each engine (step_path.PATHS): with replicas, a step whose records are
# all in the window is "local" (no exchange, a graph of its own), else "selected".
TARGET_PATHS = {"stock": {"stock"}, "selected": {"selected"}, "replicas": {"selected", "local"}}


def _tokens(path: str) -> int:
    return REPLICAS["tokens"] if path == "replicas" else MAX_TOKENS


def _check_replays(name: str, replays: list) -> None:
    """Decode steps of one shape and path made the same launches (``launches``: pointers, shapes,
    scalars and grids; what a CUDA graph replays) in every forward of every worker (the target
    model's on each mode's path and the MTP drafter's passes, which run stock in every mode); and the
    probe compared some (steps after the first of their kind: ``launches.WARMUP``)."""
    for w in replays:
        assert w, "no two decode steps of one shape and path to compare"
        for r in w:
            assert len(r["differences"]) == r["forwards"] > 1, r  # the target's forward and the drafter's
            assert r["paths"][0] in TARGET_PATHS[name], r["paths"]
            sites = [set(found) for found in r["differences"]]
            print(f"{name} {r['paths']}: {r['forwards']} forwards of {r['kernels']} kernel launches; sites "
                  f"differing per forward {[sorted(x) for x in sites]}")
            for f, differing in enumerate(sites):
                assert not differing, r["differences"][f]
            for f, found in enumerate(r["breakdown"]):  # the eager layers' launches (test_eager_launches)
                if r["paths"][f] == "stock":
                    _check_stock_launches(found, len(PATTERN) if f == 0 else 1)
        assert {r["paths"][0] for r in w} == TARGET_PATHS[name], [r["paths"] for r in w]  # each path compared


def _check_stock_launches(found: dict, layers: int) -> None:
    """A stock forward of ``layers`` layers (fp32 here) launched per layer one kernel for its cache write
    and at most ``ATTENTION_LAUNCHES`` for its attention, kernels only (tests/decode/test_eager_launches.py)."""
    from test_eager_launches import ATTENTION_LAUNCHES, WRITE_LAUNCHES

    per_entry = {}
    for (entry, site, kernel), n in found.items():
        per_entry.setdefault(entry, {})[kernel] = per_entry.get(entry, {}).get(kernel, 0) + n
    assert per_entry["do_kv_cache_update"] == {"native:write_paged": WRITE_LAUNCHES * layers}, per_entry
    attention = per_entry["forward_mqa"]
    assert sum(attention.values()) <= ATTENTION_LAUNCHES[torch.float32] * layers, attention
    assert all(kernel.startswith("triton:") for kernel in attention), attention


def _model_layers(w: dict) -> dict:
    """The worker's per-layer rows (``host_reads.summarize``): every decoder layer and the MTP layer
    ran in every decode step (the probe saw them; a layer it missed would book nothing)."""
    layers = w["per_layer"]
    target = [k for k in layers if not k.startswith("mtp:")]
    assert sorted(target) == [f"model.layers.{i}" for i in range(len(PATTERN))], sorted(layers)
    assert len(layers) > len(target), sorted(layers)  # the MTP layer
    assert all(row["calls"] >= 1 for row in layers.values()), {k: row["calls"] for k, row in layers.items()}
    return layers
