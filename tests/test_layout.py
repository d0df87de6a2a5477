"""The package's shape: the library never imports the command line, there are no import
cycles, modules stay small, and building the CLI parser imports no heavy dependency."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "mlxformer"
MAX_MODULE_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports anywhere in its body (function-level imports and those
    under ``if TYPE_CHECKING:`` too: a type-only import is a dependency all the same).
    ``from pkg import sub`` counts as importing ``pkg.sub``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "mlxformer")
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.split(".")[0] != "mlxformer":
                return
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return {m for m in found if m in modules}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_walker_sees_imports(graph):
    # A known edge of each kind, so that a broken walker cannot pass the checks below.
    assert "mlxformer.models.decoder" in graph["mlxformer.loader"]  # module-level import
    assert "mlxformer.generation.stream" in graph["mlxformer.cli.generate"]  # function-level import
    assert "mlxformer.cli.bench" in graph["mlxformer.cli.main"]  # from package import submodule


def test_library_never_imports_the_cli(graph):
    offenders = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if not name.startswith("mlxformer.cli") and name != "mlxformer.__main__"  # entry points
        for target in targets
        if target == "mlxformer.cli" or target.startswith("mlxformer.cli.")
    )
    assert offenders == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles(graph):
    assert find_cycle(graph) is None


def test_modules_stay_small():
    long = {name: n for name, path in all_modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_help_imports_no_heavy_dependency():
    code = (
        "import sys\n"
        "from mlxformer.cli.main import build_parser\n"
        "build_parser().format_help()\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'jinja2', 'sentencepiece', 'tokenizers', "
        "'numpy', 'huggingface_hub', 'transformers', 'torch'})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


MAX_ROOT_MODULES = 6


def test_the_package_root_holds_a_handful_of_modules():
    """Modules live in packages named for their job (``text``, ``sampling``, ``generation``, ...)."""
    loose = sorted(p.name for p in PACKAGE_DIR.glob("*.py"))
    assert len(loose) <= MAX_ROOT_MODULES, loose


def test_the_layout_guide_names_every_module():
    """docs/guide/layout.md lists every package (``name/``) and every module of the root and of
    the top-level packages (``name.py``) as they are."""
    guide = (PACKAGE_DIR.parent / "docs" / "guide" / "layout.md").read_text(encoding="utf-8")
    modules = [p for p in sorted(PACKAGE_DIR.rglob("*.py")) if len(p.relative_to(PACKAGE_DIR).parts) <= 2]
    missing = [str(p.relative_to(PACKAGE_DIR)) for p in modules if p.name != "__init__.py" and f"`{p.name}`" not in guide]
    packages = [p for p in PACKAGE_DIR.rglob("*") if p.is_dir() and (p / "__init__.py").exists()]
    missing += [f"{p.name}/" for p in packages if f"`{p.name}/`" not in guide]
    assert missing == []


def undocumented_modules(package: Path) -> list[str]:
    """The modules (``name.py``) and subpackages (``name/``) of ``package`` that its
    ``__init__.py`` docstring does not name as a literal: the name, ``name.py`` or ``name/``
    between double backquotes."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    parts = [p.stem for p in package.glob("*.py") if not p.name.startswith("__")]
    parts += [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
    return sorted(name for name in parts if not re.search(rf"``{re.escape(name)}(\.py|/)?``", doc))


def test_undocumented_modules_finds_a_missing_name(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("one.py", "two.py", "sub/__init__.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "__init__.py").write_text('"""``one.py`` and ``sub/``, and two (not as a name)."""\n')
    assert undocumented_modules(tmp_path) == ["two"]


def test_every_package_docstring_names_its_modules():
    """Each package's ``__init__.py`` docstring names every module and subpackage in it, so a
    newcomer reading it sees the whole package, and a module added without a word fails here."""
    packages = [p.parent for p in sorted(PACKAGE_DIR.rglob("__init__.py"))]
    assert len(packages) > 10
    missing = {str(p.relative_to(PACKAGE_DIR.parent)): names for p in packages if (names := undocumented_modules(p))}
    assert missing == {}


def cache_class_checks(path: Path) -> list[str]:
    """``isinstance``/``issubclass`` calls in ``path`` whose class is one imported from
    ``mlxformer.cache`` (``isinstance(cache, PackedLayerCache)``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cache_names = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and (node.module or "").startswith("mlxformer.cache") for a in node.names}
    return sorted(f"{path.name}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
            and {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & cache_names)


def test_cache_class_checks_finds_one(tmp_path):
    source = tmp_path / "mixer.py"
    source.write_text("from mlxformer.cache.packed import PackedLayerCache as P\nfrom mlxformer.cache.state import S\n"
                      "isinstance(c, (int, P))\nisinstance(c, int)\nissubclass(type(c), S)\n")
    assert cache_class_checks(source) == ["mixer.py:3", "mixer.py:5"]


def test_only_the_cache_package_checks_a_cache_class():
    """``cache/protocol.py``'s promise: the decoder, its mixers, the engine and the generation
    loop ask the cache (a method, an attribute such as ``segments``), never which class it is."""
    outside = [p for p in sorted(PACKAGE_DIR.rglob("*.py")) if "cache" not in p.relative_to(PACKAGE_DIR).parts[:1]]
    assert len(outside) > 100
    assert [c for p in outside for c in cache_class_checks(p)] == []


def registrations(path: Path) -> list[str]:
    """Module-level writes into a table imported from another project module
    (``FAMILIES["x"] = ...``, ``GATES.update(...)``): a registration done by importing."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("mlxformer") for a in node.names}
    found = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        written = [t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)]
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute) \
                and isinstance(node.value.func.value, ast.Name):
            written.append(node.value.func.value.id)
        found += [f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} {name}" for name in written if name in imported]
    return found


def test_no_table_is_filled_by_importing_a_module():
    """Registries (model families, MLP kinds, ...) are literal tables built where they are
    defined: no module adds its rows to another's table as a side effect of being imported."""
    assert [r for p in sorted(PACKAGE_DIR.rglob("*.py")) for r in registrations(p)] == []
