"""The replica store's share of vLLM's KV memory (sparkinfer/vllm/replica_budget.py), on plain
stand-ins for vLLM's config objects: what the engine core reserves always holds what the worker's
runtime then keeps, and the store never applies where the selected path cannot run."""

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer.config import SparkinferConfig
from sparkinfer.core.replicas import store_bytes
from sparkinfer.vllm import replica_budget as rb
from sparkinfer.vllm.step_requests import set_request_ids


def _config(window="auto", mode="auto", dcp=4, dtype="nvfp4_368", seqs=8, layers=78, max_len=1 << 20):
    ns = types.SimpleNamespace
    return ns(parallel_config=ns(decode_context_parallel_size=dcp),
              cache_config=ns(cache_dtype=dtype, enable_prefix_caching=True),
              additional_config={"sparkinfer": SparkinferConfig(mode=mode, replica_window=window).as_dict()},
              device_config=ns(device_type="cuda"), scheduler_config=ns(max_num_seqs=seqs),
              model_config=ns(max_model_len=max_len, hf_config=ns(num_hidden_layers=layers)))


@pytest.mark.parametrize("kwargs", [dict(dcp=1), dict(mode="stock"), dict(dtype="auto"), dict(window=0)])
def test_nothing_is_reserved_where_replicas_do_not_apply(kwargs):
    cfg = _config(**kwargs)
    assert rb.reserved_bytes(cfg, 10 << 30) == 0 and rb.window(cfg, 10 << 30) == 0


def test_an_explicit_window_reserves_its_store_or_says_what_to_change():
    cfg = _config(window=4096)
    assert rb.reserved_bytes(cfg, 10 << 30) == store_bytes(4096, 8, 78, 368) == 4096 * 8 * 78 * 368
    assert rb.window(cfg, 1) == 4096
    with pytest.raises(ValueError, match="replica_window 4096.*max_num_seqs"):
        rb.reserved_bytes(cfg, 256 << 20)


@settings(max_examples=300, deadline=None)
@given(mem=st.integers(1 << 20, 1 << 36), seqs=st.integers(1, 64), max_len=st.integers(1, 1 << 21),
       rounding=st.integers(0, 1 << 22))
def test_auto_runtime_store_fits_what_the_engine_reserved(mem, seqs, max_len, rounding):
    """The worker sizes from the KV bytes it got (at most the budget minus the reservation, less
    block rounding); its store must fit the reservation, and the whole context is kept whenever a
    fifth of the memory holds it."""
    cfg = _config(seqs=seqs, max_len=max_len)
    reserved = rb.reserved_bytes(cfg, mem)
    kv = max(0, mem - reserved - rounding)
    w = rb.window(cfg, kv)
    assert store_bytes(w, seqs, 78, 368) <= reserved <= mem // rb.AUTO_SHARE
    if store_bytes(max_len, seqs, 78, 368) <= mem // rb.AUTO_SHARE and rounding == 0:
        assert w == max_len


def test_step_request_ids_only_describe_real_requests():
    """Patch 0008's ids land in the runtime of the runner's engine, which gives them only for real
    requests; an engine without sparkinfer layers has nowhere to keep them."""
    from sparkinfer.decode.runtime import WorkerRuntime
    from test_worker_runtime import _config, engine

    set_request_ids(types.SimpleNamespace(vllm_config=_config()), ["a"])  # no runtime: nothing kept
    rt = WorkerRuntime("cpu")
    runner = types.SimpleNamespace(vllm_config=engine(rt))
    set_request_ids(runner, ["a", "b", "c"])
    assert rt.step_request_ids(2) == ["a", "b"] and rt.step_request_ids(3) == ["a", "b", "c"]
    assert rt.step_request_ids(4) is None  # a padded dummy batch
    set_request_ids(runner, ["a", None])
    assert rt.step_request_ids(2) is None
    set_request_ids(runner, None)
    assert rt.step_request_ids(1) is None
