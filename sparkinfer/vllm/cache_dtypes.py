"""sparkinfer record formats as vLLM KV-cache dtypes (called from patch 0001-record-formats).

vLLM names a cache layout by its ``--kv-cache-dtype`` string. The two NVFP4 formats enter under
their full names (``nvfp4_ds_mla:fp8-rope-368``, ``nvfp4_ds_mla:bf16-rope-432``); the short names
``nvfp4_368`` / ``nvfp4_432`` are accepted on input and canonicalized to the full names, so every
later check sees one spelling. In vLLM's cache each token of an MLA layer is one opaque record
of ``record_bytes(dtype)`` bytes (``uint8 [num_blocks, block_size, record_bytes]``).

Torch-free except ``write_records``.
"""

from __future__ import annotations

from sparkinfer.core.layouts import NVFP4_368, NVFP4_432, layout

#: formats sparkinfer adds to vLLM (full names), and every spelling vLLM must accept for them.
CACHE_DTYPES = (NVFP4_368.name, NVFP4_432.name)
ACCEPTED_NAMES = CACHE_DTYPES + (NVFP4_368.short, NVFP4_432.short)


#: record formats the sparkinfer backend reads and writes: its own two and vLLM's 656-byte
#: ``fp8_ds_mla`` (FlashMLA's layout, record-formats.md), which vLLM already sizes itself.
RECORD_DTYPES = CACHE_DTYPES + ("fp8_ds_mla",)


def is_sparkinfer_cache_dtype(cache_dtype: object) -> bool:
    return isinstance(cache_dtype, str) and cache_dtype in ACCEPTED_NAMES


def is_record_cache_dtype(cache_dtype: object) -> bool:
    """A fixed-width record format the sparkinfer backend encodes, reads and exchanges."""
    return is_sparkinfer_cache_dtype(cache_dtype) or cache_dtype == "fp8_ds_mla"


def canonical_cache_dtype(cache_dtype: str) -> str:
    """Full name for a sparkinfer short name; any other vLLM cache dtype is returned unchanged."""
    return layout(cache_dtype).name if is_sparkinfer_cache_dtype(cache_dtype) else cache_dtype


def record_bytes(cache_dtype: str) -> int | None:
    """Bytes per token of a sparkinfer cache dtype (368/432); None for vLLM's own dtypes."""
    return layout(cache_dtype).record_bytes if is_sparkinfer_cache_dtype(cache_dtype) else None


def check_backend_reads(backend_name: str, supported_kv_cache_dtypes, cache_dtype: str) -> None:
    """Refuse a sparkinfer format that the chosen attention backend cannot read.

    Without this, vLLM's sparse-MLA canonicalization would silently turn any quantized dtype into
    ``fp8_ds_mla`` for FlashMLA, i.e. serve a 656-byte cache when 368 bytes were asked for.
    """
    if not is_sparkinfer_cache_dtype(cache_dtype):
        return
    supported = list(supported_kv_cache_dtypes or ())
    if canonical_cache_dtype(cache_dtype) not in [canonical_cache_dtype(d) for d in supported]:
        raise ValueError(
            f"kv_cache_dtype={cache_dtype!r} is a sparkinfer record format, but the selected "
            f"attention backend {backend_name} cannot read it (it reads: {', '.join(map(str, supported))}); "
            f"use the SPARKINFER_SPARSE_MLA backend or another kv_cache_dtype")


def write_records(cache_dtype: str, kv_c_normed, k_pe, kv_cache, slot_mapping) -> None:
    """Encode each token's latent ``kv_c_normed [T, 512]`` and rope ``k_pe [T, 64]`` (or [T, 1, 64])
    into ``kv_cache`` (uint8 ``[num_blocks, block_size, record_bytes]``, contiguous or one of vLLM's
    strided layer views) at ``slot_mapping [T]`` (flat slot = block * block_size + offset; -1 =
    padding, skipped).

    sparkinfer.formats runs the CUDA encoder on a GPU and the host build on CPU; both are byte
    identical to the torch reference. Checked on the host (``paged_sparse_mla.write_cache_records``);
    the backend's forward writes through ``paged_sparse_mla.forward_write_records``.
    """
    from sparkinfer.formats import get_format
    from sparkinfer.decode.paged_sparse_mla import write_cache_records

    if k_pe.dim() == 3:  # vLLM hands MLA's rope key as [T, 1, 64]
        k_pe = k_pe.squeeze(1)
    num_tokens = slot_mapping.shape[0]
    write_cache_records(get_format(canonical_cache_dtype(cache_dtype)), kv_cache, slot_mapping,
                        kv_c_normed[:num_tokens], k_pe[:num_tokens])
