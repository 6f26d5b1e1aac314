"""DCP's own effect over many prompts: TP2/DCP2 against TP2/DCP1 (the same tensor parallelism).

Comparing TP2/DCP2 with TP1 mixes two effects: TP changes the reduction order of every row-parallel
layer (with quantized records that can flip an NVFP4 rounding: docs/design/vllm-integration.md,
"DCP against DCP1 at the same TP, and TP1 vs TP2 with quantized records"), DCP changes where the
records live and how attention over them is combined. Here the reference is the same TP at DCP1,
so only DCP differs: 22 greedy prompts of 10 to 129 tokens (ignore_eos, 8 new tokens each) in one
``generate`` call per engine; their lengths straddle the 64-token page of DCP1, the 128-token
virtual page of DCP2 (64 per rank), and the 24-token prefill chunks (``max_num_batched_tokens=24``),
and some cross a page during decode. Both engines run the same scheduler settings on the same
batch, so the batch composition is the same step by step and the tokens must be equal, prompt for
prompt, except for a near-tie flip (``near_tie_flips``: DCP still sums attention in another order,
and a rounding flip can tip a near-tie), which must then vanish when that prompt runs alone at
both DCP sizes. Measured: TP2 equal on 22 of 22 in every configuration; TP4 one near-tie flip
(prompt 13, DCP1 margin 0.064 nats, equal alone).

Matrix (CI budget ~6 min; a TP2 engine ~17 s on the idle 2-core box, the file 488 s while other
jobs loaded it): TP2 with every record format (368, 432, 656) in mode ``selected`` (records
fetched over the host fabric, no LSE merge), 368 also in ``stock`` (vLLM's DCP decode: partial
outputs + LSE merge), the unquantized cache in ``stock`` (``selected`` needs a record format);
TP4/DCP4 vs TP4/DCP1 for 368 in ``selected`` with the 4-head variant of the model. Replicas are
off (window 0) so every step exchanges. The indexer scores replicated (every rank the whole
context) except in the TP2 368 ``stock+sharded`` run and the TP4 run, where every rank scores the
positions it owns and the ranks merge candidates (``indexer_scoring = sharded``).
"""

import random

import pytest

from sparkinfer.vllm.worker_runtime import forward_counts

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
CHUNK = 24  # prefill tokens per step: prompts longer than this are chunked
LENGTHS = [10, 13, 23, 24, 25, 31, 40, 47, 48, 49, 58, 63, 64, 65, 72, 88, 96, 100, 122, 127, 128, 129]


