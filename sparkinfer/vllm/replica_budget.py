"""The replica store's memory, taken out of vLLM's KV cache budget (patch 0008) (torch-free).

Every rank of the DCP group keeps, per layer, ``window`` positions of up to ``max_num_seqs``
requests (``sparkinfer.core.replicas``): ``window x max_num_seqs x layers x record_bytes`` bytes.
Patched ``get_kv_cache_configs`` (the engine core, before vLLM turns each worker's available memory
into KV blocks) subtracts ``reserved_bytes`` from every worker's budget, so the store is counted
inside the KV memory, not allocated on top of it. The worker's runtime then sizes the store with
``window`` from the KV bytes it was actually given, which are the same on every rank (vLLM gives
every worker the smallest worker's block count), so every rank derives the same window. With
``num_gpu_blocks_override`` the operator fixed the KV size: the store then comes beside it.

``replica_window``:
  * an int W > 0: reserve exactly W positions per request;
  * ``auto``: the whole ``max_model_len`` if that store fits a fifth of the KV memory, else a fifth
    of it. The runtime sizes from what the KV caches kept: min(max_model_len, window of
    kv_bytes / 4); with ``R = min(full, M / 5)`` reserved out of ``M``, ``kv_bytes <= M - R`` and so
    ``kv_bytes / 4 <= R``: the store always fits what was reserved;
  * 0: off.
Replicas apply only where the selected path can run (DCP > 1, mode not stock, a record cache
dtype, the replicated indexer). With prefix caching a request whose prompt hit the cache starts
its first run at that context: the hit positions are not replicated (they are fetched when
selected), never wrongly held.
"""

from __future__ import annotations

from sparkinfer.config import from_additional_config
from sparkinfer.core.replicas import store_bytes, window_for_budget
from sparkinfer.vllm.cache_dtypes import canonical_cache_dtype, is_record_cache_dtype

AUTO_SHARE = 5  # auto reserves at most 1 / AUTO_SHARE of each worker's KV memory


def selected_path_possible(vllm_config) -> bool:
    """The engine can take the selected path at all (what ``SelectedRuntime.create`` builds a runtime for)."""
    from sparkinfer.vllm.indexer_layout import indexer_replicated

    par = getattr(vllm_config, "parallel_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if par is None or cache is None or getattr(par, "decode_context_parallel_size", 1) <= 1:
        return False
    cfg = from_additional_config(getattr(vllm_config, "additional_config", None))
    return cfg.mode != "stock" and is_record_cache_dtype(cache.cache_dtype) and indexer_replicated(vllm_config)


def replicas_apply(vllm_config) -> bool:
    if not selected_path_possible(vllm_config):
        return False
    return from_additional_config(vllm_config.additional_config).replica_window != 0


def _geometry(vllm_config) -> tuple[int, int, int]:
    """(slots, layers, record bytes) of the store."""
    from sparkinfer.core.layouts import layout

    fmt = layout(canonical_cache_dtype(vllm_config.cache_config.cache_dtype))
    return (vllm_config.scheduler_config.max_num_seqs, vllm_config.model_config.hf_config.num_hidden_layers,
            fmt.record_bytes)


def reserved_bytes(vllm_config, available: int) -> int:
    """Bytes of a worker's KV memory ``available`` that the replica store takes (0 where it does
    not apply)."""
    if not replicas_apply(vllm_config):
        return 0
    slots, layers, width = _geometry(vllm_config)
    w = from_additional_config(vllm_config.additional_config).replica_window
    if w == "auto":
        full = store_bytes(max(vllm_config.model_config.max_model_len, 0), slots, layers, width)
        return min(full, available // AUTO_SHARE) if full else available // AUTO_SHARE
    need = store_bytes(w, slots, layers, width)
    if need >= available:
        raise ValueError(f"sparkinfer replica_window {w}: its store ({w} positions x {slots} max_num_seqs x "
                         f"{layers} layers x {width} B = {need / 2**30:.2f} GiB per rank) does not fit the "
                         f"{available / 2**30:.2f} GiB of KV cache memory; lower replica_window or "
                         f"max_num_seqs, or set it to auto")
    return need


def window(vllm_config, kv_bytes: int) -> int:
    """Positions per request the runtime keeps, from the KV bytes this worker was given."""
    if not replicas_apply(vllm_config):
        return 0
    w = from_additional_config(vllm_config.additional_config).replica_window
    if w != "auto":
        return int(w)
    slots, layers, width = _geometry(vllm_config)
    fit = window_for_budget(kv_bytes // (AUTO_SHARE - 1), slots, layers, width)
    return min(vllm_config.model_config.max_model_len, fit)
