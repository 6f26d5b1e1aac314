"""Compile the Triton kernels for the real GPUs without one, and read ptxas's verdict.

The interpreter cannot tell whether a kernel fits the hardware. These tests compile every launch
configuration the sparse MLA wrapper uses (``triton_decode.compile_specs()``: the decode kernel
for the three record formats with bf16 and fp32 queries, the index compaction and the split
merge) for sm_120 (RTX PRO 6000) and sm_90 (H200), run ``ptxas -v`` on the PTX and assert:
- no register spills (spill stores and loads are 0 bytes) under plain ``ptxas -v`` (Triton's own
  ``--regAllocOptLevel=2`` spills 8-104 B outside the loops of several variants: sparse-attention.md,
  "Known limits", and ``kernel_report.json``);
- the decode kernel multiplies on tensor cores (``mma.sync`` / ``wgmma`` in the PTX);
- shared memory within a block's limit (sm_120: 99 KB, binding; sm_90: 227 KB), and a 64-key variant's
  within the threshold the wrapper picks it by (``TILE64_SHARED``, ``WIDE_SHARED``).
The indexer's kernels have their own compile test (``tests/indexer/test_indexer_compile.py``). ptxas is the one Triton
itself uses for that arch (its bundled ``ptxas-blackwell`` unless TRITON_PTXAS_BLACKWELL_PATH is
set), else ``ptxas`` on PATH; without one the tests skip. Compilation runs in a subprocess because
conftest sets TRITON_INTERPRET=1 here, which replaces @triton.jit functions by interpreted ones.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from sparkinfer.attention.triton_decode import SHARED_OPTIN, TILE64_SHARED, WIDE_H, WIDE_SHARED, compile_specs

ARCHS = (120, 90)
# (name, arch): a spec with "archs" compiles for those only (its shared memory fits only there)
SPECS = [(s["name"], arch) for s in compile_specs() for arch in ARCHS if arch in s.get("archs", ARCHS)]

_SCRIPT = r"""
import json, re, subprocess, sys, tempfile
from concurrent.futures import ThreadPoolExecutor
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparkinfer.attention import triton_decode as td

ptxas = json.loads(sys.argv[1])

def ptxas_info(ptx, arch):
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([ptxas[str(arch)], "-v", f"-arch={target}", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(run.stderr)
    num = lambda pat: sum(int(x) for x in re.findall(pat, run.stderr))
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads")}

def compile_(name, fn, sig, constexprs, warps, stages, options, arch):
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, "num_stages": stages, **options})
    ptx = k.asm["ptx"]
    info = {"shared": k.metadata.shared, "mma": len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\b", ptx))}
    info.update(ptxas_info(ptx, arch))
    return f"{name}@{arch}", info

jobs = [(s["name"], s["fn"], s["signature"], s["constexprs"], s["num_warps"], s["num_stages"], s.get("options", {}),
         arch)
        for s in td.compile_specs() for arch in (120, 90) if arch in s.get("archs", (120, 90))]
with ThreadPoolExecutor(2) as pool:
    print(json.dumps(dict(pool.map(lambda j: compile_(*j), jobs))))
"""


def _ptxas_for(arch: int) -> str | None:
    """The ptxas Triton uses for this arch if it runs, else the toolkit's on PATH."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(arch).path
    except Exception:  # noqa: BLE001 - no NVIDIA backend or no bundled binary
        path = None
    for cand in (path, shutil.which("ptxas")):
        if cand and os.access(cand, os.X_OK) and subprocess.run([cand, "--version"], capture_output=True).returncode == 0:
            return cand
    return None


@pytest.fixture(scope="module")
def compiled():
    tools = {str(a): _ptxas_for(a) for a in ARCHS}
    if not all(tools.values()):
        pytest.skip(f"needs ptxas for sm_120 and sm_90 (found {tools})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(tools)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name, arch", SPECS)
def test_mla_kernels_fit_without_spills(compiled, name, arch):
    info = compiled[f"{name}@{arch}"]
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, f"{name} sm_{arch} spills: {info}"
    assert info["shared"] <= SHARED_OPTIN[arch], f"{name} sm_{arch}: {info['shared']} B shared memory"
    if name.startswith("sparse_mla_decode["):
        assert info["mma"] > 0, f"{name} sm_{arch}: no tensor-core MMA in the PTX"
        # the wrapper's thresholds hold what the compile needs: a device passing them runs the variant
        spec = next(s for s in compile_specs() if s["name"] == name)
        if spec["constexprs"]["BLOCK_K"] == 64:
            bound = WIDE_SHARED if spec["constexprs"]["BLOCK_H"] == WIDE_H else TILE64_SHARED
            assert info["shared"] <= bound, f"{name} sm_{arch}: {info['shared']} B > {bound}"

