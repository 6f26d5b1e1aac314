"""worker_processes: a TP worker forked from the preloaded server sees what a spawned one would see
(the parent's environment and stdout at its start), and a worker whose start-up variables differ
from the server's is spawned. The child reports what it saw into a file; whether vLLM's worker
module was already imported when the target ran tells a fork of the server from a spawn."""

import os
import sys

import pytest

import worker_processes


def _report(path: str, name: str):
    """The worker's target (vLLM calls its target with keyword arguments only)."""
    preloaded = "vllm.v1.worker.cpu_worker" in sys.modules
    with open(path, "w") as f:
        f.write(f"{os.environ.get(name)}\n{preloaded}")
    print(f"worker {name} says hello", flush=True)


def _start(tmp_path, name: str) -> tuple[str, bool]:
    from vllm.v1.executor import multiproc_executor

    context = multiproc_executor.get_mp_context()
    assert isinstance(context, worker_processes.PreloadedContext), "tests/vllm/conftest.py installs it"
    out = tmp_path / "report"
    proc = context.Process(target=_report, kwargs={"path": str(out), "name": name}, name="probe", daemon=True)
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    value, preloaded = out.read_text().split("\n")
    return value, preloaded == "True"


@pytest.mark.vllm
def test_forked_worker_gets_the_parents_environment_and_stdout(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    _start(tmp_path, "PATH")  # the server runs before the changes below (started here if no engine has)
    monkeypatch.setenv("SPARKINFER_PROBE", "set after the server started")
    out = os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT)
    saved = os.dup(1)
    os.dup2(out, 1)  # stdout moved after the server started, as pytest's capture moves it per test
    try:
        assert _start(tmp_path, "SPARKINFER_PROBE") == ("set after the server started", True)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(out)
    assert (tmp_path / "stdout").read_text() == "worker SPARKINFER_PROBE says hello\n"
    monkeypatch.delenv("SPARKINFER_PROBE")
    assert _start(tmp_path, "SPARKINFER_PROBE") == ("None", True)  # removed again


@pytest.mark.vllm
def test_a_different_start_variable_spawns(tmp_path, monkeypatch, capfd):
    pytest.importorskip("vllm")
    _start(tmp_path, "OMP_NUM_THREADS")  # the server runs (started here if no engine has started it)
    other = "3" if worker_processes._server_start["OMP_NUM_THREADS"] != "3" else "2"
    monkeypatch.setenv("OMP_NUM_THREADS", other)
    capfd.readouterr()
    assert _start(tmp_path, "OMP_NUM_THREADS") == (other, False)  # spawned: vLLM imported by nobody yet
    assert "spawning probe: OMP_NUM_THREADS differs" in capfd.readouterr().err


@pytest.mark.vllm
def test_spawn_on_request(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("SPARKINFER_TEST_SPAWN", "1")
    assert _start(tmp_path, "SPARKINFER_TEST_SPAWN") == ("1", False)
