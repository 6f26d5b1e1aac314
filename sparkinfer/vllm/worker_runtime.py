"""Where the adapter finds the worker's ``WorkerRuntime`` (``sparkinfer.decode.runtime``: every piece of
state a worker keeps between steps).

vLLM constructs the sparkinfer objects itself and hands them only its config: the attention impl at
model load (inside ``set_current_vllm_config``), the metadata builders when the KV caches are bound,
then patch 0008 calls ``engine_start.start``. Each of them asks ``for_engine`` once, at construction,
and keeps the object; the first one makes it. The engine is told apart by its compilation config,
where vLLM registers every layer of the engine (its static forward context): the MTP drafter's
layers are built under a copy of the ``VllmConfig`` (``dataclasses.replace``) that shares it, and a
later engine in the same process has its own, so it gets a new runtime. Two patch entry points carry
no config (the request ids of patch 0008, the indexer's q quantization of patch 0003): they take
``current()``.

Torch- and vLLM-free at import (the patches import their modules when vLLM is imported).
"""

from __future__ import annotations

# (the compilation config of the engine it was made for, the WorkerRuntime): the one runtime of this
# worker process
_worker: list = [None, None]


def for_engine(vllm_config=None):
    """This worker's runtime for the engine configured by ``vllm_config`` (made at the first call);
    None: vLLM's current config (the attention impl, which vLLM builds at model load under it)."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
    if _worker[0] is not vllm_config.compilation_config:
        from sparkinfer.decode.runtime import WorkerRuntime

        _worker[:] = [vllm_config.compilation_config, WorkerRuntime(vllm_config.device_config.device)]
    return _worker[1]


def of_engine(vllm_config):
    """The runtime made for the engine of ``vllm_config``, or None: the engine built no sparkinfer object
    (its attention is not sparkinfer's)."""
    return _worker[1] if _worker[0] is vllm_config.compilation_config else None


def current():
    """The runtime of the engine this worker runs, or None before vLLM built a sparkinfer object."""
    return _worker[1]


def use_paths(worker, mode: str, replicas: bool = False) -> dict:
    """Switch the paths this worker's later steps may take, for ``LLM.collective_rpc(use_paths,
    args=(mode, replicas))`` between requests (every rank must switch alike): one engine then measures
    stock DCP, the selected path and replicas back to back over the same memory
    (``SelectedRuntime.use``). ``worker``: the vLLM worker collective_rpc passes (unused). Returns
    the mode and replica state now in force. An engine that can never take the selected path (DCP
    1, mode stock at start, not a record format, or a fabric that failed its proof) serves only
    stock: asking it for more raises."""
    rt = current()
    selected = None if rt is None else rt.selected
    if selected is None:
        if mode != "stock" or replicas:
            raise ValueError(f"this engine serves only stock DCP (no selected-path runtime), so it cannot take mode "
                             f"{mode!r} / replicas {replicas}: start it at DCP > 1 with a record KV cache dtype in "
                             f"mode selected or auto")
        return {"mode": "stock", "replicas": False}
    selected.use(mode, replicas)
    return {"mode": selected.config.mode, "replicas": selected.replicas_on}
