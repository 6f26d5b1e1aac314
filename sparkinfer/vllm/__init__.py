"""The thin vLLM-facing glue that the patch series (``vllm_patches/``) calls into.

Patched vLLM imports these modules, so importing this package must stay cheap: the modules vLLM
imports while it is itself being imported (``cache_dtypes``, ``indexer_layout``, ``platforms``)
import neither torch nor vllm at module level; ``sparse_mla_backend`` (loaded by class path once
vLLM is up) imports vllm.

* ``cache_dtypes``      sparkinfer record formats as vLLM KV-cache dtypes: names, sizes, the
                        backend-can-read check and the cache writer (patch 0001).
* ``indexer_layout``    replicated vs. DCP-sharded indexer cache (patch 0003).
* ``paged_sparse_mla``  sparse MLA over vLLM's paged record cache, logical top-k -> physical
                        slots (DCP-aware); the core of the backend's forward_mqa.
* ``platforms``         what the CPU and CUDA platforms need to know: backend name and path, the
                        DSA block size, the sm_12x MLA priorities (0005, 0007).
* ``sparse_mla_backend``  the sparkinfer sparse-MLA backend (0005 on CPU, 0007 on sm_12x).
* ``replicated_indexer``       the GLM-DSA indexer on CPU: metadata, q quantization, top-k (0003).
* ``cpu_dcp``           DCP on the CPU platform: slot mapping and LSE combine twins (0006).
* ``step_path``         the per-step gates: stock, selected or gathered.
* ``selected_runtime``  the backend's hooks into selected and gathered steps (one per worker).
* ``selected_decode``   the per-step executor: union, planes, ring, exchange, attention.
* ``replica_budget``    the replica store's bytes, reserved out of the KV memory (0008) and
                        the window the runtime keeps.
* ``tiny_model``        the tiny GLM-5.2-shaped checkpoint and its transformers reference.

Configuration (patch 0002) lives in ``sparkinfer.config``.
"""
