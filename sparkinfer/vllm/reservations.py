"""sparkinfer's device memory, taken out of vLLM's KV cache budget (patch 0008) (torch-free).

Patched ``get_kv_cache_configs`` (the engine core, before vLLM turns each worker's available memory
into KV blocks) subtracts ``reserved_bytes`` from every worker's budget:

* wherever the sparkinfer backend reads record caches (any DCP, any mode): the attention arena
  (``attention_workspace``, ``core.attention_workspace``), which the worker allocates at engine
  start (``engine_start``);
* where the selected path can run (DCP > 1, mode not stock, a record format, the replicated
  indexer): the buffers of ``sparkinfer.core.reservations`` (prefetch ring, exchange slabs, the
  stashed records, the indexer's workspace, the group plan), which the worker's runtime allocates
  from the same ``sizing``, and then the replica store (``replica_budget``: its ``auto`` window
  takes its share of what the other buffers left).

So what sparkinfer holds on a GPU is counted inside the KV memory, not allocated on top of it.
``sparkinfer plan --json`` lists the same names.
"""

from __future__ import annotations

from sparkinfer.config import from_additional_config
from sparkinfer.core.attention_workspace import AttentionWorkspace
from sparkinfer.core.reservations import SelectedSizing
from sparkinfer.decode import impls
from sparkinfer.vllm import replica_budget
from sparkinfer.vllm.cache_dtypes import is_record_cache_dtype


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
                          sizing=impls.exchange_sizing(vllm_config.device_config.device_type),
                          step_tokens=getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None) or 0,
                          max_model_len=vllm_config.model_config.max_model_len or 0)


def attention_workspace(vllm_config) -> AttentionWorkspace:
    """The attention arena of this engine's workers: a step's rows (vLLM's token budget, or a decode
    step of ``max_num_seqs x (1 + drafts)`` rows), the heads a rank attends (stock DCP gathers the
    queries of the DCP group), the model's top-k and output dtype, and the indexer's q where
    sparkinfer's indexer op serves (``indexer_layout.serves_replicated_indexer``)."""
    from sparkinfer.vllm.indexer_layout import serves_replicated_indexer

    hf = vllm_config.model_config.hf_config
    par = vllm_config.parallel_config
    spec = vllm_config.speculative_config
    sched = vllm_config.scheduler_config
    decode_rows = (sched.max_num_seqs or 0) * (1 + (spec.num_speculative_tokens if spec is not None else 0))
    bf16 = str(getattr(vllm_config.model_config, "dtype", "bfloat16")).removeprefix("torch.") == "bfloat16"
    return AttentionWorkspace(rows=max(1, decode_rows, getattr(sched, "max_num_batched_tokens", None) or 0),
                              heads=max(1, hf.num_attention_heads // par.tensor_parallel_size)
                              * par.decode_context_parallel_size,
                              topk=hf.index_topk, out_bytes=2 if bf16 else 4,
                              index_heads=hf.index_n_heads if serves_replicated_indexer(vllm_config) else 0,
                              index_dim=hf.index_head_dim)


def reservations(vllm_config, available: int) -> dict[str, int]:
    """{buffer name: bytes} this engine holds per rank out of ``available`` bytes of KV memory."""
    out = {}
    if is_record_cache_dtype(vllm_config.cache_config.cache_dtype):
        out["attention_workspace"] = attention_workspace(vllm_config).nbytes
    selected = replica_budget.selected_path_possible(vllm_config)
    if selected:
        out.update(sizing(vllm_config).buffers())
    rest = available - sum(out.values())
    if out and rest <= 0:
        raise ValueError(f"sparkinfer's buffers ({sum(out.values()) / 2**30:.2f} GiB per rank: "
                         + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in out.items())
                         + f") do not fit the {available / 2**30:.2f} GiB of KV cache memory; lower "
                           "max_num_batched_tokens, pool_mb, prefetch_depth or max_num_seqs, or raise "
                           "gpu_memory_utilization")
    store = replica_budget.reserved_bytes(vllm_config, rest) if selected else 0
    if store:
        out["replica_store"] = store
    return out


def reserved_bytes(vllm_config, available: int) -> int:
    """Bytes of a worker's KV memory ``available`` that sparkinfer takes (0 where its backend does
    not serve)."""
    return sum(reservations(vllm_config, available).values())
