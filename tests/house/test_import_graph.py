"""The import graph of ``sparkinfer``, read from the source with ``ast`` (nothing is imported):
no module imports itself back through others, and the torch-free planning core imports nothing
above it.

Every ``import`` statement counts, at module level or inside a function: a function-local import
still runs when the function is called, so a cycle through a lazy import is still a cycle (it
only moves the failure from import time to the first call). An edge goes to the module named:
``from a.b import c`` is an edge to ``a.b.c`` when that is a module and to ``a.b`` (its
``__init__``) otherwise; the implicit import of parent packages is not an edge (every module
would otherwise depend on ``sparkinfer/__init__.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "sparkinfer"

# The torch-free planning core (README, "Imports go downward only"): ``sparkinfer.core`` and the
# settings module ``sparkinfer.config``, which patched vLLM and every layer above read. They may
# import each other and the standard library / numpy, nothing else of sparkinfer and no GPU stack.
CORE = ("sparkinfer.core", "sparkinfer.config")
GPU_STACK = ("torch", "triton", "vllm")

# The layers, bottom up (docs/design/overview.md): a module imports its own layer and those below.
# The executors may import one another; the adapter (``vllm``) is the only layer that meets vLLM;
# the top (cli, demo, testing, fixture, preflight) may import anything.
LAYERS = (("sparkinfer.core", "sparkinfer.config"),
          ("sparkinfer.formats", "sparkinfer.native", "sparkinfer.attention", "sparkinfer.indexer",
           "sparkinfer.plan", "sparkinfer.comm"),
          ("sparkinfer.decode",),
          ("sparkinfer.vllm",))


def _in(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} of every module of the package (``pkg/__init__.py`` -> ``pkg``)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules) -> list[tuple[str, int]]:
    """[(imported name, line)] of every import statement in the file, relative imports resolved;
    a name is a sparkinfer module where it names one, else the dotted name as written."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in modules else base, node.lineno))
    return out


def _owner(imported: str, modules) -> str | None:
    """The sparkinfer module an import runs: the longest module prefix of the dotted name."""
    parts = imported.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def import_graph(root: Path = ROOT) -> tuple[dict[str, dict[str, int]], dict[str, list[tuple[str, int]]]]:
    """({module: {sparkinfer module it imports: line}}, {module: [(any imported name, line)]})."""
    modules = module_files(root)
    graph, raw = {}, {}
    for name, path in modules.items():
        raw[name] = imports_of(name, path, modules)
        graph[name] = {}
        for imported, line in raw[name]:
            target = _owner(imported, modules)
            if target is not None and target != name:
                graph[name].setdefault(target, line)
    return graph, raw


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a list of modules, first == last) per strongly connected component of more than
    one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))
    return [_cycle_in(graph, comp) for comp in sorted(comps)]


