"""Compile the indexer scorer for the real GPUs without one: no spills, shared memory within bounds, MMA.

Every launch configuration the wrappers use (``triton_scores.compile_specs()``: the score matrix and
the tiled top-k's key pass without and with token ids, for fp32 and bf16 q, at GLM-5.2's 32 index
heads; ``triton_paged.compile_specs()``: the paged top-k, one split and several, a spec per arch with
the launch's attrs and options) is compiled with ``triton.compile`` for sm_120 (RTX PRO 6000: at most
99 KB of shared memory per block) and sm_90 (a spec with "archs" for those only).
The cubin Triton produced, the code a GPU would run, is read back with the toolkit's
``cuobjdump --dump-resource-usage``: a spill needs a local-memory stack frame, so STACK and LOCAL
must be 0 and registers at most 255. The PTX must hold tensor-core ``mma`` instructions, and on sm_90
the scorer's kernels whose dot takes a chunk's 64 keys as M (bf16 and fp8 q: ``triton_scores.chunk_scores``,
and the paged top-k's sm_90 form) ``wgmma`` ones. Compilation
runs in a subprocess because conftest sets TRITON_INTERPRET=1, which replaces @triton.jit functions
by interpreted ones.
"""

import json
import os
import re
import subprocess
import sys

import pytest

MAX_SHARED = {120: 99 * 1024, 90: 227 * 1024}

_SCRIPT = r"""
import json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparkinfer.indexer import triton_paged as tp, triton_scores as ts

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
out = {}
for spec in ts.compile_specs() + tp.compile_specs():
    for arch in spec.get("archs", (120, 90)):  # a spec with "archs" is its launch on those only
        k = triton.compile(ASTSource(spec["fn"], spec["signature"], constexprs=spec["constexprs"],
                                     attrs=spec.get("attrs")),
                           target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"],
                                    **spec.get("options", {})})
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        os.unlink(f.name)
        res = {key: int(v) for key, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
        out[f"{spec['name']}-{arch}"] = {"shared": k.metadata.shared, "mma": len(re.findall(r"\b(?:wg)?mma\.", k.asm["ptx"])),
                                         "wgmma": len(re.findall(r"\bwgmma\.mma_async", k.asm["ptx"])), **res}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("needs Triton's bundled CUDA tools (backends/nvidia/bin/cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_spec_compiled_for_both_targets(compiled):
    from sparkinfer.indexer import triton_paged, triton_scores

    specs = triton_scores.compile_specs() + triton_paged.compile_specs()
    names = {s["name"] for s in specs}
    assert names == {f"{k}[q_{d}]" for k in ("indexer_scores", "indexer_keys", "indexer_keys_ids")
                     for d in ("fp32", "bf16")} | {"indexer_keys[q_fp8]",  # the engine's key pass reads fp8 q
                                                   "paged_topk[k2048]", "paged_topk_split[k2048]"}
    assert set(compiled) == {f"{s['name']}-{a}" for s in specs for a in s.get("archs", (120, 90))}
    assert {n.rsplit("-", 1)[1] for n in compiled if n.startswith("paged_topk")} == {"120", "90"}


@pytest.mark.parametrize("arch", [120, 90])
def test_no_spills_shared_memory_fits_and_mma(compiled, arch):
    from sparkinfer.indexer.triton_scores import GROUPS, WARPS

    for name, info in compiled.items():
        if not name.endswith(f"-{arch}"):
            continue
        assert info["REG"] <= 255 and info["STACK"] == 0 and info["LOCAL"] == 0, f"{name}: spills {info}"
        assert info["shared"] <= MAX_SHARED[arch], f"{name}: {info['shared']} B shared memory"
        assert info["mma"] > 0, f"{name}: no tensor-core mma in the PTX"
        if arch == 120 and name.startswith("indexer_"):  # mma.sync: a warp's share of GROUPS[p] x 32 heads' dots
            # a chunk's MMAs per row, from the PTX's per warp: fp32 q takes the 3-pass tf32 split of k8 MMAs,
            # six times those of bf16 q (one pass of k16 bf16 MMAs, its operands exact in bf16); fp8 q one
            # pass of f16 MMAs, as bf16
            per_row = lambda n, p: compiled[n]["mma"] * WARPS[p] // GROUPS[p]
            bf16 = per_row(name.replace("q_fp32", "q_bf16").replace("q_fp8", "q_bf16"), "bf16")
            if "q_fp32" in name:
                assert per_row(name, "tf32x3") == 6 * bf16, name
            if "q_fp8" in name:
                assert per_row(name, "f16") == bf16, name
        elif name.startswith("indexer_") and "q_fp32" not in name:  # M = 64 or 128: wgmma on sm_90
            assert info["wgmma"] > 0, f"{name}: no wgmma"
        # the paged top-k's chunk dot: the keys as M on sm_90 (``triton_paged.keys_as_m_on``), a dot per row elsewhere
        if name.startswith("paged_topk"):
            assert (info["wgmma"] > 0) == (arch == 90), f"{name}: {info['wgmma']} wgmma"


def test_spec_signatures_match_the_kernel():
    from sparkinfer.indexer import triton_paged, triton_scores

    for mod, kernel in ((triton_scores, triton_scores._indexer_scores_kernel),
                        (triton_paged, triton_paged._paged_topk_kernel)):
        for spec in mod.compile_specs():
            assert spec["fn"] is kernel
            assert set(spec["signature"]) == set(kernel.arg_names)
            assert all(spec["signature"][n] == "constexpr" for n in spec["constexprs"])
            assert all(re.fullmatch(r"\*(fp32|bf16|u8|i64|i32)|i32|constexpr", t) for t in spec["signature"].values())

