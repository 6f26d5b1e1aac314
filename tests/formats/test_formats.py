"""Record formats: torch reference == host build (== CUDA build on a GPU),
hand-derived records, round-trip error bounds, paged writes and bad input."""

import hashlib
import json
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sparkinfer.core import layouts
from sparkinfer.formats import ALL_FORMATS, get_format
from sparkinfer.formats.native import layout_offset

GOLDEN = pathlib.Path(__file__).parent / "golden" / "records.json"

FORMAT_CASES = [
    ("nvfp4_ds_mla:fp8-rope-368", {}),
    ("nvfp4_ds_mla:bf16-rope-432", {}),
    ("nvfp4_ds_mla:bf16-rope-432", {"outer_scale": 0.0125}),
    ("fp8_ds_mla", {"scale_format": "ue8m0"}),
    ("fp8_ds_mla", {"scale_format": "arbitrary_fp32"}),
    ("indexer_fp8", {}),
]
IDS = [f"{n}{'-' + '-'.join(f'{v}' for v in o.values()) if o else ''}" for n, o in FORMAT_CASES]


def make_inputs(fmt, latent, rope):
    return (latent[:, :fmt.value_dim],) if fmt.rope_dim == 0 else (latent, rope)


def random_tokens(n: int, seed: int):
    """Mixed-scale tokens: per-token magnitudes over 2**-20..2**12, with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    scale = 2.0 ** (torch.rand(n, 1, generator=g) * 32 - 20)
    latent = torch.randn(n, 512, generator=g) * scale
    latent[:, torch.randint(0, 512, (8,), generator=g)] *= 30  # outlier channels
    rope = torch.randn(n, 64, generator=g) * scale
    return latent, rope


def adversarial_tokens():
    """Zeros, ties on every E2M1/E4M3 midpoint, clamps, tiny and huge values, signed zeros."""
    rows_l, rows_r = [], []
    z = torch.zeros(512)
    rows_l.append(z.clone()); rows_r.append(torch.zeros(64))
    rows_l.append(-z.clone()); rows_r.append(-torch.zeros(64))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    x = torch.cat([ties, -ties] * 16)
    x[-1] = 2688.0  # makes s_t exactly 1 for the 368 format
    rows_l.append(x); rows_r.append(torch.linspace(-448, 448, 64))
    rows_l.append(torch.full((512,), 1e30)); rows_r.append(torch.full((64,), -1e30))
    rows_l.append(torch.full((512,), 2.0 ** -140)); rows_r.append(torch.full((64,), 2.0 ** -149))
    one_hot = torch.zeros(512); one_hot[17] = 3.0
    rows_l.append(one_hot); rows_r.append(torch.zeros(64))
    alt = torch.tensor([1e-8, 1e8] * 256)
    rows_l.append(alt); rows_r.append(torch.tensor([1e-8, 1e8] * 32))
    midpoints = torch.tensor([1.0 + k / 16 for k in range(16)] * 32)  # e4m3 ties after scaling
    rows_l.append(midpoints); rows_r.append(midpoints[:64])
    return torch.stack(rows_l), torch.stack(rows_r)


@pytest.mark.parametrize("name,opts", FORMAT_CASES, ids=IDS)
def test_reference_equals_host_build_on_1e5_tokens(name, opts):
    fmt = get_format(name, **opts)
    for seed in range(4):
        latent, rope = random_tokens(25_000, seed)
        args = make_inputs(fmt, latent, rope)
        ref = fmt.encode(*args, backend="torch")
        host = fmt.encode(*args, backend="host")
        mism = (ref != host).any(1).nonzero().flatten()
        assert mism.numel() == 0, f"{name}: {mism.numel()} records differ, first at token {mism[:5].tolist()}"
        dec_ref, dec_host = fmt.decode(ref, backend="torch"), fmt.decode(ref, backend="host")
        for a, b in zip(*(([dec_ref], [dec_host]) if fmt.rope_dim == 0 else (dec_ref, dec_host))):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name,opts", FORMAT_CASES, ids=IDS)
def test_adversarial_and_bf16_inputs(name, opts):
    fmt = get_format(name, **opts)
    latent, rope = adversarial_tokens()
    for dtype in (torch.float32, torch.bfloat16):
        args = [a.to(dtype) for a in make_inputs(fmt, latent, rope)]
        ref = fmt.encode(*args, backend="torch")
        assert torch.equal(ref, fmt.encode(*args, backend="host"))
        # bf16 input is upcast exactly, so it encodes like its fp32 value
        assert torch.equal(ref, fmt.encode(*[a.float() for a in args], backend="torch"))
    zeros = fmt.encode(*make_inputs(fmt, torch.zeros(1, 512), torch.zeros(1, 64)))
    dec = fmt.decode(zeros)
    for part in ([dec] if fmt.rope_dim == 0 else dec):
        assert torch.equal(part, torch.zeros_like(part)), "an all-zero token must decode to exact zeros"


def e2m1_boundary_tokens(fmt, n: int = 256, seed: int = 5):
    """Tokens whose values sit within 3 fp32 ulps of an E2M1 boundary (0.25 ... 5) times their group's
    divisor m_g = s * d_g, computed as the spec does: the inputs where the encoder's per-value quotient
    (a reciprocal and an FMA correction, not a division) must round exactly as x / m_g does. Element 0
    of each group is its amax (random mantissa, token scales 2**-30 .. 2**30); the others stay below it."""
    from sparkinfer.formats import codecs as C

    g = torch.Generator().manual_seed(seed)
    gmax = (torch.rand(n, 32, generator=g) + 0.5) * 2.0 ** torch.randint(-30, 30, (n, 1), generator=g).float()
    if fmt.layout.record_bytes == 368:
        s = (gmax.amax(1) / 2688.0).clamp_min(C.TINY)
    else:
        s = torch.full((n,), fmt.outer_scale)
    m = s[:, None] * C.e4m3_decode(C.e4m3_encode(gmax / (6.0 * s[:, None])))
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])[torch.randint(0, 7, (n, 32, 15), generator=g)]
    x = t * m[..., None]
    for _ in range(3):  # step 0..3 ulps up or down
        step = torch.randint(-1, 2, x.shape, generator=g).float()
        x = torch.where(step != 0, torch.nextafter(x, x + step * x.abs().clamp_min(1e-30)), x)
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, -x, x).clamp(-gmax[..., None], gmax[..., None])
    latent = torch.cat([gmax[..., None], x], dim=2).view(n, 512)
    return latent, torch.randn(n, 64, generator=g)


@pytest.mark.parametrize("name,opts", FORMAT_CASES[:3], ids=IDS[:3])
def test_e2m1_quotient_boundaries(name, opts):
    fmt = get_format(name, **opts)
    latent, rope = e2m1_boundary_tokens(fmt)
    assert torch.equal(fmt.encode(latent, rope, backend="torch"), fmt.encode(latent, rope, backend="host"))


@settings(max_examples=60, deadline=None)
@given(latent=arrays("float32", (3, 512), elements=st.floats(-1e6, 1e6, width=32)),
       rope=arrays("float32", (3, 64), elements=st.floats(-1e6, 1e6, width=32)))
def test_property_reference_equals_host(latent, rope):
    latent, rope = torch.from_numpy(latent), torch.from_numpy(rope)
    for name, opts in FORMAT_CASES:
        fmt = get_format(name, **opts)
        args = make_inputs(fmt, latent, rope)
        assert torch.equal(fmt.encode(*args, backend="torch"), fmt.encode(*args, backend="host")), name


def test_hand_derived_368_record():
    """One record worked out by hand from the spec (s_t = 1 because amax = 2688)."""
    latent = torch.zeros(1, 512)
    latent[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                                   -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    latent[0, 496:512] = 2688.0
    rope = torch.zeros(1, 64)
    rope[0, 0], rope[0, 1] = 448.0, -1.0
    rec = get_format("nvfp4_368").encode(latent, rope)[0]
    # group 0: c = E4M3(6 / 6) = 1.0 = 0x38, m = 1 -> codes 0,2,2,4,4,6,6,7 then +0,A,A,C,C,E,E,F
    codes = [0, 2, 2, 4, 4, 6, 6, 7, 0, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 0xF]
    assert rec[:8].tolist() == [codes[2 * i] | codes[2 * i + 1] << 4 for i in range(8)]
    assert rec[256] == 0x38
    assert rec[256 + 31] == 0x7E  # E4M3(2688 / 6 = 448)
    assert rec[248:256].tolist() == [0x77] * 8  # 2688 / 448 = 6 -> code 7 in both nibbles
    assert rec[256 + 1:256 + 31].tolist() == [0] * 30  # zero groups: zero scale
    assert rec[288:292].view(torch.float32).item() == 1.0  # r = 448 / 448
    assert rec[292:296].view(torch.float32).item() == 1.0  # s_t = 2688 / 2688
    assert rec[296:304].tolist() == [0] * 8
    assert rec[304] == 0x7E and rec[305] == 0xB8  # 448 and -1.0 in E4M3


def test_hand_derived_656_and_132_scales():
    latent = torch.zeros(1, 512)
    latent[0, 0] = 448.0          # u = 1      -> scale 1
    latent[0, 128] = 449.0        # u > 1      -> scale 2
    latent[0, 256] = 0.001        # u < 1e-4   -> 2**ceil(log2(1e-4)) = 2**-13
    rec = get_format("fp8_ds_mla").encode(latent, torch.zeros(1, 64))[0]
    assert rec[512:528].view(torch.float32).tolist() == [1.0, 2.0, 2.0 ** -13, 2.0 ** -13]
    key = torch.zeros(1, 128)
    key[0, 5] = 1000.0  # 1000 / 448 = 2.23 -> s = 4; 1000 / 4 = 250 rounds to 256 = 0x78
    krec = get_format("indexer_fp8").encode(key)[0]
    assert krec[128:132].view(torch.float32).item() == 4.0
    assert krec[5] == 0x78
    assert get_format("indexer_fp8").decode(krec[None])[0, 5].item() == 1024.0


@pytest.mark.parametrize("name,opts", FORMAT_CASES, ids=IDS)
def test_round_trip_error_bounds(name, opts):
    fmt = get_format(name, **opts)
    g = torch.Generator().manual_seed(7)
    latent, rope = torch.randn(2000, 512, generator=g) * 0.02, torch.randn(2000, 64, generator=g)
    if fmt.rope_dim == 0:
        key = latent[:, :128]
        err = (fmt.decode(fmt.encode(key)) - key).abs()
        s = key.abs().amax(1, keepdim=True) / 448
        assert bool((err <= key.abs() * 2.0 ** -4 + s * 2.0 ** -9).all())  # E4M3: 3 mantissa bits
        return
    dl, dr = fmt.decode(fmt.encode(latent, rope))
    rel = ((dl - latent).norm(dim=1) / latent.norm(dim=1))
    if fmt.layout.record_bytes == 656:
        assert float(rel.max()) < 0.04  # E4M3 with per-tile scales
    elif opts.get("outer_scale", 1.0) == 1.0 and fmt.layout.record_bytes == 432:
        # S = 1 is far above this latent's range: group scales sink into E4M3 subnormals
        assert float(rel.mean()) < 0.5
    else:
        assert float(rel.mean()) < 0.11 and float(rel.max()) < 0.15  # NVFP4 with fine group scales
    rope_err = (dr - rope).abs()
    if fmt.layout.record_bytes == 368:
        r = rope.abs().amax(1, keepdim=True) / 448
        assert bool((rope_err <= rope.abs() * 2.0 ** -4 + r * 2.0 ** -9).all())
    else:
        assert bool((rope_err <= rope.abs() * 2.0 ** -8).all())  # bf16


@pytest.mark.parametrize("name,opts", FORMAT_CASES, ids=IDS)
def test_paged_write_and_gather(name, opts):
    fmt = get_format(name, **opts)
    latent, rope = random_tokens(40, 3)
    cache = torch.zeros(8, 16, fmt.record_bytes, dtype=torch.uint8)  # 8 blocks x 16 slots
    slots = torch.randperm(128)[:40]
    slots[5] = -1
    fmt.write(cache, slots, *make_inputs(fmt, latent, rope))
    flat = cache.view(-1, fmt.record_bytes)
    expect = fmt.encode(*make_inputs(fmt, latent, rope))
    keep = slots >= 0
    assert torch.equal(flat[slots[keep]], expect[keep])
    untouched = torch.ones(128, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert int(flat[untouched].count_nonzero()) == 0
    idx = torch.cat([slots[keep][:7], torch.tensor([-1])])
    got = fmt.gather(cache, idx)
    ref = fmt.decode(expect[keep][:7])
    for g_part, r_part in zip(*(([got], [ref]) if fmt.rope_dim == 0 else (got, ref))):
        assert torch.equal(g_part[:7], r_part) and int(g_part[7].count_nonzero()) == 0


def golden_inputs():
    """Fixed inputs from a formula (not an RNG, so they never change across torch versions)."""
    i = torch.arange(64 * 512, dtype=torch.float64)
    latent = (torch.sin(i * 0.7) * torch.exp(torch.cos(i * 0.013) * 6)).view(64, 512).float()
    rope = (torch.cos(torch.arange(64 * 64, dtype=torch.float64) * 1.3) * 40).view(64, 64).float()
    return latent, rope


def test_golden_vectors():
    """Fixed inputs (a formula, not an RNG) against hashes and records checked in under tests/golden."""
    golden = json.loads(GOLDEN.read_text())
    latent, rope = golden_inputs()
    for name, opts in FORMAT_CASES:
        fmt = get_format(name, **opts)
        key = f"{name}{json.dumps(opts, sort_keys=True) if opts else ''}"
        recs = fmt.encode(*make_inputs(fmt, latent, rope))
        assert hashlib.sha256(recs.numpy().tobytes()).hexdigest() == golden[key]["sha256"], key
        assert recs[0].numpy().tobytes().hex() == golden[key]["record0"], key


def test_layout_constants_agree_with_csrc():
    assert [layout_offset(k) for k in range(7)] == [
        layouts.NVFP4_368.field("group_scales").offset, layouts.NVFP4_368.field("rope_scale").offset,
        layouts.NVFP4_368.field("outer_scale").offset, layouts.NVFP4_368.field("rope").offset,
        layouts.FP8_DS_MLA.field("tile_scales").offset, layouts.FP8_DS_MLA.field("rope").offset,
        layouts.INDEXER_FP8.field("scale").offset]
    assert [get_format(n).record_bytes for n in ALL_FORMATS] == [368, 432, 656, 132]
    assert layouts.NVFP4_432.field("rope").offset == layouts.NVFP4_368.field("rope").offset


@pytest.mark.parametrize("bad,match", [
    (lambda f: f.encode(torch.zeros(2, 511), torch.zeros(2, 64)), r"\[N, 512\]"),
    (lambda f: f.encode(torch.zeros(2, 512), torch.zeros(3, 64)), "tokens"),
    (lambda f: f.encode(torch.zeros(2, 512, dtype=torch.float64), torch.zeros(2, 64)), "float32 or bfloat16"),
    (lambda f: f.encode(torch.full((2, 512), float("nan")), torch.zeros(2, 64)), "NaN"),
    (lambda f: f.encode(torch.zeros(2, 512), torch.full((2, 64), float("inf"))), "infinity"),
    (lambda f: f.encode(torch.zeros(2, 512)), "rope"),
    (lambda f: f.decode(torch.zeros(2, 432, dtype=torch.uint8)), "432 bytes wide"),
    (lambda f: f.decode(torch.zeros(2, 368)), "uint8"),
    (lambda f: f.write(torch.zeros(4, 368, dtype=torch.uint8), torch.tensor([4]), torch.zeros(1, 512),
                       torch.zeros(1, 64)), r"\[-1, 4\)"),
])
def test_bad_input_raises_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        bad(get_format("nvfp4_368"))


def test_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown record format"):
        get_format("nvfp4_400")
    with pytest.raises(ValueError, match="scale_format"):
        get_format("fp8_ds_mla", scale_format="e8m0")
    with pytest.raises(ValueError, match="takes options"):
        get_format("nvfp4_368", outer_scale=2.0)
    with pytest.raises(ValueError, match="outer_scale"):
        get_format("nvfp4_432", outer_scale=0.0)
    with pytest.raises(ValueError, match="key only"):
        get_format("indexer_fp8").encode(torch.zeros(1, 128), torch.zeros(1, 64))
    assert get_format("368").name == get_format("nvfp4_368").name == "nvfp4_ds_mla:fp8-rope-368"


@pytest.mark.gpu
@pytest.mark.parametrize("name,opts", FORMAT_CASES, ids=IDS)
def test_cuda_kernels_equal_host_build(name, opts):
    fmt = get_format(name, **opts)
    latent, rope = random_tokens(50_000, 11)
    adv_l, adv_r = adversarial_tokens()
    latent, rope = torch.cat([latent, adv_l]), torch.cat([rope, adv_r])
    args = make_inputs(fmt, latent, rope)
    host = fmt.encode(*args, backend="host")
    cuda = fmt.encode(*[a.cuda() for a in args]).cpu()
    assert torch.equal(host, cuda)
    cache = torch.zeros(latent.shape[0] + 7, fmt.record_bytes, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(cache.shape[0], device="cuda")[:latent.shape[0]]
    fmt.write(cache, slots, *[a.cuda() for a in args])
    assert torch.equal(cache[slots].cpu(), host)
    # rows off 16-byte alignment (the binding copies them for the NVFP4 kernel) and skipped slots
    shifted = [torch.empty(a.numel() + 1, device="cuda")[1:].view_as(a).copy_(a) for a in args]
    again = torch.zeros_like(cache)
    skip = slots.clone()
    skip[::3] = -1
    fmt.write(again, skip, *shifted)
    kept = skip >= 0
    assert torch.equal(again[skip[kept]].cpu(), host[kept.cpu()])
    written = torch.zeros(cache.shape[0], dtype=torch.bool, device="cuda")
    written[skip[kept]] = True
    assert not again[~written].any()
    dec_host = fmt.decode(host, backend="host")
    dec_cuda = fmt.gather(cache, slots)
    for a, b in zip(*(([dec_host], [dec_cuda]) if fmt.rope_dim == 0 else (dec_host, dec_cuda))):
        assert torch.equal(a, b.cpu())


def write_golden() -> None:
    """Regenerate tests/formats/golden/records.json (maintainers only, after a deliberate format change)."""
    latent, rope = golden_inputs()
    out = {}
    for name, opts in FORMAT_CASES:
        fmt = get_format(name, **opts)
        recs = fmt.encode(*make_inputs(fmt, latent, rope), backend="host")
        assert torch.equal(recs, fmt.encode(*make_inputs(fmt, latent, rope), backend="torch"))
        key = f"{name}{json.dumps(opts, sort_keys=True) if opts else ''}"
        out[key] = {"sha256": hashlib.sha256(recs.numpy().tobytes()).hexdigest(),
                    "record0": recs[0].numpy().tobytes().hex()}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    write_golden()
