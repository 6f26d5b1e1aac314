"""Sparse MLA decode over per-token records, and the LSE merge of partials.

    out, lse = sparse_mla_decode(q_nope, q_rope, records, fmt, indices, scale)

q_nope float32/bf16 [M, H, 512] (absorbed), q_rope [M, H, 64], records uint8
[T, fmt.record_bytes], indices int32/int64 [M, K] into records (-1 = skip), scale the
softmax scale applied to q . k. Returns out float32 [M, H, 512] and lse float32
[M, H] = log sum_j exp(scale * q . k_j) (natural log; -inf with a zero output
for a row without any index). Keys are [latent ; rope], values the latent.

``backend``: "triton" (the kernel; on CPU it needs TRITON_INTERPRET=1 set
before this package is imported), "torch" (the reference), or "auto" (Triton on
a GPU or under the interpreter, else the reference, logged once).
"""

from __future__ import annotations

from .dispatch import pick_backend
from .merge import merge_lse
from .reference import sparse_mla_decode_torch
from .validate import check_decode_inputs


# Names of the precisions before the kernel moved to tensor cores ("ieee": fp32 products, "tf32").
_OLD_PRECISION = {"ieee": "bf16x2", "tf32": "bf16"}


def sparse_mla_decode(q_nope, q_rope, records, fmt, indices, scale, *, backend: str = "auto",
                      check_indices: bool = True, num_splits: int | None = None, dot_precision: str = "bf16x2",
                      out=None, lse=None, workspace=None):
    """Attention of each query row over its selected records; see the module docstring.

    check_indices=False skips the range check of indices (it reads them back to the host).
    num_splits and dot_precision tune the Triton kernel: "bf16x2" (default) splits fp32 queries and
    the probabilities into two bf16 halves (~16-bit products), "bf16" rounds them once; "ieee" and
    "tf32", the names of the fp32 kernel, are accepted as "bf16x2" and "bf16". out, lse and
    workspace (``triton_decode.DecodeWorkspace``) are optional preallocated buffers of the Triton
    path (the torch path ignores workspace and copies into out / lse when given).
    """
    dot_precision = _OLD_PRECISION.get(dot_precision, dot_precision)
    if dot_precision not in ("bf16x2", "bf16"):
        raise ValueError(f"dot_precision must be 'bf16x2' or 'bf16', got {dot_precision!r}")
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if pick_backend(backend, q_nope.is_cuda, "sparse_mla_decode") == "torch":
        ref_out, ref_lse = sparse_mla_decode_torch(q_nope, q_rope, records, fmt, indices, scale, check_indices)
        if out is not None:
            ref_out = out.copy_(ref_out)
        if lse is not None:
            ref_lse = lse.copy_(ref_lse)
        return ref_out, ref_lse
    lay = check_decode_inputs(q_nope, q_rope, records, fmt, indices, scale, check_indices)
    from .triton_decode import sparse_mla_decode_triton

    return sparse_mla_decode_triton(q_nope, q_rope, records, lay, indices, scale,
                                    outer_scale=float(getattr(fmt, "outer_scale", 1.0)),
                                    num_splits=num_splits, dot_precision=dot_precision,
                                    out=out, lse=lse, workspace=workspace)


__all__ = ["sparse_mla_decode", "sparse_mla_decode_torch", "merge_lse"]
