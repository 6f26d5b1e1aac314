"""Serve benchmark: cold prefill and decode against a running OpenAI-compatible server (vLLM).

Cold prefill: for each context length, ``--prefill-reps`` requests whose prompt is a fresh list of
random token ids (so nothing hits the prefix cache) with ``max_tokens=1``; prefill tokens/s =
prompt tokens / time to first token (TTFT, from sending the request to the first streamed chunk).

Decode: at each concurrency c, c streams run at once (threads), each a fresh random prompt of
``--decode-prompt`` tokens and ``--decode-tokens`` generated tokens (``ignore_eos``). Reported:
aggregate decode tokens/s (completion tokens of all streams / the window from the first stream's
first token to the last stream's last token), per-stream tokens/s (completion tokens after the first
/ its own first-to-last time), and inter-token latency p50/p99 over the gaps between streamed
chunks. With MTP a chunk can carry several accepted tokens, so the ITL is per chunk (per decode
step), and per-stream tokens/s is what speculation raises.

Decode runs at each ``--decode-prompt`` length times each ``--concurrency`` level (decode tok/s vs
context and vs concurrency). Prompts are token-id lists (vLLM's /v1/completions accepts them), so
the prompt length is exact; the server's ``usage`` (requested with ``stream_options.include_usage``)
is used when present. Every request has a timeout, the request counts are bounded by the arguments,
and only a server on localhost is contacted unless ``--allow-remote``. Uses ``requests`` when
installed, else urllib. A progress bar (rich, on stderr) counts the requests.

Each result row carries the server's identity: the model (``/v1/models``), the vLLM version
(``/version``), and, when the server runs with ``VLLM_SERVER_DEV_MODE=1`` (``/server_info``), its
sparkinfer mode, TP/DCP sizes, KV cache dtype and speculative tokens; ``--profile`` and
``--sparkinfer-mode`` name them for a server that does not report them (a flag that contradicts
the server is an error). ``--csv`` and ``--jsonl`` write the rows; benchmarks/plot_serve.py draws
one or more such files side by side.

    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --contexts 8192 32768 131072 \\
        --decode-prompt 1024 32768 --concurrency 1 8 --profile glm52-tp4-dcp4-mtp3-368 \\
        --csv serve.csv --jsonl serve.jsonl
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

try:
    import requests
except ImportError:  # urllib does the same job, a little more verbosely
    requests = None

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
# GLM-5.2's vocabulary is 154,880 ids; this range stays clear of the special tokens at either end.
TOKEN_RANGE = (1000, 150000)


@dataclass
class StreamResult:
    """One streamed completion, timed with time.perf_counter()."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def timed(self) -> bool:
        """Whether the stream's decode was timed: its tokens came in more than one chunk. An API server
        that falls behind its engine merges a request's queued tokens into one chunk (seen on a busy
        2-core CI machine), and then the client saw no decode at all."""
        return len(self.chunks) > 1 and self.chunks[-1] > self.chunks[0]

    @property
    def decode_rate(self) -> float:
        """Tokens/s after the first token; NaN when the decode was not timed (``timed``)."""
        return (self.completion_tokens - 1) / (self.chunks[-1] - self.chunks[0]) if self.timed else float("nan")


@dataclass
class Row:
    phase: str  # "prefill" or "decode"
    context: int  # prompt tokens per request
    concurrency: int
    requests: int
    ttft_s: float  # median
    prefill_tok_s: float  # prompt tokens / TTFT, median
    decode_tok_s: float  # aggregate over concurrent streams
    stream_tok_s: float  # median per stream
    itl_p50_ms: float
    itl_p99_ms: float


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no data."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(-(-q * len(xs) // 100)) - 1))]


def check_url(url: str, allow_remote: bool) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must be http(s)://host:port, got {url!r}")
    if parts.hostname not in LOCAL_HOSTS and not allow_remote:
        raise ValueError(f"{parts.hostname} is not localhost; pass --allow-remote to benchmark another machine")
    return url.rstrip("/")


def random_prompt(rng: random.Random, n: int, token_range: tuple[int, int] = TOKEN_RANGE) -> list[int]:
    return [rng.randrange(*token_range) for _ in range(n)]


