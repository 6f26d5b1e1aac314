"""The accuracy gate on the trained fixture (benchmarks/accuracy_gate.py, sparkinfer/fixture).

CI runs the reduced matrix (``fixture_matrix(full=False)``, 6 configurations: the reference,
fp8_ds_mla and nvfp4_432 at DCP1, nvfp4_368 at TP2/DCP2 in stock, selected and replicas), one
engine per format and DCP size (4 engines; the DCP2 one switches between its modes), every check
on it:

* the fixture is trained: held-out perplexity far below uniform and MTP drafts accepted
  (unquantized cache, DCP1); recall of the planted span at depth is what it has NOT learned
  (a strict xfail: it fails the day a fixture that copies is shipped, so the mark goes);
* every mode equals stock at the same format and DCP (greedy tokens, acceptance, top-1 outside
  near-ties, KL(stock || mode) at summation-order size);
* the formats fall in the order of their byte budgets: KL(unquantized || format) grows as the
  record shrinks (656 < 432 < 368 bytes; each format's stock row at its lowest DCP, DCP2 for
  368), and each stays within its documented budget.

The server path: ``vllm serve`` of the reference configuration on 127.0.0.1 (tests/vllm_server.py),
measured over HTTP exactly as a node would be (one held-out window: its full-vocabulary prompt
logprobs are most of the check's HTTP time), must give what the in-process engine gave.

The checks of the gate's own logic run without an engine.
"""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import accuracy_gate as gate  # noqa: E402


def _measured(seed=0, positions=6, vocab=8):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(positions, vocab)) * 3
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return gate.Measured([lp], [[5, 6, 7]], [[1, 2, 3, 4]], drafts=10, accepted=7)


def test_mode_check_passes_identical_and_catches_each_difference():
    stock = _measured()
    assert gate.mode_differences(stock, _measured()) == []
    for change, what in [(lambda m: m.retrieval[0].__setitem__(1, 0), "retrieval"),
                         (lambda m: m.mtp_tokens[0].__setitem__(3, 0), "MTP greedy"),
                         (lambda m: setattr(m, "accepted", 6), "acceptance"),
                         (lambda m: m.logprobs.__setitem__(0, _measured(seed=1).logprobs[0]), "KL")]:
        other = _measured()
        change(other)
        found = gate.mode_differences(stock, other)
        assert found and any(what in f for f in found), (what, found)


def test_kl_rows_is_zero_on_itself_and_positive_otherwise():
    a, b = _measured(0).logprobs, _measured(1).logprobs
    assert np.allclose(gate.kl_rows(a, a), 0)
    assert (gate.kl_rows(a, b) > 0).all()


def test_budgets_are_documented_for_every_record_format():
    budgets = gate.read_budgets()
    assert set(gate.FORMATS[1:]) <= set(budgets)
    for fmt in gate.FORMATS[1:]:
        assert {"fixture_kld_mean", "fixture_top1", "node_kld_mean"} <= set(budgets[fmt])
    fixture = [budgets[f]["fixture_kld_mean"] for f in gate.FORMATS[1:]]
    assert fixture == sorted(fixture)  # fewer bytes, a larger allowance


def test_matrix_shapes():
    small, full = gate.fixture_matrix(False), gate.fixture_matrix(True)
    assert small[0] == gate.REFERENCE and set(small) <= set(full)
    assert {(c.format, c.mode, c.dcp) for c in full} >= {
        (f, m, d) for f in gate.FORMATS[1:] for m in ("stock", "selected", "replicas") for d in (2, 4)}
    assert not any(c.format == "auto" and c.mode != "stock" for c in full)
    assert {c.format for c in small if c.mode == "stock"} == set(gate.FORMATS)  # the order check sees all four
    assert {c.mode for c in small if c.dcp > 1} == {"stock", "selected", "replicas"}