def prompts(lengths=LENGTHS, seed=0) -> list[list[int]]:
    """Random token-id prompts (ids 4..127: the tiny tokenizer's words, no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 128) for _ in range(n)] for n in lengths]


PROMPTS = prompts()


def generate(model_dir, monkeypatch, prompt_ids, *, tp, dcp, mode="stock", max_tokens=MAX_TOKENS,
             logprobs=None, before=None, after=None, alone=None, **kwargs):
    """Greedy continuations (ignore_eos) of every prompt in one ``generate`` call of one engine at
    TP ``tp`` / DCP ``dcp`` in sparkinfer ``mode``; returns ``[(tokens, top)]`` where ``top`` is,
    with ``logprobs=k``, per generated position the ``{token: logprob}`` of the top-k (else None).
    ``before`` / ``after``: ``(callable, args)`` run on every worker (``LLM.collective_rpc``) before
    and after the generate call; with ``after`` the result is ``(outputs, after's results)``.
    ``mode`` a tuple: one engine, started in mode selected, generates once per mode in that order
    (``worker_runtime.use_paths`` before each, the prefix cache emptied) and the outputs are a list,
    one per mode; ``after`` runs once, at the end. ``alone(mode, outputs)``: the indices of the prompts
    to run again alone after that mode's batch, in this engine, one ``generate`` call each with the
    prefix cache emptied (one request per step, nothing else in the batch: what an engine with
    ``max_num_seqs=1`` runs, without starting one); a mode's outputs are then ``(outputs, {index:
    tokens alone})``."""
    import gc

    from vllm import LLM, SamplingParams

    from sparkinfer.vllm.worker_runtime import use_paths

    # the settings of test_vllm_dcp._greedy (why: see there), at any TP/DCP and for a batch
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                 "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(k, v)
    kwargs.setdefault("sparkinfer_pool_mb", 4)
    kwargs.setdefault("sparkinfer_replica_window", 0)  # every step exchanges
    kwargs.setdefault("max_model_len", 160)
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_num_batched_tokens", CHUNK)
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, enable_chunked_prefill=True,
              tensor_parallel_size=tp, decode_context_parallel_size=dcp,
              sparkinfer_mode=mode if isinstance(mode, str) else "selected",
              compilation_config={"custom_ops": ["-rotary_embedding"]}, **kwargs)  # CPU rope bug for MLA q
    try:
        if before is not None:
            llm.collective_rpc(before[0], args=before[1])
        results = []
        for m in modes:
            if not isinstance(mode, str):
                assert llm.collective_rpc(use_paths, args=(m,)) == [{"mode": m, "replicas": False}] * tp
                llm.reset_prefix_cache()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                               logprobs=logprobs), use_tqdm=False)
            result = []
            for o in outs:
                c = o.outputs[0]
                top = None if logprobs is None else [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]
                result.append((list(c.token_ids), top))
            if alone is not None:
                solo = {}
                for i in alone(m, result):
                    assert llm.reset_prefix_cache()  # nothing of the batch is reused: the prompt prefills afresh
                    out = llm.generate([{"prompt_token_ids": prompt_ids[i]}],
                                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                       use_tqdm=False)
                    solo[i] = list(out[0].outputs[0].token_ids)
                result = (result, solo)
            results.append(result)
        result = results[0] if isinstance(mode, str) else results
        return result if after is None else (result, llm.collective_rpc(after[0], args=after[1]))
    finally:
        llm.llm_engine.engine_core.shutdown()  # stops the TP workers now, not at interpreter exit
        del llm
        gc.collect()


# Near-tie bound (nats) on the reference's top-1 minus top-2 logprob where another run may pick the
# runner-up. Runs that differ only in float summation order (TP's all-reduce, DCP's combine, batch
# shapes) give latents equal to ~1e-6; where one sits on an NVFP4 / FP8 rounding boundary its code
# flips by a whole step, and the cascade moved top-2 margins by up to 0.045 nats where tokens still
# agreed; where it tipped a near-tie the reference-side margin was at most 0.073 (TP1 vs TP2, 368,
# 2 x 40 prompts: benchmarks/tp_divergence.py and docs/design/vllm-integration.md, "DCP against
# DCP1 at the same TP, and TP1 vs TP2 ..."). 0.1 covers that; a flip above it, or to a token other
# than the runner-up, fails.
NEAR_TIE = 0.1


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def margin(top: dict) -> float:
    """Top-1 minus top-2 logprob at one position (nats)."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1]


def flip(want: list[int], want_top: list[dict], have: list[int]):
    """Where ``have`` (the same prompt's tokens from another run, possibly cut short) first differs
    from the reference ``want``: None if nowhere, else (position, the reference's top-2 margin
    there, whether ``have`` took the reference's runner-up)."""
    at = next((k for k, (x, y) in enumerate(zip(want, have)) if x != y), None)
    if at is None:
        return None
    ranked = sorted(want_top[at], key=want_top[at].get, reverse=True)
    return at, margin(want_top[at]), have[at] == ranked[1]


def near_tie_flips(ref, got, label) -> dict[int, str]:
    """The prompts where ``got`` leaves the reference ``ref`` (``[(tokens, top-2)]`` each); fails unless
    each is a near-tie flip (reference margin < NEAR_TIE, ``got`` took the runner-up)."""
    flips, bad = {}, []
    for i, ((want, top), (have, _)) in enumerate(zip(ref, got)):
        assert len(have) == len(want), (label, i)
        f = flip(want, top, have)
        if f is None:
            continue
        at, gap, runner_up = f
        note = (f"{label}: prompt {i} at {at}: {have[at:]} vs DCP1 {want[at:]}, DCP1 top-2 margin {gap:.3g} "
                f"nats, runner-up taken: {runner_up}")
        if gap < NEAR_TIE and runner_up:
            flips[i] = note
        else:
            bad.append(note)
    assert not bad, f"{len(bad)} of {len(ref)} prompts differ from DCP1 beyond a near-tie:\n" + "\n".join(bad)
    return flips


def _alone_flips(ref, label):
    """``generate``'s ``alone`` for a run compared with ``ref``: its near-tie flips (``near_tie_flips``,
    which fails on any other difference) run again alone in the same engine."""
    def flipped(mode, got):
        flips = near_tie_flips(ref, got, label(mode))
        print("".join(f"\n{note}" for note in flips.values()))
        return list(flips)

    return flipped


