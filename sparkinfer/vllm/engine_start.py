"""Worker start-up (patch 0008, ``Worker.initialize_from_config`` after the KV caches exist).

Everything a step needs that can fail is settled here, before the first request:

* graph modes that would capture a sparkinfer op (the KV-cache update, the sparse-MLA attention
  or the indexer) are refused: FULL modes, the breakable CUDA graph, and piecewise graphs whose
  ``splitting_ops`` leave one of those ops inside a captured piece (``impls.CUDA_GRAPH_REASON``:
  the ops read host-side step data, which a graph would freeze);
* a fabric that cannot reach the caches is refused: ``fabric = host`` with the caches on a GPU
  (the host fabric moves CPU tensors), ``fabric = cuda`` with the caches on the CPU
  (``impls.fabric_problem``, when ``SelectedRuntime.start`` builds the fabric);
* the worker's runtime (``worker_runtime.for_engine``: every piece of state a worker keeps between
  steps, ``sparkinfer.decode.runtime``) gets its attention arena (``AttentionArena.reserve``: its
  bytes were reserved out of the KV memory, ``reservations.attention_workspace``), in every mode;
* the selected path's buffers are allocated (their bytes were reserved out of the KV memory,
  ``reservations``), the fabric is built and proven with a real exchange (``comm.proof``); a
  node without working P2P serves stock DCP from the first request, with one log line naming the
  fix (``sparkinfer.vllm.selected_runtime.SelectedRuntime.start``); the runtime holds it
  (``WorkerRuntime.selected``).

Torch-free at import (patched vLLM imports it at start); the work is imported when it runs.
"""

from __future__ import annotations

from sparkinfer.vllm.cache_dtypes import is_record_cache_dtype

# the ops that must run outside captured graphs (vLLM's names)
SPARKINFER_OPS = ("vllm::unified_mla_attention_with_output", "vllm::sparse_attn_indexer")


def graph_problem(compilation_config, breakable: bool) -> str | None:
    """Why ``compilation_config`` (as vLLM resolved it) would capture a sparkinfer op; None if it
    does not. ``breakable``: vLLM's breakable CUDA graph is enabled."""
    mode = compilation_config.cudagraph_mode
    if mode is None or mode.name == "NONE":
        return None
    if breakable:
        return ("the breakable CUDA graph (VLLM_USE_BREAKABLE_CUDAGRAPH=1) captures the sparkinfer ops between its "
                "break points; unset it")
    if mode.has_full_cudagraphs():
        return (f"cudagraph_mode {mode.name} captures whole steps, the sparse-MLA attention included; use PIECEWISE "
                "(or NONE)")
    split = compilation_config.splitting_ops
    missing = [op for op in SPARKINFER_OPS if split is None or op not in split]
    if split is not None and not compilation_config.splitting_ops_contain_kv_cache_update():
        missing.append("vllm::unified_mla_kv_cache_update")
    if compilation_config.mode.name == "VLLM_COMPILE" and missing:
        return (f"cudagraph_mode {mode.name} with splitting_ops {split} leaves {missing} inside captured pieces; "
                "leave splitting_ops unset (vLLM's default splits them out)")
    return None


def check_graph_mode(vllm_config) -> None:
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    from sparkinfer.decode.impls import CUDA_GRAPH_REASON

    why = graph_problem(vllm_config.compilation_config, is_breakable_cudagraph_enabled())
    if why is not None:
        raise ValueError(f"sparkinfer: {why}. The sparkinfer ops are not capture-safe ({CUDA_GRAPH_REASON})")


def uses_sparkinfer(vllm_config) -> bool:
    """Some attention layer of this worker runs the sparkinfer backend."""
    if not is_record_cache_dtype(vllm_config.cache_config.cache_dtype):
        return False
    ctx = vllm_config.compilation_config.static_forward_context
    return any(type(getattr(m, "impl", None)).__module__.startswith("sparkinfer.") for m in ctx.values())


def _cache_device(vllm_config):
    """The device of this worker's attention caches."""
    ctx = vllm_config.compilation_config.static_forward_context
    return next(m.kv_cache.device for m in ctx.values() if type(getattr(m, "impl", None)).__module__.startswith("sparkinfer."))


def start(vllm_config) -> None:
    """The worker's start-up checks and the selected path's fabric (module docstring)."""
    if not uses_sparkinfer(vllm_config):
        return
    check_graph_mode(vllm_config)
    from sparkinfer.vllm import reservations, worker_runtime
    from sparkinfer.vllm.selected_runtime import SelectedRuntime

    runtime = worker_runtime.for_engine(vllm_config)
    if runtime.device != _cache_device(vllm_config):
        raise RuntimeError(f"sparkinfer: the worker's device {runtime.device} is not its caches' "
                           f"{_cache_device(vllm_config)}")
    runtime.arena.reserve(reservations.attention_workspace(vllm_config).segments())
    rt = SelectedRuntime.create(vllm_config, runtime)
    if rt is not None:
        rt.start()
