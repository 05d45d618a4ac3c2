"""The layout's rules (docs/architecture.md): imports run one way, down the layer map (`LAYERS`), with no
cycle inside optsched; no private name imported from another module; a core (`solvers/`) that imports neither
torch nor a terminal UI (rich); torch's private symbols reached through optsched/_torch.py only.

Imports are read from the source (ast): every import counts, at module level, inside functions or under
TYPE_CHECKING, so a cycle hidden behind a lazy import fails too.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# installed as optsched and optsched.solvers (see [tool.setuptools.package-dir])
ROOTS = {"optsched": REPO / "optsched", "optsched.solvers": REPO / "solvers"}
FORBIDDEN_IN_CORE = ("torch", "rich")
# Files that still reach into torch's private modules themselves: others were editing them when the rest moved to
# optsched/_torch.py. Move their uses there and empty this list. (costs/cuda_allocator.py, edited then too, has none.)
PRIVATE_TORCH_ALLOWED: set[str] = set()  # files still reaching torch's private names directly: none left


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


# The layer map, lowest first: a module may import from its own layer and the ones below, never from above. A name
# stands for the module and, if it holds a dot, everything under it (a bare top-level name, "optsched", only for
# itself: a new top-level module must be placed here). The longest name that matches places a module.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("torch's door and the solvers' data types", ("optsched._torch", "optsched.solvers.model")),
    ("capture", ("optsched.capture",)),
    ("graph passes and the ops they write", ("optsched.passes",)),
    ("the optimizer's updates and state", ("optsched.optim",)),
    ("costs and problems", ("optsched.costs",)),
    ("executors and fusion groups", ("optsched.executors",)),
    ("lowering", ("optsched.lower",)),
    # the search (and the package's face, which loads it): the layers below read the data types only
    ("the solver", ("optsched.solvers",)),
    ("plans and plan files", ("optsched.plans",)),
    ("options", ("optsched.budget", "optsched.settings")),
    ("planning", ("optsched.planning", "optsched.user_checkpoint", "optsched.progress")),
    ("compile hooks", ("optsched.compiler",)),
    ("entry points", ("optsched", "optsched.api", "optsched.state_snapshot", "optsched.attribute_sync", "optsched.cli",
                      "optsched.distributed", "optsched.measure", "optsched.baselines")),
]


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    """Index in `layers` of the longest name placing `module`; None: the map does not place it."""
    found = [(len(name), i) for i, (_, names) in enumerate(layers) for name in names
             if module == name or ("." in name and module.startswith(name + "."))]
    return max(found)[1] if found else None


def against_the_map(graph: nx.DiGraph, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    """Each import running up the map: "a (its layer) imports b (a higher layer)"."""
    up = []
    for a, b in sorted(graph.edges()):
        la, lb = layer_of(a, layers), layer_of(b, layers)
        if la is not None and lb is not None and lb > la:
            up.append(f"{a} ({layers[la][0]}) imports {b} ({layers[lb][0]})")
    return up


def test_every_module_has_a_layer_and_every_name_in_the_map_a_module():
    known = modules(ROOTS)
    unplaced = sorted(m for m in known if layer_of(m) is None)
    assert not unplaced, f"place these in tests/test_layout.py's LAYERS: {unplaced}"
    stale = [name for _, names in LAYERS for name in names if name not in known]
    assert not stale, f"no such module: take these off LAYERS: {stale}"


def test_imports_run_down_the_layer_map():
    up = against_the_map(import_graph(ROOTS))
    assert not up, "imports against the layer map (move the code imported down, or the importer up):\n" + "\n".join(up)


def test_the_direction_check_finds_an_import_against_the_map(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "low" / "__init__.py"):
        init.write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..high import g\n")  # lazy: counts all the same
    (pkg / "high.py").write_text("from .low import a\n")  # down: allowed
    layers = [("low", ("pkg.low",)), ("high", ("pkg.high",)), ("top", ("pkg",))]
    assert layer_of("pkg.low.a", layers) == 0 and layer_of("pkg.other", layers) is None
    assert against_the_map(import_graph({"pkg": pkg}), layers) == ["pkg.low.a (low) imports pkg.high (high)"]


@pytest.mark.parametrize("importer, imported", [
    ("optsched.passes.chunking", "optsched.lower.programs"),  # the chunked cross-entropy ops lived in lower/
    ("optsched.costs.problem_builder", "optsched.lower.programs"),
    ("optsched.executors.groups", "optsched.solvers.search.fusion_groups"),  # the search, not its data types
    ("optsched.capture.joint_graph", "optsched.solvers"),  # the package's face loads the search
    ("optsched.lower.programs", "optsched.planning.planner"),
    ("optsched.planning.planner", "optsched.compiler.backend"),
])
def test_the_map_refuses_the_arrows_that_ran_back_up(importer, imported):
    graph = import_graph(ROOTS)
    graph.add_edge(importer, imported)
    assert [u for u in against_the_map(graph) if u.startswith(f"{importer} (")] == [
        f"{importer} ({LAYERS[layer_of(importer)][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})"]


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
    above (planner, lowering, plans, the hooks) would run an arrow back up. optsched._torch is below all."""
    graph = import_graph(ROOTS)
    up = [f"{a} imports {b}" for a, b in graph.edges()
          if a.startswith("optsched.capture") and not b.startswith(("optsched.capture", "optsched.solvers", "optsched._torch"))]
    assert not up, "\n".join(up)


