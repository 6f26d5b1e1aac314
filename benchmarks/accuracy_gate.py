"""Accuracy gate: KL divergence per record format, top-1 agreement, MTP acceptance, retrieval at depth.

Two ways to run it:

    # in-process on the trained fixture (sparkinfer/fixture), vLLM engines via vllm.LLM (patched venv)
    python benchmarks/accuracy_gate.py --fixture [--full] [--json rows.json]
    # against two running OpenAI-compatible vLLM servers serving the same model (a real node)
    python benchmarks/accuracy_gate.py --reference http://ref:8000 --candidate http://node:8000 \\
        --format nvfp4_368 --mode selected --dcp 4 --model-dir MODEL --context 4096 --logprobs 64
    # one node, one server at a time: measure the reference, save it, then the candidate
    python benchmarks/accuracy_gate.py --reference http://node:8000 --save-reference ref.npz ...
    python benchmarks/accuracy_gate.py --reference ref.npz --candidate http://node:8000 ...

Per configuration (kv cache format, sparkinfer mode, DCP) it measures, against the reference (the
unquantized cache at DCP1):

* ``kld_mean`` / ``kld_p99``: KL(reference || candidate) in nats of the full next-token
  distributions, teacher-forced over held-out text (prompt logprobs over the whole vocabulary);
* ``top1``: the fraction of those positions where both pick the same most likely token;
* ``accept_len``: MTP mean acceptance length with 3 speculative tokens (1 + accepted drafts per
  verification step, from vLLM's spec-decode counters) over the gate's greedy generations: the
  retrieval recalls and greedy continuations of held-out text (one batch, so that their decode
  steps overlap);
* ``retrieval``: {depth fraction: pass rate}: a NEEDLE-token span of random ids planted at that
  depth of the context, its first CUE tokens repeated at the end; pass = the greedy continuation
  is the rest of the span exactly (sparkinfer/fixture/data.py).

It fails (exit 1) when a mode changes anything against stock at the same format and DCP (greedy
tokens of the retrieval and MTP runs, acceptance, top-1 wherever stock's top-2 margin is above
NEAR_TIE, and KL(stock || mode) above MODE_KLD), or when a format exceeds its budget: the table
after ``<!-- accuracy-budgets -->`` in docs/design/record-formats.md (the single source; the
fixture's budgets for ``--fixture``, the node budgets for servers).

Matrix (``--full``): the reference (auto, DCP1), every record format at DCP1 (TP1) and, per
format, DCP2 (TP2) and DCP4 (TP4) in modes stock, selected (replica window 0) and replicas
(selected with a replica window of REPLICA_WINDOW < the context), the unquantized cache in stock
only (selected needs a record format). Without ``--full`` (CI, 6 engines): the reference,
fp8_ds_mla and nvfp4_432 at DCP1, and nvfp4_368 at DCP2 in all three modes; its DCP2 stock row is
the 368 point of the format order (DCP changes the numbers by summation order only: equal to
DCP1 to every printed digit when both were run). One engine per format and DCP size runs every
measurement of its modes in turn (``measure_engine``; CI: 4 engines).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparkinfer.fixture import MODEL_DIR, data  # noqa: E402

FORMATS = ("auto", "fp8_ds_mla", "nvfp4_432", "nvfp4_368")
RECORD_BYTES = {"auto": None, "fp8_ds_mla": 656, "nvfp4_432": 432, "nvfp4_368": 368}
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
CI_DEPTHS = (0.1, 0.5, 0.9)
NUM_SPEC = 3
REPLICA_WINDOW = 64
NEAR_TIE = 0.1  # nats: tests/vllm/test_vllm_dcp_prompts.py (a float-order flip may tip a tie this close)
MODE_KLD = 1e-4  # nats, KL(stock || mode) mean: summation order only (measured: docs/design/record-formats.md)
BUDGET_MARK = "<!-- accuracy-budgets -->"


@dataclass(frozen=True)
class Config:
    format: str
    mode: str  # stock | selected | replicas
    dcp: int

    @property
    def label(self) -> str:
        return f"{self.format}/{self.mode}/DCP{self.dcp}"


REFERENCE = Config("auto", "stock", 1)


def fixture_matrix(full: bool) -> list[Config]:
    if not full:
        return [REFERENCE] + [Config(f, "stock", 1) for f in FORMATS[1:-1]] + \
            [Config(FORMATS[-1], m, 2) for m in ("stock", "selected", "replicas")]
    out = [REFERENCE] + [Config(f, "stock", 1) for f in FORMATS[1:]]
    for dcp in (2, 4):
        out.append(Config("auto", "stock", dcp))
        out += [Config(f, m, dcp) for f in FORMATS[1:] for m in ("stock", "selected", "replicas")]
    return out


@dataclass
class Sets:
    """The token-id inputs every configuration gets (the same for engines and servers)."""
    heldout: list[list[int]]  # teacher-forced KL windows
    retrieval: list[tuple[float, list[int], list[int]]]
    mtp_prompts: list[list[int]]
    mtp_tokens: int

    @classmethod
    def build(cls, model_dir, context: int, full: bool) -> "Sets":
        """CI: 3 windows, one needle at each of CI_DEPTHS, 2 text continuations as long as a recall
        (every greedy request ends at the same step); ``full``: 8 windows, 4 needles at each of
        DEPTHS, 8 continuations of 48."""
        return cls(heldout=data.heldout_windows(model_dir, 8 if full else 3, context, seed=11),
                   retrieval=data.retrieval_prompts(model_dir, context, list(DEPTHS if full else CI_DEPTHS),
                                                    4 if full else 1, seed=12),
                   mtp_prompts=data.heldout_windows(model_dir, 8 if full else 2, context // 2, seed=13),
                   mtp_tokens=48 if full else data.NEEDLE - data.CUE)

    def max_model_len(self) -> int:
        """The longest request (prompt + generated tokens) plus the drafts past its last token."""
        longest = max([len(w) + 1 for w in self.heldout] + [len(p) + len(w) for _, p, w in self.retrieval] +
                      [len(p) + self.mtp_tokens for p in self.mtp_prompts])
        return longest + NUM_SPEC


@dataclass
class Measured:
    logprobs: list[np.ndarray]  # per held-out window: float64 [len - 1, vocab], position i predicts token i+1
    retrieval: list[list[int]]  # greedy continuation per retrieval prompt
    mtp_tokens: list[list[int]]
    drafts: float
    accepted: float
    seconds: float = 0.0

    @property
    def accept_len(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else float("nan")

    def save(self, path: Path) -> None:
        """As .npz (no pickles): a reference measured once, compared later (``--reference FILE``)."""
        meta = {"retrieval": self.retrieval, "mtp_tokens": self.mtp_tokens, "drafts": self.drafts,
                "accepted": self.accepted, "seconds": self.seconds}
        np.savez_compressed(path, meta=np.array(json.dumps(meta)),
                            **{f"logprobs_{i}": lp for i, lp in enumerate(self.logprobs)})

    @classmethod
    def load(cls, path: Path) -> "Measured":
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            logprobs = [z[f"logprobs_{i}"] for i in range(len(z.files) - 1)]
        return cls(logprobs, meta["retrieval"], meta["mtp_tokens"], meta["drafts"], meta["accepted"], meta["seconds"])


# --- engines ---------------------------------------------------------------------------------------

CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


def _spec_counts(metrics) -> tuple[float, float]:
    vals = {m.name: m.value for m in metrics if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
    return vals.get("vllm:spec_decode_num_drafts", 0.0), vals.get("vllm:spec_decode_num_accepted_tokens", 0.0)


def engine_args(cfg: Config, max_model_len: int, vocab: int) -> dict:
    """vLLM engine arguments of a configuration: TP = DCP = ``cfg.dcp``, MTP x NUM_SPEC, fp32."""
    return dict(dtype="float32", enforce_eager=True, max_model_len=max_model_len, max_num_seqs=8,
                kv_cache_dtype=cfg.format, tensor_parallel_size=cfg.dcp, decode_context_parallel_size=cfg.dcp,
                sparkinfer_mode="selected" if cfg.mode == "replicas" else cfg.mode, sparkinfer_pool_mb=4,
                sparkinfer_replica_window=REPLICA_WINDOW if cfg.mode == "replicas" else 0,
                max_logprobs=vocab, disable_log_stats=False,
                speculative_config={"method": "mtp", "num_speculative_tokens": NUM_SPEC},
                compilation_config={"custom_ops": ["-rotary_embedding"]})  # CPU rope bug for MLA q


def serve_args(cfg: Config, max_model_len: int, vocab: int) -> list[str]:
    """``engine_args`` as ``vllm serve`` flags."""
    out = []
    for k, v in engine_args(cfg, max_model_len, vocab).items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False:
            out += [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
    return out


def engine_groups(configs: list[Config]) -> list[list[Config]]:
    """The configurations one engine measures: those of one format and DCP size, in matrix order."""
    groups: dict = {}
    for cfg in configs:
        groups.setdefault((cfg.format, cfg.dcp), []).append(cfg)
    return list(groups.values())


def _engine_config(group: list[Config]) -> Config:
    """The configuration a group's engine starts in: the one that needs the most (a replica store
    for ``replicas``, the selected runtime for ``selected``); the others are switched to."""
    rank = {"stock": 0, "selected": 1, "replicas": 2}
    return max(group, key=lambda c: rank[c.mode])


def measure_engine(model_dir, group: list[Config], sets: Sets, vocab: int, max_model_len: int) -> dict:
    """One vllm.LLM at TP = DCP (TP1 for DCP1), MTP x NUM_SPEC, every measurement of every mode of
    ``group`` (one format and DCP, ``engine_groups``) -> {Config: Measured}. Between modes the
    workers switch paths (``worker_runtime.use_paths``) and the prefix cache is emptied, so each
    mode prefills and decodes every request itself; ``seconds`` of the first includes the start."""
    for k, v in CPU_ENV.items():
        os.environ[k] = v
    from vllm import LLM, SamplingParams

    from sparkinfer.vllm.worker_runtime import use_paths

    t0 = time.monotonic()
    llm = LLM(str(model_dir), **engine_args(_engine_config(group), max_model_len, vocab))
    out = {}
    try:
        for cfg in group:
            if len(group) > 1:
                mode, replicas = ("selected", True) if cfg.mode == "replicas" else (cfg.mode, False)
                llm.collective_rpc(use_paths, args=(mode, replicas))
                llm.reset_prefix_cache()
            tf = llm.generate([{"prompt_token_ids": p} for p in sets.heldout],
                              SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=vocab), use_tqdm=False)
            logprobs = [_dense(o.prompt_logprobs[1:], vocab) for o in tf]
            # one generate call for both greedy sets: the decode steps overlap (CI time)
            prompts = [p for _, p, _ in sets.retrieval] + sets.mtp_prompts
            lengths = [len(w) for _, _, w in sets.retrieval] + [sets.mtp_tokens] * len(sets.mtp_prompts)
            d0, a0 = _spec_counts(llm.get_metrics())
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths],
                                use_tqdm=False)
            d1, a1 = _spec_counts(llm.get_metrics())
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            k = len(sets.retrieval)
            out[cfg] = Measured(logprobs, tokens[:k], tokens[k:], d1 - d0, a1 - a0, time.monotonic() - t0)
            t0 = time.monotonic()
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()  # stops the TP workers now, not at interpreter exit
        del llm
        gc.collect()


def _dense(positions, vocab: int) -> np.ndarray:
    """vLLM's per-position {token: Logprob} (all ``vocab`` ids) as float64 [positions, vocab]."""
    out = np.full((len(positions), vocab), -np.inf)
    for i, pos in enumerate(positions):
        for tok, lp in pos.items():
            out[i, int(tok)] = lp.logprob if hasattr(lp, "logprob") else lp["logprob"]
    return out


