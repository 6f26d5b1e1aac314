"""Element codecs: torch codecs and the C++ codecs of csrc/ against an
independent nearest-value search in float64 (ties to the even code)."""

import numpy as np
import pytest
import torch

from sparkinfer.formats import codecs as C
from sparkinfer.formats.native import host_codec

E2M1_MAGS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def e4m3_magnitudes() -> np.ndarray:
    """All non-negative finite E4M3 values by code 0..126, built from the bit definition."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


def nearest_even(a: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest table value to each |a|; a tie picks the even index."""
    d = np.abs(np.abs(a)[:, None] - table[None, :])
    best = d.min(axis=1, keepdims=True)
    ties = d == best
    idx = np.where(ties.sum(1) > 1, np.argmax(ties & (np.arange(len(table)) % 2 == 0)[None, :], axis=1),
                   np.argmin(d, axis=1))
    return idx


def probe_values(table: np.ndarray, clamp: float, seed: int = 0) -> np.ndarray:
    """Table values, midpoints, midpoints one fp32 ulp either side, random values, both signs."""
    mids = (table[1:] + table[:-1]) / 2
    mids32 = mids.astype(np.float32)
    around = np.concatenate([mids32, np.nextafter(mids32, np.float32(np.inf)), np.nextafter(mids32, np.float32(0))])
    rng = np.random.default_rng(seed)
    rand = (rng.random(20000) * clamp * 1.3).astype(np.float32)
    logr = (2.0 ** rng.uniform(-14, 10, 20000)).astype(np.float32)
    base = np.concatenate([table.astype(np.float32), around, rand, logr, [0, clamp, clamp * 1.01, 1e30]])
    return np.concatenate([base, -base]).astype(np.float32)


def test_e4m3_matches_nearest_even_search():
    table = e4m3_magnitudes()
    x = probe_values(table, 448.0)
    expect_idx = nearest_even(np.clip(x, -448, 448).astype(np.float64), table)
    expect = np.where(np.signbit(x), expect_idx | 0x80, expect_idx).astype(np.uint8)
    got_torch = C.e4m3_encode(torch.from_numpy(x)).numpy()
    got_host = host_codec("e4m3", torch.from_numpy(x)).view(-1).numpy()
    np.testing.assert_array_equal(got_torch, expect)
    np.testing.assert_array_equal(got_host, expect)
    # decode is the table itself
    codes = torch.arange(256, dtype=torch.uint8)
    dec = C.e4m3_decode(codes).numpy()
    finite = ~(((np.arange(256) & 0x7F) == 0x7F))
    np.testing.assert_array_equal(np.abs(dec[finite]), np.concatenate([table, table]))


def test_e2m1_matches_nearest_even_search_and_spec_examples():
    x = probe_values(E2M1_MAGS, 6.0)
    idx = nearest_even(np.clip(x, -6, 6).astype(np.float64), E2M1_MAGS)
    expect = np.where(np.signbit(x) & (idx != 0), idx | 8, idx).astype(np.uint8)
    np.testing.assert_array_equal(C.e2m1_encode(torch.from_numpy(x)).numpy(), expect)
    np.testing.assert_array_equal(host_codec("e2m1", torch.from_numpy(x)).view(-1).numpy(), expect)
    # the spec's own examples
    spec = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0, 7.0: 6.0, -0.1: 0.0}
    y = torch.tensor(list(spec), dtype=torch.float32)
    codes = C.e2m1_encode(y)
    assert C.e2m1_decode(codes).tolist() == list(spec.values())
    assert int(codes[-1]) == 0, "a magnitude-0 result is stored as +0"


def test_bf16_and_pow2_ceil_host_match_torch():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(50000) * 2.0 ** rng.uniform(-30, 30, 50000)).astype(np.float32)
    t = torch.from_numpy(x)
    assert torch.equal(host_codec("bf16", t).view(-1), C.bf16_encode(t))
    pos = t.abs() + 1e-30
    expect = torch.tensor([2.0 ** int(np.ceil(np.log2(np.float64(v)))) if v > 0 else 0 for v in pos.tolist()],
                          dtype=torch.float32)
    assert torch.equal(C.pow2_ceil(pos), expect)
    assert torch.equal(host_codec("pow2_ceil", pos).view(torch.float32).view(-1), expect)


@pytest.mark.parametrize("v", [2.0 ** -13, 2.0 ** -13 * (1 + 2 ** -23), 0.75, 1.0, 1.5 * 2 ** 20])
def test_pow2_ceil_exact_near_powers_of_two(v):
    expect = 2.0 ** int(np.ceil(np.log2(np.float64(np.float32(v)))))
    t = torch.tensor([v], dtype=torch.float32)
    assert float(C.pow2_ceil(t)) == expect
    assert float(host_codec("pow2_ceil", t).view(torch.float32)) == expect


def test_nvfp4_division_free_codes_on_every_boundary(tmp_path):
    """csrc/tools/check_nvfp4_codes.cpp on every 64th value: the E2M1 magnitude of fp32 in [0, 6], the
    codes of x / m1 near each E2M1 boundary for divisor mantissas across [1, 2), the division-free
    reciprocal, token and rope scales and the quotients near every E4M3 boundary (records.h's paths,
    built with the host twin's flags) against fp32 divisions and the spec's thresholds. Run without a
    stride it checks all 1.2e10 cases."""
    import shutil
    import subprocess

    from sparkinfer.native import build

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    exe = tmp_path / "check"
    flags = [f for f in build.HOST_FLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run([cxx, *flags, "-I", build.CSRC_DIR + "/include", build.CSRC_DIR + "/tools/check_nvfp4_codes.cpp",
                    "-o", str(exe)], check=True)
    run = subprocess.run([str(exe), "64"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    assert run.stdout.strip().endswith("checked, 0 wrong") and int(run.stdout.split()[0]) > 60_000_000