def test_nothing_below_the_compile_hooks_imports_them():
    """optsched.compiler (the torch.compile backend, the offline capture) is the top driver: only the public
    entry points (api, cli, the package's lazy exports, distributed) may import it."""
    graph = import_graph(ROOTS)
    top = ("optsched.compiler", "optsched.api", "optsched.cli", "optsched.distributed")
    up = [f"{a} imports {b}" for a, b in graph.edges()
          if b.startswith("optsched.compiler") and a != "optsched" and not a.startswith(top)]
    assert not up, "\n".join(up)


def _is_private(dotted: str) -> bool:
    """A torch name with a private part. Dunders are public (`torch.__version__`), and `torch.ops.<ns>.<op>`
    names an operator of the dispatcher's registry (`_foreach_add`, `_unsafe_view`), not a Python symbol."""
    return not dotted.startswith("torch.ops.") and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in dotted.split("."))


def _dotted(node: ast.expr) -> tuple[str, str] | None:
    """(root name, the rest) of an attribute chain `a.b.c`; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id, ".".join(reversed(parts))) if isinstance(node, ast.Name) else None


def private_torch_uses(path: Path) -> list[tuple[int, str]]:
    """(line, name) for each private torch name `path` uses: imported from a private module or by a private
    name, or reached through an attribute chain or a getattr from torch or a name bound to a torch object."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> the torch object it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
                    found += [(node.lineno, a.name)] if _is_private(a.name) else []
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
                found += [(node.lineno, f"{node.module}.{a.name}")] if _is_private(f"{node.module}.{a.name}") else []
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # a.b of a.b.c: seen as a.b.c
    for node in ast.walk(tree):
        chain = None
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _dotted(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            root = _dotted(node.args[0]) or ((node.args[0].id, "") if isinstance(node.args[0], ast.Name) else None)
            chain = root and (root[0], ".".join(p for p in (root[1], node.args[1].value) if p))
        if chain and chain[0] in bound:
            name = ".".join(p for p in (bound[chain[0]], chain[1]) if p)
            found += [(node.lineno, name)] if _is_private(name) else []
    return sorted(set(found))


def private_torch_uses_outside_the_door(package: Path) -> dict[str, list[tuple[int, str]]]:
    """The private torch names each file of `package` uses (by its path from the package's parent), but those of
    `package`/_torch.py, the one door to them."""
    door = package / "_torch.py"
    return {str(p.relative_to(package.parent)): private_torch_uses(p) for p in sorted(package.rglob("*.py")) if p != door}


def test_torch_private_names_are_reached_through_optsched_torch_only():
    """torch's private modules and names change between releases without notice: optsched/_torch.py names each
    one optsched uses, with what it is for and a safe stand-in, and nothing else reaches for them."""
    uses = private_torch_uses_outside_the_door(REPO / "optsched")
    assert PRIVATE_TORCH_ALLOWED <= set(uses), PRIVATE_TORCH_ALLOWED - set(uses)
    found = [f"{rel}:{line} uses {name}" for rel, found in uses.items() if rel not in PRIVATE_TORCH_ALLOWED
             for line, name in found]
    assert not found, "import these from optsched._torch (add them there if new):\n" + "\n".join(found)
    moved = sorted(rel for rel in PRIVATE_TORCH_ALLOWED if not uses[rel])
    assert not moved, f"no private torch name left in {moved}: take them off PRIVATE_TORCH_ALLOWED"


def test_the_door_check_finds_a_private_torch_name_used_outside_the_door(tmp_path):
    pkg = tmp_path / "optsched"
    (pkg / "lower").mkdir(parents=True)
    (pkg / "_torch.py").write_text("import torch\nstorage_use_count = torch._C._storage_Use_Count\n")
    (pkg / "lower" / "runtime.py").write_text("import torch\ndef refs(t):\n    return torch._C._storage_Use_Count(t)\n")
    assert private_torch_uses_outside_the_door(pkg) == {"optsched/lower/runtime.py": [(3, "torch._C._storage_Use_Count")]}


def test_the_private_torch_check_finds_each_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\n"
        "import torch.utils._pytree as pytree\n"  # 2
        "from torch._guards import tracing\n"  # 3
        "from torch.fx.graph import _BoxedCodeGen\n"  # 4
        "from torch import fx, Tensor\n"
        "def f(x):\n"
        "    torch._C._foo(x)\n"  # 7
        "    fx.graph._private(Tensor._make_subclass)\n"  # 8 (twice)
        "    getattr(torch.compiler, '_flag', None)\n"  # 9
        "    return torch.__version__, torch.ops.aten._foreach_add.List, torch.Tag.pointwise, x._private\n"
    )
    assert private_torch_uses(src) == [
        (2, "torch.utils._pytree"), (3, "torch._guards.tracing"), (4, "torch.fx.graph._BoxedCodeGen"), (7, "torch._C._foo"),
        (8, "torch.Tensor._make_subclass"), (8, "torch.fx.graph._private"), (9, "torch.compiler._flag"),
    ]


