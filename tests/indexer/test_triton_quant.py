"""The indexer's q quantization kernel (sparkinfer.indexer.triton_quant) against its torch twin, bit for bit.

``group_quant_fp8`` against ``replicated_indexer.quant_q_fp8``'s torch form, over fp32 and bf16
inputs, ue8m0 and plain scales, groups of 64 and 128, row counts across the kernel's block, with
groups at every scale from below the 1e-4 floor to 1e4, amaxes exactly on a power of two and one ulp
above it (where an approximate log2 would round the wrong way), and rows holding NaN or infinity
(which must stay non-finite in q, for the indexer's check). Interpreted on CPU (conftest); natively
on a GPU (the ``cuda`` cases, ``-m gpu``). ``quant_q_fp8`` takes the kernel when the GPU implementations are forced.
"""

import pytest
import torch

from sparkinfer.decode import impls
from sparkinfer.vllm.replicated_indexer import quant_q_fp8
from sparkinfer.indexer.triton_quant import group_quant_fp8


DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted only without a GPU")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(n: int, d: int, group: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    groups = x.view(n, d // group, group)
    scales = 10.0 ** torch.linspace(-6, 4, n * (d // group)).view(n, d // group, 1)
    groups *= scales
    if n >= 4:
        groups[1, 0] = 0.0  # all zero: the floor
        groups[2, 0, 5] = 448.0 * 2.0 ** -3  # an amax on a power-of-two scale
        groups[2, 0, 6] = 0.0
        groups[2, 0] = groups[2, 0].clamp(-56, 56)
        groups[3, 0] = groups[3, 0].clamp(-1, 1)
        groups[3, 0, 0] = torch.nextafter(torch.tensor(448.0 * 2.0 ** -5), torch.tensor(1e9))  # one ulp above
    return x.to(dtype)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("n,d,group", [(37, 256, 128), (5, 128, 64), (1, 128, 128)])
def test_kernel_equals_the_torch_twin(monkeypatch, dev, dtype, ue8m0, n, d, group):
    x = _inputs(n, d, group, dtype, seed=n + d)
    monkeypatch.setenv(impls.FORCE_ENV, "0")
    want_q, want_s = quant_q_fp8(x, group, use_ue8m0=ue8m0)
    got_q, got_s = (t.cpu() for t in group_quant_fp8(x.to(dev), group, ue8m0))
    assert got_q.dtype == torch.float8_e4m3fn and got_s.dtype == torch.float32 and got_s.shape == want_s.shape
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    monkeypatch.setenv(impls.FORCE_ENV, "1")  # the forced dispatch takes the kernel
    forced_q, forced_s = (t.cpu() for t in quant_q_fp8(x.to(dev), group, use_ue8m0=ue8m0))
    assert torch.equal(forced_s, want_s) and torch.equal(forced_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_input_stays_non_finite(dev, bad):
    x = torch.randn(4, 128)
    x[2, 7] = bad
    q, s = (t.cpu() for t in group_quant_fp8(x.to(dev), 128, True))
    assert not bool(torch.isfinite(q[2].float()).all())
    assert bool(torch.isfinite(q[[0, 1, 3]].float()).all()) and bool(torch.isfinite(s[[0, 1, 3]]).all())
