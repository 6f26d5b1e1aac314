"""Count host reads and data-dependent shapes per decode step inside vLLM's workers (a probe).

On a GPU each of these makes the host wait for the device queue to drain, and the GPU then idles
while the host catches up: a tensor read back to Python (``item``, ``tolist``, ``numpy``, ``cpu``,
``int()``/``float()``/``bool()``/``__index__`` of a tensor), and an op whose output shape depends on
tensor values (``nonzero``/``argwhere``, ``unique``, ``masked_select``, indexing or assigning through a
boolean mask, ``repeat_interleave`` without ``output_size``, one-argument ``where``). A
wrapper around each of these calls (``_patch``) walks the stack and books
the call against the innermost frame under ``sparkinfer/`` (``sparkinfer:<file>:<function>``), or
else the innermost frame under ``vllm/`` (``vllm:...``); calls made by Triton's interpreter (the
CPU stand-in for a kernel launch, which reads nothing on a GPU) or from ``KERNEL_FILES`` (the CPU
platform's twins of vLLM's Triton kernels, a benchmark's kernel stand-ins) are not counted. Each step also records its seconds (``times``: the worker's ``wall`` time in the step,
and what ``time_entries`` books). A call is booked
``layer`` when a layer's forward (``LAYER_ENTRIES``: attention, cache write, indexer op and its q
quantization) is on the
stack, else ``step``. Inside vLLM each sparkinfer read and allocation is also booked against the
model layer whose forward runs it (``<layer>|<kind>@layer|<site>``): ``install`` hooks every decoder
layer of the worker's model and of its MTP drafter (a module named ``...layers.<i>``) and counts
each one's forward calls (``<layer>|calls@layer|forward``). What a layer costs is then read off one
engine (``summarize``'s ``per_layer``) rather than from two engines at two depths, and a layer that
ran and booked nothing shows that the measure saw it.

    LLM.collective_rpc(install)          # in every worker: the mode and the step brackets
    ... llm.generate(...)
    LLM.collective_rpc(report)           # per worker: [{"decode": bool, "reads": {...}}, ...] per step
    LLM.collective_rpc(reset)            # forget them (before the engine's next path)

``install`` wraps the worker's model runner ``execute_model`` (the step's metadata build and
forward) and ``sample_tokens`` (sampling and the MTP drafter), so a step is everything between two
``execute_model`` calls; a step is a decode step when it schedules no new request and none of its
requests has more than ``1 + speculative`` rows. ``count_reads`` is the same mode around a block of
code in this process (what the probe's own test plants a read into).

Reads of vLLM's host-side copies (``query_start_loc_cpu`` and the like) made through
``host_array`` (``sparkinfer.decode.host_copies``) are booked as ``host`` instead: on a GPU node they are pinned host memory, so they
cost no sync, and ``host_array`` refuses a tensor that is not on the CPU so that this cannot hide a
device read there.

Allocations (kind ``alloc``, with their bytes as kind ``alloc_bytes``) are counted in the same steps
and booked at the same sites: on a GPU each is a trip through the caching allocator, and one made in
a layer's forward is memory the KV budget never counted (and, under a CUDA graph, a pointer that
must not move). With no CUDA allocator on CPU the measure is a ``TorchDispatchMode`` (``_AllocMode``)
that sees every aten op and books each output whose storage is none of its inputs' (a factory op, a
functional op, a copy; not a view, an in-place op or an ``out=`` write into a preallocated buffer).
Storage-less and 0-byte outputs are not allocations; ``lift_fresh`` (``torch.tensor(data)``) is. A
mode is off inside the ops it intercepts, so a custom op (vLLM's attention and indexer ops, where the
layers' code runs) is redispatched past the mode with the mode re-entered, and only the aten ops under
it are booked. ``count_allocations`` is the mode around a block of code in this process.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = ("item", "tolist", "numpy", "cpu", "__int__", "__index__", "__bool__", "__float__")
_SHAPES = ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select")
# a layer's forward: anything under these is per-layer work
LAYER_ENTRIES = {"forward_mqa", "do_kv_cache_update", "run_indexer", "quant_q_fp8"}
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../sparkinfer/
_PROBES = os.path.dirname(os.path.abspath(__file__)) + os.sep  # sparkinfer/testing: probes are not sites
# the reads of vLLM's host copies (``host_array``: pinned host memory on a GPU node, no sync)
_HOST_ARRAY = (os.path.join(_PKG, "decode", "host_copies.py"), "host_array")
# files whose code stands in for a kernel launch (on a GPU it reads nothing): not counted, as Triton's
# interpreter is not. cpu_dcp.py: the CPU platform's torch twins of vLLM's Triton slot-mapping and
# DCP-combine kernels, which a GPU node runs instead.
KERNEL_FILES: set[str] = {os.path.join(_PKG, "vllm", "cpu_dcp.py")}
_counters: list[Counter] = []  # the active counts (innermost last); empty: the patches only forward
_layers: list[str] = []  # the decoder layers whose forward is running, innermost last (``_hook_layers``)
_patched: list = []


def _bool_index(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _site(depth: int = 3, standins: frozenset = frozenset()):
    """(site, phase) of the call being made: the innermost sparkinfer (else vLLM) frame, searched from
    ``depth`` frames up; (None, None) for a call from Triton's interpreter, from ``KERNEL_FILES``
    or from a function named in ``standins``."""
    frame = sys._getframe(depth)
    site = vllm_site = None
    phase = "step"
    while frame is not None:
        path = frame.f_code.co_filename
        name = frame.f_code.co_name
        if f"{os.sep}triton{os.sep}" in path or path in KERNEL_FILES or name in standins:
            return None, None
        if (path, name) == _HOST_ARRAY and site is None:
            return "host", "host"
        if path.startswith(_PKG) and not path.startswith(_PROBES):  # the probes' own frames are not sites
            if site is None:
                site = f"sparkinfer:{os.path.relpath(path, _PKG)}:{name}"
            if name in LAYER_ENTRIES:
                phase = "layer"
        elif vllm_site is None and f"{os.sep}vllm{os.sep}" in path:
            vllm_site = f"vllm:{path.split(os.sep + 'vllm' + os.sep, 1)[1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return site or vllm_site or "other", phase


def _book(kind: str, op: str) -> None:
    site, phase = _site()
    if site is not None:
        _book_at(_counters[-1], f"{phase}|{kind}|{site}:{op}", 1)


def _book_at(counts: Counter, key: str, n: int) -> None:
    """``counts[key] += n``; a sparkinfer one also against the decoder layer whose forward runs it."""
    counts[key] += n
    _, kind, site = key.split("|", 2)
    if _layers and site.startswith("sparkinfer:"):
        counts[f"{_layers[-1]}|{kind}@layer|{site}"] += n


def _wrap(owner, name: str, kind: str, when=None) -> None:
    """Replace ``owner.name`` by a wrapper that books ``kind`` (when ``when(args, kwargs)`` holds)."""
    orig = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if _counters and (when is None or when(args, kwargs)):
            _book(kind, name)
        return orig(*args, **kwargs)

    wrapper.__name__ = name
    setattr(owner, name, wrapper)
    _patched.append((owner, name, orig))


def _tensor_repeats(args, kwargs, at: int) -> bool:
    reps = args[at] if len(args) > at else kwargs.get("repeats")
    return kwargs.get("output_size") is None and isinstance(reps, torch.Tensor)


def _patch() -> None:
    """Wrap the calls (process-wide, once): Tensor methods and their torch.* functions. Patching,
    not a TorchFunctionMode: a mode is off inside the custom ops (vLLM's attention and indexer ops)
    it dispatches, which is exactly where the layers' code runs."""
    if _patched:
        return
    for name in _READS:
        _wrap(torch.Tensor, name, "read")
    for name in _SHAPES:
        _wrap(torch.Tensor, name, "shape")
        _wrap(torch, name, "shape")
    _wrap(torch.Tensor, "__getitem__", "shape", lambda a, k: _bool_index(a[1]))
    _wrap(torch.Tensor, "__setitem__", "shape", lambda a, k: _bool_index(a[1]) and isinstance(a[2], torch.Tensor))
    _wrap(torch.Tensor, "repeat_interleave", "shape", lambda a, k: _tensor_repeats(a, k, 1))
    _wrap(torch, "repeat_interleave", "shape", lambda a, k: _tensor_repeats(a, k, 1))
    _wrap(torch, "where", "shape", lambda a, k: len(a) + len(k) == 1)


# the record codecs' torch references (sparkinfer.formats), which the GPU implementations still run on
# CPU: on a GPU ``Format.encode`` launches the CUDA encoder, which allocates nothing, so their
# temporaries are not counted. The reference's output is not either: the forward encodes into the
# arena's staging rows (``out``), which only the GPU run sees (test_vllm_gpu_impls, cuda)
CODEC_STANDINS = frozenset({"_encode_ref", "_decode_ref"})
_FRESH = {"lift_fresh", "lift_fresh_copy"}  # torch.tensor(data): a storage made before the dispatch
_AFTER_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


def storages(values, into: dict) -> dict:
    """{storage data_ptr: nbytes} of the tensors in ``values`` (nested lists/tuples)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            try:
                st = v.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
                continue
            into.setdefault(st.data_ptr(), st.nbytes())
        elif isinstance(v, (list, tuple)):
            storages(v, into)
    return into


class OpWatcher(TorchDispatchMode):
    """Sees every aten op, inside vLLM's custom ops too, and hands each to ``seen`` with the storages
    its outputs made ({data_ptr: nbytes}: none of its inputs', module docstring), then to each of
    ``also`` (another probe's ``seen``: one mode serves both, as two stacked modes would see each
    other's redispatches)."""

    def __init__(self):
        super().__init__()
        self.also: list = []

    def seen(self, func, args, kwargs, out, made: dict) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("aten", "prims", "prim"):  # a custom op: see the aten ops inside it
            keys = next((torch._C._dispatch_keys(t) for t in _tensors(args, kwargs)), None)
            if keys is not None:
                with self:
                    return func.redispatch(keys & _AFTER_PYTHON, *args, **kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        made = storages(out if isinstance(out, (list, tuple)) else (out,), {})
        if made and func._opname not in _FRESH:
            inputs = storages((args, tuple(kwargs.values())), {})
            made = {p: n for p, n in made.items() if p not in inputs}
        made = {p: n for p, n in made.items() if n}
        self.seen(func, args, kwargs, out, made)
        for seen in self.also:
            seen(func, args, kwargs, out, made)
        return out


class _AllocMode(OpWatcher):
    """Books, per aten op, the outputs whose storage is not one of its inputs' (module docstring)."""

    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def seen(self, func, args, kwargs, out, made: dict) -> None:
        if made:
            site, phase = _site(3, CODEC_STANDINS)
            if site is not None:
                key = f"{site}:{func._opname}"
                _book_at(self.counts, f"{phase}|alloc|{key}", len(made))
                self.counts[f"{phase}|alloc_bytes|{key}"] += sum(made.values())


def _tensors(args, kwargs):
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


@contextmanager
def count_allocations():
    """Counter of "<phase>|alloc|<site>:<op>" -> outputs allocated in the block (and
    "<phase>|alloc_bytes|..." -> their bytes)."""
    counts: Counter = Counter()
    with _AllocMode(counts):
        yield counts


@contextmanager
def count_reads():
    """Counter of "<phase>|<kind>|<site>:<op>" -> calls made in the block."""
    _patch()
    counts: Counter = Counter()
    _counters.append(counts)
    try:
        yield counts
    finally:
        _counters.remove(counts)


_LAYER_NAME = re.compile(r"(^|\.)layers\.\d+$")


def _hook_layers(runner, counts: Counter) -> None:
    """Bracket the forward of every decoder layer of ``runner``'s model (``model.layers.<i>``) and of
    its MTP drafter (``mtp:...``) so that ``_book_at`` knows the layer, and count its calls."""
    drafter = getattr(getattr(runner, "drafter", None), "model", None)
    for prefix, model in (("", runner.model), ("mtp:", drafter)):
        for name, module in (model.named_modules() if model is not None else ()):
            if not _LAYER_NAME.search(name):
                continue

            def enter(module, args, __name=prefix + name):
                _layers.append(__name)
                counts[f"{__name}|calls@layer|forward"] += 1

            def leave(module, args, out):
                _layers.pop()

            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave, always_call=True)


class _Probe:
    def __init__(self, runner, spec_rows: int):
        self.counts: Counter = Counter()
        self.times: Counter = Counter()  # seconds of the open step: "wall", "sparkinfer", "kernel"
        self.steps: list[dict] = []
        self.spec_rows = spec_rows
        _patch()
        _counters.append(self.counts)
        _hook_layers(runner, self.counts)
        execute, sample = runner.execute_model, getattr(runner, "sample_tokens", None)

        def execute_model(scheduler_output, *a, **k):
            self._close()
            n = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
            if n:
                self.steps.append({"decode": is_decode_step(scheduler_output, self.spec_rows),
                                   "rows": sum(n.values()), "reads": None})
            with self.timer("wall"), _AllocMode(self.counts):
                return execute(scheduler_output, *a, **k)

        runner.execute_model = execute_model
        if sample is not None:  # sampling and the MTP drafter: part of the open step
            def sample_tokens(*a, **k):
                with self.timer("wall"), _AllocMode(self.counts):
                    return sample(*a, **k)

            runner.sample_tokens = sample_tokens

    @contextmanager
    def timer(self, key: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[key] += time.perf_counter() - t

    def _close(self):
        if self.steps and self.steps[-1]["reads"] is None:
            self.steps[-1]["reads"] = dict(self.counts)
            self.steps[-1]["times"] = dict(self.times)
        self.counts.clear()
        self.times.clear()

    def report(self) -> list[dict]:
        self._close()
        return self.steps

    def reset(self) -> None:
        self._close()
        self.steps = []


def spec_rows(runner) -> int:
    """Rows a decode request has in a step of this model runner: 1 + its speculative tokens."""
    spec = runner.vllm_config.speculative_config
    return 1 + (spec.num_speculative_tokens if spec is not None else 0)


def is_decode_step(scheduler_output, spec_rows: int) -> bool:
    """A step that schedules no new request and at most ``spec_rows`` (1 + speculative) rows per request."""
    n = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
    return bool(n) and not scheduler_output.scheduled_new_reqs and max(n.values()) <= spec_rows


_probe: list = [None]


def install(worker=None) -> bool:
    """``LLM.collective_rpc(install)``: count from now on in this worker (idempotent)."""
    if _probe[0] is None:
        _probe[0] = _Probe(worker.model_runner, spec_rows(worker.model_runner))
    return True


def time_entries(entries, kernel: bool = False) -> None:
    """Time, per step, the calls of ``entries`` ((owner, attribute name) pairs: sparkinfer's entry
    points, outermost calls only) as "sparkinfer", or with ``kernel`` as "kernel": the stand-in
    for a kernel launch whose time is device time, not host time (``benchmarks/host_overhead.py``)."""
    key = "kernel" if kernel else "sparkinfer"
    depth = [0]
    for owner, name in entries:
        orig = getattr(owner, name)

        def timed(*args, __orig=orig, **kwargs):
            if depth[0] or _probe[0] is None:
                return __orig(*args, **kwargs)
            depth[0] += 1
            try:
                with _probe[0].timer(key):
                    return __orig(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(owner, name, timed)


def report(worker=None) -> list[dict]:
    """``LLM.collective_rpc(report)``: this worker's steps since ``install`` (see the module docstring)."""
    return [] if _probe[0] is None else _probe[0].report()


def reset(worker=None) -> bool:
    """``LLM.collective_rpc(reset)``: forget the steps counted so far (``report`` then returns the later ones)."""
    if _probe[0] is not None:
        _probe[0].reset()
    return True


def summarize(steps: list[dict], decode_only: bool = True, warmup: int = 1) -> dict:
    """Per step on average over the (decode) steps: {"steps": n, "sparkinfer": reads, "vllm": reads,
    "layer": sparkinfer reads under a layer's forward, "host": host-copy reads, "sites": Counter of the
    reads}; and over the decode steps after the first ``warmup`` (lazily built buffers):
    {"alloc_steps": n, "alloc": sparkinfer allocations, "layer_alloc": those under a layer's forward,
    "alloc_bytes", "layer_alloc_bytes", "vllm_alloc", "alloc_sites": Counter of the sparkinfer ones};
    and "per_layer" (``_per_layer``): what each model layer's forward costs."""
    chosen = [s for s in steps if s["decode"] or not decode_only]

    def per_step(group, kinds) -> tuple[Counter, int]:
        sites: Counter = Counter()
        for s in group:
            sites.update({k: v for k, v in (s["reads"] or {}).items() if k.split("|")[1] in kinds})
        return sites, max(len(group), 1)

    sites, n = per_step(chosen, {"read", "shape"})

    def total(counts, pred, m) -> float:
        return sum(v for k, v in counts.items() if pred(k.split("|"))) / m

    times: Counter = Counter()
    for s in chosen:
        times.update(s.get("times") or {})
    steady = [s for s in steps if s["decode"]][warmup:]
    allocs, m = per_step(steady, {"alloc", "alloc_bytes"})
    ours = lambda k: k[2].startswith("sparkinfer:")  # noqa: E731
    return {"steps": len(chosen), "times": {k: v / n for k, v in times.items()},
            "sparkinfer": total(sites, lambda k: k[0] != "host" and ours(k), n),
            "layer": total(sites, lambda k: k[0] == "layer" and ours(k), n),
            "vllm": total(sites, lambda k: k[0] != "host" and not ours(k), n),
            "host": total(sites, lambda k: k[0] == "host", n),
            "sites": {k: v / n for k, v in sites.most_common()},
            "alloc_steps": len(steady),
            "alloc": total(allocs, lambda k: k[1] == "alloc" and ours(k), m),
            "layer_alloc": total(allocs, lambda k: k[1] == "alloc" and k[0] == "layer" and ours(k), m),
            "alloc_bytes": total(allocs, lambda k: k[1] == "alloc_bytes" and ours(k), m),
            "layer_alloc_bytes": total(allocs, lambda k: k[1] == "alloc_bytes" and k[0] == "layer" and ours(k), m),
            "vllm_alloc": total(allocs, lambda k: k[1] == "alloc" and not ours(k), m),
            "alloc_sites": {k: v / m for k, v in allocs.most_common() if k.split("|")[1] == "alloc" and ours(k.split("|"))},
            "per_layer": _per_layer(chosen, n, steady, m)}


def _per_layer(chosen: list[dict], n: int, steady: list[dict], m: int) -> dict:
    """{layer: {"calls": forward calls, "reads": sparkinfer reads and shapes in its forward, "read_sites",
    per (decode) step; "alloc": sparkinfer allocations in its forward per steady step, "alloc_sites"}}."""
    out: dict = {}

    def add(group, kinds, div, field, sites=None):
        for s in group:
            for k, v in (s["reads"] or {}).items():
                layer, kind, site = k.split("|", 2)
                if kind in kinds:
                    row = out.setdefault(layer, {"calls": 0, "reads": 0, "alloc": 0, "read_sites": Counter(),
                                                 "alloc_sites": Counter()})
                    row[field] += v
                    if sites is not None:
                        row[sites][site] += v
        for row in out.values():  # totals over the group, then per step
            row[field] /= div
            if sites is not None:
                row[sites] = Counter({k: v / div for k, v in row[sites].items()})

    add(chosen, {"calls@layer"}, n, "calls")
    add(chosen, {"read@layer", "shape@layer"}, n, "reads", "read_sites")
    add(steady, {"alloc@layer"}, m, "alloc", "alloc_sites")
    return out
