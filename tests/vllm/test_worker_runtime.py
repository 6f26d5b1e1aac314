"""How the adapter finds the worker's runtime (sparkinfer/vllm/worker_runtime.py), on plain stand-ins for
vLLM's config: every object of one engine gets the same runtime, the MTP drafter's config copy (which
shares the engine's compilation config) included; another engine gets a new one."""

import types

from sparkinfer.vllm import worker_runtime


def _config(compilation):
    ns = types.SimpleNamespace
    return ns(device_config=ns(device="cpu"), compilation_config=compilation)


def test_one_runtime_per_engine_drafter_included():
    shared = types.SimpleNamespace()
    target, drafter = _config(shared), _config(shared)  # dataclasses.replace shares the sub-configs
    rt = worker_runtime.for_engine(target)
    assert worker_runtime.for_engine(drafter) is rt and worker_runtime.for_engine(target) is rt
    assert worker_runtime.current() is rt
    other = worker_runtime.for_engine(_config(types.SimpleNamespace()))  # a later engine in this process
    assert other is not rt and worker_runtime.current() is other
