"""The kernels' inline PTX, run on the CPU by ``sparkinfer.testing.ptx``, against independent references on
every code: the packed record decoders (``triton_codes``), the bf16 output rounding (``triton_decode``), the
indexer's E4M3 conversions and its address multiply (``triton_scores``). The interpreter runs none of this
asm (its ``ASM`` branches run on a GPU only; ``test_gpu_packed_decoders_asm_equals_twin_for_every_code``
compiles them there); here a wrong mask, shift, constant or operand order fails without one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkinfer.attention.triton_codes import (_E2M1X8_PTX, _E4M3X4_PTX, NVFP4_SHIFT, SCALE_SELECTOR,
                                              SCALE_SELECTOR_STEP)
from sparkinfer.attention.triton_decode import _BF16X2_PTX
from sparkinfer.indexer.triton_scores import _E4M3X4_BF16_PTX, _E4M3X4_F16_PTX, _MUL_WIDE_PTX
from sparkinfer.testing import ptx

BYTES = np.arange(256, dtype=np.int64)
MAGNITUDES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)


def _words(seed: int = 0, n_random: int = 4096) -> np.ndarray:
    """uint32 words: every byte in every position (word i: four bytes i) and random words."""
    rng = np.random.default_rng(seed)
    return np.concatenate([BYTES * 0x01010101, rng.integers(0, 2**32, n_random, dtype=np.int64)])


def _byte(words: np.ndarray, i: int) -> torch.Tensor:
    return torch.from_numpy((words >> (8 * i)) & 255)


def _e4m3(code: torch.Tensor, nan_as_480: bool) -> torch.Tensor:
    """torch's float8_e4m3fn value of each code (float64); its NaN codes as +-480 when ``nan_as_480``."""
    v = code.to(torch.uint8).view(torch.float8_e4m3fn).double()
    return torch.where(v.isnan(), torch.where(code >= 128, -480.0, 480.0), v) if nan_as_480 else v


def _bits16(values: torch.Tensor, dtype) -> np.ndarray:
    """Values exact in ``dtype`` -> their 16 bits (uint64, as the evaluator returns them)."""
    return values.to(dtype).view(torch.int16).numpy().astype(np.uint16).astype(np.uint64)


def test_e4m3x4_bf16_decoder_every_code():
    """``e4m3x4_to_bf16``'s asm: byte i of a word -> element i, exact, the NaN codes as +-480."""
    words = _words()
    out = ptx.run(_E4M3X4_PTX.value, "=h,=h,=h,=h,r", [words])
    for i in range(4):
        assert np.array_equal(out[i], _bits16(_e4m3(_byte(words, i), True), torch.bfloat16)), f"element {i}"


@pytest.mark.parametrize("byte", range(4))
def test_e2m1x8_bf16_decoder_every_code_and_scale(byte):
    """``e2m1x8_to_bf16``'s asm: nibble i of a word x its E4M3 group scale (byte ``byte`` of a scale word,
    the others random: the permute must take that one) / NVFP4_SHIFT -> element i, exact, for every (code
    byte, scale code) pair and random words with random scales."""
    rng = np.random.default_rng(1 + byte)
    words = np.concatenate([np.repeat(BYTES * 0x01010101, 256), rng.integers(0, 2**32, 4096, dtype=np.int64)])
    scales = np.concatenate([np.tile(BYTES, 256), rng.integers(0, 256, 4096, dtype=np.int64)])
    others = rng.integers(0, 2**32, scales.size, dtype=np.int64) & ~(0xFF << (8 * byte))
    selector = np.full(words.size, byte * SCALE_SELECTOR_STEP.value + SCALE_SELECTOR.value)  # ``e2m1x8_to_bf16``'s
    out = ptx.run(_E2M1X8_PTX.value, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, others | scales << (8 * byte), selector])
    d = _e4m3(torch.from_numpy(scales), True) / NVFP4_SHIFT.value
    for i in range(8):
        nib = torch.from_numpy((words >> (4 * i)) & 15)
        want = torch.where(nib >= 8, -MAGNITUDES[nib & 7], MAGNITUDES[nib & 7]) * d
        assert np.array_equal(out[i], _bits16(want, torch.bfloat16)), f"element {i}"


