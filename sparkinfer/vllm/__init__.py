"""The thin vLLM-facing glue that the patch series (``vllm_patches/``) calls into.

Patched vLLM imports these modules, so importing this package must stay cheap: the modules vLLM
imports while it is itself being imported (``cache_dtypes``, ``indexer_layout``, ``platforms``)
import neither torch nor vllm at module level; ``sparse_mla_backend`` (loaded by class path once
vLLM is up) imports vllm.

* ``cache_dtypes``      sparkinfer record formats as vLLM KV-cache dtypes: names, sizes, the
                        backend-can-read check and the checked cache writer (patch 0001).
* ``indexer_layout``    replicated vs. DCP-sharded indexer cache (patch 0003).
* ``platforms``         what the CPU and CUDA platforms need to know: backend name and path, the
                        DSA block size, the sm_12x MLA priorities (0005, 0007).
* ``sparse_mla_backend``  the sparkinfer sparse-MLA backend (0005 on CPU, 0007 on sm_12x): its
                        builder makes each step's ``decode.forward_step.ForwardStep``.
* ``replicated_indexer``  the GLM-DSA indexer: metadata, q quantization, top-k (0003).
* ``indexer_scoring``   replicated or DCP-sharded scoring of the indexer, per step.
* ``cpu_dcp``           DCP on the CPU platform: slot mapping and LSE combine twins (0006).
* ``dcp_slots``         the MTP drafter's later passes write where DCP puts the record (0009).
* ``model_config_check``  start-up checks of settings, heads and the DCP group (0002).
* ``worker_runtime``    how the adapter reaches its engine's ``decode.runtime.WorkerRuntime`` (no state).
* ``engine_start``      worker start-up: refusals, the arena, the selected path's fabric (0008).
* ``selected_runtime``  the backend's hooks into selected and gathered steps (one per worker).
* ``reservations``, ``replica_budget``  the bytes reserved out of the KV memory (0008) and the
                        replica window the runtime keeps.
* ``step_requests``     the step's request ids (0008), into the worker's runtime.

The vLLM-free decode step they drive lives in ``sparkinfer.decode``.

Configuration (patch 0002) lives in ``sparkinfer.config``.
"""
