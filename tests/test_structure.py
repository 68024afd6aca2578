"""The package's shape: no import cycles, no private name taken from another module.

Read from the source with ``ast`` (nothing is imported), so the test sees imports made
inside functions too - a lazy import that closes a cycle is still a cycle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("conformance", "asv_benches", "attn_ref")

# Entries may leave, none may be added: (importing module, imported module, name).
# attn_ref's gradient modules reach the forward modules' named steps by public names
# (issue 22), so none is left.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def _imports(name, path):
    """``(imported module, [names])`` of every import statement in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[: len(base) - (node.level - 1)]
                mod = ".".join(up + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names]


MODULES = dict(_modules())


def _resolve(mod, names):
    """Project modules an import statement loads (a ``from pkg import mod`` counts)."""
    out = []
    if mod in MODULES:
        out.append(mod)
    for n in names:
        sub = f"{mod}.{n}"
        if sub in MODULES:
            out.append(sub)
    return out


def test_modules_found():
    assert {"conformance.oracle", "conformance.features", "asv_benches.scaling"} <= set(MODULES)


def test_no_private_name_imported_from_another_module():
    found = set()
    for name, path in MODULES.items():
        for mod, names in _imports(name, path):
            if not (mod in MODULES or mod.split(".")[0] in PACKAGES):
                continue
            for n in names:
                if n.startswith("_") and not n.startswith("__") and f"{mod}.{n}" not in MODULES:
                    found.add((name, mod, n))
    new = sorted(found - KNOWN_PRIVATE_IMPORTS)
    assert not new, "private names imported across modules:\n" + "\n".join(map(str, new))
    gone = sorted(KNOWN_PRIVATE_IMPORTS - found)
    assert not gone, "fixed, so remove from KNOWN_PRIVATE_IMPORTS:\n" + "\n".join(map(str, gone))


def import_graph(package):
    """``{module: {project modules of package it imports}}``."""
    graph = {}
    for name, path in MODULES.items():
        if not name.startswith(package):
            continue
        deps = set()
        for mod, names in _imports(name, path):
            for dep in _resolve(mod, names):
                # a package's __init__ is not a dependency of the modules below it
                if dep.startswith(package) and dep != name and not name.startswith(dep + "."):
                    deps.add(dep)
        graph[name] = deps
    return graph


def find_cycles(graph):
    """Every cycle a depth-first search meets, as module lists ``[a, b, ..., a]``."""
    cycles, state = [], {}

    def visit(n, stack):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return cycles


@pytest.mark.parametrize("package", ["conformance", "asv_benches"])
def test_no_import_cycles(package):
    cycles = find_cycles(import_graph(package))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_a_lazy_cycle_and_a_private_import(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from .b import _g\n")
    (tmp_path / "b.py").write_text("from .a import f\n")
    a = list(_imports("pkg.a", tmp_path / "a.py"))
    b = list(_imports("pkg.b", tmp_path / "b.py"))
    assert a == [("pkg.b", ["_g"])] and b == [("pkg.a", ["f"])]
    assert find_cycles({"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert find_cycles({"pkg.a": {"pkg.b"}, "pkg.b": set()}) == []