def _f32_cases() -> np.ndarray:
    """fp32 bit patterns: ties (to even and to odd), just below and above them, the largest finite
    values, infinities, NaNs of both signs, subnormals, signed zeros, every exponent with random
    mantissas."""
    edges = [0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000,
             0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x00008000, 0x00018000,
             0x00000001, 0x807FFFFF, 0x80000000, 0, 0xBF808000]
    rng = np.random.default_rng(2)
    exps = np.repeat(np.arange(256, dtype=np.int64), 64)
    rand = (rng.integers(0, 2, exps.size) << 31) | (exps << 23) | rng.integers(0, 2**23, exps.size)
    return np.concatenate([np.array(edges, dtype=np.int64), rand])


def test_bf16x2_rounding_every_exponent():
    """``_bf16_bits``'s asm (pack 2: elements 0 and 1 in $1 and $2, the result's low and high halves): fp32
    -> bf16 rounded to nearest, ties to even, as torch rounds; every NaN to 0x7FC0 (torch's canonical)."""
    x = _f32_cases()
    y = np.roll(x, 1)  # element 1 of each pair: another case, so a swapped pair shows
    (out,) = ptx.run(_BF16X2_PTX.value, "=r,r,r", [x, y])
    for half, src in ((out & 0xFFFF, x), (out >> 16, y)):
        f = torch.from_numpy(src.astype(np.uint32).view(np.float32).copy())
        want = _bits16(f, torch.bfloat16)
        nan = f.isnan().numpy()
        assert np.array_equal(half[~nan], want[~nan])
        assert (half[nan] == 0x7FC0).all() and nan.sum() >= 4


@pytest.mark.parametrize("asm,dtype", [(_E4M3X4_F16_PTX, torch.float16), (_E4M3X4_BF16_PTX, torch.bfloat16)],
                         ids=["f16", "bf16"])
def test_indexer_e4m3x4_conversions_every_code(asm, dtype):
    """``key_rows``'s asm: byte i of a word -> element i in f16 / bf16, exact; the E4M3 NaN codes (never
    written by the encoders) give NaN."""
    words = _words(seed=3)
    out = ptx.run(asm.value, "=h,=h,=h,=h,r", [words])
    for i in range(4):
        code = _byte(words, i)
        ref = _e4m3(code, False)
        nan = ref.isnan().numpy()
        got = torch.from_numpy(out[i].astype(np.uint16).view(np.int16).copy()).view(dtype).double()
        assert torch.equal(got[~nan], ref[~nan]), f"element {i}"
        assert bool(got[nan].isnan().all())


def test_indexer_slot_offset_is_a_signed_wide_multiply():
    """``record_rows``'s asm: slot x stride as a signed 64-bit product, past 2^31 and 2^32 bytes."""
    rng = np.random.default_rng(4)
    slot = np.concatenate([[0, 1, 2**31 - 1, -1], rng.integers(0, 2**31, 1000)])
    stride = np.concatenate([[368, 656, 432, 368], rng.integers(1, 2**20, 1000)])
    (out,) = ptx.run(_MUL_WIDE_PTX.value, "=l,r,r", [slot & 0xFFFFFFFF, stride])
    want = [(int(a) * int(b)) & (2**64 - 1) for a, b in zip(slot, stride)]
    assert out.tolist() == want
    assert max(want[:3]) > 2**32


def test_the_evaluator_catches_a_wrong_constant_and_refuses_what_it_does_not_model():
    """The checks above can fail: the E4M3 decoder with its 2^120 constant off by one exponent (0x7B00,
    2^119) decodes every nonzero code to half its value; an instruction the evaluator has no semantics for
    raises instead of passing."""
    words = _words(n_random=0)
    wrong = _E4M3X4_PTX.value.replace("0x7B807B80", "0x7B007B00")
    assert wrong != _E4M3X4_PTX.value
    out = ptx.run(wrong, "=h,=h,=h,=h,r", [words])
    want = _e4m3(_byte(words, 0), True)
    assert np.array_equal(out[0], _bits16(want / 2, torch.bfloat16))
    with pytest.raises(NotImplementedError, match="not modelled"):
        ptx.run("{ .reg .b32 a; popc.b32 a, $1; mov.b32 $0, a; }", "=r,r", [words])
    with pytest.raises(NotImplementedError, match="special register"):
        ptx.run("mov.u32 $0, %ctaid.y;", "=r,r", [words])