def _sse_lines(url: str, payload: dict, timeout: float):
    """Lines of a streamed POST response as they arrive (bytes, newline stripped)."""
    if requests is not None:
        with requests.post(url, json=payload, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                raise RuntimeError(f"POST {url}: HTTP {r.status_code}: {r.text[:300]}")
            # chunk_size=None: hand over each HTTP chunk as it comes, never wait to fill a buffer
            yield from r.iter_lines(chunk_size=None)
        return
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                yield line.rstrip(b"\r\n")
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None


def stream_completion(base: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> StreamResult:
    """One streamed /v1/completions request; raises RuntimeError on an HTTP error or an empty stream."""
    # return_token_ids (vLLM): each chunk names its tokens, so a token whose text is empty (a special
    # token, half a UTF-8 character) still counts as the step that produced it.
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
               "return_token_ids": True}
    res = StreamResult(sent=time.perf_counter())
    ids = 0  # tokens named by token_ids, where the server sends them
    for line in _sse_lines(base + "/v1/completions", payload, timeout):
        now = time.perf_counter()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        msg = json.loads(data)
        choice = (msg.get("choices") or [{}])[0]
        if choice.get("text") or choice.get("token_ids"):
            res.chunks.append(now)
            ids += len(choice.get("token_ids") or ())
        if msg.get("usage"):
            res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
            res.completion_tokens = msg["usage"].get("completion_tokens", 0)
    if not res.chunks:
        raise RuntimeError(f"{base}: the stream carried no tokens (max_tokens={max_tokens})")
    res.prompt_tokens = res.prompt_tokens or len(prompt)
    # no usage: the chunks' token_ids, else one token per chunk
    res.completion_tokens = res.completion_tokens or ids or len(res.chunks)
    return res


def _get_json(url: str, timeout: float, missing_ok: bool = False) -> dict | None:
    """GET a JSON body; None for a 404 when ``missing_ok`` (an endpoint this server does not have)."""
    if requests is not None:
        r = requests.get(url, timeout=timeout)
        if r.status_code == 404 and missing_ok:
            return None
        if r.status_code != 200:
            raise RuntimeError(f"GET {url}: HTTP {r.status_code}")
        return r.json()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        if e.code == 404 and missing_ok:
            return None
        raise RuntimeError(f"GET {url}: HTTP {e.code}") from None


def first_model(base: str, timeout: float) -> str:
    body = _get_json(base + "/v1/models", timeout)
    if not body.get("data"):
        raise RuntimeError(f"GET {base}/v1/models: the server lists no model")
    return body["data"][0]["id"]


# Identity columns, in the order the CSV writes them before the measurements.
IDENTITY = ("label", "model", "max_model_len", "vllm_version", "profile", "sparkinfer_mode", "mode_source",
            "tp", "dcp", "kv_cache_dtype", "spec_tokens", "url", "started_utc")


def server_identity(base: str, model: str | None, timeout: float, profile: str = "",
                    mode: str | None = None, label: str | None = None) -> dict:
    """Who answered: the model card, /version, and /server_info where the server exposes it (vLLM's
    dev mode). ``mode``/``profile`` come from the caller; a ``mode`` the server contradicts is refused."""
    cards = (_get_json(base + "/v1/models", timeout) or {}).get("data") or []
    if not cards:
        raise RuntimeError(f"GET {base}/v1/models: the server lists no model")
    card = next((c for c in cards if c.get("id") == model), None) if model else cards[0]
    if card is None:
        raise RuntimeError(f"--model {model!r} is not served by {base} (it serves "
                           f"{', '.join(c.get('id', '?') for c in cards)})")
    version = (_get_json(base + "/version", timeout, missing_ok=True) or {}).get("version", "unknown")
    ident = {"model": card["id"], "max_model_len": card.get("max_model_len", ""), "vllm_version": version,
             "profile": profile, "sparkinfer_mode": mode or "", "mode_source": "flag" if mode else "",
             "tp": "", "dcp": "", "kv_cache_dtype": "", "spec_tokens": "", "url": base,
             "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    info = _get_json(base + "/server_info?config_format=json", timeout, missing_ok=True)
    cfg = (info or {}).get("vllm_config")
    if isinstance(cfg, dict):
        par, cache, spec = cfg.get("parallel_config") or {}, cfg.get("cache_config") or {}, cfg.get("speculative_config")
        ident.update(tp=par.get("tensor_parallel_size", ""), dcp=par.get("decode_context_parallel_size", ""),
                     kv_cache_dtype=cache.get("cache_dtype", ""),
                     spec_tokens=(spec or {}).get("num_speculative_tokens") or 0)
        served = ((cfg.get("additional_config") or {}).get("sparkinfer") or {}).get("mode")
        if served:
            if mode and mode != served:
                raise RuntimeError(f"--sparkinfer-mode {mode} but the server at {base} runs sparkinfer mode "
                                   f"{served}; drop the flag or benchmark the intended server")
            ident.update(sparkinfer_mode=served, mode_source="server")
    ident["label"] = label or " ".join(x for x in (profile or ident["model"], ident["sparkinfer_mode"]) if x)
    return {k: ident[k] for k in IDENTITY}


def prefill_row(results: list[StreamResult], context: int) -> Row:
    nan = float("nan")
    return Row("prefill", context, 1, len(results), ttft_s=statistics.median(r.ttft for r in results),
               prefill_tok_s=statistics.median(r.prompt_tokens / r.ttft for r in results),
               decode_tok_s=nan, stream_tok_s=nan, itl_p50_ms=nan, itl_p99_ms=nan)


def decode_row(results: list[StreamResult], prompt_len: int) -> Row:
    """Streams that ran at once: aggregate tokens/s over the window from the first stream's first
    token to the last stream's last token, median per-stream rate, ITL over all chunk gaps. Only the
    streams whose decode was timed count (``StreamResult.timed``); none timed gives NaN rates."""
    timed = [r for r in results if r.timed]
    window = max(r.chunks[-1] for r in timed) - min(r.chunks[0] for r in timed) if timed else 0.0
    after_first = sum(r.completion_tokens - 1 for r in timed)
    gaps = [g for r in results for g in r.gaps]
    return Row("decode", prompt_len, len(results), len(results),
               ttft_s=statistics.median(r.ttft for r in results), prefill_tok_s=float("nan"),
               decode_tok_s=after_first / window if window > 0 else float("nan"),
               stream_tok_s=statistics.median(r.decode_rate for r in timed) if timed else float("nan"),
               itl_p50_ms=percentile(gaps, 50) * 1e3, itl_p99_ms=percentile(gaps, 99) * 1e3)


def _nothing() -> None:
    pass


def cold_prefill(base: str, model: str, context: int, reps: int, timeout: float, rng: random.Random,
                 token_range: tuple[int, int] = TOKEN_RANGE, on_done=_nothing) -> Row:
    results = []
    for _ in range(reps):
        results.append(stream_completion(base, model, random_prompt(rng, context, token_range), 1, timeout))
        on_done()
    return prefill_row(results, context)


def decode(base: str, model: str, concurrency: int, prompt_len: int, tokens: int, timeout: float,
           rng: random.Random, token_range: tuple[int, int] = TOKEN_RANGE, on_done=_nothing) -> Row:
    prompts = [random_prompt(rng, prompt_len, token_range) for _ in range(concurrency)]
    results: list[StreamResult | None] = [None] * concurrency
    errors: list[BaseException] = []

    def one(i):
        try:
            results[i] = stream_completion(base, model, prompts[i], tokens, timeout)
            on_done()
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return decode_row(results, prompt_len)


def request_count(args: argparse.Namespace) -> int:
    return len(args.contexts) * args.prefill_reps + len(args.decode_prompt) * sum(args.concurrency)


def _progress(enabled: bool):
    """A rich progress bar on stderr (stdout keeps the table), or None."""
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
                    TimeElapsedColumn(), console=Console(stderr=True))


def run(args: argparse.Namespace, identity: dict | None = None) -> list[Row]:
    base = check_url(args.url, args.allow_remote)
    model = args.model or (identity or {}).get("model") or first_model(base, args.timeout)
    rng = random.Random(args.seed)
    rng_range = tuple(args.token_range)
    bar = _progress(getattr(args, "progress", False))
    rows: list[Row] = []
    lock = threading.Lock()
    with bar if bar is not None else _NoBar():
        task = bar.add_task("serve bench", total=request_count(args)) if bar is not None else None

        def done():
            if bar is not None:
                with lock:  # decode streams finish on their own threads
                    bar.advance(task)

        def phase(text):
            if bar is not None:
                bar.update(task, description=text)

        for n in args.contexts:
            phase(f"prefill {n:,} tok")
            rows.append(cold_prefill(base, model, n, args.prefill_reps, args.timeout, rng, rng_range, done))
        for p in args.decode_prompt:
            for c in args.concurrency:
                phase(f"decode {p:,} tok x{c}")
                rows.append(decode(base, model, c, p, args.decode_tokens, args.timeout, rng, rng_range, done))
    return rows


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def print_rows(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ("phase", "context", "concurrency", "requests", "TTFT s", "prefill tok/s", "decode tok/s (all)",
            "tok/s per stream", "ITL p50 ms", "ITL p99 ms")
    for c in cols:
        table.add_column(c, justify="left" if c == "phase" else "right")
    fmt = lambda x: "-" if x != x else f"{x:,.3f}" if abs(x) < 10 else f"{x:,.0f}"  # noqa: E731 (NaN -> "-")
    for r in rows:
        table.add_row(r.phase, f"{r.context:,}", str(r.concurrency), str(r.requests), fmt(r.ttft_s),
                      fmt(r.prefill_tok_s), fmt(r.decode_tok_s), fmt(r.stream_tok_s), fmt(r.itl_p50_ms),
                      fmt(r.itl_p99_ms))
    Console().print(table)


def result_records(rows: list[Row], identity: dict) -> list[dict]:
    """One flat record per row: the server's identity, then the measurements."""
    return [{**identity, **asdict(r)} for r in rows]


def write_csv(rows: list[Row], path: str, identity: dict | None = None) -> None:
    recs = result_records(rows, identity or {})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(recs[0]))
        w.writeheader()
        w.writerows(recs)


def write_jsonl(rows: list[Row], path: str, identity: dict) -> None:
    """JSON lines; NaN (a measurement that does not apply to the phase) is written as null."""
    with open(path, "w") as f:
        for rec in result_records(rows, identity):
            f.write(json.dumps({k: None if isinstance(v, float) and v != v else v for k, v in rec.items()}) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default localhost:8000)")
    ap.add_argument("--allow-remote", action="store_true", help="allow a server that is not on localhost")
    ap.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="cold prefill lengths")
    ap.add_argument("--prefill-reps", type=int, default=2, help="requests per prefill length (default 2)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="decode concurrency levels")
    ap.add_argument("--decode-prompt", type=int, nargs="+", default=[1024],
                    help="prompt tokens of a decode request; several: decode at each (tok/s vs context)")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens generated per decode request")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request (connect and each read)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-range", type=int, nargs=2, default=list(TOKEN_RANGE), metavar=("LO", "HI"),
                    help="random prompt ids in [LO, HI) (default GLM-5.2's %(default)s; a small model needs "
                         "its own vocabulary's)")
    ap.add_argument("--profile", default="", help="serve profile the server was started with (recorded)")
    ap.add_argument("--sparkinfer-mode", default=None, choices=("auto", "stock", "selected"),
                    help="sparkinfer mode of the server, recorded when the server does not report it")
    ap.add_argument("--label", default=None, help="name of this run in plots (default: profile or model, mode)")
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    ap.add_argument("--jsonl", default=None, help="also write the rows as JSON lines to this file")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = ap.parse_args(argv)
    for name in ("prefill_reps", "timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if min(args.decode_prompt) < 1:
        ap.error("--decode-prompt must be >= 1")
    if not 0 <= args.token_range[0] < args.token_range[1]:
        ap.error("--token-range LO HI needs 0 <= LO < HI")
    if args.decode_tokens < 2:
        ap.error("--decode-tokens must be >= 2 (inter-token latency needs two tokens)")
    if min(args.contexts) < 1 or not 1 <= min(args.concurrency) <= max(args.concurrency) <= 256:
        ap.error("--contexts must be >= 1 and --concurrency in [1, 256]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        base = check_url(args.url, args.allow_remote)
        identity = server_identity(base, args.model, args.timeout, args.profile, args.sparkinfer_mode, args.label)
        rows = run(args, identity)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"serve_bench: {e}", file=sys.stderr)
        return 1
    who = ", ".join(f"{k} {identity[k]}" for k in ("model", "vllm_version", "profile", "sparkinfer_mode", "tp", "dcp")
                    if identity[k] != "")
    print_rows(rows, f"serve benchmark: {args.url} ({who}; {'requests' if requests else 'urllib'})")
    if args.csv:
        write_csv(rows, args.csv, identity)
    if args.jsonl:
        write_jsonl(rows, args.jsonl, identity)
    return 0


if __name__ == "__main__":
    sys.exit(main())
