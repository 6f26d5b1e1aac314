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

Prompts are token-id lists (vLLM's /v1/completions accepts them), so the prompt length is exact;
the server's ``usage`` (requested with ``stream_options.include_usage``) is used when present.
Every request has a timeout, the request counts are bounded by the arguments, and only a server on
localhost is contacted unless ``--allow-remote``. Uses ``requests`` when installed, else urllib.

    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --contexts 8192 32768 131072 \\
        --concurrency 1 8 --csv serve.csv
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
    def decode_rate(self) -> float:
        """Tokens/s after the first token (0 when fewer than two chunks)."""
        span = self.chunks[-1] - self.chunks[0] if len(self.chunks) > 1 else 0.0
        return (self.completion_tokens - 1) / span if span > 0 else 0.0


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


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


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
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = StreamResult(sent=time.perf_counter())
    for line in _sse_lines(base + "/v1/completions", payload, timeout):
        now = time.perf_counter()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        msg = json.loads(data)
        if msg.get("choices") and msg["choices"][0].get("text"):
            res.chunks.append(now)
        if msg.get("usage"):
            res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
            res.completion_tokens = msg["usage"].get("completion_tokens", 0)
    if not res.chunks:
        raise RuntimeError(f"{base}: the stream carried no tokens (max_tokens={max_tokens})")
    res.prompt_tokens = res.prompt_tokens or len(prompt)
    res.completion_tokens = res.completion_tokens or len(res.chunks)  # no usage: one token per chunk
    return res


def first_model(base: str, timeout: float) -> str:
    url = base + "/v1/models"
    if requests is not None:
        r = requests.get(url, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"GET {url}: HTTP {r.status_code}")
        body = r.json()
    else:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = json.load(r)
    if not body.get("data"):
        raise RuntimeError(f"GET {url}: the server lists no model")
    return body["data"][0]["id"]


def prefill_row(results: list[StreamResult], context: int) -> Row:
    nan = float("nan")
    return Row("prefill", context, 1, len(results), ttft_s=statistics.median(r.ttft for r in results),
               prefill_tok_s=statistics.median(r.prompt_tokens / r.ttft for r in results),
               decode_tok_s=nan, stream_tok_s=nan, itl_p50_ms=nan, itl_p99_ms=nan)


def decode_row(results: list[StreamResult], prompt_len: int) -> Row:
    """Streams that ran at once: aggregate tokens/s over the window from the first stream's first
    token to the last stream's last token, median per-stream rate, ITL over all chunk gaps."""
    window = max(r.chunks[-1] for r in results) - min(r.chunks[0] for r in results)
    after_first = sum(r.completion_tokens - 1 for r in results)
    gaps = [g for r in results for g in r.gaps]
    return Row("decode", prompt_len, len(results), len(results),
               ttft_s=statistics.median(r.ttft for r in results), prefill_tok_s=float("nan"),
               decode_tok_s=after_first / window if window > 0 else float("nan"),
               stream_tok_s=statistics.median(r.decode_rate for r in results),
               itl_p50_ms=percentile(gaps, 50) * 1e3, itl_p99_ms=percentile(gaps, 99) * 1e3)


def cold_prefill(base: str, model: str, context: int, reps: int, timeout: float, rng: random.Random) -> Row:
    return prefill_row([stream_completion(base, model, random_prompt(rng, context), 1, timeout)
                        for _ in range(reps)], context)


def decode(base: str, model: str, concurrency: int, prompt_len: int, tokens: int, timeout: float,
           rng: random.Random) -> Row:
    prompts = [random_prompt(rng, prompt_len) for _ in range(concurrency)]
    results: list[StreamResult | None] = [None] * concurrency
    errors: list[BaseException] = []

    def one(i):
        try:
            results[i] = stream_completion(base, model, prompts[i], tokens, timeout)
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


def run(args: argparse.Namespace) -> list[Row]:
    base = check_url(args.url, args.allow_remote)
    model = args.model or first_model(base, args.timeout)
    rng = random.Random(args.seed)
    rows = [cold_prefill(base, model, n, args.prefill_reps, args.timeout, rng) for n in args.contexts]
    rows += [decode(base, model, c, args.decode_prompt, args.decode_tokens, args.timeout, rng)
             for c in args.concurrency]
    return rows


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


def write_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default localhost:8000)")
    ap.add_argument("--allow-remote", action="store_true", help="allow a server that is not on localhost")
    ap.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="cold prefill lengths")
    ap.add_argument("--prefill-reps", type=int, default=2, help="requests per prefill length (default 2)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="decode concurrency levels")
    ap.add_argument("--decode-prompt", type=int, default=1024, help="prompt tokens of a decode request")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens generated per decode request")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request (connect and each read)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = ap.parse_args(argv)
    for name in ("prefill_reps", "decode_prompt", "timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.decode_tokens < 2:
        ap.error("--decode-tokens must be >= 2 (inter-token latency needs two tokens)")
    if min(args.contexts) < 1 or not 1 <= min(args.concurrency) <= max(args.concurrency) <= 256:
        ap.error("--contexts must be >= 1 and --concurrency in [1, 256]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        rows = run(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"serve_bench: {e}", file=sys.stderr)
        return 1
    print_rows(rows, f"serve benchmark: {args.url} ({'requests' if requests else 'urllib'})")
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
