"""Record the launches of a step's forward, to prove a decode step replays from a captured CUDA graph (a probe).

A captured graph replays its kernels with the arguments they had at capture: the same pointers,
shapes, strides and scalars; only the bytes inside the buffers may differ from step to step. So a
decode step is capture-safe when every decode step at the same padded batch shape makes exactly
the same launches, whatever its requests, their lengths and contexts. This probe records the
launches each forward makes in vLLM's workers and compares two decode steps of equal shape that
take the same path (``step_path.PATHS``: stock, selected, local or gathered; a graph is captured
for one path, docs/design/cuda-graphs.md), after the first step of each kind (``WARMUP``).

What a launch is on CPU: an aten op (a kernel on a GPU) or an interpreted Triton kernel, made
by sparkinfer's code; in the engine, under a layer's forward (``host_reads.LAYER_ENTRIES``: the cache write, the
attention, the indexer op and its q quantization). vLLM's own ops are vLLM's to make capture-safe
and are not compared; they are only watched for what they produce.

Which pointers must be equal: a tensor a launch reads or writes is either

* made inside the forward (by any op, vLLM's included): inside a graph it comes from the graph's
  own memory pool, at the same address every replay. It is named by its first use among the
  recorded launches (``("made", n, offset, shape, stride, dtype)``), so two steps agree when they
  use their temporaries in the same pattern;
* or made outside it (the KV cache, the arena, weights, the step's metadata): the graph froze its
  address, so it must be the very same memory at the same offset, shape and stride
  (``("outside", address, ...)``). The probe keeps the last step's outside tensors alive until the
  comparison, so a buffer made afresh each step cannot land at the old address by chance and pass.

Python scalars (ints, floats, dtypes) and Triton grids are compared by value: a graph freezes them
too (a row count passed as a kernel argument is a shape the graph would keep).

    LLM.collective_rpc(install)          # in every worker: forward brackets and step brackets
    ... llm.generate(...)                # at least two decode steps of one batch shape
    LLM.collective_rpc(report)           # per worker: one comparison per pair of equal-shape decode steps
    LLM.collective_rpc(reset)            # forget them (before the engine's next path)

``record`` is the same recording around a block of code in this process (the probe's own tests).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from sparkinfer.testing.host_reads import LAYER_ENTRIES, OpWatcher, is_decode_step, spec_rows

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../sparkinfer/
_TESTING = os.path.join(_PKG, "testing") + os.sep
_active: list = []  # the recordings open in this process (innermost last)
# decode steps of a kind not compared: the first builds what the path keeps between steps (the ring's
# first prefetch, lazily sized plans), as vLLM's warm-up runs do before it captures a graph
WARMUP = 1


def _site(layers_only: bool):
    """(site, entry) of the call being made: the innermost sparkinfer frame, and the layer's forward
    entry it runs under (``LAYER_ENTRIES``; None outside one); (None, None) when the call is not
    sparkinfer's, or with ``layers_only`` not under a layer's forward: where a launch is booked."""
    frame = sys._getframe(2)
    site = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PKG) and not path.startswith(_TESTING):
            if site is None:
                site = f"{os.path.relpath(path, _PKG)}:{frame.f_code.co_name}"
            if frame.f_code.co_name in LAYER_ENTRIES:
                return site, frame.f_code.co_name
        frame = frame.f_back
    return (None, None) if layers_only else (site, None)


class Recording:
    """The launches of one forward: ``events`` [(site, kernel, arguments)], and the outside tensors'
    storages they touched (held alive: see the module docstring)."""

    def __init__(self, layers_only: bool):
        self.layers_only = layers_only
        self.events: list[tuple] = []
        # per event: (the layer's forward entry it ran under or None, whether it is a kernel launch
        # on a GPU: not a view, not an allocation)
        self.booked: list[tuple[str | None, bool]] = []
        self.made: dict[int, int] = {}  # storage (its serial in ``inside``) -> its name (order of first use)
        # address -> serial of the storage made there last: a freed address the allocator hands out
        # again is a new storage, so it gets a new name
        self.inside: dict[int, int] = {}
        self._serial = 0
        self.held: list = []

    @property
    def kernels(self) -> int:
        """The events that are a kernel launch on a GPU."""
        return sum(kernel for _, kernel in self.booked)

    def book(self, site: str, entry: str | None, kernel: bool, event: tuple) -> None:
        self.events.append((site, *event))
        self.booked.append((entry, kernel))

    def breakdown(self) -> Counter:
        """Kernel launches per (entry, site, kernel): where the forward's launches come from."""
        return Counter((entry, e[0], e[1]) for e, (entry, kernel) in zip(self.events, self.booked) if kernel)

    def tensor(self, t: torch.Tensor) -> tuple:
        st = t.untyped_storage()
        at = st.data_ptr()
        layout = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type)
        if at in self.inside:
            return ("made", self.made.setdefault(self.inside[at], len(self.made)), *layout)
        self.held.append(st)
        return ("outside", at, *layout)

    def born(self, made: dict) -> None:
        """Storages made inside the forward, at these addresses."""
        for at in made:
            self._serial += 1
            self.inside[at] = self._serial

    def value(self, v):
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, (list, tuple)):
            return tuple(self.value(x) for x in v)
        if isinstance(v, dict):
            return tuple((k, self.value(x)) for k, x in sorted(v.items()))
        if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return v
        return type(v).__name__  # an object without a value a kernel reads (a stream, a generator)


