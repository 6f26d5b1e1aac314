"""The attention arena's layout (sparkinfer/core/attention_workspace.py): every call the engine can make
fits what engine start reserved, whatever the GPU's SM count, and the segments do not overlap."""

import pytest

from sparkinfer.attention.triton_decode import BLOCK_H, MAX_SPLITS, num_splits_for
from sparkinfer.core.attention_workspace import (ALIGN, BLOCK_PROGRAMS, BLOCK_ROWS, AttentionWorkspace, block_rows,
                                                  call_plan, offsets)


@pytest.mark.parametrize("rows, heads, topk, out_bytes", [(64, 64, 2048, 2), (1000, 16, 2048, 2), (8192, 64, 2048, 2),
                                                          (2500, 4, 256, 4), (1, 1, 16, 4), (700, 20, 512, 2)])
def test_every_call_within_the_engine_limits_fits_the_layout(rows, heads, topk, out_bytes):
    """A call of m <= rows rows, h <= heads heads and the layout's top-k (the selected path attends
    fewer heads than stock DCP's gathered ones) needs no segment larger than the layout's, with the
    decode kernel's splits of an RTX PRO 6000 (188 SMs), an H200 (132) or the CPU (1); its blocks
    cover [0, m) in order, none over BLOCK_ROWS, and no block launches more than BLOCK_PROGRAMS
    programs (rows x ceil(h / 16) head blocks x splits) when it keeps partials."""
    layout = AttentionWorkspace(rows, heads, topk, out_bytes)
    have = layout.segments()
    ms = sorted(m for m in {*range(1, 301), *range(1, rows + 1, 97), rows, BLOCK_ROWS + 1, 2 * BLOCK_ROWS - 1}
                if m <= rows)
    for sms in (188, 132, None):
        for h in {heads, max(1, heads // 4), max(1, heads - 3)}:
            split = (lambda n: 1) if sms is None else (lambda n: num_splits_for(n, h, topk, sms))
            size = block_rows(h)
            for m in ms:
                need, blocks = call_plan(m, h, topk, out_bytes, split)
                over = {k: (v, have[k]) for k, v in need.items() if v > have[k]}
                assert not over, (sms, h, m, over)
                assert [a for a, _, _ in blocks] == list(range(0, m, size)) and blocks[-1][1] == m
                programs = -(-h // BLOCK_H)
                assert all(b - a <= BLOCK_ROWS and 1 <= s <= MAX_SPLITS
                           and (b - a) * programs * s <= max(BLOCK_PROGRAMS, programs) for a, b, s in blocks)


def test_partials_and_tickets_only_for_splits_and_small_blocks_take_more_splits():
    need, blocks = call_plan(1, 64, 2048, 2, lambda n: num_splits_for(n, 64, 2048, 188))
    assert blocks == [(0, 1, 16)]  # 188 SMs over 4 head blocks: 47 wanted, 2048 // 128 = 16 at most
    assert need["partial_out"] == 4 * 16 * 64 * 512
    assert need["tickets"] == 4 * 1 * 4  # one row x 4 head blocks
    need, blocks = call_plan(2048, 64, 2048, 2, lambda n: 1)
    rows = BLOCK_PROGRAMS // (64 // BLOCK_H)  # one split of 4 head blocks per row
    assert blocks[0] == (0, rows, 1) and len(blocks) == 2048 // rows
    assert need["partial_out"] == need["tickets"] == 0  # one split: the kernel writes the output (bf16 too)
    # the partials are BLOCK_PROGRAMS programs of 16 heads whatever the heads: 16 MiB where they were
    # 1,024 rows x 64 heads (128 MiB)
    assert AttentionWorkspace(8192, 64, 2048, 2).segments()["partial_out"] == 4 * BLOCK_PROGRAMS * BLOCK_H * 512


def test_segments_are_aligned_and_disjoint():
    layout = AttentionWorkspace(8192, 64, 2048, 2, index_heads=32, index_dim=128, index_group=128)
    at = offsets(layout.segments())
    spans = sorted(at.values())
    assert all(o % ALIGN == 0 for o, _ in spans)
    assert all(o1 + n1 <= o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))
    assert layout.nbytes >= spans[-1][0] + spans[-1][1] and layout.nbytes - sum(layout.segments().values()) < 9 * ALIGN
    assert layout.segments()["indexer_q"] == 8192 * 32 * 128 and layout.segments()["indexer_scales"] == 4 * 8192 * 32


@pytest.mark.parametrize("bad", [dict(rows=0), dict(out_bytes=3), dict(index_heads=2, index_dim=100)])
def test_bad_layouts_say_which_field(bad):
    kw = {**dict(rows=8, heads=4, topk=16, out_bytes=4), **bad}
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        AttentionWorkspace(**kw)
