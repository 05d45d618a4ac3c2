"""The layout's rules (docs/architecture.md): no import cycle inside optsched, no private name imported
from another module, and a core (`solvers/`) that imports neither torch nor a terminal UI (rich).

Imports are read from the source (ast): every import counts, at module level, inside functions or under
TYPE_CHECKING, so a cycle hidden behind a lazy import fails too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[1]
# installed as optsched and optsched.solvers (see [tool.setuptools.package-dir])
ROOTS = {"optsched": REPO / "optsched", "optsched.solvers": REPO / "solvers"}
FORBIDDEN_IN_CORE = ("torch", "rich")


def modules(roots: dict[str, Path]) -> dict[str, Path]:
    """Every module of the packages: dotted name -> file."""
    out: dict[str, Path] = {}
    for name, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.setdefault(".".join([name, *parts]), path)
    return out


def imports(module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) for each import in `path`; relative imports resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, target, [a.name for a in node.names]))
    return out


def import_graph(roots: dict[str, Path]) -> nx.DiGraph:
    """Module -> the package modules it imports (a `from package import module` names the module too)."""
    known = modules(roots)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for module, path in known.items():
        for _line, target, names in imports(module, path):
            for imported in [target, *(f"{target}.{n}" for n in names)]:
                if imported in known and imported != module:
                    graph.add_edge(module, imported)
    return graph


def test_no_import_cycle_inside_optsched():
    cycles = sorted(" -> ".join([*c, c[0]]) for c in nx.simple_cycles(import_graph(ROOTS)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    assert list(nx.simple_cycles(import_graph({"pkg": pkg}))) != []


def test_no_private_name_is_imported_from_another_module():
    known = modules(ROOTS)
    private = [
        f"{path.relative_to(REPO)}:{line} imports {n} from {target}"
        for module, path in known.items()
        for line, target, names in imports(module, path)
        if target.startswith("optsched")
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not private, "\n".join(private)


def test_the_core_never_imports_torch_or_rich():
    found = []
    for path in sorted((REPO / "solvers").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
                names = [str(node.args[0].value)]
            else:
                continue
            found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in FORBIDDEN_IN_CORE]
    assert not found, "\n".join(found)


def test_every_core_module_imports_without_torch_or_rich():
    code = (
        "import importlib, pkgutil, sys; sys.path.insert(0, sys.argv[1]); import solvers; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(solvers.__path__, 'solvers.')]; "
        f"loaded = [m for m in {FORBIDDEN_IN_CORE!r} if m in sys.modules]; "
        "assert not loaded, f'solvers imported {loaded}'"
    )
    subprocess.run([sys.executable, "-c", code, str(REPO)], check=True, timeout=120)


def test_no_package_attribute_hides_a_module_of_the_same_name():
    """`optsched.solvers.solve` is the function; no module of that name hides behind it."""
    import importlib
    import pkgutil
    import types

    import optsched
    import optsched.solvers

    packages = ["optsched", "optsched.solvers"] + [  # solvers/ is mapped in from its own folder: walked on its own
        info.name
        for root, prefix in ((optsched.__path__, "optsched."), (optsched.solvers.__path__, "optsched.solvers."))
        for info in pkgutil.walk_packages(root, prefix)
        if info.ispkg
    ]
    assert {"optsched.solvers", "optsched.solvers.search", "optsched.solvers.baselines", "optsched.plans"} <= set(packages)
    for package in packages:
        mod = importlib.import_module(package)
        for info in pkgutil.iter_modules(mod.__path__):
            value = mod.__dict__.get(info.name)
            assert value is None or isinstance(value, types.ModuleType), f"{package}.{info.name} hides its module"


def test_every_package_is_installed():
    """A package missing from [tool.setuptools] packages works in an editable install and is left out of a
    wheel: every folder with an __init__.py must be listed."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in modules(ROOTS).items() if path.name == "__init__.py"}
    assert found <= listed, sorted(found - listed)


def test_capture_imports_only_itself_and_the_solvers_data_types():
    """capture/ holds the graph types the layers below the compile hooks read: an import of anything
    above (planner, lowering, plans, the hooks) would run an arrow back up."""
    graph = import_graph(ROOTS)
    up = [f"{a} imports {b}" for a, b in graph.edges()
          if a.startswith("optsched.capture") and not b.startswith(("optsched.capture", "optsched.solvers"))]
    assert not up, "\n".join(up)


def test_nothing_below_the_compile_hooks_imports_them():
    """optsched.compiler (the torch.compile backend, the offline capture) is the top driver: only the public
    entry points (api, cli, the package's lazy exports, distributed) may import it."""
    graph = import_graph(ROOTS)
    top = ("optsched.compiler", "optsched.api", "optsched.cli", "optsched.distributed")
    up = [f"{a} imports {b}" for a, b in graph.edges()
          if b.startswith("optsched.compiler") and a != "optsched" and not a.startswith(top)]
    assert not up, "\n".join(up)