class _RecordMode(OpWatcher):
    """Every aten op of the forward: its outputs are inside storages; under a layer's forward it is a launch."""

    def __init__(self, rec: Recording):
        super().__init__()
        self.rec = rec

    def seen(self, func, args, kwargs, out, made: dict) -> None:
        self.rec.born(made)
        site, entry = _site(self.rec.layers_only) if not _in_kernel[0] else (None, None)
        if site is not None:
            self.rec.book(site, entry, not (func.is_view or func._opname in _NO_KERNEL),
                          (func._opname, self.rec.value(args), self.rec.value(kwargs)))


# aten ops that launch no kernel on a GPU (besides views): allocations and metadata
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "set_", "resize_", "lift_fresh", "detach", "alias",
              "_local_scalar_dense"}
# the native record kernels' bindings (``formats.native``), each one launch
NATIVE_LAUNCHES = ("encode", "gather", "write_paged")
_in_kernel = [0]  # inside a kernel's launch (an interpreted Triton kernel, a native call): not launches


def _launching(name: str, orig, event):
    """``orig`` wrapped to book each call as one launch named ``name``; ``event(rec, args, kwargs)``
    gives its arguments as recorded."""
    def launch(*args, **kwargs):
        if _active and not _in_kernel[0]:
            rec = _active[-1]
            site, entry = _site(rec.layers_only)
            if site is not None:
                rec.book(site, entry, True, (name, *event(rec, args, kwargs)))
        _in_kernel[0] += 1
        try:
            return orig(*args, **kwargs)
        finally:
            _in_kernel[0] -= 1

    launch._sparkinfer_launch = True
    return launch


def _patch_kernels() -> None:
    """Book each interpreted Triton launch (``GridExecutor.__call__``) and each call of the native record
    kernels (``formats.native``: the host build on CPU, one CUDA launch on a GPU) as one launch
    (once per process)."""
    from sparkinfer.formats import native

    for name in NATIVE_LAUNCHES:
        fn = getattr(native, name)
        if not getattr(fn, "_sparkinfer_launch", False):
            setattr(native, name, _launching(f"native:{name}", fn, lambda rec, a, k: (rec.value(a), rec.value(k))))
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    if getattr(interpreter.GridExecutor.__call__, "_sparkinfer_launch", False):
        return

    def event(rec, args, kwargs):
        self, args = args[0], args[1:]
        grid = self.grid if not callable(self.grid) else "callable"
        return ("grid", rec.value(grid)), rec.value(args), rec.value(kwargs)

    orig = interpreter.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        return _launching(f"triton:{self.fn.__name__}", orig, event)(self, *args, **kwargs)

    grid_call._sparkinfer_launch = True
    interpreter.GridExecutor.__call__ = grid_call


@contextmanager
def record(layers_only: bool = False):
    """The launches sparkinfer's code makes in the block (one forward), as a ``Recording``; with
    ``layers_only``, only those under a layer's forward (the engine probe's choice)."""
    _patch_kernels()
    rec = Recording(layers_only)
    mode = _RecordMode(rec)
    # inside another probe's mode (host_reads' allocation count in the engine), ride on it
    outer = next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, OpWatcher)), None)
    _active.append(rec)
    try:
        if outer is None:
            with mode:
                yield rec
        else:
            outer.also.append(mode.seen)
            try:
                yield rec
            finally:
                outer.also.remove(mode.seen)
    finally:
        _active.remove(rec)


def differences(a: list[Recording], b: list[Recording]) -> list[dict[str, str]]:
    """Per forward of ``a`` and ``b`` (one step's, in order), {site: the first difference there, in
    words}: all empty when they made the same launches. Forwards that made different numbers of
    launches are compared up to the shorter, and the counts are reported under "count"; steps with
    different numbers of forwards give one entry, {"count": ...}."""
    if len(a) != len(b):
        return [{"count": f"{len(a)} forwards against {len(b)}"}]
    out = []
    for f, (x, y) in enumerate(zip(a, b)):
        found: dict[str, str] = {}
        for i, (p, q) in enumerate(zip(x.events, y.events)):
            if p != q:
                found.setdefault(p[0], f"forward {f}, launch {i} ({p[1]}): {_diff(p, q)}")
        if len(x.events) != len(y.events):
            found.setdefault("count", f"forward {f}: {len(x.events)} launches against {len(y.events)}")
        out.append(found)
    return out


def first_difference(a: list[Recording], b: list[Recording]) -> str | None:
    """None when the forwards ``a`` and ``b`` made the same launches; else the first difference."""
    for found in differences(a, b):
        for site, why in found.items():
            return why if site == "count" else f"{site}: {why}"
    return None


