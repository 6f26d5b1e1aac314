"""Applying and reverting the series with GNU ``patch``, all-or-nothing.

The touched files are copied into a staging directory and the whole series is applied there
first (``patch -p1 --fuzz=0``: a hunk that does not match exactly is a conflict, never a guess).
Only when every patch applied cleanly are the staged files copied over the target, so a
conflict leaves the target exactly as it was.

States of a target with respect to the series (``probe``):
  clean     every patch applies forward             -> ``apply`` patches it
  partial   the first k patches are there and the   -> ``apply`` adds the rest (an older series
            rest applies on top                        was applied); ``revert`` takes k out
  applied   the whole series is there               -> ``apply`` refuses, or is a no-op with
                                                       ``if_needed``; ``revert`` restores it
  conflict  none of the above                       -> the first failing patch and its hunks
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .series import Patch, touched_files


class PatchError(RuntimeError):
    """A patch did not apply; the message names it and carries GNU patch's report of the hunks."""


@dataclass(frozen=True)
class Probe:
    state: str  # "clean" | "partial" | "applied" | "conflict"
    applied: int  # how many leading patches the target carries (clean 0, applied all)
    detail: str  # for "conflict": the forward failure (first failing patch and its hunks)


def stage_copy(src_root: Path, files: list[str], dest_root: Path) -> None:
    """Copy ``files`` (root-relative) from ``src_root`` to ``dest_root``; absent files stay absent."""
    for f in files:
        src = src_root / f
        if src.is_file():
            (dest_root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest_root / f)


def run_patch(root: Path, patch: Patch, reverse: bool = False) -> None:
    # --forward in both directions: without it --batch would take a patch that is not applied,
    # given --reverse, as "reversed" and apply it forward instead.
    cmd = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
           "--reject-file=-", "-d", str(root), "-i", str(patch.path)]
    if reverse:
        cmd.insert(1, "--reverse")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        verb = "revert" if reverse else "apply"
        raise PatchError(f"{patch.name} does not {verb} cleanly\n{(r.stdout + r.stderr).rstrip()}")


def apply_series(root: Path, patches: list[Patch], reverse: bool = False) -> None:
    """Apply (or revert, in reverse order) ``patches`` in place under ``root``; stops at the first failure."""
    for p in (reversed(patches) if reverse else patches):
        run_patch(root, p, reverse)


def _staged(src_root: Path, patches: list[Patch], revert: list[Patch],
            apply: list[Patch]) -> tuple[tempfile.TemporaryDirectory, Path]:
    """A staging copy of every touched file with ``revert`` taken out, then ``apply`` applied."""
    tmp = tempfile.TemporaryDirectory(prefix="vllm_patches-")
    stage = Path(tmp.name)
    stage_copy(src_root, touched_files(patches), stage)
    try:
        apply_series(stage, revert, reverse=True)
        apply_series(stage, apply)
    except PatchError:
        tmp.cleanup()
        raise
    return tmp, stage


def probe(root: Path, patches: list[Patch]) -> Probe:
    """How many leading patches ``root`` carries: the largest k such that patches[:k] revert and
    then the whole series applies again (so the rest of the series applies on top)."""
    first_failure = ""
    for k in range(len(patches), -1, -1):
        try:
            tmp, _ = _staged(root, patches, patches[:k], patches)
        except PatchError as e:
            if k == 0:
                first_failure = str(e)
            continue
        tmp.cleanup()
        state = "clean" if k == 0 else "applied" if k == len(patches) else "partial"
        return Probe(state, k, "")
    return Probe("conflict", 0, first_failure)


def install_files(stage: Path, root: Path, files: list[str]) -> None:
    """Copy staged results over ``root``: replace each file atomically, delete files the series removed."""
    for f in files:
        staged, dest = stage / f, root / f
        if staged.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".vllm_patches.tmp")
            shutil.copyfile(staged, tmp)
            if dest.exists():
                shutil.copymode(dest, tmp)
            os.replace(tmp, dest)
        elif dest.exists():
            dest.unlink()


def transact(root: Path, patches: list[Patch], revert: list[Patch], apply: list[Patch]) -> list[str]:
    """Revert ``revert`` then apply ``apply`` on a staged copy, then install it over ``root``.

    Raises PatchError, leaving ``root`` untouched, when any patch fails. Returns the files written.
    """
    tmp, stage = _staged(root, patches, revert, apply)
    try:
        files = touched_files(patches)
        install_files(stage, root, files)
        return files
    finally:
        tmp.cleanup()
