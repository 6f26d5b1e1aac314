"""The host side of a step's plan, built by the metadata builders from vLLM's host-side data.

vLLM keeps host copies of what the scheduler decided (``query_start_loc_cpu``,
``seq_lens_cpu_upper_bound``); the builders plan everything data-dependent from those with numpy
(which request owns which rows, the rows' causal positions, how many keys each request scores),
and the plan reaches the device in one copy (``to_device``). A layer's forward then runs
fixed-shape device work with no read back (``host_reads`` counts what is left).

Shapes: ``qsl`` int64 [R + 1] (request r's rows are ``qsl[r] .. qsl[r + 1]``), ``seq_lens`` int64 [R]
(tokens of request r including this step's), ``token_req`` / ``offset`` int64 [T] (row t's request
and its index among the request's rows).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from sparkinfer.decode.host_copies import host_array

log = logging.getLogger(__name__)


def host_lens(cm, vllm_config) -> tuple[np.ndarray, np.ndarray]:
    """(qsl int64 [R + 1], seq_lens int64 [R]) of a ``CommonAttentionMetadata`` on the host.

    ``seq_lens_cpu_upper_bound`` is exact except for speculative decode under async scheduling
    (vLLM's rule), and for the drafter's own passes, which advance it by one per pass whatever was
    accepted: callers use it as a size (the keys a request may score, masked by the device's
    positions) and take exact contexts only where it is exact (``exact_seq_lens``)."""
    r = cm.num_reqs
    qsl = host_array(cm.query_start_loc_cpu)[: r + 1].astype(np.int64)
    bound = cm.seq_lens_cpu_upper_bound
    if bound is None:  # a vLLM caller without host lengths: read them (one device read)
        return qsl, cm.seq_lens[:r].cpu().numpy().astype(np.int64)
    return qsl, host_array(bound)[:r].astype(np.int64)


def exact_seq_lens(vllm_config) -> bool:
    """Whether a target step's ``seq_lens_cpu_upper_bound`` is its exact sequence lengths."""
    return not (vllm_config.scheduler_config.async_scheduling and vllm_config.speculative_config is not None)


def batch_rows(qsl: np.ndarray, num_tokens: int) -> np.ndarray:
    """int64 [R]: the token rows each request holds in a batch of ``num_tokens`` rows.

    A request's rows are its query length, except in a batch vLLM padded for a FULL CUDA graph of a
    larger size: vLLM appends requests of no rows (query length 0, sequence length 0, block-table
    row ``NULL_BLOCK_ID``) and token rows past the real ones (slot -1); the padded token rows are
    spread over the padded requests, ``(num_tokens - qsl[-1]) / padded`` each (the uniform decode
    batch's query length, as the graph's capture run laid them out). A batch of fewer rows than its
    requests' keeps their first ``num_tokens``."""
    qlen = qsl[1:] - qsl[:-1]
    extra = num_tokens - int(qsl[-1])
    if extra <= 0:
        return qlen
    padded = len(qlen) - len(np.trim_zeros(qlen, "b"))  # vLLM's padding: the trailing requests of no rows
    if padded == 0 or extra % padded:
        raise ValueError(f"{extra} token rows past the requests' {int(qsl[-1])} and {padded} padded requests to "
                         "hold them: not a batch vLLM padded for a CUDA graph")
    rows = qlen.copy()
    rows[len(qlen) - padded:] = extra // padded
    return rows


def token_layout(qsl: np.ndarray, seq_lens: np.ndarray, num_tokens: int):
    """(token_req, positions) int64 [T]: row t's request and causal position ``seq_len - query_len + i``;
    a padded row (``batch_rows``) belongs to its padded request at position -1: no key to score and
    none to attend, and the indexer's slot of it is -1 (not written)."""
    qlen = qsl[1:] - qsl[:-1]
    token_req = np.repeat(np.arange(qlen.shape[0]), batch_rows(qsl, num_tokens))[:num_tokens]
    offset = np.arange(num_tokens) - qsl[token_req]
    real = offset < qlen[token_req]
    return token_req, np.where(real, seq_lens[token_req] - qlen[token_req] + offset, -1)


def to_device(device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """int64 copies of ``arrays`` on ``device``, moved in one host-to-device copy (new tensors: a
    direct caller's; a builder's step plan goes through its ``Uploads``)."""
    return Uploads(device)(*arrays)


class Uploads:
    """One builder's step plan on the device: the host's arrays copied each step into the same
    persistent int64 buffer, in one host-to-device copy.

    Why persistent: a captured CUDA graph reads its metadata at the addresses it saw at capture, so a
    step's plan must land where the last step of the same shape put it (the arrays are laid out in
    call order, so a step of the same shape gets views at the same offsets;
    ``sparkinfer.testing.launches`` holds the forwards to that). The buffer is sized at engine start
    for the largest step (``capacity`` int64s); a larger plan grows it, once, with a log line: a
    graph captured before then would read the old buffer. A later build overwrites the plan the
    previous one left: the copy is stream-ordered after the forwards that read it."""

    def __init__(self, device, capacity: int = 0):
        self.device = device
        self.buf = torch.empty(capacity, dtype=torch.int64, device=device)

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        sizes = [np.asarray(a).size for a in arrays]
        flat = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays]))
        if flat.numel() > self.buf.numel():
            if self.buf.numel():
                log.warning("sparkinfer: a step plan of %d int64s outgrew its %d-entry device buffer (a step "
                            "larger than the engine was sized for); grown", flat.numel(), self.buf.numel())
            self.buf = torch.empty(flat.numel(), dtype=torch.int64, device=self.device)
        on = self.buf[: flat.numel()]
        on.copy_(flat, non_blocking=True)
        return [t.view(np.shape(a)) for t, a in zip(torch.split(on, sizes), arrays)]
