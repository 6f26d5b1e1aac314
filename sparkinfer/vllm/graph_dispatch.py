"""The runner's hook before a step runs (patch 0008): a FULL CUDA graph replays only the path it was
captured on (``decode.graph_paths``).

vLLM dispatches a step to a captured graph by its padded batch shape alone (``CudagraphDispatcher``:
a ``BatchDescriptor`` of its token count, requests and uniformity). A sparkinfer step's path is
chosen on the host when the attention metadata is built, after that dispatch, and each path launches
its own kernels; so patched ``GPUModelRunner.execute_model`` asks ``replay`` once the metadata is
built: the FULL dispatch stands when the step's path is its graph's, else the step runs PIECEWISE
(where vLLM captured that size piecewise: ``FULL_AND_PIECEWISE``) or eagerly (``FULL_DECODE_ONLY``),
counted and logged per reason in the worker's ``GraphPaths``. Every rank of a DCP group takes the
same path (the scheduler output is the same) and captured the same paths, so all fall back together.

Torch- and vLLM-free at import (patched vLLM imports it with its runner).
"""

from __future__ import annotations

from dataclasses import replace

from sparkinfer.vllm import worker_runtime


def replay(runner, cudagraph_mode, batch_desc):
    """(runtime mode, batch descriptor) the step runs with; unchanged but for a FULL dispatch in an
    engine whose attention is sparkinfer's."""
    rt = worker_runtime.of_engine(runner.vllm_config)
    if rt is None or cudagraph_mode.name != "FULL":
        return cudagraph_mode, batch_desc
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    relaxed = replace(batch_desc, num_reqs=None, uniform=False)  # the dispatcher's piecewise key
    piecewise = relaxed in runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.PIECEWISE]
    run = rt.graphs.replay(cudagraph_mode.name, batch_desc.num_tokens, piecewise)
    if run == "FULL":
        return cudagraph_mode, batch_desc
    if run == "PIECEWISE":
        return CUDAGraphMode.PIECEWISE, relaxed
    return CUDAGraphMode.NONE, BatchDescriptor(batch_desc.num_tokens)  # eager, on the padded inputs
