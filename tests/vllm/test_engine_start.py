"""The start-up graph-mode policy (sparkinfer/vllm/engine_start.py) on vLLM's own compilation
config: a CUDA graph mode that would capture a sparkinfer op is refused, with the op named."""

import pytest


@pytest.mark.vllm
@pytest.mark.parametrize("mode, splitting, breakable, refused", [
    ("NONE", None, False, None),
    ("PIECEWISE", None, False, None),  # vLLM's default splitting ops take the sparkinfer ops out
    ("PIECEWISE", [], False, None),  # nothing split: vLLM itself then captures nothing (NONE)
    ("PIECEWISE", ["vllm::unified_mla_attention_with_output"], False, "sparse_attn_indexer"),
    ("PIECEWISE", ["vllm::unified_mla_attention_with_output", "vllm::sparse_attn_indexer"], False,
     "unified_mla_kv_cache_update"),
    ("FULL", None, False, "FULL"),
    ("FULL_DECODE_ONLY", None, False, "FULL_DECODE_ONLY"),
    ("PIECEWISE", None, True, "breakable"),
])
def test_graph_modes_that_capture_a_sparkinfer_op_are_refused(mode, splitting, breakable, refused):
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    from sparkinfer.vllm.engine_start import graph_problem

    cfg = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode[mode],
                            splitting_ops=splitting)
    cfg.set_splitting_ops_for_v1("naive")
    why = graph_problem(cfg, breakable)
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why
