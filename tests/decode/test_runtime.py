"""The worker's runtime (sparkinfer/decode/runtime.py): the indexer buffers its builders share are kept
while they fit and replaced when a builder needs more or another shape; the step's request ids are
given only for real requests."""

import torch

from sparkinfer.decode.runtime import WorkerRuntime


def test_shared_indexer_buffers_are_kept_while_they_fit():
    rt = WorkerRuntime("cpu")
    assert rt.device == torch.device("cpu") and rt.checks.device == rt.device and rt.arena.held_bytes() == 0
    ws = rt.topk_workspace_of(1 << 12)
    assert rt.topk_workspace_of(1 << 12) is ws and rt.topk_workspace_of(1 << 10) is ws  # a second builder's ask
    bigger = rt.topk_workspace_of(1 << 16)
    assert bigger is not ws and 8 * bigger.buffer.numel() >= 1 << 16
    merge = rt.merge_of(2, 8, 16)
    assert rt.merge_of(2, 4, 16) is merge  # fewer rows fit
    assert rt.merge_of(2, 9, 16) is not merge  # more rows do not
    assert rt.merge_of(4, 9, 16).world == 4 and rt.merge_of(4, 9, 32).k == 32  # another group or top-k


def test_request_ids_describe_only_real_requests():
    rt = WorkerRuntime("cpu")
    assert rt.step_request_ids(1) is None
    rt.request_ids = ["a", "b"]
    assert rt.step_request_ids(2) == ["a", "b"] and rt.step_request_ids(1) == ["a"]
    assert rt.step_request_ids(3) is None
