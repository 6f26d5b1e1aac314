"""How the adapter reaches the engine's runtime (sparkinfer/vllm/worker_runtime.py), on plain stand-ins for
vLLM's config and layers: the first attention impl makes it, every later object of the engine gets
that one from the engine's layers, the MTP drafter's config copy (which shares the engine's
compilation config) included; another engine gets its own; the module keeps none."""

import types

import pytest

from sparkinfer.vllm import worker_runtime


def _config(compilation=None):
    ns = types.SimpleNamespace
    return ns(device_config=ns(device="cpu"), compilation_config=compilation or ns(static_forward_context={}))


def register(config, runtime, name="model.layers.0.self_attn.attn"):
    """Register a stand-in attention layer whose impl keeps ``runtime`` in ``config``'s engine (as
    vLLM's MLAAttention registers itself once its impl is built); returns ``config``."""
    ns = types.SimpleNamespace
    config.compilation_config.static_forward_context[name] = ns(impl=ns(runtime=runtime))
    return config


def engine(runtime):
    """A stand-in engine config whose layers hold ``runtime`` (a vLLM worker or model runner with it:
    ``ns(vllm_config=engine(rt))``)."""
    return register(_config(), runtime)


def test_one_runtime_per_engine_drafter_included():
    ns = types.SimpleNamespace
    shared = ns(static_forward_context={"model.layers.0.self_attn.indexer.k_cache": ns()})  # not ours
    target, drafter = _config(shared), _config(shared)  # dataclasses.replace shares the sub-configs
    assert worker_runtime.of_engine(target) is None
    rt = worker_runtime.for_engine(target)  # the first impl's, which it keeps
    assert worker_runtime.for_engine(target) is not rt  # not kept anywhere else
    register(target, rt)
    assert worker_runtime.for_engine(drafter) is rt and worker_runtime.for_engine(target) is rt
    register(target, rt, "model.layers.1.self_attn.attn")
    assert worker_runtime.of_engine(drafter) is rt
    other = _config()  # a later engine in this process
    assert worker_runtime.of_engine(other) is None and worker_runtime.for_engine(other) is not rt
    assert not [k for k, v in vars(worker_runtime).items() if not k.startswith("__") and not callable(v)
                and k != "annotations"]  # no state in the module


@pytest.mark.parametrize("kept", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("forced", [False, True])
def test_fixed_shape_replica_writes_equal_the_kept_ones(monkeypatch, kept, forced):
    """A step's replica writes in fixed shape (one entry per token row, ``_replica_writes``: what a
    graph replays) leave the store exactly as writing only the kept rows does, through the torch
    twin and the Triton kernel (forced, interpreted)."""
    import numpy as np
    import torch

    from sparkinfer.decode import impls
    from sparkinfer.decode.paged_sparse_mla import copy_rows
    from sparkinfer.vllm.selected_runtime import _replica_writes

    if forced:
        monkeypatch.setenv(impls.FORCE_ENV, "1")
    rng = np.random.default_rng(int(kept * 10) + forced)
    t = 12
    rows = np.where(rng.random(t) < kept, rng.permutation(40)[:t], -1)  # a write never hits a row twice
    g = torch.Generator().manual_seed(1)
    store = torch.randint(0, 256, (40, 16), generator=g, dtype=torch.uint8)
    records = torch.randint(0, 256, (t, 16), generator=g, dtype=torch.uint8)
    want = store.clone()
    for i in np.flatnonzero(rows >= 0):
        want[rows[i]] = records[i]
    dst, src, taken = (torch.from_numpy(a) for a in _replica_writes(rows))
    copy_rows(store, records, src, taken != 0, dst_rows=dst)
    assert torch.equal(store, want)


def test_use_paths_on_an_engine_that_serves_only_stock():
    """``use_paths`` (switching an engine's paths between requests): an engine without a selected
    runtime (DCP 1, mode stock, not a record format, a failed fabric proof) keeps stock and refuses
    more with the fix; one with a runtime checks the mode and that a replica store exists."""
    import dataclasses

    from sparkinfer.config import SparkinferConfig
    from sparkinfer.vllm.selected_runtime import SelectedRuntime

    rt = worker_runtime.for_engine(_config())
    worker = types.SimpleNamespace(vllm_config=engine(rt))
    assert rt.selected is None
    assert worker_runtime.use_paths(worker, "stock") == {"mode": "stock", "replicas": False}
    for mode, replicas in (("selected", False), ("auto", False), ("stock", True)):
        with pytest.raises(ValueError, match="serves only stock DCP"):
            worker_runtime.use_paths(worker, mode, replicas)
    # the switch itself on a runtime's state alone (its constructor needs a whole engine)
    sel = SelectedRuntime.__new__(SelectedRuntime)
    sel.config, sel.replicas, sel.replicas_on = SparkinferConfig(mode="selected", replica_window=0), None, False
    sel.path = types.SimpleNamespace(config=sel.config)
    rt.selected = sel
    assert worker_runtime.use_paths(worker, "stock") == {"mode": "stock", "replicas": False}
    assert sel.path.config.mode == "stock"
    with pytest.raises(ValueError, match="without a replica store"):
        worker_runtime.use_paths(worker, "selected", True)
    with pytest.raises(ValueError, match="stock, selected or auto"):
        worker_runtime.use_paths(worker, "replicas")
    sel.config = dataclasses.replace(sel.config, replica_window=64)
    assert worker_runtime.use_paths(worker, "selected", True) == {"mode": "selected", "replicas": True}
