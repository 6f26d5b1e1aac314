"""How the adapter reaches the worker's ``WorkerRuntime`` (``sparkinfer.decode.runtime``: every piece of
state a worker keeps between steps). No state here: the runtime belongs to the engine's objects.

vLLM constructs the sparkinfer objects itself and hands them only its config: the attention impls at
model load (inside ``set_current_vllm_config``), the metadata builders when the KV caches are bound,
then patch 0008 calls ``engine_start.start``. The first attention impl makes the runtime
(``for_engine``) and keeps it (``impl.runtime``); everything built after it takes that one from the
engine's attention layers, through the table where vLLM registers every layer of one engine
(``compilation_config.static_forward_context``: the MTP drafter's layers are built under a copy of
the ``VllmConfig`` that shares it, and a later engine in the same process has its own). Each object
takes it once, at construction, and keeps it; the metadata the builders make carries it into a
layer's forward. What runs per step gets it from what vLLM hands it: the model runner (patch 0008's
request ids, ``graph_dispatch``), the worker (``LLM.collective_rpc``: ``use_paths``, the probes of
``selected_runtime``), the forward context (the indexer's q quantization, patch 0003).

Torch- and vLLM-free at import (the patches import their modules when vLLM is imported).
"""

from __future__ import annotations


def of_layers(layers: dict):
    """The runtime the sparkinfer attention layers among ``layers`` (name -> layer: an engine's
    ``static_forward_context``, a forward context's ``no_compile_layers``) hold, or None: none of them
    is sparkinfer's. The first such layer answers (every one of an engine holds the same runtime)."""
    from sparkinfer.decode.runtime import WorkerRuntime

    for layer in layers.values():
        runtime = getattr(getattr(layer, "impl", None), "runtime", None)
        if isinstance(runtime, WorkerRuntime):
            return runtime
    return None


def of_engine(vllm_config):
    """The runtime of the engine configured by ``vllm_config``, or None: the engine has no sparkinfer
    attention layer (yet: the first impl is being built)."""
    return of_layers(vllm_config.compilation_config.static_forward_context)


def for_engine(vllm_config=None):
    """The runtime of the engine configured by ``vllm_config`` (None: vLLM's current config, under
    which it builds the attention impls at model load); a new one when the engine has none yet, for
    the first attention impl to keep."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
    runtime = of_engine(vllm_config)
    if runtime is None:
        from sparkinfer.decode.runtime import WorkerRuntime

        runtime = WorkerRuntime(vllm_config.device_config.device)
    return runtime


def use_paths(worker, mode: str, replicas: bool = False) -> dict:
    """Switch the paths this worker's later steps may take, for ``LLM.collective_rpc(use_paths,
    args=(mode, replicas))`` between requests (every rank must switch alike): one engine then measures
    stock DCP, the selected path and replicas back to back over the same memory
    (``SelectedRuntime.use``). ``worker``: the vLLM worker collective_rpc passes (its engine's
    runtime). Returns the mode and replica state now in force. An engine that can never take the
    selected path (DCP 1, mode stock at start, not a record format, or a fabric that failed its proof)
    serves only stock: asking it for more raises."""
    rt = of_engine(worker.vllm_config)
    selected = None if rt is None else rt.selected
    if selected is None:
        if mode != "stock" or replicas:
            raise ValueError(f"this engine serves only stock DCP (no selected-path runtime), so it cannot take mode "
                             f"{mode!r} / replicas {replicas}: start it at DCP > 1 with a record KV cache dtype in "
                             f"mode selected or auto")
        return {"mode": "stock", "replicas": False}
    selected.use(mode, replicas)
    return {"mode": selected.config.mode, "replicas": selected.replicas_on}


def forward_counts(worker) -> dict:
    """What this worker's forwards did so far (``WorkerRuntime.counts``), for
    ``LLM.collective_rpc(forward_counts)``; empty for an engine without a sparkinfer layer."""
    rt = of_engine(worker.vllm_config)
    return {} if rt is None else dict(rt.counts)
