"""The start-up checks of patched vLLM over plain config dicts (no vLLM, no transformers): the
GLM-5.2 (glm_moe_dsa) keys vLLM 0.32.0 would misread, heads and DCP against TP, the record format
against the model, and sparkinfer's settings as SparkinferConfigError. tests/vllm/test_vllm_startup_faults.py
runs the same faults through `vllm serve` and checks the transformers emulation against transformers
itself."""

import copy

import pytest

from sparkinfer.config import SparkinferConfigError
from sparkinfer.vllm import model_config_check as mcc

# GLM-5.2's IndexShare layout, written out here rather than taken from sparkinfer.core.topology.
GLM52_PATTERN = "FFFSSS" + "FSSS" * 18


def glm52_config(**overrides):
    """A GLM-5.2-shaped config.json as transformers saves it, plus the keys vLLM needs."""
    cfg = {
        "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 78,
        "first_k_dense_replace": 3, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 75,
        "indexer_types": ["full" if c == "F" else "shared" for c in GLM52_PATTERN],
        "n_routed_experts": 256, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "index_topk": 2048, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "indexer_rope_interleave": True,
        "index_topk_pattern": GLM52_PATTERN,
    }
    cfg.update(overrides)
    return cfg


def without(cfg, *keys):
    cfg = copy.deepcopy(cfg)
    for k in keys:
        cfg.pop(k)
    return cfg


def test_complete_config_has_no_problems():
    assert mcc.glm_config_problems(glm52_config()) == []


@pytest.mark.parametrize("key,bad,fix", [
    ("scoring_func", "softmax", '"scoring_func": "sigmoid"'),
    ("topk_method", "greedy", '"topk_method": "noaux_tc"'),
    ("indexer_rope_interleave", False, '"indexer_rope_interleave": true'),
])
def test_router_and_indexer_rope_keys_missing_or_contradictory(key, bad, fix):
    for cfg, state in ((without(glm52_config(), key), "missing"), (glm52_config(**{key: bad}), f"is {bad!r}")):
        problems = mcc.glm_config_problems(cfg)
        assert len(problems) == 1, problems
        assert problems[0].startswith(f"{key} {state}") and fix in problems[0]


def test_transformers_save_without_the_vllm_keys_lists_each():
    """What GlmMoeDsaForCausalLM.save_pretrained writes: every key vLLM reads with a DeepSeek default
    is named, and IndexShare asks for the pattern derived from indexer_types."""
    cfg = without(glm52_config(), "scoring_func", "topk_method", "indexer_rope_interleave", "index_topk_pattern")
    problems = mcc.glm_config_problems(cfg)
    assert [p.split()[0] for p in problems] == ["scoring_func", "topk_method", "indexer_rope_interleave",
                                                "IndexShare:"]
    assert f'"index_topk_pattern": "{GLM52_PATTERN}"' in problems[3]
    assert "F" * 78 in problems[3]  # what vLLM would run: the indexer on every layer


def test_pattern_length_must_be_the_layer_count():
    for pattern in (GLM52_PATTERN[:-1], GLM52_PATTERN + "S"):
        (problem,) = mcc.glm_config_problems(glm52_config(index_topk_pattern=pattern))
        assert f"index_topk_pattern has {len(pattern)} characters but num_hidden_layers is 78" in problem
        assert f'"index_topk_pattern": "{GLM52_PATTERN}"' in problem


def test_pattern_contradicting_indexer_types():
    flipped = "FFFFSS" + GLM52_PATTERN[6:]
    (problem,) = mcc.glm_config_problems(glm52_config(index_topk_pattern=flipped))
    assert f"vLLM reads {flipped} from index_topk_pattern" in problem and GLM52_PATTERN in problem


