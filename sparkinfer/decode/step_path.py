"""Per-step path inside vLLM: stock DCP decode or selected records (torch-free).

``StepPath.choose`` applies the gates below in order; the first that applies decides, and each
reason is logged once per process (a serving engine takes this decision every step):

1. ``mode`` stock                               -> stock
2. DCP size 1                                   -> stock: every record is local
3. a cache dtype that is not a record format (368/432/656 B) -> stock: the exchange moves
   fixed-width records
4. rows not uniform (a prefill chunk in the batch, or requests with different numbers of
   speculative rows: the union assumes R rows per request) -> a gathered step (every rank gets
   each request's whole cached prefix, see ``selected_decode.py``) when its ``B x T`` rows
   (T = the longest context + rows) fit the workspace (``gather_rows``) and, in ``auto``, when it
   moves strictly fewer bytes into the busiest rank than stock DCP's query gather and output
   reduce-scatter for the same rows (``accounting.gathered_layer`` vs ``stock_dcp_layer``; a
   cold prefill moves none). Otherwise stock. The byte rule is exact, not a model: both paths do
   the same attention FLOPs (H/N heads over all top-k tokens vs H heads over a 1/N share)
5. more requests than the decoder's workspace holds (``max_batch``, sized from ``pool_mb``) -> stock
   (every record local through replicas: decode rows -> local, rows not uniform -> gathered
   when they fit the workspace, in every mode but stock: the step runs no exchange and no
   collective, which no stock step can beat)
6. otherwise ``StepPolicy.decide`` (mode selected: selected whenever its workspace fits; auto: the
   cost model of the node profile). Without a profile for this node and DCP size, ``auto`` is
   stock: prior measurements show stock DCP winning wherever selected records move more bytes,
   so the system never guesses in favour of the path that can lose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Sequence

from sparkinfer.config import SparkinferConfig
from sparkinfer.core.accounting import StockDcpShape, gathered_layer, stock_dcp_layer
from sparkinfer.core.policy import StepPolicy
from sparkinfer.core.topology import DcpLayout

log = logging.getLogger(__name__)

# A step's paths. Each launches its own kernels, so a CUDA graph captured on one replays only steps of
# that path (docs/design/cuda-graphs.md): "stock" (vLLM's DCP decode), "selected" (decode rows over
# exchanged records), "local" (decode rows whose records are all in the replica store: the selected
# kernels without the exchange) and "gather" (rows not uniform: each request's whole prefix).
PATHS = ("stock", "selected", "local", "gather")


@dataclass(frozen=True)
class StepChoice:
    path: str  # one of PATHS
    depth: int  # prefetch depth for selected / local / gather, 0 for stock
    reason: str


class StepPath:
    def __init__(self, config: SparkinferConfig, *, dcp: int, record_format: bool, rows: int, max_batch: int,
                 policy: StepPolicy | None = None, gather_rows: int = 0, layout: DcpLayout | None = None,
                 record_bytes: int = 0, stock: StockDcpShape | None = None):
        """``record_format``: the main cache holds sparkinfer records; ``rows``: 1 + speculative
        tokens; ``policy``: a StepPolicy for this node and DCP size built with ``mode=config.mode``,
        or None when no profile describes it. Gathered steps: ``gather_rows`` workspace rows (0:
        never), and for ``auto``'s byte rule the records' ``layout`` and ``record_bytes`` and the
        ``stock`` DCP exchange's shape (its ``rows`` is replaced by the step's)."""
        if rows < 1 or max_batch < 0 or gather_rows < 0:
            raise ValueError(f"rows must be >= 1, max_batch and gather_rows >= 0, got rows={rows}, "
                             f"max_batch={max_batch}, gather_rows={gather_rows}")
        if gather_rows and (layout is None or layout.world_size != dcp or record_bytes < 1 or stock is None):
            raise ValueError(f"gathered steps need the DCP {dcp} layout, record_bytes and the stock exchange shape")
        self.config, self.dcp, self.record_format = config, dcp, record_format
        self.rows, self.max_batch, self.policy = rows, max_batch, policy
        self.gather_rows, self.layout, self.record_bytes, self.stock = gather_rows, layout, record_bytes, stock
        self._logged: set[str] = set()

    def _stock(self, reason: str) -> StepChoice:
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("sparkinfer: stock DCP decode (%s)", reason)
        return StepChoice("stock", 0, reason)

    def choose(self, query_lens: Sequence[int], contexts: Sequence[int], all_local: bool = False,
               fetched_below: Sequence[int] | None = None) -> StepChoice:
        """``query_lens``: rows per request this step; ``contexts``: tokens before them;
        ``all_local``: every request's context is in the replica store (the step moves nothing);
        ``fetched_below``: per request, the replica store holds positions from there to the
        context, so a gathered step fetches only the remote ones below it (None: all of them)."""
        if len(query_lens) != len(contexts):
            raise ValueError(f"{len(query_lens)} query lengths but {len(contexts)} contexts")
        mode = self.config.mode
        if mode == "stock":
            return self._stock("mode stock")
        if self.dcp == 1:
            return self._stock("DCP size 1: every record is local")
        if not self.record_format:
            return self._stock("the KV cache dtype is not a record format (nvfp4_368 / nvfp4_432 / fp8_ds_mla)")
        if not query_lens:
            return StepChoice("stock", 0, "empty step")
        if any(q != self.rows for q in query_lens):
            return self._gather_or_stock(query_lens, contexts, all_local, fetched_below)
        if len(query_lens) > self.max_batch:
            return self._stock(f"more than {self.max_batch} requests: the selected workspace (pool_mb "
                               f"{self.config.pool_mb}) does not hold them")
        if all_local:  # no exchange, no collective: strictly cheaper than stock's per-layer a2a
            return StepChoice("local", self.config.prefetch_depth, "every record local (replicas)")
        if self.policy is None:
            if mode == "selected":
                return StepChoice("selected", self.config.prefetch_depth, "mode selected")
            return self._stock("auto without a cost-model profile for this node")
        d = self.policy.decide(list(query_lens), list(contexts))
        if d.path == "stock":
            return self._stock(d.reason)
        return StepChoice("selected", d.depth, d.reason)

    def _gather_or_stock(self, query_lens: Sequence[int], contexts: Sequence[int], all_local: bool,
                         fetched_below: Sequence[int] | None) -> StepChoice:
        if not self.gather_rows:
            return self._stock(f"a request without exactly {self.rows} rows (prefill, or fewer speculative tokens)")
        longest = max(c + q for c, q in zip(contexts, query_lens))
        if len(query_lens) * longest > self.gather_rows:
            return self._stock(f"a gathered step (rows not uniform) larger than the workspace's {self.gather_rows} "
                               f"rows (pool_mb {self.config.pool_mb})")
        if self.config.mode == "selected":
            return StepChoice("gather", self.config.prefetch_depth, "mode selected, rows not uniform")
        if all_local:
            return StepChoice("gather", self.config.prefetch_depth, "every record local (replicas)")
        # positions [fetched_below, context) are replicas: the gather moves the remote ones below
        gathered = gathered_layer(contexts if fetched_below is None else fetched_below, self.layout,
                                  self.record_bytes).rx.max()
        stock = stock_dcp_layer(replace(self.stock, rows=sum(query_lens))).rx.max()
        if gathered < stock:
            return StepChoice("gather", self.config.prefetch_depth,
                              f"gathered prefix {gathered} B < stock DCP {stock} B into the busiest rank")
        return self._stock("a gathered step would move no fewer bytes than stock DCP")
