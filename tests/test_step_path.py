"""The per-step path gates used inside vLLM (sparkinfer.vllm.step_path)."""

import logging

import pytest

from sparkinfer.config import SparkinferConfig
from sparkinfer.core.costmodel import load_profile
from sparkinfer.core.policy import StepPolicy
from sparkinfer.vllm.step_path import StepPath

R = 4  # MTP3


def _path(mode="auto", dcp=4, record_format=True, max_batch=8, policy=None):
    return StepPath(SparkinferConfig(mode=mode, prefetch_depth=2), dcp=dcp, record_format=record_format, rows=R,
                    max_batch=max_batch, policy=policy)


@pytest.mark.parametrize("kwargs, lens, reason", [
    ({"mode": "stock"}, [R, R], "mode stock"),
    ({"mode": "selected", "dcp": 1}, [R, R], "DCP size 1"),
    ({"mode": "selected", "record_format": False}, [R, R], "not a sparkinfer record format"),
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
    with caplog.at_level(logging.INFO, logger="sparkinfer.vllm.step_path"):
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
