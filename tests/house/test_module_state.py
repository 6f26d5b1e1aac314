"""No module-level registry of runtime state in ``sparkinfer`` (issue 35: one runtime object per
worker owns the arena, workspaces, device checks, fabric and counters, and is passed to where it is
used, not looked up by device).

Read from the source with ``ast`` (nothing is imported). A registry shows as a module-level name
bound to an empty container (``{}``, ``[]``, ``set()``, ``dict()``, ``defaultdict(...)``,
``Counter()``, ...): it can only be filled while the process runs. Tables written in the source
(non-empty literals) are read-only and not flagged. ``sparkinfer/testing/`` is left out: its probes
patch a process on purpose. The few empty containers that are not runtime state are listed below,
each with why; a new one needs a reason here, or an owner that is passed to its users.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXCLUDED = ("sparkinfer/testing/",)
CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "WeakKeyDictionary",
              "WeakValueDictionary", "WeakSet"}

ALLOWED = {
    "sparkinfer/attention/dispatch.py:_logged": "the fallbacks already logged once (log hygiene, no data a step uses)",
    "sparkinfer/attention/dispatch.py:calls": "a diagnostic probe: backend picks per process, read over "
                                              "collective_rpc by decode.impls.probe_counts; no step reads it",
    "sparkinfer/attention/triton_decode.py:_DEVICE": "hardware facts (SM count, shared memory) per device index, "
                                                     "queried once",
    "sparkinfer/cli/plan.py:_SECTIONS": "filled at import by add_section (the plan command's tables)",
    "sparkinfer/core/layouts.py:_BY_NAME": "filled at import from ALL_LAYOUTS (a read-only name table)",
    "sparkinfer/decode/graph_paths.py:NOT_REPLAY_SAFE": "a read-only table written in the source, empty today",
}


def _empty_container(value: ast.expr) -> bool:
    if isinstance(value, ast.Dict):
        return not value.keys
    if isinstance(value, (ast.List, ast.Set)):
        return not value.elts
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        # defaultdict(list) is empty whatever its factory; dict(a=1) or list(X) are tables
        return name in CONTAINERS and (name == "defaultdict" or not (value.args or value.keywords))
    return False


def module_registries(root: Path = ROOT) -> dict[str, int]:
    """{"path:name": line} of every module-level name bound to an empty container."""
    found = {}
    for path in sorted((root / "sparkinfer").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(EXCLUDED):
            continue
        for node in ast.parse(path.read_text(), rel).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if _empty_container(value):
                for t in targets:
                    if isinstance(t, ast.Name):
                        found[f"{rel}:{t.id}"] = node.lineno
    return found


def test_no_module_level_registry_of_runtime_state():
    found = module_registries()
    new = {k: line for k, line in found.items() if k not in ALLOWED}
    assert not new, ("module-level containers filled at run time (issue 35: give the state an owner that is "
                     "passed to its users, e.g. the fabric or WorkerRuntime, or list it in ALLOWED with why): "
                     + ", ".join(f"{k} (line {line})" for k, line in sorted(new.items())))
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"ALLOWED lists names that are gone or no longer start empty: {stale}"


def test_the_check_sees_a_registry():
    src = "import collections\nA = {}\nB: list = []\nC = collections.defaultdict(list)\nD = dict(x=1)\nE = {1: 2}\n"
    flagged = [t.id for node in ast.parse(src).body if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
               if _empty_container(node.value)]
    assert flagged == ["A", "B", "C"]
