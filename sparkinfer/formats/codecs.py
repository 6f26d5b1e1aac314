"""Element codecs in torch: E4M3, E2M1, bf16 and exact power-of-two scales.

These are the torch reference's building blocks. Each is one definition from
``../shared/spec/record-formats.md``; the C++ twins are the functions of the
same names in ``csrc/include/sparkinfer/records.h``. All take and return
tensors of any shape; floats are fp32, codes uint8.
"""

from __future__ import annotations

import torch

TINY = 2.0 ** -126

# E2M1 magnitudes by code 0..7; code 8 is -0.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn bytes: clamp to +-448, round to nearest even."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (0..15), nearest magnitude, ties to the even code.

    The midpoints between neighbouring magnitudes are 0.25, 0.75, 1.25, 1.75,
    2.5, 3.5 and 5; a tie goes to the even code, which is the lower neighbour at
    0.25, 1.25, 2.5, 5 (strict >) and the upper one at 0.75, 1.75, 3.5 (>=).
    Values past 6 land on code 7 (the clamp). A zero magnitude is stored as +0.
    """
    a = y.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    negative = torch.signbit(y) & (code != 0)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes; element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def bf16_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., n] -> little-endian bf16 bytes [..., 2n] (round to nearest even)."""
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


def bf16_decode(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.bfloat16).to(torch.float32)


def f32_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 [...] -> little-endian bytes [..., 4]."""
    return x.to(torch.float32).contiguous().unsqueeze(-1).view(torch.uint8)


def bytes_to_f32(raw: torch.Tensor) -> torch.Tensor:
    """bytes [..., 4] -> fp32 [...]."""
    return raw.contiguous().view(torch.float32).squeeze(-1)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(v)) for positive normal fp32 v, exactly.

    With v = m * 2**e and m in [0.5, 1) (frexp), v is a power of two exactly when
    m == 0.5, and then the answer is v itself; otherwise it is 2**e. No log2 is
    evaluated, so no rounding can move the result across a power of two.
    """
    m, e = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), e - (m == 0.5).to(e.dtype))
