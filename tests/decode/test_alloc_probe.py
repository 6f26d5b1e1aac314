"""The allocation counter of the host-read probe (``sparkinfer.testing.host_reads``, issue 16): what it
books as an allocation and where, without an engine (the engines' counts come from
``tests/vllm/test_vllm_host_reads.py``). Every expectation is worked out from the ops by hand."""

import pytest
import torch

from sparkinfer.testing import host_reads


def _allocs(counts, kind="alloc"):
    return {k.split("|", 2)[2]: v for k, v in counts.items() if k.split("|")[1] == kind}


def test_new_storage_is_booked_views_in_place_and_out_writes_are_not():
    x, buf = torch.ones(4), torch.empty(4)
    with host_reads.count_allocations() as made:
        y = x * 2  # a functional op: 16 new bytes
        torch.mul(x, 2, out=buf)  # into a preallocated buffer
        x[1:].add_(1)  # a view, in place
        x.view(2, 2).t()  # views
        torch.tensor([1, 2, 3])  # lift_fresh: int64, 24 bytes
        torch.empty(0)  # no bytes
    assert _allocs(made) == {"other:mul": 1, "other:lift_fresh": 1}
    assert _allocs(made, "alloc_bytes") == {"other:mul": 16, "other:lift_fresh": 24}
    assert y.sum() == 8


_lib = torch.library.Library("sparkinfer_alloc_probe_test", "DEF")
_lib.define("twice_plus_one(Tensor x) -> Tensor")
_lib.impl("twice_plus_one", lambda x: x * 2 + 1, "CPU")


def test_the_aten_ops_inside_a_custom_op_are_booked_once():
    """A mode is off inside the op it intercepts; the counter redispatches a custom op (vLLM's
    attention and indexer ops) with itself re-entered, so the two temporaries inside are seen, and
    the op's output (the second of them) is not booked again."""
    x = torch.ones(3)
    with host_reads.count_allocations() as made:
        out = torch.ops.sparkinfer_alloc_probe_test.twice_plus_one(x)
    assert out.tolist() == [3.0, 3.0, 3.0]
    assert _allocs(made) == {"other:mul": 1, "other:add": 1}


def test_sites_are_the_innermost_sparkinfer_frame():
    from sparkinfer.indexer.topk import pack_keys, unpack_keys

    keys = pack_keys(torch.tensor([[0.5, -1.0]]), torch.tensor([3, 4]))
    with host_reads.count_allocations() as made:
        unpack_keys(keys, True)
    sites = _allocs(made)
    # the ids: empty, then an in-place copy_ and bitwise_not_ (not allocations); the scores:
    # torch.where(o >= 0, o, o ^ 0x7FFFFFFF) of o = (top >> 32).to(int32), masked_fill(ids < 0, -inf)
    assert sites == {f"sparkinfer:indexer/topk.py:unpack_keys:{op}": 1
                     for op in ("empty", "__rshift__", "_to_copy", "ge", "bitwise_xor", "where", "lt", "masked_fill")}
    out = torch.empty(1, 2, dtype=torch.int32)
    with host_reads.count_allocations() as made:  # into a caller's buffer: none
        unpack_keys(keys, False, out=out)
    assert not _allocs(made) and out.tolist() == [[3, 4]]


def test_the_codecs_torch_reference_is_a_kernel_stand_in():
    """On a GPU ``Format.encode`` allocates its output and the CUDA encoder allocates nothing: the
    host build (the same call shape) books exactly that output; the torch reference (what CPU tensors
    take by default) books nothing, as the interpreted Triton kernels book nothing."""
    from sparkinfer.formats import get_format

    fmt = get_format("nvfp4_368")
    g = torch.Generator().manual_seed(0)
    latent, rope = torch.randn(5, 512, generator=g), torch.randn(5, 64, generator=g)
    with host_reads.count_allocations() as ref:
        fmt.encode(latent, rope, backend="torch")
    # the input checks (formats/base.py:check_values) run on either backend; nothing from the codec
    assert ref and all(k.split("|")[2].startswith("sparkinfer:formats/base.py:check_values:") for k in ref), dict(ref)
    try:
        with host_reads.count_allocations() as host:
            fmt.encode(latent, rope, backend="host")
    except (OSError, RuntimeError) as e:  # no host build of the native library here
        pytest.skip(f"host build unavailable: {e}")
    out = "sparkinfer:formats/base.py:encode:empty"
    assert _allocs(host) == {**_allocs(ref), out: 1}
    assert _allocs(host, "alloc_bytes")[out] == 5 * 368