def _check(model, monkeypatch, run, label, tp, **kwargs):
    """``run``: ``generate``'s outputs with ``alone=_alone_flips(ref, ...)`` (the batch, which left the
    reference only by near-tie flips, and the flipped prompts alone at DCP > 1: one request per step,
    nothing else in the batch). Each flipped prompt alone must equal the same prompt alone at DCP1
    (an engine of ``max_num_seqs=1``, started only when a prompt flipped)."""
    solo = run[1]
    if solo:
        want = generate(model, monkeypatch, [PROMPTS[i] for i in solo], tp=tp, dcp=1, max_num_seqs=1, **kwargs)
        assert [t for t, _ in want] == list(solo.values()), f"{label}: alone, DCP > 1 != DCP1"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from sparkinfer.testing.tiny_model import build_tiny_glm

    return build_tiny_glm(tmp_path_factory.mktemp("tiny_glm_prompts"))


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """4 attention heads, so TP4 leaves one head per rank."""
    pytest.importorskip("transformers")
    from sparkinfer.testing.tiny_model import build_tiny_glm

    return build_tiny_glm(tmp_path_factory.mktemp("tiny_glm_prompts4"), heads=4)


def test_prompt_set_straddles_pages_and_chunks():
    """The lengths cover both sides of every boundary the runs below care about."""
    for boundary in (CHUNK, 2 * CHUNK, 64, 128):  # chunks; DCP1 page; DCP2 virtual page
        assert {boundary - 1, boundary, boundary + 1} <= set(LENGTHS)
    assert any(n < 64 < n + MAX_TOKENS for n in LENGTHS) and any(n < 128 < n + MAX_TOKENS for n in LENGTHS)
    assert min(LENGTHS) >= 10 and len(LENGTHS) >= 16
    assert len({tuple(p) for p in PROMPTS}) == len(LENGTHS)


@pytest.mark.parametrize("cache_dtype, modes", [
    ("nvfp4_368", ("selected", "stock", "stock+sharded")),
    ("nvfp4_432", ("selected",)),
    ("fp8_ds_mla", ("selected",)),
    ("auto", ("stock",)),
])
def test_tp2_dcp2_equals_tp2_dcp1(tiny, cache_dtype, modes, monkeypatch):
    """``+sharded``: the indexer scored sharded (``indexer_scoring``) on every step, which the
    workers' counters show: each rank scores its half of the positions and all-gathers candidates."""
    pytest.importorskip("vllm")
    ref = generate(tiny, monkeypatch, PROMPTS, tp=2, dcp=1, kv_cache_dtype=cache_dtype, logprobs=2)
    assert all(len(t) == MAX_TOKENS for t, _ in ref)
    # the variants of one indexer scoring share an engine (its modes switched between generate calls)
    for scoring in dict.fromkeys(v.partition("+")[2] for v in modes):
        engine_modes = tuple(v.partition("+")[0] for v in modes if v.partition("+")[2] == scoring)
        kw = dict(kv_cache_dtype=cache_dtype, sparkinfer_indexer_scoring=scoring or "replicated")
        label = lambda mode: f"TP2/DCP2 {cache_dtype} {mode}{'+' + scoring if scoring else ''}"  # noqa: E731
        runs, scored = generate(tiny, monkeypatch, PROMPTS, tp=2, dcp=2, after=(forward_counts, ()),
                                mode=engine_modes[0] if len(engine_modes) == 1 else engine_modes,
                                alone=_alone_flips(ref, label), **kw)
        way = "indexer:" + (scoring or "replicated")
        for counts in scored:  # every indexer call of the engine scored the chosen way (WorkerRuntime.counts)
            assert {k for k in counts if k.startswith("indexer:")} == {way} and counts[way] > 0, counts
        for mode, run in zip(engine_modes, [runs] if len(engine_modes) == 1 else runs):
            _check(tiny, monkeypatch, run, label(mode), 2, **kw)


def test_tp4_dcp4_equals_tp4_dcp1(tiny4, monkeypatch):
    """Selected records with the indexer scored sharded over four ranks."""
    pytest.importorskip("vllm")
    ref = generate(tiny4, monkeypatch, PROMPTS, tp=4, dcp=1, kv_cache_dtype="nvfp4_368", logprobs=2)
    kw = dict(kv_cache_dtype="nvfp4_368", sparkinfer_indexer_scoring="sharded")
    label = "TP4/DCP4 nvfp4_368 selected, sharded scoring"
    run, scored = generate(tiny4, monkeypatch, PROMPTS, tp=4, dcp=4, mode="selected", after=(forward_counts, ()),
                           alone=_alone_flips(ref, lambda mode: label), **kw)
    assert all({k for k in c if k.startswith("indexer:")} == {"indexer:sharded"} for c in scored), scored
    _check(tiny4, monkeypatch, run, label, 4, **kw)
