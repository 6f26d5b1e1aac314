"""The end-to-end demo: four host-fabric ranks, selected records and stock DCP against the dense
reference. The corrupted run proves the check can fail."""

import pytest

from sparkinfer.cli import main
from sparkinfer.cli.demo import run_demo
from sparkinfer.demo.config import DemoConfig

pytestmark = pytest.mark.multiproc


def test_demo_check_passes(capsys):
    assert main(["demo", "--check", "--format", "nvfp4_368"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "top-k identical on all ranks: True" in out
    assert "2-5" in out and "74-77" in out and " 78 " in out  # the real pattern's groups and the MTP layer


def test_demo_detects_a_corrupt_shard():
    summary = run_demo(DemoConfig(context=64, topk=16, batch=1, corrupt_rank=2, fmt="fp8_ds_mla"))
    assert not summary["ok"]
    assert summary["topk_identical"]  # the indexer is replicated: corrupting main records leaves top-k alone
    # both paths see the corrupt records (a group whose rows selected none of rank 2's tokens may pass)
    assert all(r["err_selected"] > summary["tol"] and r["err_stock"] > summary["tol"] for r in summary["bad"])
    assert len(summary["bad"]) > len(summary["rows"]) // 2


def test_demo_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divide"):
        DemoConfig(heads=6)
    with pytest.raises(ValueError, match="topk"):
        DemoConfig(context=16, topk=32)
