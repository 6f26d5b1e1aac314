"""A CPU evaluator of the inline PTX that the Triton kernels hand to ``tl.inline_asm_elementwise``.

Triton's interpreter (TRITON_INTERPRET=1) runs no inline asm, so a kernel's ``ASM`` branch (the packed
record decoders of ``sparkinfer.attention.triton_codes``, the bf16 rounding of ``triton_decode``, the
indexer's E4M3 conversions and address multiply) would otherwise run only on a GPU. ``run`` executes
the asm text itself on numpy arrays, one lane per element, so tests check each bit trick against its
reference on every code without a GPU (``tests/attention/test_inline_ptx.py``).

The semantics are those of the PTX ISA for the instructions the kernels use, and only those: any other
instruction, type or operand form raises ``NotImplementedError``, so new asm gets its semantics written
here (and a test) before it counts as checked. What the ISA text leaves open is stated where it is
modelled: a NaN that ``cvt`` produces is the canonical one (bf16 0x7FFF, f16 0x7FFF).

A value is held as its bits (uint64, masked to the register's width); floating-point instructions
reinterpret them. ``fma.rn.bf16x2`` is computed exactly in float64 and rounded once to bf16 (ties to
even, subnormals kept: PTX's bf16 arithmetic does not flush them); a case float64 cannot hold exactly
raises rather than round twice.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

# the constraint letters of an inline-asm operand -> register width in bits
_CONSTRAINT_BITS = {"h": 16, "r": 32, "l": 64}
# register / instruction types -> width in bits
_TYPE_BITS = {f"{k}{n}": n for k in ("b", "u", "s") for n in (8, 16, 32, 64)}
_TYPE_BITS.update(f16=16, bf16=16, f32=32, f64=64, f16x2=32, bf16x2=32)

_U64 = np.uint64


def _mask(bits: int) -> np.uint64:
    return _U64((1 << bits) - 1)


def _signed(v: np.ndarray, bits: int) -> np.ndarray:
    """The bits of ``v`` (``bits`` wide) as two's-complement int64."""
    v = v.astype(np.int64)
    return np.where(v >= 1 << (bits - 1), v - (1 << bits), v)


