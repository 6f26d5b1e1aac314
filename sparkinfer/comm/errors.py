"""The exchange's device-side error words, read one step late without a sync.

Inside a step nothing reads the device back (the forward is fixed-shape device work). The checks
that do run on the device leave words behind instead (layouts in ``csrc/include/sparkinfer/``):

* the pack / unpack / direct kernels' word (the fabric's ``move_err``, device int32, passed to every
  move of the exchange; ``comm.pack``): ``SI_ERR_RANGE`` (3, ``common.h``) once a kernel saw a
  record count outside ``[0, capacity]`` or an out-of-range request, ordinal, layer or slot (the
  record is skipped, never read or written out of bounds);
* the CUDA fabric's wait word (pinned host int32 the wait kernel stores into, ``comm_flags.cu``):
  ``SI_ERR_RANGE | (1 + peer) << 8`` once a device-side wait spun past ``timeout_s``;
* the host fabric: its copy thread's failure and the peers' abort words (``core/slab.py``).

``StepChecks.end_step()`` (after a step's last layer) copies the device words into pinned host
memory with ``non_blocking`` copies and records an event; ``poll()`` (the next step, before it
plans anything) reads them: by then the copies are long done, so the event wait returns at once
and nothing drains the GPU queue mid-step. A set word raises :class:`DeviceCheckFailed` naming
the check, and the engine stops there rather than serve the next step on top of a wrong one.
"""

from __future__ import annotations

import torch

SI_ERR_RANGE = 3  # common.h si_status


class DeviceCheckFailed(RuntimeError):
    """A device-side check of the exchange failed in an earlier step."""


def describe(name: str, code: int) -> str:
    """The meaning of a set error word ``code`` of check ``name``."""
    status, peer = code & 0xFF, (code >> 8) - 1
    if name == "wait":
        return f"a device-side wait timed out (missing peer {peer}): the step's records never all arrived"
    if status == SI_ERR_RANGE:
        return ("a record count outside [0, capacity] or an out-of-range request / ordinal / layer / slot index: "
                "the records were skipped, the step's attention read an incomplete workspace")
    return f"status {status}"


class StepChecks:
    """One rank's error words of the exchange on ``fabric`` (see the module docstring)."""

    def __init__(self, fabric):
        self.fabric = fabric
        self.steps = 0  # steps whose words were read
        self._pending = False
        self._words: list[tuple[str, torch.Tensor]] = []
        if fabric.move_err is not None:  # the CUDA fabric's; the host fabric's moves raise at once
            self._words = [("pack", fabric.move_err)]
            self._host = torch.zeros(len(self._words), dtype=torch.int32).pin_memory()
            self._event = torch.cuda.Event()

    def end_step(self) -> None:
        """Queue the copies of this step's device words (after its last kernel; no wait)."""
        for i, (_, word) in enumerate(self._words):
            self._host[i: i + 1].copy_(word, non_blocking=True)
        if self._words:
            self._event.record()
        self._pending = True

    def poll(self) -> None:
        """Raise DeviceCheckFailed if a check of an earlier step failed (no device sync)."""
        rank = self.fabric.rank
        try:
            self.fabric.poll()  # host-side words: the pinned wait word, the copy thread, the abort words
        except RuntimeError as e:
            raise DeviceCheckFailed(f"rank {rank}: the exchange failed in an earlier step: {e}") from e
        if not self._pending:
            return
        self._pending = False
        self.steps += 1
        if not self._words:
            return
        self._event.synchronize()  # recorded a step ago: already complete
        for (name, _), code in zip(self._words, self._host.tolist()):
            if code:
                raise DeviceCheckFailed(f"rank {rank}: device check '{name}' failed in an earlier step: "
                                        f"{describe(name, code)}; the engine stops instead of serving wrong tokens")
