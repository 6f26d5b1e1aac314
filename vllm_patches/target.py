"""Where a vLLM tree is and which release it is.

A target is either a source checkout (a directory holding ``vllm/``) or an installed package
(the ``vllm`` directory itself, e.g. ``site-packages/vllm``). Patches are applied with ``-p1``
from the directory that holds the package, so both kinds resolve to that ``root``.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    root: Path  # directory holding the vllm package; patch paths are relative to it
    package: Path  # root / "vllm"


def resolve_target(path: str | Path) -> Target:
    p = Path(path).resolve()
    if not p.is_dir():
        raise ValueError(f"target {p} is not a directory")
    if p.name == "vllm" and (p / "__init__.py").is_file():
        return Target(p.parent, p)
    if (p / "vllm" / "__init__.py").is_file():
        return Target(p, p / "vllm")
    raise ValueError(f"target {p} is neither a vllm package directory (vllm/__init__.py) "
                     f"nor a source checkout holding one (vllm/vllm/__init__.py)")


_VERSION_RE = re.compile(r"""^__version__\s*=.*?['"]([^'"]+)['"]""", re.M)


def detect_version(target: Target) -> tuple[str | None, str]:
    """(version, where it was read) of a target; version None when nothing tells.

    Sources, first hit wins: ``vllm/_version.py`` (written by the build), the installed
    distribution's ``*.dist-info/METADATA`` next to the package, ``git describe`` of a checkout.
    """
    version_py = target.package / "_version.py"
    if version_py.is_file():
        m = _VERSION_RE.search(version_py.read_text())
        if m:
            return m.group(1), str(version_py)
    for meta in sorted(target.root.glob("vllm*.dist-info/METADATA")):
        m = re.search(r"^Version:\s*(\S+)", meta.read_text(errors="replace"), re.M)
        if m and re.search(r"^Name:\s*vllm(-cpu)?\s*$", meta.read_text(errors="replace"), re.M | re.I):
            return m.group(1), str(meta)
    if (target.root / ".git").exists():
        r = subprocess.run(["git", "-C", str(target.root), "describe", "--tags", "--exact-match"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.strip().lstrip("v"), f"git tag in {target.root}"
    return None, "no _version.py, dist-info or git tag found"


def release_of(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``: local build tags do not change the Python sources we patch."""
    return version.split("+", 1)[0]
