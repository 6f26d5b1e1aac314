"""A destination rank's reuse pool: the remote records it received in earlier steps.

``pool`` uint8 [capacity, W] (one row per record, any layer); which row holds what is decided by
``sparkinfer.core.reuse.ReuseTracker``, replicated on every rank, so no rank ever asks another what
it holds. Per layer of a step:

* ``fill``: union records this rank holds (tracker ``slots``) are copied from the pool into the
  workspace rows ``b * U + u`` the exchange did not write;
* ``store``: after the step's acceptance, ``tracker.commit`` says which received records become
  reusable and in which rows; they are copied from the step's workspace into the pool.
"""

from __future__ import annotations

import numpy as np
import torch


class ReusePool:
    def __init__(self, rank: int, capacity: int, width: int):
        self.rank = rank
        self.rows = torch.zeros(capacity, width, dtype=torch.uint8)

    def fill(self, workspace: torch.Tensor, slots: np.ndarray, rows_mask: np.ndarray) -> int:
        """Copy held records into ``workspace`` uint8 [B*U, W] where ``rows_mask`` (bool [B, U]);
        ``slots`` int64 [B, U] is the tracker's pool row of this rank's records. Returns rows copied."""
        b, u = np.nonzero(rows_mask)
        if len(b) == 0:
            return 0
        src = slots[b, u]
        if (src < 0).any():
            raise RuntimeError(f"rank {self.rank}: reuse pool asked for {int((src < 0).sum())} records "
                               "it does not hold")
        U = slots.shape[1]
        workspace[torch.from_numpy(b * U + u)] = self.rows[torch.from_numpy(src)]
        return len(b)

    def store(self, workspace: torch.Tensor, stored, union_width: int) -> int:
        """Copy the records ``commit`` assigned to this rank (``(b, u, slot)`` arrays) from ``workspace``."""
        b, u, slot = stored
        if len(b):
            self.rows[torch.from_numpy(slot)] = workspace[torch.from_numpy(b * union_width + u)]
        return len(b)
