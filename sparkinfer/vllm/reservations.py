"""sparkinfer's device memory, taken out of vLLM's KV cache budget (patch 0008) (torch-free).

Patched ``get_kv_cache_configs`` (the engine core, before vLLM turns each worker's available memory
into KV blocks) subtracts ``reserved_bytes`` from every worker's budget: the buffers of
``sparkinfer.core.reservations`` (prefetch ring, exchange slabs, attention output, the stashed
records, the indexer's workspace) and then the
replica store (``replica_budget``: its ``auto`` window takes its share of what the other buffers
left). The worker's runtime allocates exactly these buffers from the same ``sizing`` at engine
start, so what sparkinfer holds on a GPU is counted inside the KV memory, not allocated on top of
it. Nothing is reserved where the selected path can never run (DCP 1, mode stock, a cache dtype
that is not a record format, a sharded indexer). ``sparkinfer plan --json`` lists the same names.
"""

from __future__ import annotations

from sparkinfer.config import from_additional_config
from sparkinfer.core.reservations import SelectedSizing
from sparkinfer.vllm import impls, replica_budget


def sizing(vllm_config) -> SelectedSizing:
    """The selected path's buffer sizes for this engine (the same in the engine core and every worker)."""
    from sparkinfer.core.layouts import layout
    from sparkinfer.vllm.cache_dtypes import canonical_cache_dtype

    hf = vllm_config.model_config.hf_config
    par = vllm_config.parallel_config
    spec = vllm_config.speculative_config
    cfg = from_additional_config(vllm_config.additional_config)
    fmt = layout(canonical_cache_dtype(vllm_config.cache_config.cache_dtype))
    return SelectedSizing(dcp=par.decode_context_parallel_size, record_bytes=fmt.record_bytes,
                          max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                          rows=1 + (spec.num_speculative_tokens if spec is not None else 0), topk=hf.index_topk,
                          prefetch_depth=cfg.prefetch_depth, pool_mb=cfg.pool_mb,
                          heads=max(1, hf.num_attention_heads // par.tensor_parallel_size),
                          sizing=impls.exchange_sizing(vllm_config.device_config.device_type),
                          step_tokens=getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None) or 0,
                          max_model_len=vllm_config.model_config.max_model_len or 0)


def reservations(vllm_config, available: int) -> dict[str, int]:
    """{buffer name: bytes} this engine holds per rank out of ``available`` bytes of KV memory."""
    if not replica_budget.selected_path_possible(vllm_config):
        return {}
    out = sizing(vllm_config).buffers()
    rest = available - sum(out.values())
    if rest <= 0:
        raise ValueError(f"sparkinfer's buffers ({sum(out.values()) / 2**30:.2f} GiB per rank: "
                         + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in out.items())
                         + f") do not fit the {available / 2**30:.2f} GiB of KV cache memory; lower pool_mb, "
                           "prefetch_depth or max_num_seqs, or raise gpu_memory_utilization")
    store = replica_budget.reserved_bytes(vllm_config, rest)
    if store:
        out["replica_store"] = store
    return out


def reserved_bytes(vllm_config, available: int) -> int:
    """Bytes of a worker's KV memory ``available`` that sparkinfer takes (0 where the selected path
    cannot run)."""
    return sum(reservations(vllm_config, available).values())
