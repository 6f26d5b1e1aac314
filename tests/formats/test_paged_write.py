"""The layer forward's cache write in one launch (``formats.native.write_paged``, the host twin of the
CUDA kernel): bf16 or fp32 rows of any row stride encoded straight into a paged cache of any block
and slot strides, with its value and slot checks flagged, equal byte for byte to the checked direct
form (contiguous pages, fp32 values, ``RecordFormat.write``)."""

import pytest
import torch

from sparkinfer.decode.device_checks import DeviceChecks
from sparkinfer.decode.paged_sparse_mla import NULL_BLOCK
from sparkinfer.formats import get_format, native


def _inputs(fmt, n, dtype, seed):
    """Rows as vLLM hands them: a bf16 model's, and views with a row stride past their width."""
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(n, fmt.value_dim + 7, generator=g).to(dtype)[:, 3:3 + fmt.value_dim]
    rope = torch.randn(n, 1, fmt.rope_dim, generator=g).to(dtype)[:, 0] if fmt.rope_dim else None
    return lat, rope


@pytest.mark.parametrize("name", ["nvfp4_368", "nvfp4_432", "fp8_ds_mla", "indexer_fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_write_equals_the_direct_write_of_the_pages(name, dtype):
    fmt = get_format(name)
    g = torch.Generator().manual_seed(1)
    backing = torch.randint(0, 256, (5, 8, 2, fmt.record_bytes + 20), generator=g, dtype=torch.uint8)
    view = backing[:, :, 1, 4:4 + fmt.record_bytes]  # blocks and slots both strided, as a layer of vLLM's layout
    want = backing.clone()
    slots = torch.tensor([9, -1, 30, 12, -1, 39, 8])
    lat, rope = _inputs(fmt, slots.shape[0], dtype, 2)
    pages = want[:, :, 1, 4:4 + fmt.record_bytes].contiguous()
    fmt.write(pages, slots, lat.float(), None if rope is None else rope.float())
    want[:, :, 1, 4:4 + fmt.record_bytes] = pages
    checks = DeviceChecks("cpu")
    native.write_paged(fmt, lat, rope, view, slots, NULL_BLOCK, checks.word("record_values"),
                       checks.word("cache_slots"))
    assert torch.equal(backing, want)
    assert not checks.flags.any()


def test_bad_slots_and_values_are_flagged_and_bad_slots_not_written():
    fmt = get_format("nvfp4_368")
    cache = torch.zeros(4, 8, 368, dtype=torch.uint8)
    lat, rope = _inputs(fmt, 4, torch.float32, 3)
    for slots, bad_slot in (([8, 9, 10, 11], False), ([3, 9, 10, 11], True), ([8, 32, 10, 11], True),
                            ([8, -2, 10, 11], True), ([8, -1, 10, 31], False)):
        checks = DeviceChecks("cpu")
        got = cache.clone()
        native.write_paged(fmt, lat, rope, got, torch.tensor(slots), NULL_BLOCK, checks.word("record_values"),
                           checks.word("cache_slots"))
        assert bool(checks.word("cache_slots")) == bad_slot, slots
        assert not checks.word("record_values")
        want = cache.clone()
        kept = [(s, i) for i, s in enumerate(slots) if 8 <= s < 32]  # past the null block 0, inside the cache
        fmt.write(want, torch.tensor([s for s, _ in kept]), lat[[i for _, i in kept]], rope[[i for _, i in kept]])
        assert torch.equal(got, want), slots
    checks = DeviceChecks("cpu")
    bad = rope.clone()
    bad[2, 5] = float("nan")
    native.write_paged(fmt, lat, bad, cache, torch.tensor([8, -1, -1, 11]), NULL_BLOCK, checks.word("record_values"),
                       checks.word("cache_slots"))
    assert bool(checks.word("record_values")) and not checks.word("cache_slots")  # a skipped row's value too


def test_slot_blocks_without_a_division():
    """records.h's slot_block (the aligned CUDA write's block of a slot: one 64-bit product and a shift)
    against integer division: block sizes 1..1100 and every power of two up to 2**30 with its neighbours
    (and 2**31 - 1), at the slots where the quotient steps (k d - 1, k d), the ends of the range and
    random ones."""
    top = 2**31 - 1
    g = torch.Generator().manual_seed(5)
    sizes = set(range(1, 1101)) | {2**k + e for k in range(11, 31) for e in (-1, 0, 1)} | {top}
    for d in sorted(sizes):
        k = torch.tensor([1, 2, 3, top // d // 2, top // d - 1, top // d])
        slots = torch.cat([k * d - 1, k * d, torch.tensor([0, 1, top - 1, top]),
                           torch.randint(0, top + 1, (64,), generator=g)]).clamp(0, top)
        assert torch.equal(native.host_slot_blocks(slots, d), (slots // d).to(torch.int32)), d


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4_368", "nvfp4_432", "fp8_ds_mla", "indexer_fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("n", [301, 1093])
def test_gpu_paged_write_equals_the_host_twin(name, dtype, aligned, n):
    """The CUDA kernel against its host twin (above: the direct write's bytes) on the same inputs, many
    rows at once so several CTAs run: every byte of a strided cache (the records written, the bytes
    around them untouched), and the same flags for the same bad slots (below -1, the null block, past
    the cache) and non-finite values (a skipped row's too). ``aligned``: rows, cache and strides on
    16 bytes, as vLLM's (the NVFP4 records then take write_paged_nvfp4_kernel: four tokens per warp at
    n = 301, eight at n = 1093, past records.cu's kWideWriteRows); else rows and records off that
    alignment (write_paged_kernel)."""
    fmt = get_format(name)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    nb, bs = max(40, n // 8), 16  # n: not a multiple of the four or eight tokens per warp
    pad, at = (32, 16) if aligned else (20, 4)
    backing = torch.randint(0, 256, (nb, bs, 2, fmt.record_bytes + pad), generator=g, dtype=torch.uint8)
    slots = torch.randperm((nb - 1) * bs, generator=g)[:n] + bs  # distinct: each record written once
    slots[::37] = -1
    lat, rope = _inputs(fmt, n, dtype, 8)
    if aligned:
        lat, rope = lat.contiguous(), None if rope is None else rope.contiguous()
    for bad_slots, bad_value in ((False, False), (True, False), (False, True)):
        s, l = slots.clone(), lat.clone()
        if bad_slots:
            s[[3, 50, 200]] = torch.tensor([-2, 5, nb * bs + 1])
        if bad_value:
            l[[0, 37]] = float("nan")  # row 37 is skipped (slot -1): its value is still checked
        got = {}
        for device in ("cpu", dev):
            b = backing.clone().to(device)
            checks = DeviceChecks(device)
            native.write_paged(fmt, l.to(device), None if rope is None else rope.to(device),
                               b[:, :, 1, at:at + fmt.record_bytes], s.to(device), NULL_BLOCK,
                               checks.word("record_values"), checks.word("cache_slots"))
            got[str(device)] = (b.cpu(), bool(checks.word("record_values")), bool(checks.word("cache_slots")))
        (host, host_v, host_s), (cuda, cuda_v, cuda_s) = got["cpu"], got[str(dev)]
        assert torch.equal(cuda, host), (bad_slots, bad_value)
        assert (cuda_v, cuda_s) == (host_v, host_s) == (bad_value, bad_slots)
        assert not torch.equal(host, backing)  # the records were written
