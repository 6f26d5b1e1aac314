"""Checks of device values on the hot path: an error flag written on the device, read a step later.

A layer's forward must not read tensors back to the host (each read drains the GPU queue), so the
checks of values that live on the device (a top-k position past the request's blocks, a latent
that is not finite) do not raise where they are made: each one ORs its verdict into its word of
``flags`` (int32 ``[len(CHECKS)]`` on the device) with torch ops, and the metadata build of a later
step (``poll``) looks at a pinned host copy of the words issued one step earlier (``non_blocking``,
ordered after that step's kernels by the stream; an event says when it landed). A set word
raises ``DeviceCheckError`` naming the check and the fix, which fails the engine: nothing after it
is served from a wrong answer. On CPU the copy is immediate and the behaviour is the same.

Each worker holds one (``runtime.WorkerRuntime.checks``); the sparkinfer backend's metadata builder
polls it once per step.
"""

from __future__ import annotations

import torch

from sparkinfer.decode.host_copies import host_array

# check name -> what it means and what to do about it
CHECKS = {
    "topk_position": "a top-k position lies beyond its request's blocks or below -1 (the indexer's output is "
                     "corrupt or the block table is short)",
    "record_values": "a latent, rope or indexer key handed to the cache write is NaN or infinite (records hold "
                     "finite values only: check the model's activations)",
    "cache_slots": "a cache write's slot lies outside the cache, or a written slot lies in vLLM's null block 0 "
                   "(the slot mapping or block table is corrupt)",
    "indexer_inputs": "the indexer's q or weights are NaN or infinite (a NaN score has no place in a top-k)",
    "selected_topk": "the selected path's top-k holds an id below -1",
}
_INDEX = {name: i for i, name in enumerate(CHECKS)}
_CHECKED_DTYPES = (torch.float32, torch.bfloat16)  # what the check kernel reads


class DeviceCheckError(RuntimeError):
    """A device-side check of an earlier step failed."""


class DeviceChecks:
    def __init__(self, device):
        from sparkinfer.decode.impls import kernel_backend

        self.device = torch.device(device)
        self.backend = kernel_backend(self.device)  # the checks' kernels: triton | torch
        self.flags = torch.zeros(len(CHECKS), dtype=torch.int32, device=self.device)
        self._words = {name: self.flags[i:i + 1] for name, i in _INDEX.items()}
        self._any = torch.zeros((), dtype=torch.bool, device=self.device)
        self._sum = torch.zeros((), dtype=torch.float32, device=self.device)
        pinned = self.device.type == "cuda"
        self._host = torch.zeros(len(CHECKS), dtype=torch.int32, pin_memory=pinned)
        self._host_words = host_array(self._host)  # shares the pinned memory: reading it is not a tensor read
        self._event = None
        self._issued = False

    def word(self, name: str) -> torch.Tensor:
        """Check ``name``'s word, int32 [1] on the device: what a kernel ORs its verdict into."""
        return self._words[name]

    def flag(self, name: str, bad: torch.Tensor) -> None:
        """OR ``bad.any()`` (a bool tensor of any shape, on the device) into check ``name``'s word,
        through a preallocated scalar: no temporary."""
        torch.any(bad, out=self._any)
        self.word(name).bitwise_or_(self._any)

    def flag_nonfinite(self, name: str, t: torch.Tensor) -> None:
        """OR "``t`` holds a NaN or an infinity" into check ``name``'s word: one kernel on the Triton backend
        (``triton_paging.flag_nonfinite``, for a [N, D] fp32 / bf16 tensor with a contiguous last dim);
        its torch twin goes through preallocated scalars: the fp32 sum of ``t`` times 0 is NaN exactly
        when a term is not finite (or the sum overflows, past 3e38: no finite activation comes near),
        and NaN is the one value unequal to itself."""
        if self.backend == "triton" and t.dim() == 2 and t.stride(-1) == 1 and t.dtype in _CHECKED_DTYPES:
            from sparkinfer.attention import triton_paging

            triton_paging.flag_nonfinite(t, self._words[name])
            return
        torch.sum(t, dim=tuple(range(t.dim())), dtype=torch.float32, out=self._sum)
        self._sum.mul_(0)
        torch.ne(self._sum, self._sum, out=self._any)
        self.word(name).bitwise_or_(self._any)

    def poll(self) -> None:
        """Raise for a word set before the copy issued at the previous poll; then issue the next copy."""
        if self._issued:
            if self._event is not None:
                self._event.synchronize()  # issued a step ago: long done
            bad = [name for name, i in _INDEX.items() if self._host_words[i]]
            if bad:
                raise DeviceCheckError("sparkinfer device check failed in an earlier step: " + "; ".join(
                    f"{name}: {CHECKS[name]}" for name in bad))
        self._host.copy_(self.flags, non_blocking=True)
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._issued = True

