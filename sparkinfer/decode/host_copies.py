"""vLLM's host-side copies of its step metadata (``*_cpu``), read without a device sync.

On a GPU node these are pinned host memory, so reading them costs no sync; ``host_array`` refuses a
tensor that is not on the CPU, so a device tensor can never pass for host data here. The host-read
probe (``sparkinfer.testing.host_reads``) books reads made through it, by its name, as ``host``.
"""

from __future__ import annotations

import torch


def host_array(t: torch.Tensor):
    """numpy view of one of vLLM's host-side copies (``*_cpu``): refused for a tensor not on the CPU,
    so that on a GPU node a device tensor can never pass for host data here."""
    if t.device.type != "cpu":
        raise ValueError(f"host_array takes vLLM's host-side copies only, got a tensor on {t.device}")
    return t.numpy()