# --- servers ---------------------------------------------------------------------------------------

class Server:
    """An OpenAI-compatible vLLM server at ``base`` (``/v1/completions`` with token-id prompts,
    vLLM's ``prompt_logprobs`` and ``return_token_ids``; spec-decode counters from ``/metrics``)."""

    def __init__(self, base: str):
        self.base = base.rstrip("/")
        self.model = json.loads(urllib.request.urlopen(self.base + "/v1/models", timeout=30).read())["data"][0]["id"]

    def complete(self, prompt: list[int], **kw) -> dict:
        body = json.dumps({"model": self.model, "prompt": prompt, "temperature": 0, **kw}).encode()
        req = urllib.request.Request(self.base + "/v1/completions", body, {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=600).read())["choices"][0]

    def spec_counts(self) -> tuple[float, float]:
        text = urllib.request.urlopen(self.base + "/metrics", timeout=30).read().decode()

        def total(name):
            return sum(float(m.group(1)) for m in re.finditer(rf"^{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))

        return total("vllm:spec_decode_num_drafts"), total("vllm:spec_decode_num_accepted_tokens")

    def measure(self, sets: Sets, vocab: int, top: int) -> Measured:
        """``top``: prompt logprobs per position (the server's ``--max-logprobs`` must allow it)."""
        t0 = time.monotonic()
        logprobs = []
        for p in sets.heldout:
            c = self.complete(p, max_tokens=1, prompt_logprobs=top)
            logprobs.append(_dense(c["prompt_logprobs"][1:], vocab))

        def greedy(p, n):
            return list(self.complete(p, max_tokens=n, ignore_eos=True, return_token_ids=True)["token_ids"])

        jobs = [(p, len(w)) for _, p, w in sets.retrieval] + [(p, sets.mtp_tokens) for p in sets.mtp_prompts]
        d0, a0 = self.spec_counts()
        with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent, so the server batches them as the engine does
            tokens = list(pool.map(lambda j: greedy(*j), jobs))
        d1, a1 = self.spec_counts()
        retrieval, mtp = tokens[:len(sets.retrieval)], tokens[len(sets.retrieval):]
        return Measured(logprobs, retrieval, mtp, d1 - d0, a1 - a0, time.monotonic() - t0)


# --- metrics and checks ----------------------------------------------------------------------------

def kl_rows(ref: list[np.ndarray], got: list[np.ndarray]) -> np.ndarray:
    """KL(ref || got) per teacher-forced position (nats), all windows concatenated.

    Tokens whose logprob either side did not report (-inf: a server asked for top-K < vocab) are
    pooled into one tail bucket per side (1 - the reported mass), so with partial logprobs this is
    the KL of the coarsened distributions, a lower bound of the full KL; with the whole vocabulary
    reported (the fixture) the tail is empty and the value exact."""
    out = []
    for p, q in zip(ref, got):
        known = np.isfinite(p) & np.isfinite(q)
        pk, qk = np.where(known, np.exp(p), 0.0), np.where(known, np.exp(q), 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            terms = np.where(known & (pk > 0), pk * (p - q), 0.0).sum(-1)
            p_tail = np.clip(1 - pk.sum(-1), 0, 1)
            q_tail = np.clip(1 - qk.sum(-1), 1e-300, 1)
            tail = np.where(p_tail > 1e-6, p_tail * np.log(np.maximum(p_tail, 1e-300) / q_tail), 0.0)
        out.append(terms + tail)
    return np.concatenate(out)


def row(cfg: Config, ref: Measured, got: Measured, sets: Sets) -> dict:
    kl = kl_rows(ref.logprobs, got.logprobs)
    top1 = np.concatenate([(a.argmax(-1) == b.argmax(-1)) for a, b in zip(ref.logprobs, got.logprobs)])
    nll = np.concatenate([-lp[np.arange(len(w) - 1), w[1:]] for lp, w in zip(got.logprobs, sets.heldout)])
    passed = {}
    for (depth, _, want), have in zip(sets.retrieval, got.retrieval):
        passed.setdefault(depth, []).append(have == want)
    return {"format": cfg.format, "mode": cfg.mode, "dcp": cfg.dcp, "kld_mean": float(kl.mean()),
            "kld_p99": float(np.quantile(kl, 0.99)), "top1": float(top1.mean()), "accept_len": got.accept_len,
            "ppl": float(np.exp(nll.mean())),
            "retrieval": {str(d): sum(v) / len(v) for d, v in passed.items()}, "seconds": round(got.seconds, 1)}


def mode_differences(stock: Measured, got: Measured) -> list[str]:
    """What a mode changed against stock at the same format and DCP (empty: nothing)."""
    bad = []
    if got.retrieval != stock.retrieval:
        bad.append("retrieval greedy tokens differ")
    if got.mtp_tokens != stock.mtp_tokens:
        bad.append("MTP greedy tokens differ")
    if (got.drafts, got.accepted) != (stock.drafts, stock.accepted):
        bad.append(f"MTP acceptance differs: {got.accepted}/{got.drafts} vs stock {stock.accepted}/{stock.drafts}")
    kl = kl_rows(stock.logprobs, got.logprobs)
    if kl.mean() > MODE_KLD:
        bad.append(f"KL(stock || mode) mean {kl.mean():.3g} > {MODE_KLD}")
    for s, g in zip(stock.logprobs, got.logprobs):
        top2 = np.sort(s, -1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > NEAR_TIE
        if (s.argmax(-1) != g.argmax(-1))[clear].any():
            bad.append("top-1 differs where stock's top-2 margin exceeds NEAR_TIE")
            break
    return bad


def read_budgets(doc: Path = ROOT / "docs/design/record-formats.md") -> dict[str, dict[str, float]]:
    """The budget table after BUDGET_MARK: ``| format | fixture kld_mean | fixture top1 | node kld_mean |``
    -> {format: {"fixture_kld_mean": .., "fixture_top1": .., "node_kld_mean": ..}}."""
    lines = doc.read_text().split(BUDGET_MARK, 1)[1].strip().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    keys = [h.replace(" ", "_").replace("≤", "").replace("≥", "").strip("_") for h in head[1:]]
    out = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        out[cells[0]] = {k: float(v) for k, v in zip(keys, cells[1:])}
    return out


def budget_failures(r: dict, budgets: dict, which: str) -> list[str]:
    b = budgets.get(r["format"])
    if b is None:
        return [f"no documented budget for format {r['format']}"]
    bad = []
    if r["kld_mean"] > b[f"{which}_kld_mean"]:
        bad.append(f"kld_mean {r['kld_mean']:.4g} > budget {b[f'{which}_kld_mean']}")
    if f"{which}_top1" in b and r["top1"] < b[f"{which}_top1"]:
        bad.append(f"top1 {r['top1']:.4f} < budget {b[f'{which}_top1']}")
    return bad


def table(rows: list[dict]) -> str:
    depths = sorted({d for r in rows for d in r["retrieval"]}, key=float)
    head = f"{'format':<11} {'mode':<9} {'dcp':>3} {'kld_mean':>9} {'kld_p99':>9} {'top1':>7} {'accept':>6}  " + \
        " ".join(f"r@{float(d):.1f}" for d in depths) + "  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['format']:<11} {r['mode']:<9} {r['dcp']:>3} {r['kld_mean']:>9.2e} {r['kld_p99']:>9.2e} "
                     f"{r['top1']:>7.4f} {r['accept_len']:>6.3f}  " +
                     " ".join(f"{r['retrieval'].get(d, float('nan')):>5.2f}" for d in depths) +
                     "  " + ("ok" if not r.get("failures") else "FAIL: " + "; ".join(r["failures"])))
    return "\n".join(lines)


def fixture_setup(model_dir: Path, full: bool) -> tuple[Sets, int, int]:
    """(the eval sets, max_model_len, vocab) of the fixture in ``model_dir``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    recipe = json.loads((Path(model_dir) / "recipe.json").read_text())
    sets = Sets.build(model_dir, recipe["context"], full)
    return sets, sets.max_model_len(), config["vocab_size"]


def run_fixture(full: bool, model_dir: Path = MODEL_DIR, configs: list[Config] | None = None,
                measured: dict | None = None) -> list[dict]:
    """Every configuration of the matrix in-process; rows with ``budget_failures`` and
    ``mode_failures`` (``failures``: both) filled in. ``measured``: filled with Config -> Measured."""
    sets, max_model_len, vocab = fixture_setup(model_dir, full)
    configs = configs or fixture_matrix(full)
    measured = {} if measured is None else measured
    for group in engine_groups(configs):
        measured.update(measure_engine(model_dir, group, sets, vocab, max_model_len))
        for cfg in group:
            print(f"[gate] {cfg.label}: {measured[cfg].seconds:.0f} s", file=sys.stderr, flush=True)
    budgets = read_budgets()
    rows = []
    for cfg in configs:
        r = row(cfg, measured[REFERENCE], measured[cfg], sets)
        r["budget_failures"] = [] if cfg == REFERENCE else budget_failures(r, budgets, "fixture")
        stock = measured.get(Config(cfg.format, "stock", cfg.dcp))
        r["mode_failures"] = mode_differences(stock, measured[cfg]) if cfg.mode != "stock" and stock else []
        r["failures"] = r["budget_failures"] + r["mode_failures"]
        rows.append(r)
    return rows


def run_servers(reference: str, candidate: str | None, model_dir: Path, cfg: Config, context: int, full: bool,
                top: int | None = None, save_reference: Path | None = None) -> list[dict]:
    """The gate between two servers; ``top`` prompt logprobs per position (default the whole
    vocabulary). ``reference``: a URL, or a file ``save_reference`` wrote earlier (one node can then
    serve the reference and the candidate one after the other); without ``candidate`` only that."""
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    sets = Sets.build(model_dir, context, full)
    top = top or vocab
    ref = Measured.load(Path(reference)) if Path(reference).is_file() else Server(reference).measure(sets, vocab, top)
    if save_reference:
        ref.save(save_reference)
    if len(ref.logprobs) != len(sets.heldout) or len(ref.retrieval) != len(sets.retrieval):
        raise SystemExit(f"{reference} was measured on other eval sets (--full / --context / --model-dir differ)")
    if candidate is None:
        return [row(REFERENCE, ref, ref, sets) | {"failures": [], "budget_failures": [], "mode_failures": []}]
    got = Server(candidate).measure(sets, vocab, top)
    r = row(cfg, ref, got, sets)
    r["budget_failures"], r["mode_failures"] = budget_failures(r, read_budgets(), "node"), []
    r["failures"] = r["budget_failures"]
    return [row(REFERENCE, ref, ref, sets) | {"failures": []}, r]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixture", action="store_true", help="run the in-process matrix on the trained fixture")
    p.add_argument("--full", action="store_true", help="the full matrix (DCP2 and DCP4, every format and mode)")
    p.add_argument("--reference", help="base URL of the reference server (unquantized cache, DCP1), or a file "
                                       "--save-reference wrote")
    p.add_argument("--save-reference", type=Path, help="write the reference's measurements here (.npz)")
    p.add_argument("--candidate", help="base URL of the candidate server")
    p.add_argument("--format", default="nvfp4_368", choices=FORMATS, help="the candidate's kv cache format (servers)")
    p.add_argument("--mode", default="stock", help="the candidate's sparkinfer mode (servers; reported only)")
    p.add_argument("--dcp", type=int, default=1, help="the candidate's DCP size (servers; reported only)")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR,
                   help="the served model's directory (tokenizer and config; default: the fixture)")
    p.add_argument("--context", type=int, default=None, help="context length of the eval sets (servers)")
    p.add_argument("--logprobs", type=int, default=None,
                   help="servers: prompt logprobs per position (default: the whole vocabulary; on a large "
                        "vocabulary e.g. 64, the KL then pools the rest into one bucket: a lower bound)")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    if args.fixture == bool(args.reference or args.candidate):
        p.error("give either --fixture or --reference (and --candidate)")
    if not args.fixture and not args.reference:
        p.error("--candidate needs --reference")
    t0 = time.monotonic()
    if args.fixture:
        rows = run_fixture(args.full, args.model_dir)
    else:
        recipe = args.model_dir / "recipe.json"
        if args.context is None and not recipe.exists():
            p.error(f"--context is needed: {recipe} (the fixture's trained context) does not exist")
        context = args.context or json.loads(recipe.read_text())["context"]
        rows = run_servers(args.reference, args.candidate, args.model_dir, Config(args.format, args.mode, args.dcp),
                           context, args.full, args.logprobs, args.save_reference)
    print(table(rows))
    print(f"[gate] {len(rows)} configurations in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    failed = [r for r in rows if r["failures"]]
    return 1 if failed or any(math.isnan(r["accept_len"]) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
