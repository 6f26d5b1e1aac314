"""The sparkinfer patch series against vLLM 0.32.0 and the tool that applies and checks it.

Run ``python -m vllm_patches --help``; the series lives in ``vllm_patches/series/``.
"""
