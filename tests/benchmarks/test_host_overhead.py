"""benchmarks/host_overhead.py's per-layer comparison (``layer_host``) compares like with like: the
engine's forward entries and the direct calls launch the same kernels, once each, per layer (the
times it prints are the benchmark's to report, not checked here)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "host_overhead", Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_layer_host_times_the_same_launches_both_ways(monkeypatch):
    for k, v in bench.ENV.items():
        monkeypatch.setenv(k, v)
    got = bench.layer_host(iters=3)
    launched = got["launches"]
    assert launched["engine"] == launched["direct"], launched
    # each kernel once per layer: the cache write, the top-k rows, the decode's
    assert set(launched["engine"].values()) == {1} and {"write_paged", "_topk_rows_kernel",
                                                        "_sparse_mla_decode_kernel"} <= set(launched["engine"])
    assert got["engine_us"] > 0 and got["direct_us"] > 0
