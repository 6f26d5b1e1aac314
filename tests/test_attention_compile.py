"""Compile the Triton kernels for the real GPUs without one (ptxas from the CUDA toolkit).

The interpreter cannot tell whether a kernel fits the hardware: sm_120 (RTX PRO
6000) gives a block at most 99 KB of shared memory (sm_90 gives 227 KB, so sm_120 binds).
These tests compile the sparse MLA decode kernel (all three record formats)
and the indexer scoring kernel with the launch configuration the wrappers use,
and check the shared-memory footprint. Compilation runs in a subprocess
because conftest sets TRITON_INTERPRET=1 here, which replaces @triton.jit
functions by interpreted ones.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

MAX_SHARED = {120: 99 * 1024}
CASES = [("mla", 120, 0), ("mla", 120, 1), ("mla", 120, 2), ("indexer", 120, 0)]

_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparkinfer.attention import triton_decode as td
from sparkinfer.indexer import triton_scores as ts

def compile_(fn, types, constexprs, arch, warps, stages):
    sig = {n: types(n) for n in fn.arg_names if n not in constexprs}
    sig.update({n: "constexpr" for n in constexprs})
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return {"shared": k.metadata.shared, "cubin": len(k.asm["cubin"])}

mla_ptrs = {"rec_ptr": "*u8", "idx_ptr": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32"}
mla_types = lambda n: (mla_ptrs.get(n, "*bf16") if n.endswith("_ptr")
                       else "fp32" if n in ("scale", "outer_scale") else "i32")
idx_ptrs = {"rec_ptr": "*u8", "slot_ptr": "*i64", "pos_ptr": "*i64"}
idx_types = lambda n: idx_ptrs.get(n, "*fp32") if n.endswith("_ptr") else "i32"
out = {}
for kind, arch, fmt in json.loads(sys.argv[1]):
    if kind == "mla":
        c = {"FMT": fmt, "BLOCK_H": td.BLOCK_H, "BLOCK_K": td.BLOCK_K, "DOT_PRECISION": "ieee"}
        out[f"{kind}-{arch}-{fmt}"] = compile_(td._sparse_mla_decode_kernel, mla_types, c, arch,
                                               td.NUM_WARPS, td.NUM_STAGES)
    else:
        c = {"HAS_SLOTS": True, "HAS_POS": True, "BLOCK_T": ts.BLOCK_T}
        out[f"{kind}-{arch}-{fmt}"] = compile_(ts._indexer_scores_kernel, idx_types, c, arch, ts.NUM_WARPS, 1)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    if shutil.which("ptxas") is None and not os.environ.get("TRITON_PTXAS_PATH"):
        pytest.skip("needs ptxas (CUDA toolkit)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind,arch,fmt", CASES)
def test_kernel_compiles_and_fits_shared_memory(compiled, kind, arch, fmt):
    info = compiled[f"{kind}-{arch}-{fmt}"]
    assert info["cubin"] > 0
    assert info["shared"] <= MAX_SHARED[arch], f"{kind} sm_{arch}: {info['shared']} B shared memory"