def test_one_engine_per_format_and_dcp_started_in_the_mode_that_needs_most():
    for full in (False, True):
        matrix = gate.fixture_matrix(full)
        groups = gate.engine_groups(matrix)
        assert sorted(c.label for g in groups for c in g) == sorted(c.label for c in matrix)  # each once
        assert len(groups) == len({(c.format, c.dcp) for c in matrix})
        for g in groups:
            assert len({(c.format, c.dcp) for c in g}) == 1
            start = gate._engine_config(g)
            args = gate.engine_args(start, 100, 10)
            # the engine holds what every mode of the group switches to: a replica store, a selected runtime
            assert (args["sparkinfer_replica_window"] > 0) == any(c.mode == "replicas" for c in g)
            assert (args["sparkinfer_mode"] == "selected") == any(c.mode != "stock" for c in g)
    assert len(gate.engine_groups(gate.fixture_matrix(False))) == 4


MEASURED = {}  # Config -> Measured of the module's engine runs


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    from sparkinfer.fixture import MODEL_DIR

    if not (MODEL_DIR / "model.safetensors").exists():
        pytest.fail(f"no trained fixture in {MODEL_DIR}: python -m sparkinfer.fixture.train {MODEL_DIR}")
    out = gate.run_fixture(full=False, measured=MEASURED)
    print("\n" + gate.table(out) + "\n" + json.dumps(out))
    return {(r["format"], r["mode"], r["dcp"]): r for r in out}


@pytest.mark.vllm
def test_fixture_is_trained(rows):
    ref = rows[("auto", "stock", 1)]
    recipe = json.loads((gate.MODEL_DIR / "recipe.json").read_text())
    assert ref["ppl"] < 512 / 10, ref  # uniform over the vocabulary is 512
    assert abs(ref["ppl"] - recipe["heldout"]["ppl_sparse"]) < 0.25 * ref["ppl"]  # vLLM agrees with training
    assert ref["accept_len"] > 1.3, ref  # drafts accepted (random MTP weights: ~1.0)


@pytest.mark.vllm
@pytest.mark.xfail(strict=True, reason="the shipped fixture did not learn to copy (induction) in its CPU training "
                                       "budget: retrieval at depth is 0 (docs/design/record-formats.md, Accuracy)")
def test_fixture_retrieves_at_depth(rows):
    ref = rows[("auto", "stock", 1)]
    assert all(v >= 0.5 for v in ref["retrieval"].values()), ref


@pytest.mark.vllm
def test_every_mode_equals_stock(rows):
    modes = [r for r in rows.values() if r["mode"] != "stock"]
    assert modes
    for r in modes:
        assert r["mode_failures"] == [], r


@pytest.mark.vllm
def test_formats_follow_their_byte_budgets(rows):
    stock = {}
    for (f, mode, dcp), r in sorted(rows.items(), key=lambda kv: -kv[0][2]):
        if mode == "stock":
            stock[f] = r  # the lowest DCP wins
    kl = [stock[f]["kld_mean"] for f in gate.FORMATS]
    assert kl[0] == 0.0 and kl == sorted(kl) and len(set(kl)) == len(kl), kl
    for r in rows.values():
        assert r["budget_failures"] == [], r


@pytest.mark.vllm
def test_server_path_gives_the_in_process_numbers(rows, tmp_path):
    from vllm_server import serve

    sets, max_model_len, vocab = gate.fixture_setup(gate.MODEL_DIR, False)
    sets = dataclasses.replace(sets, heldout=sets.heldout[:1])
    cli = Path(sys.executable).with_name("vllm")
    with serve(cli, gate.MODEL_DIR, gate.serve_args(gate.REFERENCE, max_model_len, vocab), tmp_path / "serve.log") as base:
        got = gate.Server(base).measure(sets, vocab, vocab)
    ref = MEASURED[gate.REFERENCE]
    assert len(got.logprobs) == 1
    assert gate.kl_rows(ref.logprobs[:1], got.logprobs).max() < 1e-4  # one request at a time: batch shapes differ
    assert got.retrieval == ref.retrieval and got.mtp_tokens == ref.mtp_tokens
    assert got.drafts > 0 and abs(got.accept_len - ref.accept_len) < 0.25, (got.accept_len, ref.accept_len)
