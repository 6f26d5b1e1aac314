"""``sparkinfer.attention.interpret``: with the skip installed (conftest), a kernel whose helpers run
in a loop gives the same values as under Triton's own interpreter, patches ``triton.language`` once
per launch instead of once per helper call, and leaves it restored."""

import os

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from sparkinfer.attention import interpret

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter only")


@triton.jit
def _scaled(x, i):
    return tl.math.exp2(x * 0.25) + tl.sqrt(tl.abs(x)) * i


@triton.jit
def _kernel(x_ptr, out_ptr, N: tl.constexpr, TRIPS: tl.constexpr):
    p = tl.program_id(0)
    o = tl.arange(0, N)
    x = tl.load(x_ptr + p * N + o)
    acc = tl.zeros([N], tl.float32)
    for i in range(TRIPS):
        acc += _scaled(x, i)
    tl.store(out_ptr + p * N + o, tl.cumsum(acc, 0))


def test_helpers_skip_the_repatch_and_values_are_unchanged(monkeypatch):
    assert interpret.install() and interpreter._patch_lang is interpret._patch_lang_once
    original, ran = interpret._original, []

    def counted(fn):  # Triton's own patch, counted
        ran.append(fn.__name__)
        return original(fn)

    def run():
        ran.clear()
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
        out = torch.empty_like(x)
        _kernel[(3,)](x, out, 16, 5)
        return out, list(ran)

    monkeypatch.setattr(interpreter, "_patch_lang", counted)  # Triton's interpreter as it ships
    want, plain = run()
    monkeypatch.setattr(interpreter, "_patch_lang", interpret._patch_lang_once)
    monkeypatch.setattr(interpret, "_original", counted)
    got, once = run()
    # Triton's own: the launch, then every helper call (ours, and tl's own jitted ones such as zeros)
    assert plain[0] == "_kernel" and plain.count("_scaled") == 15 and "_kernel" not in plain[1:], plain
    assert once == ["_kernel"]
    assert torch.equal(got, want)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.math.exp2)  # restored after the launch
