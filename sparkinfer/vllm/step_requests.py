"""The request ids of the step whose attention metadata is being built (set by patch 0008).

vLLM's attention metadata carries no request identity, and a batch row is not one (the persistent
batch reorders rows). The replica rule keys each request's store slot by its id, which vLLM never
reuses for another request, so patched ``GPUModelRunner._build_attention_metadata`` (the CPU runner
inherits it) records ``input_batch.req_ids`` here for the builders of that step. Torch-free.
"""

from __future__ import annotations

_ids: list = [None]


def set_request_ids(ids) -> None:
    _ids[0] = None if ids is None else list(ids)


def request_ids(num_reqs: int) -> list | None:
    """The step's ids, or None when they do not describe ``num_reqs`` requests (dummy and capture
    runs, whose rows are not requests)."""
    ids = _ids[0]
    if ids is None or len(ids) < num_reqs or any(i is None for i in ids[:num_reqs]):
        return None
    return ids[:num_reqs]