def _diff(p, q) -> str:
    """The first differing argument of two launch records (a tensor's whole record)."""
    tensor = isinstance(p, tuple) and p[:1] in (("made",), ("outside",))
    if isinstance(p, tuple) and isinstance(q, tuple) and len(p) == len(q) and not tensor:
        for x, y in zip(p, q):
            if x != y:
                return _diff(x, y)
    return f"{p!r} against {q!r}"


class _Probe:
    """Step brackets (``execute_model``) and forward brackets (the target model's and the drafter's)."""

    def __init__(self, runner, spec_rows: int):
        self.spec_rows = spec_rows
        self.step: dict | None = None
        self.last: dict = {}  # (batch shape, paths and scorings of its forwards) -> the last decode step of that kind
        self.seen: dict = {}  # the same key -> decode steps of that kind so far
        self.results: list[dict] = []
        execute = runner.execute_model

        def execute_model(scheduler_output, *a, **k):
            self._close()
            n = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
            if n and is_decode_step(scheduler_output, spec_rows):
                self.step = {"shape": (len(n), sum(n.values())), "forwards": [], "paths": [], "scorings": []}
            return execute(scheduler_output, *a, **k)

        runner.execute_model = execute_model
        self._bracket(runner, "_model_forward")
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and getattr(drafter, "model", None) is not None:
            self._bracket(drafter.model, "forward")

    def _bracket(self, owner, name: str) -> None:
        orig = getattr(owner, name)

        def forward(*a, **k):
            if self.step is None or _active:
                return orig(*a, **k)
            path, scoring = _step_choice()
            self.step["paths"].append(path)
            self.step["scorings"].append(scoring)
            with record(layers_only=True) as rec:
                out = orig(*a, **k)
            self.step["forwards"].append(rec)
            return out

        setattr(owner, name, forward)

    def _close(self) -> None:
        step, self.step = self.step, None
        if step is None or not step["forwards"]:
            return
        key = (step["shape"], tuple(step["paths"]), tuple(step["scorings"]))
        before = self.last.get(key)
        self.seen[key] = self.seen.get(key, 0) + 1
        if before is not None and self.seen[key] > WARMUP + 1:
            self.results.append({"shape": step["shape"], "paths": step["paths"], "scorings": step["scorings"],
                                 "forwards": len(step["forwards"]),
                                 "launches": sum(len(r.events) for r in step["forwards"]),
                                 "kernels": [r.kernels for r in step["forwards"]],
                                 "breakdown": [dict(r.breakdown()) for r in step["forwards"]],
                                 "differences": differences(before["forwards"], step["forwards"])})
        self.last[key] = step

    def report(self) -> list[dict]:
        self._close()
        return self.results

    def reset(self) -> None:
        self._close()
        self.last, self.seen, self.results = {}, {}, []


def _step_choice() -> tuple[str | None, str | None]:
    """(path, scoring) of the forward vLLM is about to run: the attention's path (``step_path.PATHS``;
    a step whose records are all local runs no exchange, so "local" is a key of its own) and the
    indexer's scoring (``graph_paths.SCORINGS``: sharded adds an all-gather and a merge), from the
    sparkinfer metadata in its forward context; None for what it lacks. A FULL graph replays only on
    its path and scoring (``graph_paths.GraphChoice``, docs/design/cuda-graphs.md), so the probe
    compares steps of equal shape, paths and scorings."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    from sparkinfer.vllm.indexer_scoring import scoring_of

    if not is_forward_context_available():
        return None, None
    mds = get_forward_context().attn_metadata
    path = scoring = None
    for md in (mds.values() if isinstance(mds, dict) else ()):
        if hasattr(md, "sparkinfer_selected"):  # the sparkinfer backend's metadata
            path = md.path
        elif hasattr(md, "key_plans"):  # the replicated indexer's
            scoring = scoring_of(md.sharded)
    return path, scoring


_probe: list = [None]


def install(worker=None) -> bool:
    """``LLM.collective_rpc(install)``: record this worker's decode steps from now on (idempotent)."""
    if _probe[0] is None:
        _probe[0] = _Probe(worker.model_runner, spec_rows(worker.model_runner))
    return True


def report(worker=None) -> list[dict]:
    """``LLM.collective_rpc(report)``: [{"shape": (requests, rows), "paths": [path of each forward], "scorings": [the indexer's scoring of each forward, None without one], "forwards": n, "launches": n, "kernels":
    [kernel launches of each forward], "breakdown": [{(entry, site, kernel): launches} per forward], "differences": [{site: where} per forward]}] for each decode step compared with the previous decode step of its shape (``differences``)."""
    return [] if _probe[0] is None else _probe[0].report()


def reset(worker=None) -> bool:
    """``LLM.collective_rpc(reset)``: forget the steps recorded so far, so that the next steps compare
    only with each other (an engine switched to another path by ``worker_runtime.use_paths``: its
    first steps there are warm-up again)."""
    if _probe[0] is not None:
        _probe[0].reset()
    return True
