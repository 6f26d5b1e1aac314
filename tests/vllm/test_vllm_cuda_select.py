"""Patch 0007 checked on a CPU box: vLLM's own CUDA backend selection (priorities and each
backend's ``validate_configuration``) picks the sparkinfer backend on sm_12x for DSA models.

``vllm/platforms/cuda.py`` imports the compiled extension only to register its ops, so the check
runs in a subprocess with that one module stubbed and the device capability faked; everything
else is vLLM's code. Backends whose imports need CUDA report themselves unavailable, as vLLM
does on a machine without them.
"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

SCRIPT = r"""
import json, sys, types
import torch
sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
from vllm.platforms.cuda import CudaPlatform, _get_backend_priorities
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.selector import AttentionSelectorConfig
from sparkinfer.vllm.platforms import BACKEND_NAME

out = {}
for name, major, kv, sparse in json.loads(sys.argv[1]):
    cap = DeviceCapability(major, 0)
    CudaPlatform.get_device_capability = classmethod(lambda cls, device_id=0, cap=cap: cap)
    cfg = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype=kv, block_size=64,
                                  use_mla=True, use_sparse=sparse, use_dcp=True)
    valid, invalid = CudaPlatform.get_valid_backends(cap, cfg, num_heads=16)
    try:
        chosen = CudaPlatform.get_attn_backend_cls(None, cfg, num_heads=16)
    except ValueError as e:
        chosen = "error: " + str(e)[:200]
    ours = [reasons for b, (_, reasons) in invalid.items() if b.name == BACKEND_NAME]
    out[name] = {"chosen": chosen, "priorities": [b.name for b in _get_backend_priorities(True, cap)],
                 "our_reasons": ours[0] if ours else None}
print("RESULT" + json.dumps(out))
"""

CASES = [
    ("sm120_368", 12, "nvfp4_ds_mla:fp8-rope-368", True),
    ("sm120_432", 12, "nvfp4_ds_mla:bf16-rope-432", True),
    ("sm120_auto", 12, "auto", True),
    ("sm121_368", 12, "nvfp4_ds_mla:fp8-rope-368", True),
    ("sm120_dense_mla", 12, "auto", False),
    ("sm120_fp8_ds_mla", 12, "fp8_ds_mla", True),
    ("sm120_fp8_per_token_head", 12, "fp8_per_token_head", True),
    ("sm90_368", 9, "nvfp4_ds_mla:fp8-rope-368", True),
]


@pytest.fixture(scope="module")
def selection():
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True, text=True,
                         timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[0][len("RESULT"):])


@pytest.mark.parametrize("case", ["sm120_368", "sm120_432", "sm120_auto", "sm121_368", "sm120_fp8_ds_mla"])
def test_dsa_models_on_sm12x_get_the_sparkinfer_backend(selection, case):
    from sparkinfer.vllm.platforms import BACKEND_NAME, BACKEND_PATH

    assert selection[case]["chosen"] == BACKEND_PATH
    assert selection[case]["priorities"][0] == BACKEND_NAME  # then upstream's order, unchanged
    assert selection[case]["priorities"][1:] == ["TRITON_MLA", "FLASHINFER_MLA_SPARSE_SM120"]


def test_dense_mla_models_on_sm12x_keep_upstream_choice(selection):
    from sparkinfer.vllm.platforms import BACKEND_PATH

    case = selection["sm120_dense_mla"]
    assert case["chosen"] != BACKEND_PATH
    assert "non-sparse not supported" in case["our_reasons"]


def test_formats_the_backend_cannot_read_are_refused(selection):
    """fp8 per-token-head is not a record format: vLLM's next backend is chosen."""
    from sparkinfer.vllm.platforms import BACKEND_PATH

    case = selection["sm120_fp8_per_token_head"]
    assert case["chosen"] != BACKEND_PATH and "kv_cache_dtype not supported" in case["our_reasons"]


def test_other_capabilities_keep_upstream_priorities(selection):
    from sparkinfer.vllm.platforms import BACKEND_NAME

    assert BACKEND_NAME not in selection["sm90_368"]["priorities"]