@pytest.mark.parametrize("pattern", ["FFXSSS" + GLM52_PATTERN[6:], list(GLM52_PATTERN)])
def test_pattern_must_be_a_string_of_f_and_s(pattern):
    (problem,) = mcc.glm_config_problems(glm52_config(index_topk_pattern=pattern))
    assert "must be a string of F (Full) and S (Shared)" in problem


def test_first_layer_must_run_the_indexer():
    pattern = "S" + GLM52_PATTERN[1:]
    cfg = glm52_config(index_topk_pattern=pattern, indexer_types=["full" if c == "F" else "shared" for c in pattern])
    (problem,) = mcc.glm_config_problems(cfg)
    assert "layer 0 has no earlier Full layer" in problem


def test_all_full_needs_no_pattern_but_freq_offset_must_agree():
    """Without index_topk_pattern vLLM derives IndexShare from index_topk_freq / offset (defaults: every
    layer Full), as transformers does when indexer_types is absent; a saved indexer_types must agree."""
    all_full = glm52_config(indexer_types=["full"] * 78)
    assert mcc.glm_config_problems(without(all_full, "index_topk_pattern")) == []
    # freq 4, offset 3: layers 0-2 Full, then every 4th from layer 6: transformers and vLLM agree
    sched = without(glm52_config(index_topk_freq=4, index_skip_topk_offset=3), "index_topk_pattern", "indexer_types")
    assert mcc.glm_config_problems(sched) == []
    (problem,) = mcc.glm_config_problems(dict(sched, indexer_types=["full"] * 78))
    assert "index_topk_freq / index_skip_topk_offset" in problem and '"index_topk_pattern": "' + "F" * 78 in problem


def test_moe_layer_layout():
    (problem,) = mcc.glm_config_problems(glm52_config(first_k_dense_replace=1))
    assert 'set "first_k_dense_replace": 3' in problem
    (problem,) = mcc.glm_config_problems(glm52_config(moe_layer_freq=2))
    assert 'remove "moe_layer_freq"' in problem
    mixed = ["dense"] * 3 + ["sparse", "dense"] + ["sparse"] * 73
    (problem,) = mcc.glm_config_problems(glm52_config(mlp_layer_types=mixed))
    assert "cannot serve this layout" in problem
    # no mlp_layer_types: transformers derives it from first_k_dense_replace, as vLLM does
    assert mcc.glm_config_problems(without(glm52_config(first_k_dense_replace=5), "mlp_layer_types")) == []


def test_rope_bias_and_llama4_scaling():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "rope_theta": 1e6}
    assert mcc.glm_config_problems(glm52_config(rope_parameters=yarn)) == []
    (problem,) = mcc.glm_config_problems(glm52_config(rope_parameters={"rope_type": "linear", "factor": 2.0}))
    assert problem.startswith("rope_parameters.rope_type is 'linear'")
    (problem,) = mcc.glm_config_problems(glm52_config(attention_bias=True))
    assert problem.startswith("attention_bias is true")
    (problem,) = mcc.glm_config_problems(glm52_config(llama_4_scaling={"beta": 0.1}))
    assert problem.startswith("llama_4_scaling is set")


class _HF:
    """A stand-in for transformers' config object: attributes plus to_dict()."""

    def __init__(self, d):
        self.__dict__.update(d)

    def to_dict(self):
        return dict(self.__dict__)


class _Untouchable:
    """A config whose only readable attribute is model_type: any other read fails the test."""

    model_type = "llama"

    def __getattr__(self, name):
        raise AssertionError(f"read {name} of a model the check must not look at")


def test_check_hf_config_raises_one_line_for_glm_only():
    with pytest.raises(SparkinferConfigError) as err:
        mcc.check_hf_config(_HF(without(glm52_config(), "scoring_func", "indexer_rope_interleave")))
    msg = str(err.value)
    assert "\n" not in msg and "glm_moe_dsa" in msg and '"scoring_func": "sigmoid"' in msg
    assert '"indexer_rope_interleave": true' in msg
    assert isinstance(err.value, ValueError)
    mcc.check_hf_config(_HF(glm52_config()))
    mcc.check_hf_config(_Untouchable())  # another model type: nothing but model_type is read


