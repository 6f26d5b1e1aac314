"""The per-step scoring choice of the replicated indexer (``sparkinfer/vllm/indexer_scoring.py``).

The engine runs (tokens equal DCP1 with sharded scoring, at TP2 and TP4) are in
``test_vllm_dcp_prompts.py``; the op's sharded path against the replicated one in
``test_vllm_gpu_impls.py``. Here: which steps each setting shards, on configs that carry what
``indexer_layout`` reads, with vLLM's DCP group stood in for.
"""

from types import SimpleNamespace as NS

import pytest
import torch

from sparkinfer.core import costmodel as cm
from sparkinfer.core.geometry import GLM52


def _config(setting, dcp=4, dtype="nvfp4_368", device="cuda", interleave=1):
    return NS(parallel_config=NS(decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=interleave),
              device_config=NS(device_type=device), cache_config=NS(cache_dtype=dtype),
              additional_config={"sparkinfer": {"mode": "selected", "indexer_scoring": setting}})


@pytest.fixture
def dcp_group(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.distributed.parallel_state as ps

    group = NS(rank_in_group=2, device_group="the DCP group's device group", gathered_over=[])

    def all_gather_single(out, t, group=None, gathered_over=group.gathered_over):  # four ranks, the same rows
        gathered_over.append(group)
        out.copy_(torch.cat([t] * 4))
    monkeypatch.setattr(ps, "get_dcp_group", lambda: group)
    monkeypatch.setattr(torch.distributed, "all_gather_single", all_gather_single)
    return group


def _positions(contexts, rows=4):
    """The causal positions of ``rows`` query rows per request (MTP verification rows)."""
    return torch.cat([torch.arange(c, c + rows) for c in contexts]).to(torch.int64)


def test_settings(dcp_group):
    from sparkinfer.vllm.indexer_scoring import IndexerScoring

    pos = _positions([100, 7])
    assert IndexerScoring(_config("replicated")).for_step(pos) is None
    share = IndexerScoring(_config("sharded", interleave=2)).for_step(pos)
    assert share.rank == 2 and (share.layout.world_size, share.layout.interleave) == (4, 2)
    owned = share.owned(40)
    assert owned.tolist() == [t for t in range(40) if (t // 2) % 4 == 2]
    out = torch.zeros(12, 2)
    share.all_gather_into(out, torch.ones(3, 2))  # into the caller's buffer, over the group's device group
    assert bool((out == 1).all()) and dcp_group.gathered_over == [dcp_group.device_group]
    # nothing to shard: DCP 1, or the indexer not replicated (vLLM's own format on CUDA)
    assert IndexerScoring(_config("sharded", dcp=1)).for_step(pos) is None
    assert IndexerScoring(_config("sharded", dtype="fp8_ds_mla")).for_step(pos) is None
    assert IndexerScoring(_config("sharded")).for_step(torch.zeros(0, dtype=torch.int64)) is None


def test_auto_without_a_profile_scores_replicated(dcp_group, caplog):
    """The CPU (or a GPU with no node profile): auto never shards, and says so once."""
    import logging

    from sparkinfer.vllm.indexer_scoring import IndexerScoring

    with caplog.at_level(logging.INFO, logger="sparkinfer.vllm.indexer_scoring"):
        scoring = IndexerScoring(_config("auto", device="cpu"))
    assert scoring.for_step(_positions([1 << 20])) is None
    assert "no node profile" in caplog.text


@pytest.mark.parametrize("profile", ["rtx_pro_6000_x4", "h200_x4"])
def test_auto_shards_exactly_where_the_cost_model_says_it_pays(dcp_group, monkeypatch, profile):
    """With a node profile auto follows ``choose_indexer`` on the step's own rows: a sum over rows of
    pos + 1 scored tokens; mixed batches (one long request among short ones) included."""
    from sparkinfer.vllm import indexer_scoring
    from sparkinfer.vllm.indexer_scoring import IndexerScoring

    p = cm.load_profile(profile)
    monkeypatch.setattr(indexer_scoring, "node_profile", lambda cfg: (p, GLM52))
    scoring = IndexerScoring(_config("auto"))
    picks = []
    for contexts in ([0], [5000], [20000], [30000], [100000], [1 << 20], [100, 200, 300], [100, 90000],
                     [8000] * 8, [2000] * 32):
        pos = _positions(contexts)
        want = cm.choose_indexer(p, sum(c * 4 + 10 for c in contexts), 4 * len(contexts), 4)
        got = scoring.for_step(pos)
        assert ("sharded" if got is not None else "replicated") == want, contexts
        picks.append(want)
    assert "sharded" in picks and "replicated" in picks


@pytest.mark.parametrize("profile", ["rtx_pro_6000_x4", "h200_x4"])
def test_a_capture_run_is_scored_as_a_step_at_the_longest_context(dcp_group, monkeypatch, profile):
    """``for_capture`` (a FULL graph's scoring, ``graph_paths.capture_scoring``): ``auto`` takes what
    ``for_step`` takes for that many requests of MTP3 rows at the context, short and long; a fixed
    setting its own share; ``auto`` without a profile replicated."""
    from sparkinfer.vllm import indexer_scoring
    from sparkinfer.vllm.indexer_scoring import IndexerScoring, scoring_of

    assert IndexerScoring(_config("auto", device="cpu")).for_capture(4, 4, 1 << 18) is None  # no profile
    assert IndexerScoring(_config("replicated")).for_capture(1, 4, 1 << 18) is None
    share = IndexerScoring(_config("sharded")).for_capture(16, 4, 0)
    assert share is not None and share.rank == 2
    p = cm.load_profile(profile)
    monkeypatch.setattr(indexer_scoring, "node_profile", lambda cfg: (p, GLM52))
    scoring = IndexerScoring(_config("auto"))
    picks = set()
    for n in (1, 3, 16):
        for context in (0, 4000, 20000, 60000, 262140):
            want = scoring_of(scoring.for_step(_positions([context] * n)))
            assert scoring_of(scoring.for_capture(n, 4, context)) == want, (n, context)
            picks.add(want)
    assert picks == {"sharded", "replicated"}
