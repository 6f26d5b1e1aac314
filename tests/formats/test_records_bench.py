"""benchmarks/records_bench.py on the host twin: it runs, its numbers are positive, its byte counts
follow the per-record formula, and its correctness check rejects wrong records."""

import csv
import importlib.util
from pathlib import Path

import pytest
import torch

from sparkinfer.formats import get_format

spec = importlib.util.spec_from_file_location("records_bench",
                                              Path(__file__).parents[2] / "benchmarks/records_bench.py")
rb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rb)

CPU = torch.device("cpu")
# Bytes per record, written out from record-formats.md: fp32 values (latent/key + rope) + int64 index + record.
PER_RECORD = {"368": 4 * 576 + 8 + 368, "432": 4 * 576 + 8 + 432, "656": 4 * 576 + 8 + 656, "132": 4 * 128 + 8 + 132}


@pytest.mark.parametrize("width", sorted(PER_RECORD))
def test_bytes_moved_formula(width):
    fmt = get_format(width)
    for op in ("encode", "decode"):
        assert rb.bytes_moved(fmt, 1000, op) == 1000 * PER_RECORD[width]
    with pytest.raises(ValueError, match="op must be"):
        rb.bytes_moved(fmt, 1, "copy")


def test_cpu_run_rows_positive_and_counted():
    n = 96  # not a multiple of the kernels' warps per block
    rows = rb.run(["368", "132"], [n], list(rb.ORDERS), CPU, reps=2, copy_bytes=1 << 20)
    assert rows[0]["op"] == "copy" and rows[0]["bytes"] == 2 << 20 and rows[0]["frac_copy"] == 1.0
    kernels = rows[1:]
    assert len(kernels) == 2 * 1 * 2 * 2  # formats x sizes x orders x ops
    for r in rows:
        assert r["ms"] > 0 and r["gbps"] > 0 and r["frac_copy"] > 0 and r["floor_ms_copy"] > 0
        assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
    for r in kernels:
        width = str(get_format(r["format"]).record_bytes)
        assert r["records"] == n and r["bytes"] == n * PER_RECORD[width]


@pytest.mark.parametrize("order", rb.ORDERS)
def test_check_sample_rejects_a_wrong_record(order):
    fmt = get_format("656")
    latent, rope, cache, slots, idx = rb.make_case(fmt, 40, order, CPU, seed=3)
    assert bool((cache == rb.POISON).all())
    fmt.write(cache, slots, latent, rope)
    decoded = fmt.gather(cache, idx)
    rb.check_sample(fmt, latent, rope, cache, slots, idx, decoded)  # correct: passes
    cache[int(slots[5]), 7] ^= 0x40
    with pytest.raises(RuntimeError, match="differ"):
        rb.check_sample(fmt, latent, rope, cache, slots, idx, decoded)


def test_cli_writes_csv(tmp_path, capsys):
    out = tmp_path / "records.csv"
    assert rb.main(["--cpu", "--formats", "432", "--records", "64", "--orders", "random", "--reps", "1",
                    "--copy-mb", "1", "--csv", str(out)]) == 0
    assert "HOST TWIN" in capsys.readouterr().out
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["op"] for r in rows] == ["copy", "encode", "decode"]
    assert all(float(r["gbps"]) > 0 for r in rows)
    assert int(rows[1]["bytes"]) == 64 * PER_RECORD["432"]


def test_check_all_written_rejects_a_skipped_record():
    fmt = get_format("368")
    latent, rope, cache, slots, _ = rb.make_case(fmt, 40, "random", CPU, seed=4)
    fmt.write(cache, slots, latent, rope)
    rb.check_all_written(fmt, latent, rope, cache, slots)  # every slot written: passes
    slots[3] = -1  # the encode skips token 3: its slot keeps each cache's poison byte
    cache.fill_(rb.POISON)
    fmt.write(cache, slots, latent, rope)
    with pytest.raises(RuntimeError, match="1 of 40 records not fully written"):
        rb.check_all_written(fmt, latent, rope, cache, slots)
