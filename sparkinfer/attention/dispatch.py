"""Backend choice shared by sparkinfer.attention and sparkinfer.indexer.

"triton" runs the kernel (on CPU only under TRITON_INTERPRET=1, which must be
set before the kernel module is imported); "torch" the reference; "auto" the
kernel on a GPU or under the interpreter, else the reference (logged once per
caller, since a silent switch to a slow path is a surprise in a benchmark).
``calls`` counts every resolution per ``"<caller>:<backend>"`` in this process: what a test reads
to prove which implementation really ran (``sparkinfer.decode.impls.probe_counts``).
"""

from __future__ import annotations

import logging
import os
from collections import Counter

log = logging.getLogger(__name__)
_logged: set[str] = set()
calls: Counter = Counter()


def pick_backend(backend: str, on_cuda: bool, what: str) -> str:
    """Resolve backend ("auto" | "triton" | "torch") for tensors on CUDA or not; ``what`` names the caller."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":
        backend = "triton" if on_cuda or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
        if backend == "torch" and what not in _logged:
            log.info("%s: CPU tensors without TRITON_INTERPRET=1, using the torch reference", what)
            _logged.add(what)
    calls[f"{what}:{backend}"] += 1
    return backend
