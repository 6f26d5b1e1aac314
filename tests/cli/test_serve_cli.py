"""`sparkinfer serve`: the shipped serve profiles (profiles/serve/*.toml) against a GLM-5.2-shaped
config.json, every check failing on the field it guards, --set / -- overrides, the dry-run command
and the exec. CPU, no vLLM (tests/vllm/test_serve_profiles.py parses the command with vLLM's parser)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkinfer import config as sc
from sparkinfer.cli import main as cli_main
from sparkinfer.cli import serve
from sparkinfer.config import SparkinferConfigError
from sparkinfer.vllm import model_config_check as mcc

REPO = Path(__file__).parents[2]
PROFILES = sorted((REPO / "profiles" / "serve").glob("*.toml"))
NAMES = [p.stem for p in PROFILES]
GIB = 1 << 30

# GLM-5.2's config.json facts (../shared/spec/glm52-and-hardware.md), written out independently of
# sparkinfer.core.geometry: 78 layers, 64 heads, latent 512, rope 64, 32 x 128 indexer, top-k 2048.
GLM52_PATTERN = "FFFSSS" + "FSSS" * 18


def glm52_config(**changes) -> dict:
    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_hidden_layers": 78,
           "num_attention_heads": 64, "hidden_size": 6144, "vocab_size": 154880, "q_lora_rank": 2048,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
           "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "index_topk_pattern": GLM52_PATTERN,
           "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576, "scoring_func": "sigmoid",
           "topk_method": "noaux_tc", "indexer_rope_interleave": True}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.fixture
def glm(tmp_path):
    def write(**changes):
        d = tmp_path / "glm-5.2"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(glm52_config(**changes)))
        return str(d)
    return write


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(sc.ENV_PREFIX):
            monkeypatch.delenv(k)


def dry_run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli_main(["serve", "--dry-run", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def command(out: str) -> list[str]:
    lines = out.strip().splitlines()
    assert all(line.startswith(("#", "export ")) for line in lines[:-1]), lines
    return shlex.split(lines[-1])


def pairs(argv: list[str]) -> dict:
    assert all(a.startswith("--") for a in argv[::2]), argv
    return dict(zip(argv[::2], argv[1::2]))


def test_the_four_profiles_ship():
    assert set(NAMES) == {"glm52-tp4-dcp4-mtp3-368", "glm52-tp4-dcp4-mtp3-432", "glm52-tp4-dcp4-mtp0-368",
                          "glm52-tp4-dcp1-mtp3-368"}
    assert not list((REPO / "profiles" / "serve").glob("*.sh")), "the shell profiles were replaced by data"


@pytest.mark.parametrize("name", NAMES)
def test_profile_data(name):
    data = serve.load_profile(name)
    v = data["vllm"]
    tp, dcp = v["tensor_parallel_size"], v["decode_context_parallel_size"]
    k = v.get("speculative_config", {}).get("num_speculative_tokens", 0)
    assert name == f"glm52-tp{tp}-dcp{dcp}-mtp{k}-{v['kv_cache_dtype'].split('_')[1]}"
    assert set(data["sparkinfer"]) == set(sc.FIELD_NAMES), "state every sparkinfer setting"
    assert sc.resolve(cli=data["sparkinfer"], environ={}).fabric == "cuda"
    # vLLM's default FULL_AND_PIECEWISE, every decode batch up to max_num_seqs a capture size of its own
    comp = v["compilation_config"]
    assert "cudagraph_mode" not in comp
    assert comp["cudagraph_capture_sizes"] == [(1 + k) * n for n in range(1, v["max_num_seqs"] + 1)]


@pytest.mark.parametrize("name", NAMES)
def test_every_profile_validates_against_glm52(name, glm, capsys):
    rc, out, err = dry_run(capsys, "--profile", name, glm())
    assert rc == 0, err
    argv = command(out)
    assert argv[:3] == ["vllm", "serve", glm()]
    data = serve.load_profile(name)
    bools = {k: v for k, v in data["vllm"].items() if isinstance(v, bool)}
    flags = {("--" if v else "--no-") + k.replace("_", "-") for k, v in bools.items()}
    assert flags <= set(argv)
    f = pairs([a for a in argv[3:] if a not in flags])
    for key, value in data["vllm"].items():
        if key in bools:
            continue
        got = f["--" + key.replace("_", "-")]
        if isinstance(value, dict):
            assert json.loads(got) == value
        else:
            assert got == str(value)
    for key, value in data["sparkinfer"].items():
        assert f[sc.cli_flag(key)] == str(value)
    assert len(f) + len(flags) == len(data["vllm"]) + len(data["sparkinfer"])


def _tokens_that_fit(kv_bytes: int, record: int, dcp: int, mtp: bool) -> int:
    """By hand: 78 (+1 MTP) layers of records on the token's owner, 21 (+1) indexer keys of 132 B
    on every rank (replicated under DCP > 1); whole 64 x DCP blocks."""
    main = (78 + mtp) * record
    idx = (21 + mtp) * 132
    granule = 64 * dcp
    per_block = granule // dcp * main + granule * idx
    return kv_bytes // per_block * granule


def _knobs(name: str) -> tuple[int, int]:
    """(vLLM's batched tokens, the ring's pool_mb) of profile ``name`` (vLLM's default batched tokens
    on these GPUs, 8,192, and sparkinfer's default pool, 512 MiB, where it sets none)."""
    data = serve.load_profile(name)
    return data["vllm"].get("max_num_batched_tokens", 8192), data["sparkinfer"].get("pool_mb", 512)


def _arena(name: str, dcp: int) -> int:
    """The attention arena (sparkinfer/core/attention_workspace.py), held in every mode: a bf16
    output and fp32 LSE for the step's rows (vLLM's batched tokens) x 16 heads per TP rank gathered
    over DCP, a block's int64 top-k rows and compacted indices (BLOCK_ROWS rows), the fp32 partials
    [512 + 1] of BLOCK_PROGRAMS programs of 16 heads and their int32 merge tickets; under DCP > 1
    sparkinfer's indexer quantizes its q (32 heads x 128 fp8 + a scale)."""
    from sparkinfer.core.attention_workspace import BLOCK_PROGRAMS, BLOCK_ROWS

    tokens = _knobs(name)[0]
    heads = 16 * dcp
    index_q = tokens * 32 * (128 + 4) if dcp > 1 else 0
    return (tokens * heads * (2 * 512 + 4) + BLOCK_ROWS * 2048 * (8 + 8) + 4 * BLOCK_PROGRAMS
            + BLOCK_PROGRAMS * 16 * 513 * 4 + index_q)


def _buffers(name: str, record: int, dcp: int, mtp: bool) -> int:
    """The buffers per GPU by hand: the attention arena, then the selected path's (the table of
    sparkinfer/core/reservations.py): a ring of pool_mb in 4 slots (depth 3) holding B requests of
    R x 2048 rows per slot (B <= 16), receive slabs of 2 slots x 4 layers x (B x R x 2048) records
    over all sources, a send slab of 1/16 of that per pair (gathered steps only), the unpack's two
    int32 index columns, the sharded indexer's merge, a Full layer's group plan; at DCP1 the arena
    alone."""
    from sparkinfer.core.indexer_tiles import ENGINE_TILE_BYTES, INDEXER_ROWS, PAGED_PROGRAMS, PAGED_TILE

    if dcp == 1:
        return _arena(name, dcp)
    tokens, pool_mb = _knobs(name)
    rows = 1 + 3 * mtp

    def align(n):
        return -(-n // 256) * 256
    slot = pool_mb * 2**20 // (record * 4)
    batch = min(16, slot // (rows * 2048))
    cap = batch * rows * 2048
    ring = 4 * slot * record
    recv = align((3 + 4) * dcp * 64) + 2 * align(4 * cap * record)  # arrive, ack, abort, landed x 4 layers
    send = 2 * dcp * align(4 * (cap // 16) * record)
    # a step's own records (vLLM's batched tokens) and the indexer's top-k workspace for an
    # INDEXER_ROWS-row block (k 2048, a pass of ENGINE_TILE_BYTES / (8 B x rows)): work, top + indices;
    # or the paged top-k's if larger (PAGED_PROGRAMS work rows of k + PAGED_TILE keys and heads of k,
    # the block's sorted k)
    stash = tokens * record
    tile = ENGINE_TILE_BYTES // (8 * INDEXER_ROWS)
    indexer = max(8 * INDEXER_ROWS * (2048 + tile) + 2 * 8 * INDEXER_ROWS * 2048,
                  8 * PAGED_PROGRAMS * (2048 + PAGED_TILE + 2048) + 8 * INDEXER_ROWS * 2048)
    # the group plan (cap entries): 5 int32 and 2 bool columns, the union kernel's scratch per request (a
    # table of the power of two >= 2 x R x 2048 slots, two columns), counts, sends, 3 planes per source
    n = rows * 2048
    table = 1 << (2 * n - 1).bit_length()
    plan = 4 * (5 * cap + batch * (2 * table + 2 * n) + batch + batch * dcp + 3 * dcp * cap + dcp * dcp) + 2 * cap
    # the sharded indexer's merge of a decode step's 16 x R rows or an INDEXER_ROWS block of a prefill
    # chunk, of k 2048 int64 keys: own, gathered, side by side, topk's two
    merge = 8 * max(16 * rows, INDEXER_ROWS) * 2048 * (1 + 2 * dcp + 2)
    return _arena(name, dcp) + ring + recv + send + 8 * cap + stash + indexer + merge + plan


def _replica_reserved(name: str, kv_bytes: int, dcp: int, record: int = 368, mtp: bool = True) -> int:
    """What patched vLLM reserves: the buffers, then under DCP > 1 replica_window auto's store: the
    whole 262,144-token store for 16 requests x 78 layers x 368/432 B is far above a fifth of what
    the buffers left, so a fifth of that; DCP1: no store."""
    b = _buffers(name, record, dcp, mtp)
    return b + (kv_bytes - b) // 5 if dcp > 1 else b


@pytest.mark.parametrize("name,sets,noted", [
    ("glm52-tp4-dcp4-mtp3-368", [], True),  # vLLM's default FULL_AND_PIECEWISE
    ("glm52-tp4-dcp4-mtp0-368", ["vllm.compilation_config.cudagraph_mode=FULL_DECODE_ONLY"], True),
    ("glm52-tp4-dcp4-mtp3-368", ["vllm.compilation_config.cudagraph_mode=PIECEWISE"], False),
    ("glm52-tp4-dcp4-mtp3-368", ["vllm.enforce_eager=true"], False),
    ("glm52-tp4-dcp1-mtp3-368", [], False),  # no DCP collectives in the graph
])
def test_full_graphs_with_dcp_print_the_unchecked_hang_and_the_fallback(name, sets, noted, glm, capsys):
    argv = ["--profile", name, glm()] + [a for s in sets for a in ("--set", s)]
    rc, out, err = dry_run(capsys, *argv)
    assert rc == 0, err
    notes = [line for line in out.splitlines() if line.startswith("# NOTE:")]
    assert bool(notes) == noted, notes
    if noted:
        assert "vllm-project/vllm#46145" in notes[0] and "cudagraph_mode=PIECEWISE" in notes[0]


@pytest.mark.parametrize("name,record,dcp,mtp", [("glm52-tp4-dcp4-mtp3-368", 368, 4, True),
                                                 ("glm52-tp4-dcp4-mtp3-432", 432, 4, True),
                                                 ("glm52-tp4-dcp4-mtp0-368", 368, 4, False),
                                                 ("glm52-tp4-dcp1-mtp3-368", 368, 1, True)])
def test_kv_budget_check_is_the_capacity_core(name, record, dcp, mtp, glm, capsys):
    kv = int(serve.load_profile(name)["kv_gb"] * GIB)
    want = _tokens_that_fit(kv - _replica_reserved(name, kv, dcp, record, mtp), record, dcp, mtp)
    checked = serve.validate(serve.load_profile(name), glm52_config(), environ={})
    assert checked.plan.kv_tokens == want
    # The boundary: max_model_len = one block more than fits fails, exactly what fits passes.
    granule = 64 * dcp
    model = glm(max_position_embeddings=1 << 24)  # past 1M positions: the budget is the limit here
    assert dry_run(capsys, "--profile", name, model, "--set", f"vllm.max_model_len={want}")[0] == 0
    rc, _, err = dry_run(capsys, "--profile", name, model, "--set", f"max_model_len={want + granule}")
    assert rc == 2 and err.startswith("sparkinfer serve: vllm.max_model_len:") and f"{want:,}" in err
    # ... and the budget that just holds 262,144 tokens (bytes from the hand count) passes, less fails
    need = 262144 // dcp * (78 + mtp) * record + 262144 * (21 + mtp) * 132
    # the buffers, then under DCP > 1 the replica store takes a fifth
    need = _buffers(name, record, dcp, mtp) + (need * 5 // 4 if dcp > 1 else need)
    assert dry_run(capsys, "--profile", name, glm(), "--kv-gb", f"{(need + 64) / GIB!r}")[0] == 0
    assert dry_run(capsys, "--profile", name, glm(), "--kv-gb", f"{(need - 64) / GIB!r}")[0] == 2
    if dcp > 1:  # without replicas the whole budget but the buffers holds records
        data = serve.load_profile(name)
        serve.apply_set(data, "sparkinfer.replica_window=0")
        assert serve.validate(data, glm52_config(), environ={}).plan.kv_tokens == _tokens_that_fit(
            kv - _buffers(name, record, dcp, mtp), record, dcp, mtp)


def test_replica_store_line(glm, capsys):
    """auto: a fifth of 10 GiB reserved, the runtime's window from the rest (a quarter of it over 16
    requests x 78 layers x 368 B); an explicit window: its own bytes; stock mode or DCP1: none."""
    kv = 10 * GIB
    left = kv - _buffers("glm52-tp4-dcp4-mtp3-368", 368, 4, True)  # the selected path's buffers come first
    window = (left - left // 5) // 4 // (16 * 78 * 368)
    rc, out, _ = dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", glm())
    assert rc == 0 and (f"replica store: {left // 5 / GIB:.2f} GiB per GPU reserved out of the KV budget, "
                        f"{window:,} positions") in out
    rc, out, _ = dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", glm(),
                         "--set", "sparkinfer.replica_window=1024")
    assert rc == 0 and f"{1024 * 16 * 78 * 368 / GIB:.2f} GiB per GPU reserved" in out and "1,024 positions" in out
    for args in (["glm52-tp4-dcp1-mtp3-368"], ["glm52-tp4-dcp4-mtp3-368", "--set", "sparkinfer.mode=stock"]):
        rc, out, _ = dry_run(capsys, "--profile", args[0], glm(), *args[1:])
        assert rc == 0 and "replica store: none" in out
    # a window whose store does not fit the budget: named, with patched vLLM's own message
    rc, _, err = dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", glm(),
                         "--set", "sparkinfer.replica_window=200000")
    assert rc == 2 and err.startswith("sparkinfer serve: sparkinfer.replica_window:") and "does not fit" in err


BAD = [  # (config changes, --set overrides, the field the error must name); start-up refusals: STARTUP
    ({"model_type": "deepseek_v32", "index_topk_pattern": GLM52_PATTERN[:-1]}, [], "index_topk_pattern"),
    ({"model_type": "deepseek_v32", "index_topk_pattern": None, "indexer_types": ["full"] * 77}, [], "indexer_types"),
    ({}, ["vllm.compilation_config={max_cudagraph_capture_size=32}"],
     "vllm.compilation_config.max_cudagraph_capture_size"),
    ({}, ["vllm.max_num_seqs=17"], "vllm.compilation_config.cudagraph_capture_sizes"),
    ({}, ["vllm.compilation_config={cudagraph_mode='PIECEWISE', cudagraph_capture_sizes=[4, 8, 16, 32, 60]}"],
     "vllm.compilation_config.cudagraph_capture_sizes"),
    ({}, ["kv_gb=2"], "vllm.max_model_len"),
    ({"max_position_embeddings": 131072}, [], "vllm.max_model_len"),
    ({"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "default", "rope_theta": 8e6}}, [],
     "vllm.max_model_len"),
    ({"num_nextn_predict_layers": 0}, [], "vllm.speculative_config"),
    ({}, ["sparkinfer.window=3"], "sparkinfer.window"),
    ({}, ["vllm.kv_cache_dtype=auto"], "vllm.kv_cache_dtype"),
    ({"index_topk": None}, [], "index_topk"),
    ({}, ["vllm.block_size=0"], "vllm.block_size"),
    ({}, ["kv_gb=-1"], "kv_gb"),
    ({}, ["bogus=1"], "--set bogus"),
]


@pytest.mark.parametrize("changes,sets,field", BAD, ids=[b[2] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_field_is_named(changes, sets, field, glm, capsys):
    argv = ["--profile", "glm52-tp4-dcp4-mtp3-368", glm(**changes)]
    for s in sets:
        argv += ["--set", s]
    rc, out, err = dry_run(capsys, *argv)
    assert rc == 2 and out == ""
    # one line: the field (a config.json key after the file's path), then what is wrong
    assert re.match(rf"sparkinfer serve: (\S+/config\.json: )?{re.escape(field)}[:= ]", err), err
    assert err.count("\n") == 1, err
    assert dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", glm())[0] == 0  # the good one passes


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "kv_lora_rank": None,
         "scoring_func": None, "topk_method": None, "indexer_rope_interleave": None}
SHARED_FIRST = "S" + GLM52_PATTERN[1:]
GLM52_TYPES = ["full" if c == "F" else "shared" for c in GLM52_PATTERN]  # transformers' indexer_types
STARTUP = [  # every reason patched vLLM refuses to start (model_config_check.startup_problems), at least once:
    # (config changes, --set overrides, environment, vLLM's ModelConfig.use_mla, what the reason names)
    ({"scoring_func": None, "indexer_rope_interleave": None}, [], {}, True,
     ['scoring_func missing', '"scoring_func": "sigmoid"', 'indexer_rope_interleave missing',
      '"indexer_rope_interleave": true']),
    ({"topk_method": "greedy"}, [], {}, True, ["topk_method is 'greedy'", '"topk_method": "noaux_tc"']),
    ({"index_topk_pattern": GLM52_PATTERN[:-1], "indexer_types": GLM52_TYPES}, [], {}, True,
     ["index_topk_pattern has 77 characters but num_hidden_layers is 78"]),
    ({"index_topk_pattern": None, "indexer_types": ["full"] * 77}, [], {}, True, ["expected 78 entries"]),
    ({"index_topk_pattern": "FFFFSS" + GLM52_PATTERN[6:], "indexer_types": GLM52_TYPES}, [], {}, True,
     ["IndexShare: vLLM reads FFFFSS"]),
    ({"index_topk_pattern": SHARED_FIRST, "indexer_types": ["full" if c == "F" else "shared" for c in SHARED_FIRST]},
     [], {}, True, ["layer 0 has no earlier Full layer"]),
    ({"first_k_dense_replace": 1, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 75}, [], {}, True,
     ['set "first_k_dense_replace": 3']),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, [], {}, True, ["rope_parameters.rope_type is 'linear'"]),
    ({"attention_bias": True}, [], {}, True, ["attention_bias is true"]),
    ({"llama_4_scaling": {"beta": 0.1}}, [], {}, True, ["llama_4_scaling is set"]),
    ({"num_attention_heads": 6}, [], {}, True, ["tensor_parallel_size 4 does not divide the model's 6 attention heads"]),
    ({}, ["vllm.tensor_parallel_size=3"], {}, True,
     ["tensor_parallel_size 3 does not divide the model's 64", "decode_context_parallel_size 4 must divide "
                                                              "tensor_parallel_size 3"]),
    ({}, ["vllm.decode_context_parallel_size=3"], {}, True, ["decode_context_parallel_size 3 must divide"]),
    ({}, ["sparkinfer.mode=fast"], {}, True, ["sparkinfer mode (from --sparkinfer-mode)", "'fast'"]),
    ({}, ["sparkinfer.pool_mb=0"], {}, True, ["sparkinfer pool_mb (from --sparkinfer-pool-mb)"]),
    ({}, ["sparkinfer.replica_window=-1"], {}, True, ["sparkinfer replica_window"]),
    ({}, [], {"VLLM_SPARKINFER_MOOD": "auto"}, True, ["VLLM_SPARKINFER_MOOD"]),
    ({}, ["env.VLLM_SPARKINFER_MODEE=stock"], {}, True, ["VLLM_SPARKINFER_MODEE"]),  # the profile's [env]
    (LLAMA, [], {}, False, ["--kv-cache-dtype nvfp4_368", "does not use MLA"]),
]
PROFILE = "glm52-tp4-dcp4-mtp3-368"


class _HF:
    """transformers' config object as vLLM holds it: attributes plus ``to_dict()``."""

    def __init__(self, d):
        self.__dict__.update(d)

    def to_dict(self):
        return dict(self.__dict__)


def vllm_refusal(profile: str, cfg: dict, sets: list[str], use_mla: bool, environ: dict) -> str | None:
    """What patched vLLM's start-up check (the function patch 0002 calls in
    ``EngineArgs.create_engine_config``) says about the profile's engine: its message, None if it
    starts. The engine's arguments as vLLM holds them: every sparkinfer field (None = not given),
    ``hf_config``, ``use_mla``, the cache dtype and the parallel sizes."""
    data = serve.load_profile(profile)
    for s in sets:
        serve.apply_set(data, s)
    v = data["vllm"]
    cli = {f: data["sparkinfer"].get(f) for f in sc.FIELD_NAMES}
    model = SimpleNamespace(hf_config=_HF(cfg), use_mla=use_mla)
    par = SimpleNamespace(tensor_parallel_size=v["tensor_parallel_size"],
                          decode_context_parallel_size=v["decode_context_parallel_size"])
    saved = dict(os.environ)
    os.environ.update(environ, **data["env"])  # vLLM runs in the caller's environment plus [env]
    try:
        mcc.check_at_startup(cli, model, v["kv_cache_dtype"], par)
    except SparkinferConfigError as e:
        return str(e)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None


@pytest.mark.parametrize("changes,sets,env,use_mla,names", STARTUP, ids=[str(i) for i in range(len(STARTUP))])
def test_dry_run_fails_on_what_vllm_refuses_at_startup(changes, sets, env, use_mla, names, glm, capsys, monkeypatch):
    """The dry run and patched vLLM's start-up check refuse the same engines for the same reasons:
    each FAIL line is one of the reasons vLLM's one error joins, in its order."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = ["--profile", PROFILE, glm(**changes)]
    for s in sets:
        argv += ["--set", s]
    rc, out, err = dry_run(capsys, *argv)
    fails = [line.removeprefix("# FAIL: ") for line in out.splitlines() if line.startswith("# FAIL: ")]
    assert rc == 2 and fails and "# ok:" not in out, (out, err)
    assert err == f"sparkinfer serve: patched vLLM would refuse to start ({len(fails)} problem(s), the FAIL lines)\n"
    for part in names:
        assert any(part in f for f in fails), (part, fails)
    assert vllm_refusal(PROFILE, glm52_config(**changes), sets, use_mla, env) == "; ".join(fails)


ATTENTION_OP = "vllm::unified_mla_attention_with_output"
WORKER = [  # every reason patched vLLM's worker refuses at engine start (model_config_check.worker_problems):
    # (profile, --set overrides, what the FAIL lines name, in order); tests/vllm/test_engine_start.py
    # holds each against the worker's own check
    (PROFILE, [f"vllm.compilation_config.splitting_ops=['{ATTENTION_OP}']"],
     [f"splitting_ops ['{ATTENTION_OP}'] leaves ['vllm::sparse_attn_indexer', 'vllm::unified_mla_kv_cache_update']"]),
    (PROFILE, ["env.VLLM_USE_BREAKABLE_CUDAGRAPH=1"], ["the breakable CUDA graph"]),  # over the profile's 0
    (PROFILE, ["sparkinfer.fabric=host"], ["sparkinfer fabric 'host' with the caches on a GPU"]),
    (PROFILE, ["sparkinfer.fabric=host", "env.VLLM_USE_BREAKABLE_CUDAGRAPH=1"],  # the profile's [env]
     ["the breakable CUDA graph", "sparkinfer fabric 'host'"]),
]
WORKER_STARTS = [  # what the worker starts though it looks close to the above: (profile, --set overrides)
    ("glm52-tp4-dcp1-mtp3-368", []),  # vLLM's default FULL_AND_PIECEWISE, every decode batch captured
    # FULL decode graphs whose sizes pad decode batches (of 3, 5, 6 and 7 requests; with vLLM's default
    # sizes, of 3, 5, 7, ...) into a larger graph: the builders plan the padding (step_plan.batch_rows)
    ("glm52-tp4-dcp1-mtp3-368", ["vllm.compilation_config.cudagraph_capture_sizes=[4, 8, 16, 32, 64]"]),
    ("glm52-tp4-dcp1-mtp3-368", ["vllm.compilation_config={cudagraph_mode='FULL_AND_PIECEWISE'}"]),
    ("glm52-tp4-dcp1-mtp3-368", ["vllm.compilation_config.cudagraph_mode=FULL_DECODE_ONLY"]),
    ("glm52-tp4-dcp1-mtp3-368", ["vllm.compilation_config.cudagraph_mode=FULL"]),  # vLLM: FULL_AND_PIECEWISE
    (PROFILE, []),  # the DCP4 profiles' own: vLLM's default FULL_AND_PIECEWISE, indexer_scoring auto
    (PROFILE, ["vllm.compilation_config.cudagraph_mode=FULL_DECODE_ONLY"]),
    (PROFILE, ["vllm.compilation_config.cudagraph_mode=FULL"]),  # vLLM: FULL_AND_PIECEWISE
    (PROFILE, ["vllm.compilation_config={max_cudagraph_capture_size=64}"]),  # vLLM's default sizes: padded
    (PROFILE, ["vllm.compilation_config.cudagraph_mode=PIECEWISE"]),
    (PROFILE, ["vllm.compilation_config.splitting_ops=[]"]),  # PIECEWISE, nothing split: NONE
    ("glm52-tp4-dcp1-mtp3-368", ["vllm.compilation_config.cudagraph_mode=FULL", "vllm.enforce_eager=true"]),
    ("glm52-tp4-dcp1-mtp3-368", ["sparkinfer.fabric=host"]),  # DCP1: no selected path, no fabric
    (PROFILE, ["sparkinfer.fabric=host", "sparkinfer.mode=stock"]),
]


@pytest.mark.parametrize("profile,sets,names", WORKER, ids=[str(i) for i in range(len(WORKER))])
def test_dry_run_fails_on_what_the_worker_refuses_at_engine_start(profile, sets, names, glm, capsys):
    """Graph modes that would capture a sparkinfer op and a fabric that cannot reach the caches on
    GPUs: FAIL lines, exit 2, each naming its reason in the worker's order (graphs, then fabric)."""
    argv = ["--profile", profile, glm()]
    for s in sets:
        argv += ["--set", s]
    rc, out, err = dry_run(capsys, *argv)
    fails = [line.removeprefix("# FAIL: ") for line in out.splitlines() if line.startswith("# FAIL: ")]
    assert rc == 2 and len(fails) == len(names) and "# ok:" not in out, (out, err)
    assert all(part in fail for part, fail in zip(names, fails)), (names, fails)


def test_dry_run_fails_on_a_named_backend_that_cannot_read_the_records(glm, capsys):
    """The workers stop building the model (tests/vllm/test_engine_start.py holds it to vLLM's
    backends): one FAIL line, before the engine-start checks (a broken fabric is not reached)."""
    for sets in (["vllm.attention_backend=FLASHMLA_SPARSE"], ["vllm.attention_config={backend='FLASHMLA_SPARSE'}"]):
        rc, out, err = dry_run(capsys, "--profile", PROFILE, glm(), "--set", "sparkinfer.fabric=host",
                               *[a for s in sets for a in ("--set", s)])
        fails = [line.removeprefix("# FAIL: ") for line in out.splitlines() if line.startswith("# FAIL: ")]
        assert rc == 2 and len(fails) == 1 and "attention backend FLASHMLA_SPARSE named cannot read it" in fails[0]
    assert dry_run(capsys, "--profile", PROFILE, glm(), "--set", "vllm.attention_backend=auto")[0] == 0


@pytest.mark.parametrize("profile,sets", WORKER_STARTS, ids=[str(i) for i in range(len(WORKER_STARTS))])
def test_dry_run_passes_what_the_worker_starts(profile, sets, glm, capsys):
    argv = ["--profile", profile, glm()]
    for s in sets:
        argv += ["--set", s]
    rc, out, err = dry_run(capsys, *argv)
    assert rc == 0 and "# FAIL" not in out, (out, err)


def test_the_profiles_opt_out_of_the_breakable_graph_whatever_the_caller_set(glm, capsys, monkeypatch):
    """vLLM turns its breakable CUDA graph on for GLM-DSA models and sets the variable itself (so a
    process that built one engine config has it set); every profile's [env] sets it to 0, and the
    profile's [env] is what vLLM runs with (``sparkinfer serve`` execs it over the caller's)."""
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    for name in NAMES:
        assert serve.load_profile(name)["env"]["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"
        assert dry_run(capsys, "--profile", name, glm())[0] == 0


@pytest.mark.parametrize("name", NAMES)
def test_vllm_starts_what_the_dry_run_passes(name, capsys, glm):
    """The converse: the profiles the dry run passes, patched vLLM's start-up check passes too."""
    assert dry_run(capsys, "--profile", name, glm())[0] == 0
    assert vllm_refusal(name, glm52_config(), [], True, {}) is None


def test_patch_0002_calls_the_checker_with_the_engine_arguments():
    """The start-up check the tests above call is the one patched vLLM runs, with the engine's
    sparkinfer fields, model config, cache dtype and parallel config."""
    patch = (REPO / "vllm_patches" / "series" / "0002-sparkinfer-config.patch").read_text()
    added = "".join(line[1:].strip() for line in patch.splitlines() if line.startswith("+") and
                    not line.startswith("+++"))
    assert ("sparkinfer_startup.check_at_startup({f: getattr(self, f\"sparkinfer_{f}\")for f in "
            "sparkinfer_config.FIELD_NAMES},model_config,cache_config.cache_dtype,parallel_config,)") in added
    assert "import sparkinfer.vllm.model_config_check as sparkinfer_startup" in added


def test_other_errors_name_what_to_fix(glm, tmp_path, capsys):
    model = glm()
    rc, _, err = dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", str(tmp_path / "nowhere"))
    assert rc == 2 and "MODEL" in err and "config.json" in err
    rc, _, err = dry_run(capsys, "--profile", "nope", model)
    assert rc == 2 and "no serve profile 'nope'" in err and "glm52-tp4-dcp4-mtp3-368" in err
    rc, _, err = dry_run(capsys, "--profile", "rtx_pro_6000_x4", model)
    assert rc == 2 and "hardware cost profile" in err and "--hw rtx_pro_6000_x4" in err
    # a flag the profile sets must go through --set, where it is checked
    rc, _, err = dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", model, "--", "--tensor-parallel-size", "2")
    assert rc == 2 and "--set vllm.tensor_parallel_size=VALUE" in err
    rc, _, err = dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", model, "--", "--sparkinfer-mode=stock")
    assert rc == 2 and "--set sparkinfer.mode=VALUE" in err


def test_overrides_and_passthrough(glm, capsys, monkeypatch):
    model = glm()
    monkeypatch.setenv("VLLM_SPARKINFER_POOL_MB", "1024")
    rc, out, err = dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", model,
                           "--set", "max_model_len=131072", "--set", "sparkinfer.mode=stock",
                           "--set", "vllm.compilation_config.cudagraph_mode=PIECEWISE",
                           "--set", "vllm.enforce_eager=true", "--set", "vllm.enable_prefix_caching=false",
                           "--set", "vllm.served_model_name='glm 5.2'", "--set", "env.NCCL_DEBUG=INFO",
                           "--", "--max-logprobs", "8", "--seed", "7")
    assert rc == 0, err
    argv = command(out)
    assert argv[-4:] == ["--max-logprobs", "8", "--seed", "7"]
    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv
    f = pairs([a for a in argv[3:-4] if a not in ("--enforce-eager", "--no-enable-prefix-caching")])
    assert "--enable-prefix-caching" not in f
    assert f["--max-model-len"] == "131072" and f["--sparkinfer-mode"] == "stock"
    assert f["--served-model-name"] == "glm 5.2"
    assert json.loads(f["--compilation-config"]) == {"cudagraph_capture_sizes": list(range(4, 65, 4)),
                                                     "cudagraph_mode": "PIECEWISE"}
    assert "export NCCL_DEBUG=INFO" in out.splitlines()
    assert "# VLLM_SPARKINFER_POOL_MB in the environment is overridden by the profile's --sparkinfer-pool-mb" in out


def test_scaled_rope_leaves_the_length_to_vllm(glm, capsys):
    model = glm(max_position_embeddings=131072, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", model)[0] == 0


def test_profile_by_path_and_kv_gb_absent(glm, tmp_path, capsys):
    text = (REPO / "profiles" / "serve" / "glm52-tp4-dcp4-mtp0-368.toml").read_text()
    path = tmp_path / "mine.toml"
    path.write_text(text.replace("kv_gb = 10.0", "").replace("max_model_len = 262144", "max_model_len = 4194304"))
    rc, out, err = dry_run(capsys, "--profile", str(path), glm(max_position_embeddings=1 << 24))
    assert rc == 0 and "KV budget" not in out  # no budget: not checked (4M tokens would not fit 10 GiB)
    rc, _, err = dry_run(capsys, "--profile", str(path), glm(max_position_embeddings=1 << 24), "--kv-gb", "10")
    assert rc == 2 and "vllm.max_model_len" in err and "do not fit kv_gb 10 GiB" in err
    path.write_text("replicas = 2\n" + text)
    rc, _, err = dry_run(capsys, "--profile", str(path), glm())
    assert rc == 2 and err.startswith("sparkinfer serve: replicas: unknown profile key")
    path.write_text(text.replace("[sparkinfer]\n", "[sparkinfer]\nreplicas = 2\n"))  # now inside [sparkinfer]
    rc, _, err = dry_run(capsys, "--profile", str(path), glm())
    assert rc == 2 and err.startswith("sparkinfer serve: sparkinfer.replicas: not a sparkinfer setting")
    path.write_text(text.replace('replica_window = "auto"', "replica_window = 300000"))
    rc, _, err = dry_run(capsys, "--profile", str(path), glm())
    assert rc == 2 and err.startswith("sparkinfer serve: sparkinfer.replica_window: 300000 positions > max_model_len")


def test_serve_execs_vllm_with_the_command_and_env(glm, tmp_path, capsys):
    """A fake `vllm` on the PATH records what `sparkinfer serve` (no --dry-run) runs."""
    model = glm()
    rc, out, _ = dry_run(capsys, "--profile", "glm52-tp4-dcp4-mtp3-368", model, "--set", "env.NCCL_DEBUG=WARN",
                         "--", "--seed", "1")
    assert rc == 0
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" vllm "$@" > "$REC/argv"\necho "$NCCL_DEBUG" > "$REC/env"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(sc.ENV_PREFIX)}
    env.update(PATH=f"{fake.parent}:{env['PATH']}", REC=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "sparkinfer", "serve", "--profile", "glm52-tp4-dcp4-mtp3-368", model,
                        "--set", "env.NCCL_DEBUG=WARN", "--", "--seed", "1"],
                       env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == out  # what it printed is what --dry-run prints
    assert (tmp_path / "argv").read_text().splitlines() == command(out)
    assert (tmp_path / "env").read_text().strip() == "WARN"
    # no vllm on the PATH: exit 2 with the reason, no traceback
    env["PATH"] = "/nonexistent"
    r = subprocess.run([sys.executable, "-m", "sparkinfer", "serve", "--profile", "glm52-tp4-dcp4-mtp3-368", model],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "vllm is not on PATH" in r.stderr and "Traceback" not in r.stderr


def test_plan_reads_the_same_profiles(capsys):
    from sparkinfer.cli import plan as plan_cli
    from sparkinfer.core.capacity import capacity_plan

    for name in NAMES:
        data = serve.load_profile(name)
        ap = __import__("argparse").ArgumentParser()
        plan_cli.add_arguments(ap)
        args = ap.parse_args(["--profile", name])
        got = plan_cli.capacity_of(args)  # the budget less sparkinfer's buffers, as serve checks it
        serve.apply_set(data, "sparkinfer.replica_window=0")  # plan's capacity table is without the store
        want = serve.validate(data, glm52_config(), environ={}).plan
        assert (got.kv_tokens, got.record_format, got.profile.dcp, got.profile.mtp) == \
            (want.kv_tokens, want.record_format, want.profile.dcp, want.profile.mtp)
        args = ap.parse_args(["--profile", name, "--dcp", "2", "--kv-gb", "4"])  # flags win
        p = plan_cli.profile_from_args(args)
        assert (p.dcp, p.kv_bytes, p.tp) == (2, 4 * GIB, 4)
    with pytest.raises(SystemExit, match="pass it as --hw rtx_pro_6000_x4"):
        cli_main(["plan", "--profile", "rtx_pro_6000_x4"])
    assert cli_main(["plan", "--profile", "glm52-tp4-dcp4-mtp3-368", "--hw", "rtx_pro_6000_x4"]) == 0
    out = capsys.readouterr().out
    assert "serve profile" in out and "Predicted per decode step on rtx_pro_6000_x4" in out


def test_core_imports_neither_torch_nor_the_cli():
    code = ("import pkgutil, importlib, sys, sparkinfer.core as c\n"
            "for m in pkgutil.iter_modules(c.__path__): importlib.import_module('sparkinfer.core.' + m.name)\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('sparkinfer.cli')]\n"
            "assert not bad, bad\n"
            "from sparkinfer.cli import main\n"
            "assert main(['plan', '--profile', 'glm52-tp4-dcp4-mtp3-368', '--hw', 'rtx_pro_6000_x4']) == 0\n"
            "assert 'torch' not in sys.modules, 'plan --profile imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
