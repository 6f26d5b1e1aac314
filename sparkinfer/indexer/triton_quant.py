"""The indexer's q quantization as one Triton kernel (``replicated_indexer.quant_q_fp8`` on a GPU).

Its torch twin (``quant_q_fp8``) is ten elementwise ops and as many temporaries per indexer layer;
this kernel reads each group once and writes only the two outputs. Bit for bit the twin's rule
(``tests/vllm/test_vllm_cpu_paths.py``, interpreted on CPU):

    x float [N, D] in groups of G -> q float8_e4m3fn [N, D], scale float32 [N, D // G]
    scale = max(amax(|group|), 1e-4) / 448, rounded up to a power of two when ``ue8m0``
    q = clamp(x / scale, -448, 448)

with IEEE division (``div_rn``: Triton's ``/`` may be approximate on a GPU), the power-of-two round
done on the bits (an approximate ``log2`` could land one binade low), NaN kept by the max and the
clamp (a group holding a NaN or an infinity has a NaN or infinite scale, which vLLM's indexer
folds into the head weights: there ``run_indexer``'s finiteness check sees it), and the fp8 bytes
encoded in the kernel (``_e4m3_bits``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, WARPS = 16, 4  # rows per program; 448 below is e4m3's largest finite value


@triton.jit
def _group_quant_kernel(x_ptr, s_xn, q_ptr, s_qn, scale_ptr, s_sn, N, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                        UE8M0: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    rc = g * GROUP + tl.arange(0, GROUP)
    rows = rn < N
    x = tl.load(x_ptr + rn[:, None].to(tl.int64) * s_xn + rc[None, :], mask=rows[:, None], other=0.0).to(tl.float32)
    floor = tl.full((BLOCK_N,), 1e-4, tl.float32)
    # NaN propagated by the max and the floor (a GPU's max.f32 drops it by default): a group holding a
    # NaN gets a NaN scale, as in the twin, and the indexer's check sees it in the weights it scales
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.div_rn(tl.maximum(amax, floor, propagate_nan=tl.PropagateNan.ALL),
                      tl.full((BLOCK_N,), 448.0, tl.float32))
    if UE8M0:  # up to the next power of two: a positive normal float with its mantissa carried (an
        # infinite or NaN scale stays as it is, so that q is NaN there as in the twin)
        bits = scale.to(tl.int32, bitcast=True)
        up = ((bits + 0x7FFFFF) & -0x800000).to(tl.float32, bitcast=True)
        scale = tl.where(scale < float("inf"), up, scale)
    q = tl.clamp(tl.div_rn(x, scale[:, None] + tl.zeros_like(x)), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptr + rn[:, None].to(tl.int64) * s_qn + rc[None, :], _e4m3_bits(q), mask=rows[:, None])
    tl.store(scale_ptr + rn.to(tl.int64) * s_sn + g, scale, mask=rows)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _e4m3_bits(q):
    """float8_e4m3fn bytes (uint8) of fp32 ``q`` (|q| <= 448 or NaN), rounded to nearest even.

    Written out rather than ``q.to(tl.float8e4nv)``: the interpreter's conversion truncates and
    turns NaN into 256, so the CPU twin could not be held to the GPU's bits. The round adds and
    subtracts 1.5 * 2^23 ulps (fp32 addition rounds to nearest even at that ulp); e4m3's ulp is
    2^(e - 3) for exponents e >= -6 and 2^-9 below (its subnormals)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((e + 20 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^23 * 2^(e - 3)
    r = tl.abs((q + magic) - magic)
    rbits = r.to(tl.int32, bitcast=True)
    normal = r >= 0.015625  # 2^-6 (the round may carry a subnormal up to it)
    exp_field = ((rbits >> 23) & 0xFF) - 127 + 7
    byte = tl.where(normal, (exp_field << 3) | ((rbits >> 20) & 0x7), (r * 512.0).to(tl.int32))
    byte = tl.where(q != q, 0x7F, byte) | sign
    return byte.to(tl.uint8)


def group_quant_fp8(x: torch.Tensor, group_size: int, ue8m0: bool, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, D], scale float32 [N, D // group_size]) of ``x`` [N, D] (last dim contiguous,
    D a multiple of ``group_size``, a power of two), by the rule in the module docstring; into ``out``
    (contiguous tensors of those shapes) when given."""
    n, d = x.shape
    q, scale = out if out is not None else (
        torch.empty((n, d), dtype=torch.float8_e4m3fn, device=x.device),  # written as its bytes
        torch.empty((n, d // group_size), dtype=torch.float32, device=x.device))
    if n:
        _group_quant_kernel[(triton.cdiv(n, BLOCK_N), d // group_size)](
            x, x.stride(0), q.view(torch.uint8), q.stride(0), scale, scale.stride(0), n, GROUP=group_size, BLOCK_N=BLOCK_N,
            UE8M0=ue8m0, num_warps=WARPS)
    return q, scale


def compile_specs() -> list[dict]:
    """Every launch configuration the wrapper uses, for compiling without a GPU (benchmarks/kernel_report.py): GLM-5.2's
    indexer q (bf16, groups of 128 = one head, ue8m0 scales) and fp32 q (the CPU twin's dtype)."""
    specs = []
    for elem in ("bf16", "fp32"):
        sig = {"x_ptr": f"*{elem}", "s_xn": "i32", "q_ptr": "*u8", "s_qn": "i32", "scale_ptr": "*fp32",
               "s_sn": "i32", "N": "i32", "GROUP": "constexpr", "BLOCK_N": "constexpr", "UE8M0": "constexpr"}
        specs.append(dict(name=f"indexer_q_quant[{elem}]", fn=_group_quant_kernel, signature=sig,
                          constexprs={"GROUP": 128, "BLOCK_N": BLOCK_N, "UE8M0": True}, num_warps=WARPS,
                          num_stages=1))
    return specs
