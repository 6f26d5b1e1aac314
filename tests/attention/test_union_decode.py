"""Union sparse MLA decode (``attention/triton_union_decode.py``, interpreted) against the per-row torch
reference (``attention/reference.py``): each of a request's R rows attends its own top-k, the kernel
walks the request's union once with a per-row bit mask (``plan.union.union_row_masks``).

Tolerance: queries are bf16 (the engine's dtype), so q is exact in the bf16 MMA operands, and the
decoded records are exact in bf16 (see triton_decode): every QK product is exact and the scores
differ from the reference's only by fp32 summation order (~1e-6 relative). The probabilities go
into the PV dot as bf16 hi + lo (~2^-16 relative: the interpreter truncates fp32 -> bf16, so its
split keeps ~16 bits, not 17), which bounds the output's difference by about |v|max 2^-16 ~ 2.3e-4
for latent values up to ~15. Measured over the formats, R x H in {1x2, 3x6, 4x16, 4x20}, splits 1-3,
scales 1/24 and 0.3: out <= 2.4e-4 (the 368 format, whose s_t folds into p), lse <= 2.3e-5
(absolute). OUT_TOL and LSE_TOL are absolute, ~2.5x over those.
"""

import math

import pytest
import torch

from sparkinfer.attention import sparse_mla_decode_torch
from sparkinfer.attention.triton_union_decode import UnionWorkspace, sparse_mla_union_decode
from sparkinfer.core.layouts import layout
from sparkinfer.formats import MAIN_FORMATS, get_format
from sparkinfer.plan.union import mtp_union_reference, union_row_masks

OUT_TOL = dict(atol=6e-4, rtol=0.0)
LSE_TOL = dict(atol=6e-5, rtol=0.0)


def make_union_case(fmt, b, r, h, k, t=90, seed=0, stride_pad=16, extra_width=5):
    """B requests of R rows with top-k K (distinct ids per row, from a shared pool so rows overlap,
    ~20% -1 pads); records in a strided view (row stride record_bytes + stride_pad)."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(t, 512, generator=g) * torch.rand(t, 1, generator=g) * 3
    rope = torch.randn(t, 64, generator=g)
    dense = fmt.encode(latent, rope)
    wide = torch.zeros(t, fmt.record_bytes + stride_pad, dtype=torch.uint8)
    wide[:, : fmt.record_bytes] = dense
    records = wide[:, : fmt.record_bytes]
    q_nope = torch.randn(b * r, h, 512, generator=g).to(torch.bfloat16)
    q_rope = torch.randn(b * r, h, 64, generator=g).to(torch.bfloat16)
    topk = torch.stack([torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(r)]) for _ in range(b)])
    topk = topk.int()
    topk[torch.rand(b, r, k, generator=g) < 0.2] = -1
    return q_nope, q_rope, records, topk


def union_inputs(topk, extra_width=5):
    """union int64 [B, R*K + extra_width] (-1 past each count), counts, row masks."""
    union, remap, counts = mtp_union_reference(topk)
    b, n = union.shape
    union = torch.cat([union.long(), torch.full((b, extra_width), -1, dtype=torch.int64)], dim=1)
    return union, counts, union_row_masks(remap, n + extra_width)


def per_row_reference(q_nope, q_rope, records, fmt, topk, scale):
    return sparse_mla_decode_torch(q_nope, q_rope, records, fmt, topk.reshape(-1, topk.shape[2]), scale)


def run_union(q_nope, q_rope, records, fmt, topk, scale, **kw):
    union, counts, mask = union_inputs(topk)
    return sparse_mla_union_decode(q_nope, q_rope, records, layout(fmt.name), union, counts, mask, topk.shape[1],
                                   scale, outer_scale=fmt.outer_scale, **kw)


def assert_close(got, want):
    torch.testing.assert_close(got[0].float(), want[0], **OUT_TOL)
    torch.testing.assert_close(got[1], want[1], **LSE_TOL)


@pytest.mark.parametrize("name", MAIN_FORMATS)
@pytest.mark.parametrize("r,h,splits", [(1, 2, 1), (4, 16, 1), (4, 16, 3), (3, 6, 2), (4, 20, 2)])
def test_union_decode_equals_per_row_reference(name, r, h, splits):
    """Rows overlap (shared pool), one row has no valid record, unions of 36..119 entries (one or two
    64-key tiles, the last one partial) plus -1 padding, a strided records view; splits 2-3 go through
    the fused merge (with 3 splits of 119 entries: 64, 55 and an empty split); 4 rows x 20 heads are
    two M blocks of 64."""
    fmt = get_format(name, outer_scale=0.5) if name.endswith("432") else get_format(name)
    q_nope, q_rope, records, topk = make_union_case(fmt, b=2, r=r, h=h, k=48, t=200, seed=r + h)
    topk[1, r - 1] = -1  # the last row of request 1 selects nothing
    scale = 1 / math.sqrt(576)
    want = per_row_reference(q_nope, q_rope, records, fmt, topk, scale)
    got = run_union(q_nope, q_rope, records, fmt, topk, scale, num_splits=splits)
    assert_close(got, want)
    assert torch.all(got[0][2 * r - 1] == 0) and torch.all(got[1][2 * r - 1] == -math.inf)
    if r > 1:  # the case tells the rows apart: attending the whole union in every row is far off
        union, _, _ = union_inputs(topk)
        everything = union[:, None, :].expand(-1, r, -1).clone()
        everything[1, r - 1] = -1
        wrong = per_row_reference(q_nope, q_rope, records, fmt, everything, scale)
        assert (wrong[0] - want[0]).abs().max() > 100 * OUT_TOL["atol"]


def test_merge_counters_reset_and_replay_is_identical():
    """Two launches on one workspace (as a CUDA-graph replay would): the merge counters are back at 0
    after each and the second result equals the first bit for bit; a bf16 output is the fp32 one rounded."""
    fmt = get_format("nvfp4_368")
    q_nope, q_rope, records, topk = make_union_case(fmt, b=3, r=2, h=4, k=40, seed=5)
    ws = UnionWorkspace.allocate(3, 2, 4, 4, "cpu")
    first = run_union(q_nope, q_rope, records, fmt, topk, 0.3, workspace=ws)
    assert torch.all(ws.counters == 0)
    second = run_union(q_nope, q_rope, records, fmt, topk, 0.3, workspace=ws)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert_close(first, per_row_reference(q_nope, q_rope, records, fmt, topk, 0.3))
    out = torch.empty(6, 4, 512, dtype=torch.bfloat16)
    run_union(q_nope, q_rope, records, fmt, topk, 0.3, workspace=ws, out=out)
    assert torch.equal(out.view(torch.int16), first[0].to(torch.bfloat16).view(torch.int16))


def test_row_masks_mark_each_rows_top_k():
    topk = torch.tensor([[[5, 7, -1], [7, 9, 5]], [[-1, -1, -1], [3, 3, 4]]], dtype=torch.int32)
    union, counts, mask = union_inputs(topk, extra_width=1)
    assert counts.tolist() == [3, 2]
    assert union[0, :3].tolist() == [5, 7, 9] and union[1, :2].tolist() == [3, 4]
    assert mask.tolist() == [[3, 3, 2, 0, 0, 0, 0], [2, 2, 0, 0, 0, 0, 0]]
    wide = torch.arange(32, dtype=torch.int32).view(1, 32, 1)  # row r holds token r: bit 31 is the sign
    _, remap, _ = mtp_union_reference(wide)
    assert union_row_masks(remap, 32)[0].tolist() == [1 << r if r < 31 else -(1 << 31) for r in range(32)]
