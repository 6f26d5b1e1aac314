"""Per-step path inside vLLM: stock DCP decode or selected records (torch-free).

``StepPath.choose`` applies the gates below in order; the first that applies decides, and each
reason is logged once per process (a serving engine takes this decision every step):

1. ``mode`` stock                               -> stock
2. DCP size 1                                   -> stock: every record is local
3. a cache dtype that is not a sparkinfer record format (368/432 B) -> stock: the exchange moves
   fixed-width records
4. rows not uniform: a prefill chunk in the batch, or requests with different numbers of
   speculative rows (the union and the workspace assume R rows per request) -> stock
5. more requests than the decoder's workspace holds (``max_batch``, sized from ``pool_mb``) -> stock
6. otherwise ``StepPolicy.decide`` (mode selected: selected whenever its workspace fits; auto: the
   cost model of the node profile). Without a profile for this node and DCP size, ``auto`` is
   stock: prior measurements show stock DCP winning wherever selected records move more bytes,
   so the system never guesses in favour of the path that can lose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from sparkinfer.config import SparkinferConfig
from sparkinfer.core.policy import StepPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepChoice:
    path: str  # "stock" or "selected"
    depth: int  # prefetch depth for selected, 0 for stock
    reason: str


class StepPath:
    def __init__(self, config: SparkinferConfig, *, dcp: int, record_format: bool, rows: int, max_batch: int,
                 policy: StepPolicy | None = None):
        """``record_format``: the main cache holds sparkinfer records; ``rows``: 1 + speculative
        tokens; ``policy``: a StepPolicy for this node and DCP size built with ``mode=config.mode``,
        or None when no profile describes it."""
        if rows < 1 or max_batch < 0:
            raise ValueError(f"rows must be >= 1 and max_batch >= 0, got rows={rows}, max_batch={max_batch}")
        self.config, self.dcp, self.record_format = config, dcp, record_format
        self.rows, self.max_batch, self.policy = rows, max_batch, policy
        self._logged: set[str] = set()

    def _stock(self, reason: str) -> StepChoice:
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("sparkinfer: stock DCP decode (%s)", reason)
        return StepChoice("stock", 0, reason)

    def choose(self, query_lens: Sequence[int], contexts: Sequence[int]) -> StepChoice:
        """``query_lens``: rows per request this step; ``contexts``: tokens before them."""
        if len(query_lens) != len(contexts):
            raise ValueError(f"{len(query_lens)} query lengths but {len(contexts)} contexts")
        mode = self.config.mode
        if mode == "stock":
            return self._stock("mode stock")
        if self.dcp == 1:
            return self._stock("DCP size 1: every record is local")
        if not self.record_format:
            return self._stock("the KV cache dtype is not a sparkinfer record format (nvfp4_368 / nvfp4_432)")
        if not query_lens:
            return StepChoice("stock", 0, "empty step")
        if any(q != self.rows for q in query_lens):
            return self._stock(f"a request without exactly {self.rows} rows (prefill, or fewer speculative tokens)")
        if len(query_lens) > self.max_batch:
            return self._stock(f"more than {self.max_batch} requests: the selected workspace (pool_mb "
                               f"{self.config.pool_mb}) does not hold them")
        if self.policy is None:
            if mode == "selected":
                return StepChoice("selected", self.config.prefetch_depth, "mode selected")
            return self._stock("auto without a cost-model profile for this node")
        d = self.policy.decide(list(query_lens), list(contexts))
        if d.path == "stock":
            return self._stock(d.reason)
        return StepChoice("selected", d.depth, d.reason)
