"""Which implementation of each kernel the vLLM glue runs: the GPU ones or their CPU twins.

Every place in ``sparkinfer/vllm`` that used to branch on the device type asks this module
instead, so the GPU branch is the same Python code as the CPU branch with only the kernels
underneath differing:

=====================  =====================================  ================================
what                   GPU implementations (``gpu_impls``)    CPU default
=====================  =====================================  ================================
sparse-MLA attention   Triton kernel (``triton_decode``)      torch reference
indexer scores         Triton scorer (``triton_scores``)      torch float64 reference
indexer top-k          Triton radix select (``triton_topk``)   torch.topk (``select_topk``'s)
exchange sizing        ``device``: no host read of the        ``host``: counts read once per
                       planes, one round, graph-replayable    exchange, pairs in rounds
fabric (``auto``)      CUDA IPC + copy engines on a GPU;      host (shared memory)
                       the host fabric when forced on CPU
=====================  =====================================  ================================

``SPARKINFER_FORCE_GPU_IMPLS=1`` forces the GPU column on CPU tensors (Triton under
``TRITON_INTERPRET=1``, which must then be set too, before Triton kernels are imported), so that a
CPU test runs inside vLLM exactly the code a GPU node runs; only the fabric stays the host one
(the CUDA fabric needs CUDA IPC). It is a plain environment variable, not a ``VLLM_SPARKINFER_*``
setting: it changes no serving decision, only where kernels run. ``probe_counts`` returns the
calls per implementation that ``sparkinfer.attention.dispatch`` counted in this process, so a test
can prove which kernels ran.
"""

from __future__ import annotations

import os
FORCE_ENV = "SPARKINFER_FORCE_GPU_IMPLS"
# sm_90 (H100/H200, the test machines) and sm_120 (RTX PRO 6000, the target): what the Triton
# kernels and record codecs are validated for.
VALIDATED_MAJORS = (9, 12)


def forced() -> bool:
    """True when ``SPARKINFER_FORCE_GPU_IMPLS=1``; a value other than 0/1/empty is an error."""
    value = os.environ.get(FORCE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{FORCE_ENV} must be 0 or 1, got {value!r}")
    if value != "1":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{FORCE_ENV}=1 on a machine without CUDA runs the Triton kernels under the "
                             "interpreter: set TRITON_INTERPRET=1 as well (before the engine starts)")
    return True


def gpu_impls(device) -> bool:
    """Whether tensors on ``device`` (a torch.device or its string) take the GPU implementations."""
    kind = device.type if hasattr(device, "type") else str(device).split(":")[0]
    return kind == "cuda" or forced()


def kernel_backend(device) -> str:
    """``sparkinfer.attention`` / ``sparkinfer.indexer`` backend for tensors on ``device``."""
    return "triton" if gpu_impls(device) else "torch"


def exchange_sizing(device) -> str:
    """The selected exchange's sizing for caches on ``device`` (``comm.exchange``)."""
    return "device" if gpu_impls(device) else "host"


def fabric_kind(setting: str, device) -> str:
    """The transport for ``fabric`` = ``setting`` (``auto`` | ``host`` | ``cuda``): ``auto`` is the CUDA
    fabric for caches on a GPU and the host fabric otherwise (forcing the GPU implementations does
    not change it: CUDA IPC needs CUDA)."""
    if setting != "auto":
        return setting
    kind = device.type if hasattr(device, "type") else str(device).split(":")[0]
    return "cuda" if kind == "cuda" else "host"


def fabric_problem(setting: str, device_type: str) -> str | None:
    """Why fabric ``setting`` cannot move caches on ``device_type`` ("cuda" / "cpu"); None if it can."""
    kind = fabric_kind(setting, device_type)
    if kind == "host" and device_type == "cuda":
        return (f"sparkinfer fabric {setting!r} with the caches on a GPU: the host fabric moves CPU tensors through "
                "shared memory; set fabric auto or cuda")
    if kind == "cuda" and device_type != "cuda":
        return f"sparkinfer fabric {setting!r} with the caches on the CPU: the CUDA fabric needs GPUs; set fabric auto"
    return None


def check_capability(device, what: str) -> None:
    """Refuse a CUDA device outside sm_90 / sm_120 (no-op for CPU tensors), naming the capability."""
    kind = device.type if hasattr(device, "type") else str(device).split(":")[0]
    if kind != "cuda":
        return
    import torch

    check_capability_of(torch.cuda.get_device_capability(device), what)


def check_capability_of(capability: tuple[int, int], what: str) -> None:
    major, minor = capability
    if major not in VALIDATED_MAJORS:
        raise RuntimeError(f"{what} is validated on sm_90 and sm_120 only; this GPU is sm_{major}{minor} "
                           f"(compute capability {major}.{minor}): use a 9.x or 12.x GPU, or sparkinfer mode "
                           "stock with a vLLM backend for this GPU")


def probe_counts(worker=None) -> dict:
    """Calls per ``"<caller>:<backend>"`` in this process (``sparkinfer.attention.dispatch.calls``);
    ``LLM.collective_rpc(probe_counts)`` asks every worker."""
    from sparkinfer.attention.dispatch import calls

    return dict(calls)


def log_graph_support(runtime, cudagraph_mode) -> None:
    """The one engine log line (per worker: ``runtime``, a ``runtime.WorkerRuntime``) saying how vLLM
    runs the sparkinfer layers under CUDA graphs (``graph_paths``: what each builder declares and why);
    on the ``vllm.sparkinfer`` logger, so it goes wherever vLLM's own lines go."""
    if runtime.graph_line_logged:
        return
    runtime.graph_line_logged = True
    import logging

    from sparkinfer.decode.graph_paths import PARTS, support, unsafe

    declared = ", ".join(f"{p} {support(p)}" for p in PARTS)
    why = "; ".join(f"{p}: {reason}" for p, reason in unsafe(PARTS).items()) or "none"
    logging.getLogger("vllm.sparkinfer").info(
        "sparkinfer: CUDA graph support per builder (AttentionCGSupport): %s. FULL graphs capture uniform "
        "decode batches, each on the path and indexer scoring fixed for its size, and a step that chose "
        "otherwise runs without it; "
        "not replay-safe yet: %s. With cudagraph_mode %s vLLM keeps a NEVER part outside its captured "
        "pieces (PIECEWISE) and resolves FULL decode graphs only where every builder supports them",
        declared, why, cudagraph_mode)