def _cycle_in(graph, comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    start, members = comp[0], set(comp)
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w in members and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in its component {comp}")


def _describe(graph, cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def core_violations(graph, raw) -> list[str]:
    """Each import of a core module that reaches above the core or into the GPU stack."""
    out = []
    for name in sorted(graph):
        if not _in(name, CORE):
            continue
        out += [f"{name} imports {target} (line {line})" for target, line in sorted(graph[name].items())
                if not _in(target, CORE)]
        out += [f"{name} imports {imported} (line {line})" for imported, line in raw[name]
                if _in(imported, GPU_STACK)]
    return out


def layer_of(module: str) -> int:
    """The module's layer in ``LAYERS`` (the top: one past the last)."""
    return next((i for i, layer in enumerate(LAYERS) if _in(module, layer)), len(LAYERS))


def upward_imports(graph) -> list[str]:
    """Each import of a module in a higher layer than the importer's."""
    return [f"{name} imports {target} (line {line})" for name in sorted(graph)
            for target, line in sorted(graph[name].items()) if layer_of(target) > layer_of(name)]


def test_the_graph_is_read():
    """The reader finds the package's edges of every kind (guards the tests below against a reader
    that sees nothing): module-level, function-local and relative imports."""
    graph, _ = import_graph()
    assert "sparkinfer.core.capacity" in graph["sparkinfer.preflight"]       # module level
    assert "sparkinfer.vllm.indexer_layout" in graph["sparkinfer.cli.serve"]  # inside a function
    assert "sparkinfer.formats.codecs" in graph["sparkinfer.formats.fp8"]     # from . import codecs
    assert "sparkinfer.attention.dispatch" in graph["sparkinfer.attention"]   # relative, in __init__
    assert len(graph) == len(module_files()) > 50


def test_no_import_cycles():
    graph, _ = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n  " + "\n  ".join(_describe(graph, c) for c in found)


def test_core_imports_only_core():
    graph, raw = import_graph()
    bad = core_violations(graph, raw)
    assert not bad, "the torch-free core imports above itself:\n  " + "\n  ".join(bad)


def test_layers_import_downward():
    graph, _ = import_graph()
    bad = upward_imports(graph)
    assert not bad, "imports reaching a higher layer (LAYERS):\n  " + "\n  ".join(bad)


def adapter_strays(graph, raw, patches: str) -> list[str]:
    """Modules of ``sparkinfer.vllm`` that neither import vLLM nor are named by the patch series (a
    call it adds, or its description of what the patch wires): such a module belongs in a layer
    below the adapter."""
    return [name for name in sorted(graph) if name.startswith("sparkinfer.vllm.")
            and not any(_in(imported, ("vllm",)) for imported, _ in raw[name])
            and not re.search(rf"\b{re.escape(name)}\b", patches)]


def test_the_adapter_holds_only_what_meets_vllm():
    graph, raw = import_graph()
    patches = "\n".join(p.read_text() for p in sorted((ROOT / "vllm_patches" / "series").glob("*.patch")))
    assert adapter_strays(graph, raw, patches) == []
    # and the check sees a stray: a module that only the adapter's own code would call
    raw = {**raw, "sparkinfer.vllm.stray": [("sparkinfer.core.capacity", 1)]}
    assert adapter_strays({**graph, "sparkinfer.vllm.stray": {}}, raw, patches) == ["sparkinfer.vllm.stray"]


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize("lazy", [False, True])
def test_a_planted_cycle_and_core_import_are_found(tmp_path, lazy):
    """The checks on a tree with a known cycle (one edge inside a function when ``lazy``, one
    relative) and a core module importing the vLLM glue and torch."""
    edge = "def f():\n    from sparkinfer.b import x\n" if lazy else "from sparkinfer.b import x\n"
    root = _plant(tmp_path, {
        "sparkinfer/__init__.py": "",
        "sparkinfer/a.py": edge,
        "sparkinfer/b.py": "from . import c\nx = 1\n",
        "sparkinfer/c.py": "import sparkinfer.a\n",
        "sparkinfer/core/__init__.py": "",
        "sparkinfer/core/plan.py": "def g():\n    from sparkinfer.vllm import glue\n    import torch\n",
        "sparkinfer/vllm/__init__.py": "",
        "sparkinfer/vllm/glue.py": "",
        "sparkinfer/decode/__init__.py": "",
        "sparkinfer/decode/step.py": "from sparkinfer.attention import kernel\nfrom sparkinfer.vllm import glue\n",
        "sparkinfer/attention/__init__.py": "",
        "sparkinfer/attention/kernel.py": "import sparkinfer.core.plan\n",
    })
    graph, raw = import_graph(root)
    assert cycles(graph) == [["sparkinfer.a", "sparkinfer.b", "sparkinfer.c", "sparkinfer.a"]]
    assert core_violations(graph, raw) == ["sparkinfer.core.plan imports sparkinfer.vllm.glue (line 2)",
                                           "sparkinfer.core.plan imports torch (line 3)"]
    assert upward_imports(graph) == ["sparkinfer.core.plan imports sparkinfer.vllm.glue (line 2)",
                                     "sparkinfer.decode.step imports sparkinfer.vllm.glue (line 2)"]
