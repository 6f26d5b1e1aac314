"""Rewrite the series from a patched working tree (maintainer command).

Each file belongs to exactly one patch (see ``series.check_rules``), so a patched tree splits
back into patches without guessing: patch P becomes the description P already had followed by
``diff -u`` of pristine vs. working tree for each file P owns. ``assign`` adds files to a patch
(a new patch needs a description). The result is checked by applying it to the pristine copy and
comparing every file with the working tree byte for byte.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from . import engine, pristine
from .series import SERIES_DIR, Patch, check_rules, load_series, parse_patch, touched_files
from .target import resolve_target


def unified_diff(old_root: Path, new_root: Path, f: str) -> str:
    """``diff -u`` of one root-relative file with ``a/``/``b/`` labels ('' when identical)."""
    old, new = old_root / f, new_root / f
    old_label = f"a/{f}" if old.is_file() else "/dev/null"
    new_label = f"b/{f}" if new.is_file() else "/dev/null"
    r = subprocess.run(["diff", "-u", "--label", old_label, "--label", new_label,
                        str(old) if old.is_file() else "/dev/null",
                        str(new) if new.is_file() else "/dev/null"],
                       capture_output=True, text=True)
    if r.returncode > 1:
        raise RuntimeError(f"diff failed on {f}: {r.stderr.strip()}")
    return r.stdout


def regenerate(from_dir: str | Path, assign: dict[str, str] | None = None,
               describe: dict[str, str] | None = None, wheel: Path | None = None,
               pristine_dir: Path | None = None, series_dir: Path = SERIES_DIR) -> list[str]:
    """Rewrite ``series_dir`` from ``from_dir``; returns a line per patch written.

    ``assign``: {"vllm/x.py": "0006-name.patch"} adds files; ``describe``: descriptions of new patches.
    """
    assign, describe = dict(assign or {}), dict(describe or {})
    work = resolve_target(from_dir)
    old = load_series(series_dir) if (series_dir / "series").is_file() else []
    owner = {f: p.name for p in old for f in p.files}
    for f, name in assign.items():
        if f in owner and owner[f] != name:
            raise ValueError(f"{f} already belongs to {owner[f]}; a file has one owner")
        owner[f] = name
    order = [p.name for p in old] + sorted({n for n in assign.values()} - {p.name for p in old})
    descriptions = {p.name: p.description for p in old}
    for name in order:
        if name not in descriptions:
            if not describe.get(name, "").strip():
                raise ValueError(f"new patch {name} needs a description (--describe {name}=TEXT)")
            descriptions[name] = describe[name].strip()
        elif name in describe:
            descriptions[name] = describe[name].strip()

    tmp, base, source = pristine.pristine_copy(old, wheel, pristine_dir, tuple(assign), series_dir)
    try:
        if source.startswith("installed package") and Path(source.split()[2]).resolve() == work.package:
            raise ValueError("the pristine copy would come from the tree being regenerated; pass --wheel "
                             "or --pristine")
        report, texts = [], {}
        for name in order:
            files = sorted(f for f, n in owner.items() if n == name)
            diffs = "".join(unified_diff(base, work.root, f) for f in files)
            if not diffs:
                raise ValueError(f"{name}: its files {files} are unchanged in {work.root}; "
                                 f"drop it from the series instead")
            texts[name] = descriptions[name] + "\n\n" + diffs
            report.append(f"{name}: {len(files)} file(s), {diffs.count(chr(10))} diff lines")
        with tempfile.TemporaryDirectory(prefix="vllm_regen-") as staging:
            for name, text in texts.items():
                (Path(staging) / name).write_text(text)
            new = [parse_patch(Path(staging) / name) for name in order]
            problems = check_rules(new)
            if problems:
                raise ValueError("regenerated series breaks the rules:\n  " + "\n  ".join(problems))
            engine.apply_series(base, new)
            mismatched = [f for f in touched_files(new)
                          if pristine.sha256_of(base / f) != pristine.sha256_of(work.root / f)]
            if mismatched:
                raise RuntimeError(f"regenerated series does not reproduce {mismatched}")
        for name, text in texts.items():
            (series_dir / name).write_text(text)
        (series_dir / "series").write_text("\n".join(order) + "\n")
        # The manifest describes pristine files: rebuild the pristine copy (base is patched now).
        tmp.cleanup()
        tmp, base, _ = pristine.pristine_copy(old, wheel, pristine_dir, tuple(owner), series_dir)
        pristine.write_manifest(base, sorted(owner), series_dir)
        return report
    finally:
        tmp.cleanup()
