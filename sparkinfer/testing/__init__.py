"""Test support shipped with the package: the host-read/allocation probe and the tiny
GLM-5.2-shaped model the engine tests and benchmarks serve."""
