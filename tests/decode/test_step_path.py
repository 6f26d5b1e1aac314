"""The per-step path gates used inside vLLM (sparkinfer.decode.step_path)."""

import logging

import pytest

from sparkinfer.config import SparkinferConfig
from sparkinfer.core.costmodel import load_profile
from sparkinfer.core.policy import StepPolicy
from sparkinfer.decode.step_path import StepPath

R = 4  # MTP3


def _path(mode="auto", dcp=4, record_format=True, max_batch=8, policy=None):
    return StepPath(SparkinferConfig(mode=mode, prefetch_depth=2), dcp=dcp, record_format=record_format, rows=R,
                    max_batch=max_batch, policy=policy)


@pytest.mark.parametrize("kwargs, lens, reason", [
    ({"mode": "stock"}, [R, R], "mode stock"),
    ({"mode": "selected", "dcp": 1}, [R, R], "DCP size 1"),
    ({"mode": "selected", "record_format": False}, [R, R], "not a record format"),
    ({"mode": "selected"}, [R, 17], f"exactly {R} rows"),  # a prefill chunk in the batch
    ({"mode": "selected"}, [R, 2], f"exactly {R} rows"),  # fewer drafts for one request
    ({"mode": "selected", "max_batch": 1}, [R, R], "more than 1 requests"),
    ({"mode": "auto"}, [R, R], "auto without a cost-model profile"),
])
def test_gates_fall_back_to_stock_with_the_reason(kwargs, lens, reason):
    choice = _path(**kwargs).choose(lens, [1000] * len(lens))
    assert choice.path == "stock" and reason in choice.reason and choice.depth == 0


def test_eligible_selected_step_uses_the_configured_depth():
    choice = _path(mode="selected").choose([R, R], [900, 1200])
    assert (choice.path, choice.depth, choice.reason) == ("selected", 2, "mode selected")


def test_each_fallback_reason_is_logged_once(caplog):
    p = _path(mode="selected", max_batch=1)
    with caplog.at_level(logging.INFO, logger="sparkinfer.decode.step_path"):
        for _ in range(5):
            p.choose([R, R], [10, 10])
            p.choose([R, 3], [10, 10])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.startswith("sparkinfer: stock DCP decode") for line in lines)


@pytest.mark.parametrize("profile", ["rtx_pro_6000_x4", "h200_x4"])
def test_auto_follows_the_cost_model(profile):
    """With a profile, an eligible step takes exactly the policy's decision."""
    policy = StepPolicy(load_profile(profile), tp=4, dcp=4, record_format="nvfp4_368", max_depth=3, mode="auto",
                        env={})
    p = _path(policy=policy)
    for contexts in ([2_000] * 8, [64_000] * 8, [256_000] * 2):
        want = policy.decide([R] * len(contexts), contexts)
        got = p.choose([R] * len(contexts), contexts)
        assert (got.path, got.depth) == (want.path, want.depth)


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 query lengths but 1 contexts"):
        _path().choose([R, R], [5])


def _gathering(mode, gather_rows=4096, interleave=1, **stock):
    from sparkinfer.core.accounting import StockDcpShape
    from sparkinfer.core.topology import DcpLayout

    return StepPath(SparkinferConfig(mode=mode, prefetch_depth=1), dcp=4, record_format=True, rows=R, max_batch=8,
                    gather_rows=gather_rows, layout=DcpLayout(4, interleave), record_bytes=368,
                    stock=StockDcpShape(rows=0, **stock))


def test_rows_not_uniform_take_a_gathered_step_when_it_fits():
    choice = _gathering("selected").choose([30, R], [0, 500])
    assert (choice.path, choice.depth) == ("gather", 1)
    too_big = _gathering("selected", gather_rows=2 * 504 - 1).choose([30, R], [0, 500])  # 2 requests x 504 rows
    assert too_big.path == "stock" and "larger than the workspace" in too_big.reason


def _busiest_rx_brute(query_lens, contexts, interleave, num_heads=64, tp=4, dcp=4):
    """Bytes into the busiest rank, by counting tokens and elements one by one."""
    gathered = [0] * dcp
    for c in contexts:
        for t in range(c):
            owner = (t // interleave) % dcp
            for d in range(dcp):
                gathered[d] += 368 if d != owner else 0
    rows, h = sum(query_lens), num_heads // tp
    per_peer = rows * h * 576 * 2 + rows * dcp * h * 4 + rows * h * 512 * 2  # q, LSE, output (bf16)
    return max(gathered), (dcp - 1) * per_peer


@pytest.mark.parametrize("query_lens, contexts", [
    ([64, R], [0, 0]),  # cold prefill and a short decode: the gather moves nothing
    ([64], [100_000]),  # a small chunk of a long prompt: the whole prefix travels for 64 rows
    ([2048], [4096]),  # a large chunk: its queries outweigh the prefix
    ([8, 1, 1], [900, 40_000, 35_000]),  # a mixed batch with long decodes
])
@pytest.mark.parametrize("interleave", [1, 64])
def test_auto_gathers_exactly_when_it_moves_fewer_bytes(query_lens, contexts, interleave):
    p = _gathering("auto", gather_rows=10**7, interleave=interleave)
    gathered, stock = _busiest_rx_brute(query_lens, contexts, interleave)
    choice = p.choose(query_lens, contexts)
    assert choice.path == ("gather" if gathered < stock else "stock")
    if choice.path == "stock":
        assert "no fewer bytes" in choice.reason


def test_gathered_steps_need_the_byte_rule_inputs():
    with pytest.raises(ValueError, match="gathered steps need"):
        StepPath(SparkinferConfig(mode="auto"), dcp=4, record_format=True, rows=R, max_batch=8, gather_rows=100)


def test_all_local_steps_go_local_even_in_auto_but_never_in_stock():
    """A step whose records are all in the replica store moves nothing: auto takes it with no profile
    (stock would still run its per-layer all-to-all); mode stock and the hard gates still win. Its
    path is "local", not "selected": it runs no exchange, so a CUDA graph of a selected step (with its
    exchange) cannot replay it."""
    for mode in ("auto", "selected"):
        assert _path(mode=mode).choose([R, R], [1000, 50], all_local=True).path == "local"
    assert _path(mode="selected").choose([R, R], [1000, 50]).path == "selected"
    assert "replicas" in _path(mode="auto").choose([R, R], [1000, 50], all_local=True).reason
    assert _path(mode="auto").choose([R, R], [1000, 50]).path == "stock"
    assert _path(mode="stock").choose([R, R], [1000, 50], all_local=True).path == "stock"
    assert _path(mode="auto", dcp=1).choose([R, R], [1000, 50], all_local=True).path == "stock"
    assert _path(mode="auto", max_batch=1).choose([R, R], [1000, 50], all_local=True).path == "stock"


@pytest.mark.parametrize("interleave", [1, 64])
def test_auto_gather_counts_only_what_the_replica_window_does_not_hold(interleave):
    """A small chunk of a long prompt: without replicas the whole prefix would travel (stock wins);
    with positions 10,000.. held by the replica store only the remote ones below travel (gather)."""
    p = _gathering("auto", gather_rows=10**7, interleave=interleave)
    assert p.choose([64], [100_000]).path == "stock"
    gathered, stock = _busiest_rx_brute([64], [10_000], interleave)
    choice = p.choose([64], [100_000], fetched_below=[10_000])
    assert choice.path == ("gather" if gathered < stock else "stock") == "gather"
