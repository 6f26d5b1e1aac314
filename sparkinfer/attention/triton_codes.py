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

