"""Triton's interpreter (``TRITON_INTERPRET=1``) without its per-call re-patching of ``triton.language``.

Under the interpreter a kernel launch patches ``triton.language`` (every builtin swapped for a numpy
twin, ``inspect.getmembers`` over ``tl``, ``tl.core``, ``tl.math`` and ``tl.tensor``) and restores it
after the grid. Triton 3.9 also runs that patch on every call of a ``@triton.jit`` helper inside the
kernel (``InterpretedFunction.__call__``), once per program and loop trip, although the launch has
patched the same modules already: the second patch finds no builtin left to swap and reinstalls
equivalent closures, and its scope is dropped unrestored (the launch's restore puts the originals
back). Measured in the host-reads engine (TP2, MTP3, the GPU kernels forced, 2026-12-07, cProfile):
57,453 helper calls per 8 generated tokens, 60 of the worker's 184 s in that patch.

``install()`` makes a helper call skip the patch when every ``triton.language`` module its globals
name is already patched (the launch's own patch), and run it as before otherwise (a helper called
outside a launch, or naming a module the kernel's globals did not). What runs, and every value, is
unchanged. The test suites install it (``tests/conftest.py``), and so does every ``WorkerRuntime``
(``decode.runtime``: an engine's TP workers, which run the GPU kernels interpreted when
``SPARKINFER_FORCE_GPU_IMPLS=1``); without ``TRITON_INTERPRET=1`` it does nothing. The patch is of
process-wide modules, so interpreted launches run one at a time in a process, with or without it.
"""

import functools
import inspect
import os

_original = None  # Triton's own _patch_lang, once installed


def _patched(lang) -> bool:
    """A ``triton.language`` module whose builtins are swapped for the interpreter's (``tl.load``
    stands for them all: a patch swaps every builtin of the module at once)."""
    from triton.language import core

    return not core.is_builtin(lang.load)


@functools.lru_cache(maxsize=None)
def _langs(fn) -> tuple:
    """The ``triton.language`` modules ``fn``'s globals name, as Triton's ``_patch_lang`` finds them (read
    once per function: the scan of a module's globals was most of the skip's own cost)."""
    import triton.language as tl

    return tuple(v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def _patch_lang_once(fn):
    """The interpreter's ``_patch_lang`` for ``fn``, skipped (an empty scope: the launch's restores it
    all) when every ``triton.language`` module ``fn``'s globals name is patched already."""
    from triton.runtime import interpreter

    langs = _langs(fn)
    if langs and all(_patched(lang) for lang in langs):
        return interpreter._LangPatchScope()
    return _original(fn)


def install() -> bool:
    """Installs the skip in this process when ``TRITON_INTERPRET=1``; returns whether it is in place.
    Idempotent."""
    global _original
    if _original is None and os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime import interpreter

        # GridExecutor.__call__ (the launch) patches first, so it never takes the skip; its helpers do
        _original, interpreter._patch_lang = interpreter._patch_lang, _patch_lang_once
    return _original is not None
