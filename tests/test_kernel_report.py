"""benchmarks/kernel_report.py: every GPU kernel compiled for sm_120 and sm_90 without a GPU, with its
registers, spills, shared memory and MMA use, and a roofline figure per kernel.

The compile runs once per module, in a subprocess (conftest sets TRITON_INTERPRET=1 here, which
replaces @triton.jit functions by interpreted ones). Skipped without nvcc (csrc) or without
Triton's NVIDIA backend (Triton kernels)."""

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
spec = importlib.util.spec_from_file_location("kernel_report", ROOT / "benchmarks/kernel_report.py")
kr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kr)

ARCHS = (120, 90)
FIELDS = {"kernel": str, "source": str, "arch": int, "registers": int, "spill_bytes": int, "spill_stores": int,
          "spill_loads": int, "stack_bytes": int, "shared_bytes": int, "mma": bool, "mma_ops": list}


def csrc_kernels() -> set[str]:
    """Report names of the __global__ functions, read from the sources (not from the compiler)."""
    names = set()
    for path in sorted((ROOT / "csrc/cuda").glob("*.cu")):
        for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(", path.read_text()):
            names.add(f"{path.name}:{m.group(1)}")
    return names


def triton_kernels() -> set[str]:
    return {s["name"] for mod in kr.TRITON_MODULES for s in importlib.import_module(mod).compile_specs()}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc (CUDA toolkit)")
    out = tmp_path_factory.mktemp("kreport") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/kernel_report.py"), "--json", str(out)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert "csrc" not in doc["errors"], doc["errors"]
    return doc


def test_csrc_kernels_do_not_spill_on_either_arch(report):
    expected = csrc_kernels()
    assert {"pack.cu:move_kernel", "comm_flags.cu:wait_kernel"} <= expected
    for arch in ARCHS:
        rows = {r["kernel"]: r for r in report["kernels"] if r["arch"] == arch and r["source"].startswith("csrc/")}
        assert set(rows) == expected, f"sm_{arch}"
        for name, r in rows.items():
            assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, f"{name} sm_{arch} spills: {r}"
            assert 0 < r["registers"] <= 255


def test_report_lists_every_kernel_with_its_fields(report):
    if "triton" in report["errors"]:
        pytest.skip(f"Triton kernels not compiled: {report['errors']['triton']}")
    expected = triton_kernels() | csrc_kernels()
    for arch in ARCHS:
        assert {r["kernel"] for r in report["kernels"] if r["arch"] == arch} == expected, f"sm_{arch}"
    for r in report["kernels"]:
        for field, typ in FIELDS.items():
            assert isinstance(r[field], typ), (r["kernel"], field, r[field])
        assert r["mma"] == bool(r["mma_ops"])
    mla = [r for r in report["kernels"] if r["kernel"].startswith("sparse_mla_decode")]
    assert mla and all(r["shared_bytes"] > 0 for r in mla)  # its tiles live in shared memory


def test_triton_topk_does_not_spill(report):
    """The indexer's top-k (``triton_topk``: a radix select and a 4,096-key in-CTA sort at k 2,048)
    fits its registers on both targets, sorted and unsorted."""
    if "triton" in report["errors"]:
        pytest.skip(f"Triton kernels not compiled: {report['errors']['triton']}")
    rows = [r for r in report["kernels"] if r["kernel"].startswith("topk_keys")]
    assert len(rows) == 2 * len(ARCHS)
    for r in rows:
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0 and 0 < r["registers"] <= 255, r


def test_every_compiled_kernel_has_a_roofline_figure(report):
    covered = {c for row in report["roofline"] for c in row["covers"]}
    bases = {c.split("[")[0] for c in covered}
    for r in report["kernels"]:
        assert r["kernel"] in covered or r["kernel"].split("[")[0] in bases, r["kernel"]


def test_roofline_arithmetic():
    rows = kr.roofline()
    mla = next(r for r in rows if r["kernel"] == "sparse_mla_decode[nvfp4_368]" and r["params"]["H"] == 16
               and r["params"]["M"] == 64 and r["params"]["gathered"] == 64 * 2048)
    # 64 rows x 16 heads x 2048 records x (QK over 576 + PV over 512) x 2 FLOPs per FMA
    assert mla["flops"] == 4_563_402_752
    # issued on tensor cores: the probabilities' hi + lo bf16 halves run PV twice: 576 + 2 x 512
    assert mla["mma_flops"] == 2 * 64 * 16 * 2048 * 1600 == 6_710_886_400
    # splits: ceil(188 SMs / (64 rows x 1 head block)) = 3, under 2048 // 256 = 8 and the merge's 64
    assert mla["params"]["splits"] == 3
    # records 64*2048*368 + compacted indices 64*2048*4 + counts 64*4 + q 64*16*576*2 (bf16)
    # + 3 fp32 partials (out + LSE) 3*64*16*513*4
    assert mla["bytes"] == 48_234_496 + 524_288 + 256 + 1_179_648 + 6_303_744
    h200, pro = mla["times"]["h200"], mla["times"]["rtx_pro_6000"]
    assert h200["mem_us"] == pytest.approx(mla["bytes"] / 4.8e12 * 1e6, abs=1e-3)
    assert pro["mem_us"] == pytest.approx(mla["bytes"] / 1.79e12 * 1e6, abs=1e-3)
    assert pro["tc_bf16_us"] == pytest.approx(6_710_886_400 / 500e12 * 1e6, abs=1e-3)
    # on bf16 tensor cores it is memory-bound on both GPUs (56.2 MB: 31.4 / 11.7 us)
    assert h200["bound"] == pro["bound"] == "memory" and 11 < h200["floor_us"] < 12 and 31 < pro["floor_us"] < 32
    stock = next(r for r in rows if r["kernel"] == "sparse_mla_decode[nvfp4_368]" and r["params"]["H"] == 64)
    # stock DCP4: of 2048 listed, the 512 of this rank are compacted and read: a quarter of the records
    assert stock["params"]["K"] == 512 and stock["params"]["splits"] == 1
    assert stock["bytes"] == 64 * 512 * 368 + 64 * 512 * 4 + 64 * 4 + 64 * 64 * 576 * 2 + 64 * 64 * 513 * 4
    compact = next(r for r in rows if r["kernel"] == "sparse_mla_compact" and r["params"]["valid"] == 512)
    assert compact["bytes"] == 64 * 2048 * 4 + 64 * 512 * 4 + 64 * 4 and compact["times"]["h200"]["bound"] == "launch"
    merge = next(r for r in rows if r["kernel"] == "sparse_mla_merge_splits" and r["params"]["M"] == 4)
    # batch 1: ceil(188 / 4) = 47 splits wanted, 8 allowed by 2048 // 256; read 8 partials, write one
    assert merge["params"]["splits"] == 8 and merge["bytes"] == 9 * 4 * 16 * 513 * 4
    idx = next(r for r in rows if r["kernel"] == "indexer_scores" and r["params"]["M"] == 4
               and r["params"]["T"] == 131072)
    # 4 rows x 32 heads x 131072 tokens x 128 dims x 2, + relu, weight, sum per head and token
    assert idx["flops"] == 2 * 4 * 32 * 131072 * 128 + 3 * 4 * 32 * 131072
    assert idx["times"]["h200"]["floor_us"] == pytest.approx(idx["flops"] / 494e12 * 1e6, abs=1e-3)  # tf32-bound
    tiled = next(r for r in rows if r["kernel"] == "indexer_topk_rows")
    # 256 MiB of int64 keys for 2048 rows: 16384 positions a pass, 8 passes over 128K
    assert tiled["params"]["tile"] == 16384 and tiled["params"]["passes"] == 8
    assert tiled["params"]["work_bytes"] == 2048 * (2048 + 16384) * 8
    # the keys written, the work buffer read by the top-k, its top-k written, then copied back to the
    # buffer's head; the last pass's 2k candidates written and read back
    per_pass = (16384 * 140 + 2048 * 32 * 129 * 4 + 2048 * 16384 * 8 + 2048 * (2048 + 16384) * 8
                + 2048 * 2048 * 8 + 2048 * 2048 * 16)
    assert tiled["bytes"] == 8 * per_pass + 2048 * 4096 * 16
    pack = next(r for r in rows if r["kernel"] == "pack" and r["params"]["records"] > 64)
    assert pack["params"]["records"] == 16 * 3584 // 4 and pack["flops"] == 0
    assert pack["bytes"] == 2 * 14336 * 4 * 368 + 14336 * 8 and pack["times"]["rtx_pro_6000"]["p2p_us"] > 0
    for r in rows:
        for t in r["times"].values():
            assert t["floor_us"] >= max(t["mem_us"], kr.LAUNCH_US)
        assert r["expect"]


def test_device_script_dry_run_runs_the_cpu_parts(tmp_path):
    """run_gpu_checks.sh --dry-run: the kernel timings (every roofline row) and the decode step at tiny
    shapes on the CPU, the exchange on the host fabric, and one gpu_checks.json gathering them."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(["bash", str(ROOT / "benchmarks/device/run_gpu_checks.sh"), "--dry-run"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert {s["stage"]: s["rc"] for s in doc["stages"]} == {"graph_exchange": "0", "kernels": "0", "graph_step": "0"}
    rows = doc["kernel_timing"]["rows"]
    assert [(r["kernel"], r["shape"]) for r in rows] == [(r["kernel"], r["shape"]) for r in kr.roofline()]
    assert not [r for r in rows if "error" in r]
    timed = [r for r in rows if "measured_us" in r]
    assert {r["kernel"] for r in timed} >= {"pack", "unpack", "direct", "union", "indexer_scores",
                                            "indexer_topk_rows", "sparse_mla_decode[nvfp4_368]",
                                            "sparse_mla_compact", "sparse_mla_merge_splits"}
    assert all(r["measured_us"] > 0 and r["frac_of_floor"] > 0 for r in timed)
    assert doc["graph_decode_step"]["all_equal"] is True and doc["graph_exchange"] is not None
    assert sorted(os.listdir(tmp_path)) == ["gpu_checks.json"]  # the dry run leaves only the document