class _ModelConfig:
    def __init__(self, hf_config, use_mla):
        self.hf_config, self.use_mla = hf_config, use_mla


def _parallel(tp=1, dcp=1):
    return _HF({"tensor_parallel_size": tp, "decode_context_parallel_size": dcp})


LLAMA = _HF({"model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 2})


@pytest.fixture
def clean_env(monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("VLLM_SPARKINFER_")]:
        monkeypatch.delenv(k)


def _problems(hf=LLAMA, use_mla=False, cache_dtype="auto", tp=1, dcp=1, cli=None, environ=None):
    return mcc.startup_problems(cli or {}, environ or {}, hf.to_dict(), use_mla=use_mla, cache_dtype=cache_dtype,
                                tensor_parallel_size=tp, decode_context_parallel_size=dcp)


@pytest.mark.parametrize("dtype", ["nvfp4_368", "nvfp4_ds_mla:bf16-rope-432"])
def test_record_format_needs_mla(dtype):
    (problem,) = _problems(cache_dtype=dtype)
    assert problem.startswith(f"--kv-cache-dtype {dtype}: ") and "does not use MLA" in problem
    assert _problems(cache_dtype=dtype, use_mla=True) == []
    assert _problems(cache_dtype="auto") == []  # not a sparkinfer format: any model


def test_heads_and_dcp_against_tp():
    assert _problems(tp=8, dcp=8) == []
    (problem,) = _problems(tp=3)
    assert problem == "tensor_parallel_size 3 does not divide the model's 32 attention heads (num_attention_heads)"
    (problem,) = _problems(tp=4, dcp=8)
    assert problem == "decode_context_parallel_size 8 must divide tensor_parallel_size 4 (DCP ranks are TP ranks)"


def test_every_problem_at_once_glm_only_for_glm():
    glm = _HF(without(glm52_config(num_attention_heads=64), "scoring_func"))
    problems = _problems(glm, use_mla=True, tp=3, dcp=3, cli={"mode": "bogus"})
    assert [p.split()[:2] for p in problems] == [["sparkinfer", "mode"], ["tensor_parallel_size", "3"],
                                                 ["glm_moe_dsa", "config.json,"]]
    assert problems[2].endswith('scoring_func missing (vLLM\'s default is softmax expert routing; GLM-MoE-DSA routes '
                                'with sigmoid): set "scoring_func": "sigmoid"')
    # the GLM keys are this model type's only: another model with the same keys missing passes
    assert _problems(_HF(dict(glm.to_dict(), model_type="deepseek_v32")), use_mla=True) == []


def test_check_at_startup_errors_are_config_errors(clean_env, monkeypatch):
    model = _ModelConfig(LLAMA, False)
    assert mcc.check_at_startup({"mode": "selected"}, model, "auto", _parallel()).mode == "selected"
    with pytest.raises(SparkinferConfigError, match=r"mode \(from --sparkinfer-mode\)"):
        mcc.check_at_startup({"mode": "bogus"}, model, "auto", _parallel())
    # one error, every problem: a bad setting, heads TP does not divide, a record format without MLA
    with pytest.raises(SparkinferConfigError) as err:
        mcc.check_at_startup({"mode": "bogus"}, model, "nvfp4_368", _parallel(tp=3))
    assert str(err.value) == "; ".join(_problems(LLAMA, cache_dtype="nvfp4_368", tp=3, cli={"mode": "bogus"}))
    assert "\n" not in str(err.value)
    monkeypatch.setenv("VLLM_SPARKINFER_MODEE", "selected")  # the process environment, as vLLM's
    with pytest.raises(SparkinferConfigError, match="VLLM_SPARKINFER_MODEE"):
        mcc.check_at_startup({}, model, "auto", _parallel())