def test_optsched_torch_is_the_bottom_layer():
    """optsched/_torch.py imports nothing of optsched (any module may import it) and no torch module by itself:
    each symbol's module loads when the symbol is first read."""
    found = [t for _line, t, _names in imports("optsched._torch", REPO / "optsched" / "_torch.py")
             if t.startswith("optsched") or t.split(".")[0] == "torch"]
    assert not found, found
    code = ("import sys, optsched.capture.errors, optsched.executors.inductor, optsched.lower.offload_runtime; "
            "loaded = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]; "
            "assert not loaded, f'importing optsched loaded {loaded}'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)


def test_every_private_torch_symbol_resolves_here_or_stands_in_with_its_reason():
    """On the installed torch each symbol is torch's own; one this torch lacks must have a safe stand-in (None or
    a class nothing matches), and `missing()` must say why. torch 2.11 lacks `compile_session_context` only."""
    from optsched import _torch

    missing = _torch.missing()
    for name, symbol in _torch.SYMBOLS.items():
        module, _, attr = symbol.path.partition(":")
        value = getattr(_torch, name)
        if name in missing:
            assert symbol.stand_in != "raise", missing[name]  # optsched has no safe path without it
            assert f"({name}) for {symbol.needed_for}" in missing[name], missing[name]
            assert value is None if symbol.stand_in == "none" else issubclass(value, Exception)
        else:
            found = importlib.import_module(module)
            assert value is (getattr(found, attr) if attr else found), name
    assert set(_torch.SYMBOLS) <= set(_torch.__all__)


def test_a_symbol_torch_lacks_fails_no_import_and_names_its_feature():
    from optsched._torch import MissingTorchSymbol, Symbol, lookup

    stub = lookup("no_such", Symbol("torch._C:_no_such_symbol", "a feature under test"))
    for use in (stub, lambda: stub.patch(x=1), lambda: isinstance(1, stub)):
        with pytest.raises(MissingTorchSymbol, match=r"torch\._C\._no_such_symbol \(no_such\) for a feature under test"):
            use()
    assert lookup("no_such", Symbol("torch._no_such_module:f", "a feature under test", stand_in="none")) is None
    never = lookup("no_such", Symbol("torch._C:_no_such_error", "a feature under test", stand_in="never"))
    with pytest.raises(ValueError):  # an except clause naming it catches nothing
        try:
            raise ValueError("not it")
        except never:
            pass
    assert not isinstance(torch.nn.BatchNorm1d(2), never)


def test_the_classes_optsched_recognizes_by_name_are_torchs():
    """Matched by class name (type(x).__name__ == ...), so a rename in torch would match nothing, silently."""
    from optsched import _torch

    for name, module in _torch.NAMED_CLASSES.items():
        if module is not None:
            assert isinstance(getattr(importlib.import_module(module), name), type), (module, name)
    compiled = torch.compile(lambda x: x.sin() * 2, backend="aot_eager", fullgraph=True)
    y = compiled(torch.randn(3, requires_grad=True))
    assert type(y.grad_fn).__name__ == _torch.COMPILED_FUNCTION_BACKWARD
    importlib.import_module(_torch.DYNAMO_METRICS_LOGGER)  # the logger is named after its module


MAX_DEFINITION_LINES = 120


def test_no_definition_in_optsched_is_over_120_lines():
    """A function or class longer than a screenful does more than one job (issue 35): split it along its seams.
    Lines run from `def`/`class` to its last line, docstring included, decorators not."""
    long = []
    for path in sorted((REPO / "optsched").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_DEFINITION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "over 120 lines: " + "; ".join(long)
