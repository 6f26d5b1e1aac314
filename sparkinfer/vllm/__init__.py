"""The thin vLLM-facing glue that the patch series (``vllm_patches/``) calls into.

Patched vLLM imports these modules, so importing this package must stay cheap: the modules vLLM
imports while it is itself being imported (``cache_dtypes``, ``indexer_layout``, ``cpu_platform``)
import neither torch nor vllm at module level; ``cpu_sparse_mla`` (loaded by class path once
vLLM is up) imports vllm.

* ``cache_dtypes``      sparkinfer record formats as vLLM KV-cache dtypes: names, sizes, the
                        backend-can-read check and the cache writer (patch 0001).
* ``indexer_layout``    replicated vs. DCP-sharded indexer cache (patch 0003).
* ``paged_sparse_mla``  sparse MLA over vLLM's paged record cache, logical top-k -> physical
                        slots (DCP-aware); the core of the backend's forward_mqa.
* ``cpu_platform``      what the CPU platform needs to know: backend path, DSA block size (0005).
* ``cpu_sparse_mla``    the sparkinfer sparse-MLA backend on CPU (0005).
* ``cpu_indexer``       the GLM-DSA indexer on CPU: metadata, q quantization, top-k (0003).
* ``tiny_model``        the tiny GLM-5.2-shaped checkpoint and its transformers reference.

Configuration (patch 0002) lives in ``sparkinfer.config``.
"""