def _halves(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A 32-bit pair's (low, high) 16-bit halves."""
    return v & _U64(0xFFFF), (v >> _U64(16)) & _U64(0xFFFF)


def _pair(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo & _U64(0xFFFF)) | ((hi & _U64(0xFFFF)) << _U64(16))


# ---- floating-point bits -------------------------------------------------------------------------------

def bf16_value(bits: np.ndarray) -> np.ndarray:
    """bf16 bits -> float64 (exact: a bf16 is the high half of an f32)."""
    return (np.asarray(bits, dtype=np.uint64).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def f16_value(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint64).astype(np.uint16).view(np.float16).astype(np.float64)


def f32_value(bits: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # a signaling NaN's widening
        return np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.float32).astype(np.float64)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float64 values -> bf16 bits, rounded once to nearest (ties to even), subnormals kept, overflow to
    infinity, NaN to the canonical 0x7FFF."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    with np.errstate(invalid="ignore", over="ignore"):
        _, e = np.frexp(np.where(np.isfinite(a), a, 1.0))
        q = np.maximum(e - 8, -133)  # the quantum: 8 significant bits, and bf16's least subnormal 2^-133
        v = np.ldexp(np.rint(np.ldexp(a, -q)), q)  # rint: ties to even
        v = np.where(np.isinf(a), np.inf, v)
        bits = (v.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint64)  # beyond bf16: inf
    bits |= np.signbit(x).astype(np.uint64) << _U64(15)
    return np.where(np.isnan(x), _U64(0x7FFF), bits)


def f16_bits(x: np.ndarray) -> np.ndarray:
    """float64 values exact in f16 -> f16 bits; NaN to the canonical 0x7FFF."""
    x = np.asarray(x, dtype=np.float64)
    h = x.astype(np.float16)
    if not np.array_equal(h.astype(np.float64), x, equal_nan=True):
        raise NotImplementedError("a value that f16 does not hold exactly (the modelled conversions are exact)")
    return np.where(np.isnan(x), _U64(0x7FFF), h.view(np.uint16).astype(np.uint64))


def e4m3_value(code: np.ndarray) -> np.ndarray:
    """float8_e4m3fn codes -> float64 (0x7F / 0xFF: NaN), as torch's float8_e4m3fn converts them."""
    import torch

    c = torch.from_numpy(np.asarray(code, dtype=np.uint64).astype(np.uint8))
    return c.view(torch.float8_e4m3fn).double().numpy()


# ---- the evaluator ---------------------------------------------------------------------------------------

def _split_operands(text: str) -> list[str]:
    """Comma-separated operands, a ``{a, b}`` vector kept whole."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += (ch == "{") - (ch == "}")
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _statements(asm: str) -> list[str]:
    body = asm.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    return [s.strip() for s in body.split(";") if s.strip()]


class _Lanes:
    """The registers of one asm instance, every lane at once."""

    def __init__(self, n: int):
        self.n = n
        self.regs: dict[str, tuple[int, np.ndarray]] = {}

    def declare(self, name: str, bits: int, value=None):
        self.regs[name] = (bits, np.zeros(self.n, _U64) if value is None else value & _mask(bits))

    def read(self, op: str, bits: int) -> np.ndarray:
        if op in self.regs:
            return self.regs[op][1] & _mask(bits)
        if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", op):
            v = int(op, 0) & ((1 << bits) - 1)
            return np.full(self.n, v, _U64)
        raise NotImplementedError(f"operand {op!r}: neither a declared register nor an integer immediate")

    def write(self, op: str, value: np.ndarray):
        if op not in self.regs:
            raise NotImplementedError(f"destination {op!r} is not a declared register")
        bits, _ = self.regs[op]
        self.regs[op] = (bits, value.astype(_U64) & _mask(bits))


def _vector(op: str) -> list[str] | None:
    return [e.strip() for e in op[1:-1].split(",")] if op.startswith("{") else None


def _fma_bf16(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    fa, fb, fc = bf16_value(a), bf16_value(b), bf16_value(c)
    prod = fa * fb  # exact: two 8-bit significands, well inside float64's exponent range
    s = prod + fc
    with np.errstate(invalid="ignore"):
        err = (prod - (s - (s - prod))) + (fc - (s - prod))  # TwoSum's error term
    finite = np.isfinite(s)
    if np.any(err[finite] != 0):
        raise NotImplementedError("fma.rn.bf16x2 with a sum float64 cannot hold exactly")
    return bf16_bits(s)


def _exec(lanes: _Lanes, stmt: str) -> None:
    m = re.fullmatch(r"([a-z][a-z0-9_.]*)\s+(.*)", stmt, re.S)
    if not m:
        raise NotImplementedError(f"cannot parse {stmt!r}")
    opcode, ops = m.group(1), _split_operands(m.group(2))
    parts = opcode.split(".")
    name, mods = parts[0], parts[1:]
    t = mods[-1] if mods else ""

    if name == "mov":
        bits = _TYPE_BITS[t]
        dst, src = ops
        if _vector(dst):  # unpack: the first element is the lowest bits
            elems = _vector(dst)
            w = bits // len(elems)
            v = lanes.read(src, bits)
            for i, e in enumerate(elems):
                lanes.write(e, (v >> _U64(i * w)) & _mask(w))
        elif _vector(src):  # pack
            elems = _vector(src)
            w = bits // len(elems)
            v = np.zeros(lanes.n, _U64)
            for i, e in enumerate(elems):
                v |= lanes.read(e, w) << _U64(i * w)
            lanes.write(dst, v)
        else:
            if src.startswith("%"):
                raise NotImplementedError(f"special register {src}: not a value the evaluator has")
            lanes.write(dst, lanes.read(src, bits))
        return
    if name in ("and", "or", "xor"):
        bits = _TYPE_BITS[t]
        a, b = (lanes.read(o, bits) for o in ops[1:])
        lanes.write(ops[0], a & b if name == "and" else a | b if name == "or" else a ^ b)
        return
    if name in ("shl", "shr"):
        bits = _TYPE_BITS[t]
        a, n = lanes.read(ops[1], bits), lanes.read(ops[2], 32).astype(np.int64)
        n = np.minimum(n, bits)  # PTX: a shift by more than the width is clamped to it
        if name == "shl":
            v = np.where(n >= bits, _U64(0), (a << n.astype(_U64)) & _mask(bits))
        elif t.startswith("s"):
            v = (_signed(a, bits) >> np.minimum(n, bits - 1)).astype(np.int64).astype(_U64)
        else:
            v = np.where(n >= bits, _U64(0), a >> n.astype(_U64))
        lanes.write(ops[0], v)
        return
    if name in ("mul", "mad") and mods[0] in ("lo", "wide") and _TYPE_BITS[t] <= 32:
        bits = _TYPE_BITS[t]
        a, b = lanes.read(ops[1], bits), lanes.read(ops[2], bits)
        if t.startswith("s"):  # a 32 x 32-bit product is exact in 64 bits (two's complement for signed)
            prod = (_signed(a, bits) * _signed(b, bits)).astype(_U64)
        else:
            prod = a * b
        width = 2 * bits if mods[0] == "wide" else bits
        if name == "mad":
            prod = prod + lanes.read(ops[3], width)  # modulo 2^64, then masked to the width
        lanes.write(ops[0], prod & _mask(width))
        return
    if name == "prmt" and mods == ["b32"]:  # bytes of {b, a} (a: bytes 0..3) by the selector's nibbles
        a, b, c = (lanes.read(o, 32) for o in ops[1:])
        pool = a | (b << _U64(32))
        v = np.zeros(lanes.n, _U64)
        for i in range(4):
            sel = (c >> _U64(4 * i)) & _U64(15)
            byte = (pool >> ((sel & _U64(7)) * _U64(8))) & _U64(0xFF)
            byte = np.where(sel & _U64(8), np.where(byte & _U64(0x80), _U64(0xFF), _U64(0)), byte)  # sign replicated
            v |= byte << _U64(8 * i)
        lanes.write(ops[0], v)
        return
    if name in ("min", "max") and t in ("s16x2", "u16x2"):
        a, b = lanes.read(ops[1], 32), lanes.read(ops[2], 32)
        pick = np.minimum if name == "min" else np.maximum
        halves = []
        for x, y in zip(_halves(a), _halves(b)):
            if t == "s16x2":
                x, y = _signed(x, 16), _signed(y, 16)
            halves.append(pick(x, y).astype(np.int64).astype(_U64))
        lanes.write(ops[0], _pair(*halves))
        return
    if name == "fma" and mods == ["rn", "bf16x2"]:
        a, b, c = (_halves(lanes.read(o, 32)) for o in ops[1:])
        lanes.write(ops[0], _pair(_fma_bf16(a[0], b[0], c[0]), _fma_bf16(a[1], b[1], c[1])))
        return
    if name == "cvt":
        key = ".".join(mods)
        if key == "rn.bf16x2.f32":  # d[31:16] = cvt(a), d[15:0] = cvt(b)
            a, b = f32_value(lanes.read(ops[1], 32)), f32_value(lanes.read(ops[2], 32))
            lanes.write(ops[0], _pair(bf16_bits(b), bf16_bits(a)))
            return
        if key == "rn.f16x2.e4m3x2":  # d[31:16] from a[15:8], d[15:0] from a[7:0] (exact)
            a = lanes.read(ops[1], 16)
            lo, hi = e4m3_value(a & _U64(0xFF)), e4m3_value(a >> _U64(8))
            lanes.write(ops[0], _pair(f16_bits(lo), f16_bits(hi)))
            return
        if key == "f32.f16":  # exact
            v = f16_value(lanes.read(ops[1], 16)).astype(np.float32)
            lanes.write(ops[0], v.view(np.uint32).astype(_U64))
            return
    raise NotImplementedError(f"instruction {opcode!r} is not modelled (sparkinfer/testing/ptx.py)")


def run(asm: str, constraints: str, args: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run inline-asm text as ``tl.inline_asm_elementwise`` would on each lane: ``constraints`` as
    Triton's (``"=h,=h,r"``: outputs first, then inputs; ``h`` 16, ``r`` 32, ``l`` 64 bits), the
    operands numbered $0.. in that order; ``args`` one integer array of bits per input (every lane's
    raw bits at the input's width; equal lengths). Returns one uint64 array of bits per output."""
    letters = [c.strip() for c in constraints.split(",")]
    outs = [c[1:] for c in letters if c.startswith("=")]
    ins = [c for c in letters if not c.startswith("=")]
    if len(ins) != len(args):
        raise ValueError(f"{len(ins)} inputs in {constraints!r}, {len(args)} arrays given")
    n = len(args[0]) if args else 1
    lanes = _Lanes(n)
    for k, c in enumerate(outs):
        lanes.declare(f"${k}", _CONSTRAINT_BITS[c])
    for k, (c, a) in enumerate(zip(ins, args)):
        a = np.asarray(a)
        if a.shape != (n,):
            raise ValueError(f"input ${len(outs) + k} has shape {a.shape}, {(n,)} expected")
        lanes.declare(f"${len(outs) + k}", _CONSTRAINT_BITS[c], a.astype(np.int64).astype(_U64))
    for stmt in _statements(asm):
        if stmt.startswith(".reg"):
            m = re.fullmatch(r"\.reg\s+\.(\w+)\s+(.*)", stmt, re.S)
            for r in m.group(2).split(","):
                lanes.declare(r.strip(), _TYPE_BITS[m.group(1)])
            continue
        _exec(lanes, stmt)
    return [lanes.regs[f"${k}"][1] for k in range(len(outs))]
