"""benchmarks/serve_bench.py against a fake OpenAI streaming server with known delays.

The fake server (127.0.0.1, a thread per connection, chunked HTTP/1.1 like uvicorn) waits
``ttft_base + per_prompt_token * prompt_tokens`` before the first chunk and ``itl`` between chunks,
so the measured TTFT and inter-token latency must come out at those delays (sleeps never end early:
the lower bounds are strict, the upper bounds allow for scheduling on a busy machine).
"""

import importlib.util
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("serve_bench", Path(__file__).parent.parent / "benchmarks/serve_bench.py")
sb = importlib.util.module_from_spec(spec)
sys.modules["serve_bench"] = sb  # dataclasses look their module up there
spec.loader.exec_module(sb)

SLACK = 0.25  # upper slack for a loaded 2-core CI box; the lower bound (>= the configured delay) is strict


class FakeServer:
    def __init__(self, ttft_base=0.03, per_prompt_token=10e-6, itl=0.02, tokens_per_chunk=1, usage=True,
                 status=200):
        self.ttft_base, self.per_prompt_token, self.itl = ttft_base, per_prompt_token, itl
        self.tokens_per_chunk, self.usage, self.status = tokens_per_chunk, usage, status
        self.requests = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                body = json.dumps({"object": "list", "data": [{"id": "glm-5.2-fake"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def chunk(self, obj):
                data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(req)
                if fake.status != 200:
                    body = b'{"error": "boom"}'
                    self.send_response(fake.status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                n_prompt, n_out = len(req["prompt"]), req["max_tokens"]
                time.sleep(fake.ttft_base + fake.per_prompt_token * n_prompt)
                sent = 0
                while sent < n_out:
                    if sent:
                        time.sleep(fake.itl)
                    k = min(fake.tokens_per_chunk, n_out - sent)
                    self.chunk({"choices": [{"index": 0, "text": " tok" * k}]})
                    sent += k
                if fake.usage:
                    self.chunk({"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out}})
                self.chunk(b"[DONE]")
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(params=["requests", "urllib"])
def client(request, monkeypatch):
    """Run each test with both HTTP clients the benchmark supports."""
    if request.param == "requests":
        if sb.requests is None:
            pytest.skip("requests not installed")
    else:
        monkeypatch.setattr(sb, "requests", None)
    return request.param


def test_cold_prefill_ttft_and_fresh_prompts(client):
    with FakeServer() as srv:
        rows = sb.run(sb.parse_args(["--url", srv.url, "--contexts", "1000", "6000", "--prefill-reps", "2",
                                     "--concurrency", "1", "--decode-tokens", "4", "--decode-prompt", "16"]))
    pre = [r for r in rows if r.phase == "prefill"]
    assert [(r.context, r.requests) for r in pre] == [(1000, 2), (6000, 2)]
    for r in pre:
        want = srv.ttft_base + srv.per_prompt_token * r.context
        assert want <= r.ttft_s <= want + SLACK, (r.context, r.ttft_s, want)
        assert r.prefill_tok_s == pytest.approx(r.context / r.ttft_s, rel=0.3)
    posts = srv.requests
    assert [len(p["prompt"]) for p in posts[:4]] == [1000, 1000, 6000, 6000]
    assert all(p["max_tokens"] == 1 and p["stream"] and p["model"] == "glm-5.2-fake" for p in posts[:4])
    assert len({tuple(p["prompt"]) for p in posts}) == len(posts)  # no two prompts alike: no prefix-cache hit


@pytest.mark.parametrize("tokens_per_chunk", [1, 3])
def test_decode_itl_and_rates(client, tokens_per_chunk):
    itl, n = 0.02, 13
    with FakeServer(itl=itl, tokens_per_chunk=tokens_per_chunk) as srv:
        one = sb.decode(srv.url, "m", 1, 32, n, 30.0, sb.random.Random(0))
        four = sb.decode(srv.url, "m", 4, 32, n, 30.0, sb.random.Random(1))
    chunks = -(-n // tokens_per_chunk)
    for row in (one, four):
        assert itl * 1e3 <= row.itl_p50_ms <= (itl + SLACK / 2) * 1e3, row
        assert row.itl_p50_ms <= row.itl_p99_ms
        # a stream: n - 1 tokens after the first, over (chunks - 1) gaps of itl
        want_stream = (n - 1) / ((chunks - 1) * itl)
        assert want_stream * 0.5 <= row.stream_tok_s <= want_stream * 1.001, row
    assert one.requests == 1 and four.requests == 4 and four.concurrency == 4
    # four concurrent streams decode more than one (~4x; the exact aggregation is tested below,
    # here the streams' start times depend on thread scheduling on a busy machine)
    assert four.decode_tok_s > 1.5 * one.decode_tok_s


def stream(sent, first, gaps, tokens, prompt=100):
    chunks = [first]
    for g in gaps:
        chunks.append(chunks[-1] + g)
    return sb.StreamResult(sent=sent, chunks=chunks, prompt_tokens=prompt, completion_tokens=tokens)


def test_aggregation_on_known_timings():
    a = stream(0.0, 0.5, [0.1] * 4, tokens=5)  # first token at 0.5 s, then 4 x 100 ms
    b = stream(0.2, 0.6, [0.2, 0.2], tokens=7)  # MTP: 7 tokens in 3 chunks, last at 1.0 s
    row = sb.decode_row([a, b], prompt_len=100)
    assert (row.phase, row.concurrency, row.requests) == ("decode", 2, 2)
    assert row.ttft_s == pytest.approx(0.45)  # median of 0.5 and 0.4
    assert row.decode_tok_s == pytest.approx((4 + 6) / (1.0 - 0.5))  # tokens after the first / window
    assert row.stream_tok_s == pytest.approx((4 / 0.4 + 6 / 0.4) / 2)
    assert row.itl_p50_ms == pytest.approx(100.0) and row.itl_p99_ms == pytest.approx(200.0)
    pre = sb.prefill_row([stream(0.0, 0.25, [], 1, prompt=1000), stream(1.0, 1.5, [], 1, prompt=1000)], 1000)
    assert pre.ttft_s == pytest.approx(0.375) and pre.prefill_tok_s == pytest.approx((4000 + 2000) / 2)
    assert pre.decode_tok_s != pre.decode_tok_s  # NaN: not a decode measurement


def test_without_usage_counts_one_token_per_chunk(client):
    with FakeServer(usage=False, itl=0.005) as srv:
        res = sb.stream_completion(srv.url, "m", [5, 6, 7], 5, 10.0)
    assert (res.prompt_tokens, res.completion_tokens, len(res.chunks)) == (3, 5, 5)


def test_errors_are_clear(client):
    with FakeServer(status=500) as srv:
        with pytest.raises(RuntimeError, match="HTTP 500"):
            sb.stream_completion(srv.url, "m", [1], 2, 10.0)
    with FakeServer(ttft_base=1.0) as srv:
        with pytest.raises(OSError):  # requests' Timeout and urllib's timeout are both OSErrors
            sb.stream_completion(srv.url, "m", [1], 2, 0.2)
        assert sb.main(["--url", srv.url, "--timeout", "0.2", "--contexts", "8", "--concurrency", "1"]) == 1


def test_main_prints_and_writes_csv(client, tmp_path, capsys):
    out = tmp_path / "serve.csv"
    with FakeServer(itl=0.002, ttft_base=0.005) as srv:
        assert sb.main(["--url", srv.url, "--contexts", "64", "--prefill-reps", "1", "--concurrency", "1", "2",
                        "--decode-tokens", "4", "--decode-prompt", "8", "--csv", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("phase,context,concurrency,requests,ttft_s")
    assert [ln.split(",")[:3] for ln in lines[1:]] == [["prefill", "64", "1"], ["decode", "8", "1"],
                                                       ["decode", "8", "2"]]
    assert "serve benchmark" in capsys.readouterr().out


def test_only_localhost_by_default():
    assert sb.check_url("http://127.0.0.1:8000/", False) == "http://127.0.0.1:8000"
    assert sb.check_url("http://localhost:8000", False) == "http://localhost:8000"
    with pytest.raises(ValueError, match="--allow-remote"):
        sb.check_url("http://10.0.0.5:8000", False)
    assert sb.check_url("http://10.0.0.5:8000", True) == "http://10.0.0.5:8000"
    with pytest.raises(ValueError, match="http"):
        sb.check_url("ftp://127.0.0.1", True)
    assert sb.main(["--url", "http://example.com:8000"]) == 1


def test_argument_bounds():
    for bad in (["--decode-tokens", "1"], ["--concurrency", "0"], ["--contexts", "0"], ["--timeout", "0"],
                ["--concurrency", "1000"]):
        with pytest.raises(SystemExit):
            sb.parse_args(bad)


def test_percentile_is_nearest_rank():
    xs = list(range(1, 101))
    assert [sb.percentile(xs, q) for q in (0, 1, 50, 99, 100)] == [1, 1, 50, 99, 100]
    assert sb.percentile([7.0], 99) == 7.0
    assert sb.percentile([3, 1, 2], 50) == 2
    assert sb.percentile([], 50) != sb.percentile([], 50)  # NaN
