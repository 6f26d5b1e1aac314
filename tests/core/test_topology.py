"""DCP placement and IndexShare pattern against brute-force enumeration."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer.core.topology import DcpLayout, IndexSharePattern

INTERLEAVES = (1, 2, 3, 4, 7, 16)


def dealt_placement(world, interleave, n):
    """Deal tokens 0..n-1 to ranks in runs of `interleave`, round robin (vLLM's DCP rule),
    recording each token's (owner, position in the owner's list)."""
    shards = [[] for _ in range(world)]
    place = []
    rank, run = 0, 0
    for t in range(n):
        place.append((rank, len(shards[rank])))
        shards[rank].append(t)
        run += 1
        if run == interleave:
            rank, run = (rank + 1) % world, 0
    return place, shards


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("interleave", INTERLEAVES)
def test_placement_matches_dealing(world, interleave):
    lay = DcpLayout(world, interleave)
    n = 3 * world * interleave + 5
    place, shards = dealt_placement(world, interleave, n)
    want_owner = [p[0] for p in place]
    want_local = [p[1] for p in place]
    # Python ints
    assert [lay.owner_and_local(t) for t in range(n)] == place
    # numpy and torch, same answers and container types
    o, l = lay.owner_and_local(np.arange(n, dtype=np.int64))
    assert isinstance(o, np.ndarray) and o.tolist() == want_owner and l.tolist() == want_local
    o, l = lay.owner_and_local(torch.arange(n, dtype=torch.int64))
    assert isinstance(o, torch.Tensor) and o.tolist() == want_owner and l.tolist() == want_local
    # inverse
    for rank in range(world):
        for j, t in enumerate(shards[rank]):
            assert lay.token_of(rank, j) == t
        got = lay.token_of(rank, torch.arange(len(shards[rank])))
        assert got.tolist() == shards[rank]
    # local_len for every prefix length
    for seq_len in range(n + 1):
        counts = [0] * world
        for r, _ in place[:seq_len]:
            counts[r] += 1
        assert [lay.local_len(seq_len, r) for r in range(world)] == counts
        assert lay.max_local_len(seq_len) == max(counts)


def test_large_token_ids_torch_int32_and_int64():
    lay = DcpLayout(4, 2)
    big = [2**31 - 1, 2**31 - 8, 1_000_003]
    for dtype in (torch.int32, torch.int64):
        o, l = lay.owner_and_local(torch.tensor(big, dtype=dtype))
        assert o.dtype == dtype
        for t, oo, ll in zip(big, o.tolist(), l.tolist()):
            assert (oo, ll) == lay.owner_and_local(t)
            assert lay.token_of(oo, ll) == t


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(world_size=4, interleave=0),
                                 dict(world_size=2.0), dict(world_size=True)])
def test_layout_rejects_bad_sizes(bad):
    with pytest.raises(ValueError):
        DcpLayout(**bad)


def test_layout_rejects_bad_ranks_and_tokens():
    lay = DcpLayout(4)
    with pytest.raises(ValueError, match="rank 4 out of range"):
        lay.local_len(10, 4)
    with pytest.raises(ValueError, match="seq_len"):
        lay.local_len(-1, 0)
    with pytest.raises(ValueError, match="token"):
        lay.owner_and_local(-1)
    with pytest.raises(ValueError, match="rank"):
        lay.token_of(-1, 0)


GLM52_FULL = [0, 1, 2] + list(range(6, 78, 4))


def test_glm52_pattern():
    pat = IndexSharePattern.glm52()
    assert pat.num_layers == 78
    assert pat.full_layers == GLM52_FULL and len(GLM52_FULL) == 21
    assert pat.topk_source(3) == 2 and pat.topk_source(5) == 2 and pat.topk_source(6) == 6
    assert pat.topk_source(77) == 74
    assert pat.prefetch_targets(2, 3) == [3, 4, 5]
    assert pat.prefetch_targets(74, 3) == [75, 76, 77]
    assert pat.prefetch_targets(74, 2) == [75, 76]
    assert pat.prefetch_targets(0, 3) == [] and pat.prefetch_targets(6, 0) == []
    # every Full layer from 2 on is followed by exactly three Shared layers
    assert all(len(pat.prefetch_targets(f, 10)) == 3 for f in GLM52_FULL[2:])


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="FS", min_size=0, max_size=40), st.integers(0, 6))
def test_pattern_against_brute_force(tail, depth):
    text = "F" + tail
    pat = IndexSharePattern.parse(text, len(text))
    assert pat.full_layers == [i for i, c in enumerate(text) if c == "F"]
    for layer in range(len(text)):
        src = max(i for i in range(layer + 1) if text[i] == "F")
        assert pat.topk_source(layer) == src
        assert pat.is_full(layer) == (text[layer] == "F")
        if text[layer] == "F":
            want = [j for j in range(layer + 1, len(text))
                    if pat.topk_source(j) == layer][:depth]
            assert pat.prefetch_targets(layer, depth) == want
        else:
            with pytest.raises(ValueError, match="Shared"):
                pat.prefetch_targets(layer, depth)


@pytest.mark.parametrize("text,layers,reason", [
    ("FFFSSS" + "FSSS" * 17, 78, "74 characters but the model has 78 layers"),
    ("FFFSSS" + "FSSS" * 18 + "S", 78, "79 characters"),
    ("SFFSSS" + "FSSS" * 18, 78, "must start with 'F'"),
    ("FFFSXS" + "FSSS" * 18, 78, "only 'F'"),
    ("fffsss" + "fsss" * 18, 78, "only 'F'"),
    ("", 1, "0 characters"),
])
def test_pattern_rejects(text, layers, reason):
    with pytest.raises(ValueError, match=reason):
        IndexSharePattern.parse(text, layers)


def test_pattern_layer_range():
    pat = IndexSharePattern.glm52()
    for bad in (-1, 78):
        with pytest.raises(ValueError, match="layer"):
            pat.topk_source(bad)
    with pytest.raises(ValueError, match="depth"):
        pat.prefetch_targets(2, -1)
