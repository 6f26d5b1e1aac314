"""Test support shipped with the package: the host-read/allocation probe, the launch counter, the
tiny GLM-5.2-shaped model the engine tests and benchmarks serve, and a CPU evaluator of the kernels'
inline PTX (``ptx``)."""
