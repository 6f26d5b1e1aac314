"""Worker start-up (patch 0008, ``Worker.initialize_from_config`` after the KV caches exist).

Everything a step needs that can fail is settled here, before the first request:

* what the configuration decides is refused by ``model_config_check.worker_problems`` (the
  checker ``sparkinfer serve --dry-run`` runs too), as one ValueError: graph modes that would
  replay a sparkinfer op wrongly (FULL graphs of mixed batches, FULL decode graphs while a part the
  engine runs is not replay-safe, ``decode.graph_paths``; the breakable CUDA graph; piecewise
  graphs whose ``splitting_ops`` leave the KV-cache update, the sparse-MLA attention or the indexer
  inside a captured piece), and with the selected path a fabric that cannot reach the caches
  (``fabric = host`` with the caches on a GPU, ``fabric = cuda`` with them on the CPU);
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
from sparkinfer.vllm.model_config_check import Graphs, engine_parts, worker_problems

def graphs(compilation_config, breakable: bool, parts: tuple[str, ...] = ("attention",)) -> Graphs:
    """``compilation_config`` (as vLLM resolved it) as the settings ``graph_problem`` reads.
    ``breakable``: vLLM's breakable CUDA graph is enabled; ``parts``: the sparkinfer builders' parts the
    engine runs (``engine_parts``)."""
    mode = compilation_config.cudagraph_mode
    split = compilation_config.splitting_ops
    return Graphs("NONE" if mode is None else mode.name, None if split is None else tuple(split),
                  compilation_config.mode.name == "VLLM_COMPILE",
                  compilation_config.splitting_ops_contain_kv_cache_update(), breakable, tuple(parts))


def check_worker(vllm_config) -> None:
    """Refuse what ``worker_problems`` finds in this worker's resolved configuration."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    from sparkinfer.config import from_additional_config
    from sparkinfer.vllm.replica_budget import selected_path_possible

    problems = worker_problems(graphs(vllm_config.compilation_config, is_breakable_cudagraph_enabled(),
                                      engine_parts(vllm_config)),
                               selected=selected_path_possible(vllm_config),
                               fabric=from_additional_config(vllm_config.additional_config).fabric,
                               device_type=_cache_device(vllm_config).type)
    if problems:
        raise ValueError("; ".join(problems))


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
    check_worker(vllm_config)
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
