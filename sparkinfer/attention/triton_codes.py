"""Triton device functions that turn record bytes into fp32 values.

Shared by the sparse MLA decode kernel and the indexer scoring kernel. Every
function builds the exact fp32 value from bit fields (no lookup tables, no
``exp2``), so a kernel decodes a record to the same fp32 numbers as the torch
codecs in ``sparkinfer.formats`` on every backend, the interpreter included.

Inputs are integer tensors holding the raw codes; outputs are float32 tensors
of the same shape. The E4M3 NaN codes (0x7F, 0xFF) are never written by the
encoders (they clamp to +-448) and decode here as +-480.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_to_f32(code):
    """float8_e4m3fn byte -> fp32 (bias 7; subnormals are m * 2**-9)."""
    b = code.to(tl.uint32)
    sign = (b >> 7) & 1
    e = (b >> 3) & 15
    m = b & 7
    # A normal E4M3 value re-biased into fp32 bit positions (127 - 7 = 120).
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where(sign == 1, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def e2m1_to_f32(nibble):
    """E2M1 code 0..15 -> fp32: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign."""
    c = nibble.to(tl.uint32)
    sign = (c >> 3) & 1
    e = (c >> 1) & 3
    m = c & 1
    # e >= 1: 2**(e-1) * (1 + m/2); e == 0: m/2.
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where(sign == 1, -mag, mag)


@triton.jit
def bf16_to_f32(bits16):
    """bfloat16 bit pattern (uint16) -> fp32 (exact)."""
    return (bits16.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def load_f32(byte_ptr, mask):
    """Load fp32 values stored little-endian at 4-byte aligned byte addresses."""
    return tl.load(byte_ptr.to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)



# ---- packed decoders for bf16 tensor-core tiles -----------------------------------------------------
# A code's bits land in a bf16's fields with shifts and masks, two codes per 32-bit op:
#   E4M3 byte b  -> bf16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 4) = float(b) * 2^-120
#   E2M1 code c  -> bf16 bits ((c & 8) << 12)   | ((c & 7) << 6)    = value(c) * 2^-126
# (exponent field = the code's exponent field: bf16's bias 127 against 7 / 1, and a code of exponent
# 0 lands on a bf16 subnormal of the same mantissa, so subnormal codes and zero come out right; the
# E4M3 NaN codes give +-480). One bf16 multiply (fma.rn.bf16x2 with -0: bf16 arithmetic keeps
# subnormals) then brings them to range, exactly: E4M3 x 2^120; E2M1 x (group scale x 2^119), since
# value x scale (<= 6 significant bits, 2^-10 .. 2688) is exact in bf16 and scale x 2^119 is at most
# 448 x 2^119 < bf16's largest. An E2M1 element thus decodes to value x scale x 2^-7 (NVFP4_SHIFT):
# the caller folds the 2^7 into its per-key scale (a power of two: the same roundings).
# ASM (a GPU: inline PTX, two codes per instruction) or the interpreter's twin (TRITON_INTERPRET=1
# runs no asm), the exact fp32 decoders above: the same bf16 values (tests compare the two).
NVFP4_SHIFT = tl.constexpr(128.0)
# The byte permute's selector for scale byte j of a word: SCALE_SELECTOR + SCALE_SELECTOR_STEP j (``_E2M1X8_PTX``)
SCALE_SELECTOR, SCALE_SELECTOR_STEP = tl.constexpr(0x4480), tl.constexpr(0x11)


def _pair_ptx(dst: str, word: str, sign_shift: int, code_shift: int, code_mask: int) -> str:
    """PTX: bf16 pair bits ``dst`` = the sign bits of ``word`` (bits 15 and 31 after a left shift by
    sign_shift) | its exponent and mantissa bits (``code_mask`` after a shift by code_shift, left when
    positive): two codes' bit fields placed in a bf16 pair's (``t`` is scratch)."""
    sign = f"shl.b32 {dst}, {word}, {sign_shift};" if sign_shift else f"mov.b32 {dst}, {word};"
    code = f"shl.b32 t, {word}, {code_shift};" if code_shift >= 0 else f"shr.u32 t, {word}, {-code_shift};"
    return f"""{sign}
    {code}
    and.b32 {dst}, {dst}, 0x80008000;
    and.b32 t, t, {code_mask:#010x};
    or.b32 {dst}, {dst}, t;
    """


def _nibble_pair_ptx(dst: str, word: str, high: int) -> str:
    """PTX: bf16 pair bits ``dst`` of the E2M1 codes in nibbles (0, 4) of ``word`` (high = 1: nibbles
    (1, 5)). The two nibbles are masked out and multiplied by 2^12 + 2^6 (2^8 + 2^2): a sum of two
    shifted copies whose bit ranges do not meet (no carries), the sign bit landing on bits 15 / 31 in
    one and the exponent and mantissa bits on 6..8 / 22..24 in the other; a last mask keeps those."""
    return f"""and.b32 {dst}, {word}, {0x000F000F << 4 * high:#010x};
    mul.lo.u32 {dst}, {dst}, {0x1040 >> 4 * high:#x};
    and.b32 {dst}, {dst}, 0x81c081c0;
    """


def _scale_unpack_ptx(j: int) -> str:
    """PTX: pair pj x the scale pair s (-0 added: a product of -0 stays -0), unpacked into $j, $(j + 4)."""
    return f"""fma.rn.bf16x2 p{j}, p{j}, s, z;
    mov.b32 {{${j}, ${j + 4}}}, p{j};
    """


# E4M3 bytes (0, 2) and (1, 3) of $4 into pairs a and b, x 2^120, unpacked into $0..$3.
_E4M3X4_PTX = tl.constexpr(f"""{{
    .reg .b32 a, b, t, k, z;
    {_pair_ptx("a", "$4", 8, 4, 0x07F007F0)}
    {_pair_ptx("b", "$4", 0, -4, 0x07F007F0)}
    mov.b32 k, 0x7B807B80;
    mov.b32 z, 0x80008000;
    fma.rn.bf16x2 a, a, k, z;
    fma.rn.bf16x2 b, b, k, z;
    mov.b32 {{$0, $2}}, a;
    mov.b32 {{$1, $3}}, b;
    }}""")
# The E4M3 scale code, byte j of the scale word $9 -> a bf16 pair s of scale x 2^119: one byte permute
# (selector $10 = 0x4480 + 0x11 j: nibbles j and 8 + j, the upper bytes from the zero operand) takes the
# byte into bits 0..7 and its sign, replicated, into bits 8..15, a mask keeps the exponent and mantissa
# bits 0..6 and the sign at bit 11, then one multiply by 0x00100010 places its fields in both halves' bf16 fields
# (scale x 2^-120, as the E4M3 bytes above, subnormal codes included), and two exact multiplies (x 2^120,
# x 2^119: one constant would overflow bf16) bring it to range; E2M1 codes (j, j + 4) of $8 into pair pj
# (j = 2, 3: of $8 >> 8, in t), x s, unpacked into $j, $(j + 4).
_E2M1X8_PTX = tl.constexpr(f"""{{
    .reg .b32 s, t, z, k, p0, p1, p2, p3;
    mov.b32 z, 0x80008000;
    prmt.b32 s, $9, 0, $10;
    and.b32 s, s, 0x087F;
    mul.lo.u32 s, s, 0x00100010;
    mov.b32 k, 0x7B807B80;
    fma.rn.bf16x2 s, s, k, z;
    mov.b32 k, 0x7B007B00;
    fma.rn.bf16x2 s, s, k, z;
    shr.u32 t, $8, 8;
    {"".join(_nibble_pair_ptx(f"p{j}", "t" if j >= 2 else "$8", j % 2) for j in range(4))}
    {"".join(_scale_unpack_ptx(j) for j in range(4))}
    }}""")


@triton.jit
def e4m3x4_to_bf16(words, ASM: tl.constexpr):
    """uint32 words of 4 E4M3 bytes (byte j: element j) -> 4 bf16 tensors (elements 0..3), exact.

    The asm is not pure for Triton (is_pure=False): a pure one is rematerialized, decoded once more in
    each layout its users need (the QK dot's and the PV tile's); impure, once."""
    if ASM:
        return tl.inline_asm_elementwise(_E4M3X4_PTX, "=h,=h,=h,=h,r", [words],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                         is_pure=False, pack=1)
    # the twin: the 4 bytes on two new axes of 2 (byte 2a + b at [..., a, b]), decoded in one pass (as
    # ``e2m1x8_to_bf16``'s), then split back out
    w = tl.expand_dims(words.to(tl.uint32), (-2, -1))
    shift = tl.reshape(tl.arange(0, 4).to(tl.uint32) * 8, [2, 2])
    b0, b1 = tl.split(e4m3_to_f32((w >> shift) & 255).to(tl.bfloat16))
    e0, e2 = tl.split(b0)
    e1, e3 = tl.split(b1)
    return e0, e1, e2, e3


@triton.jit
def e2m1x8_to_bf16(words, scale_words, byte, ASM: tl.constexpr):
    """uint32 words of 8 E2M1 codes (bits 4i..4i+3: element i) times their E4M3 group scale (byte ``byte``,
    0..3, of the uint32 ``scale_words``) -> 8 bf16 tensors (elements 0..7) of value x scale / NVFP4_SHIFT,
    exact (ASM: not pure, as ``e4m3x4_to_bf16``)."""
    if ASM:  # the permute's selector (a constant per column: folded)
        return tl.inline_asm_elementwise(_E2M1X8_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                                         [words, scale_words, byte * SCALE_SELECTOR_STEP + SCALE_SELECTOR],
                                         dtype=(tl.bfloat16,) * 8, is_pure=False, pack=1)
    scale_code = (scale_words >> (8 * byte)) & 0xFF
    # the twin: the 8 codes on three new axes of 2 (element 4a + 2b + c at [..., a, b, c]), decoded in one
    # pass, then split back out (the interpreter's cost is per operation, hardly per element: a pass per
    # code took test_attention.py 38 s, this 22)
    w = tl.expand_dims(words.to(tl.uint32), (-3, -2, -1))
    d = tl.expand_dims(e4m3_to_f32(scale_code.to(tl.uint32)) * 0.0078125, (-3, -2, -1))  # 1 / NVFP4_SHIFT
    shift = tl.reshape(tl.arange(0, 8).to(tl.uint32) * 4, [2, 2, 2])
    c0, c1 = tl.split((e2m1_to_f32((w >> shift) & 15) * d).to(tl.bfloat16))
    c00, c01 = tl.split(c0)
    c10, c11 = tl.split(c1)
    e0, e4 = tl.split(c00)
    e2, e6 = tl.split(c01)
    e1, e5 = tl.split(c10)
    e3, e7 = tl.split(c11)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def bf16x2_split(words):
    """uint32 words of 2 bf16 (low half: element 0) -> 2 bf16 tensors, bit for bit."""
    w = words.to(tl.uint32)
    return (w & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True), (w >> 16).to(tl.uint16).to(tl.bfloat16,
                                                                                             bitcast=True)
