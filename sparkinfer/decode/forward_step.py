"""What a layer's forward needs in one step, resolved once by the metadata build: ``ForwardStep``.

The forward entries (``paged_sparse_mla.attend``, ``forward_cache_rows``, ``forward_write_records``,
``forward_scatter_rows``) take it and only launch kernels: the kernel backend is chosen, the
buffers are the worker's (``runtime.WorkerRuntime``), and the step's inputs were made by the build,
so nothing is validated there; checks of device values OR into ``checks`` and raise a step later
(``device_checks``). Direct callers use the public functions beside them, which validate their
arguments on the host and allocate what they return.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from sparkinfer.decode.device_checks import DeviceChecks
from sparkinfer.decode.layer_buffers import AttentionArena


@dataclass(frozen=True)
class ForwardStep:
    backend: str  # the kernels' backend for the step's caches (``impls.kernel_backend``): triton | torch
    checks: DeviceChecks  # where the forward's checks of device values go
    arena: AttentionArena  # the forward's outputs and scratch, consumed before the next layer's
    token_req: torch.Tensor | None = None  # int64 [T] on the caches' device: each row's request
    block_table: torch.Tensor | None = None  # int32 [R, B]: the step's block table
    interleave: int = 1  # the DCP interleave of the records
    # the step's attention plans (``layer_buffers.AttentionPlan``) by shape: made by its first layer, used by the rest
    plans: dict = field(default_factory=dict, compare=False, repr=False)
    # the worker's counts of what its forwards did (``WorkerRuntime.counts``); a direct caller's step its own
    counts: Counter = field(default_factory=Counter, compare=False, repr=False)

    @classmethod
    def of(cls, runtime, **inputs) -> "ForwardStep":
        """The step over ``runtime``'s buffers (a ``WorkerRuntime``), its kernels chosen for its device."""
        from sparkinfer.decode.impls import kernel_backend

        return cls(kernel_backend(runtime.device), runtime.checks, runtime.arena, counts=runtime.counts, **inputs)
