"""Everything a worker process keeps between steps, in one object: ``WorkerRuntime``.

One per engine of a worker, made by its first sparkinfer attention impl and held by its attention
layers (``sparkinfer.vllm.worker_runtime``), filled in at engine start
(``sparkinfer.vllm.engine_start``). The adapter hands it to what uses it: the metadata builders and
the attention impl keep it from their construction, the metadata they build carries it into a
layer's forward. Nothing below it looks it up; a direct caller (a test, a benchmark) makes its own
or passes none and gets tensors of its own.

=====================  =========================================================================
field                  what it holds
=====================  =========================================================================
``checks``             the device error words the forward's checks set, polled a step later
                       (``device_checks``)
``arena``              the attention arena: the forward's outputs and scratch, reserved at engine
                       start out of the KV memory (``layer_buffers``)
``topk_workspace``     the indexer's batched top-k workspace, shared by the worker's indexer
                       builders (``indexer.TopkWorkspace``)
``merge``              the sharded indexer's merge buffers, shared the same way (``indexer.MergeBuffers``)
``selected``           the selected-record path's executor (``sparkinfer.vllm.selected_runtime``);
                       None where the engine never takes that path
``request_ids``        the ids of the step whose metadata is being built (patch 0008 records them:
                       ``sparkinfer.vllm.step_requests``)
``graph_line_logged``  whether the worker's one line on CUDA graphs was logged (``impls``)
``graphs``             the path and indexer scoring each FULL CUDA graph was captured on, the step's,
                       and the steps that ran without their graph (``graph_paths.GraphPaths``)
``counts``             what the forwards did, counted on the host (indexer calls per scoring way:
                       ``indexer:replicated``, ``indexer:sharded``); no step reads them, tests and
                       benchmarks do (``LLM.collective_rpc``)
=====================  =========================================================================
"""

from __future__ import annotations

from collections import Counter

from sparkinfer import native
from sparkinfer.attention import interpret
from sparkinfer.decode.device_checks import DeviceChecks
from sparkinfer.decode.graph_paths import GraphPaths
from sparkinfer.decode.layer_buffers import AttentionArena


class WorkerRuntime:
    def __init__(self, device):
        interpret.install()  # under TRITON_INTERPRET=1 (the GPU kernels forced on CPU): helpers skip Triton's re-patch
        self.device = native.device_key(device)
        self.checks = DeviceChecks(self.device)
        self.arena = AttentionArena(self.device)
        self.topk_workspace = None
        self.merge = None
        self.selected = None
        self.request_ids: list | None = None
        self.graph_line_logged = False
        self.graphs = GraphPaths()  # the captured FULL graphs' choices and this step's (decode.graph_paths)
        self.counts = Counter()  # what the forwards did (ForwardStep.counts)

    def topk_workspace_of(self, nbytes: int):
        """The indexer's top-k workspace of at least ``nbytes`` (kept: every builder of the worker asks
        for the same engine-wide size, and one call runs at a time)."""
        from sparkinfer.indexer import TopkWorkspace

        if self.topk_workspace is None or 8 * self.topk_workspace.buffer.numel() < nbytes:
            self.topk_workspace = TopkWorkspace(nbytes, self.device)
        return self.topk_workspace

    def merge_of(self, world: int, rows: int, k: int):
        """The sharded merge's buffers for ``rows`` rows of ``world`` ranks' top-``k`` (kept, as the workspace)."""
        from sparkinfer.indexer import MergeBuffers

        held = self.merge
        if held is None or (held.world, held.k) != (world, k) or held.rows < rows:
            held = self.merge = MergeBuffers(world, rows, k, self.device)
        return held

    def step_request_ids(self, num_reqs: int) -> list | None:
        """The step's request ids, or None when they do not describe ``num_reqs`` requests (dummy and
        capture runs, whose rows are not requests)."""
        ids = self.request_ids
        if ids is None or len(ids) < num_reqs or any(i is None for i in ids[:num_reqs]):
            return None
        return ids[:num_reqs]
