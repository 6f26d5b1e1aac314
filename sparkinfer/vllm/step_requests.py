"""The request ids of the step whose attention metadata is being built (set by patch 0008).

vLLM's attention metadata carries no request identity, and a batch row is not one (the persistent
batch reorders rows). The replica rule keys each request's store slot by its id, which vLLM never
reuses for another request, so patched ``GPUModelRunner._build_attention_metadata`` (the CPU runner
inherits it) records ``input_batch.req_ids`` in its engine's runtime (``WorkerRuntime.request_ids``)
for the builders of that step. Torch-free at import.
"""

from __future__ import annotations

from sparkinfer.vllm import worker_runtime


def set_request_ids(runner, ids) -> None:
    """Record the step's ids (None: a capture run) in the runtime of ``runner``'s engine (the model
    runner patch 0008 calls from); an engine without one (no sparkinfer layer) has nothing to key."""
    rt = worker_runtime.of_engine(runner.vllm_config)
    if rt is not None:
        rt.request_ids = None if ids is None else list(ids)
