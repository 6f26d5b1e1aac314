"""End-to-end demo: one TP4/DCP4/MTP3 decode step of a GLM-5.2-shaped attention stack on four
host-fabric ranks (``sparkinfer demo``). See ``config.py`` (sizes), ``inputs.py`` (the synthetic
model state every rank derives from one seed), ``rank.py`` (what each rank runs) and
``report.py`` (the table)."""
