"""End-to-end demo: consecutive TP4/DCP4/MTP3 decode steps of a GLM-5.2-shaped attention stack on
four host-fabric ranks (``sparkinfer demo``). See ``config.py`` (sizes), ``inputs.py`` (the
synthetic model state and MTP acceptance every rank derives from one seed), ``rank.py`` (what each
rank runs per step: policy, selected records with cross-step reuse, stock DCP, reference, byte
checks), ``pool.py`` (a destination's reuse pool), ``stock.py`` (vLLM's ag_rs DCP over gloo) and
``report.py`` (checks and the per-step table)."""
