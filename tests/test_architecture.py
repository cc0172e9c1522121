"""The package plan of docs/architecture.md holds: every package of `cat/` has a floor, and
a module imports only packages on floors below its own (or its own package)."""

from __future__ import annotations

import ast
from pathlib import Path

import cat

CAT = Path(cat.__file__).resolve().parent

# Bottom to top, as docs/architecture.md draws them; packages on one floor do not import
# each other.
FLOORS = {
    "core": 0,
    "text": 1,
    "audio": 2, "lm": 2, "storage": 2,
    "data": 3, "graph": 3,
    "features": 4,
    "formats": 5,
    "loading": 6, "models": 6,
    "training": 7,
    "decoding": 8,
    "ctc": 9, "rnnt": 9,
    "shared": 10, "crf": 10, "serving": 10,
    "utils": 11,
    "testing": 12,
}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, package) of every `cat.<package>` a module imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "cat" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def upward_imports(root: Path = CAT) -> list[str]:
    """Every import of a package not below the importing module's package."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if len(relative.parts) < 2:
            continue  # cat/__init__.py
        package = relative.parts[0]
        for line, target in imported_packages(path):
            if target != package and FLOORS[target] >= FLOORS[package]:
                problems.append(f"cat/{relative}:{line}: cat.{package} (floor "
                                f"{FLOORS[package]}) imports cat.{target} (floor "
                                f"{FLOORS[target]})")
    return problems


def test_every_package_has_a_floor():
    packages = {p.name for p in CAT.iterdir() if (p / "__init__.py").is_file()}
    assert packages - set(FLOORS) == set()


def test_modules_import_only_downward():
    assert upward_imports() == []


def test_an_upward_import_is_caught(tmp_path):
    for package in ("loading", "training"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "loading" / "batch.py").write_text("from cat.training import manager\n")
    (tmp_path / "training" / "manager.py").write_text("import cat.loading.batch\n")
    assert upward_imports(tmp_path) == [
        "cat/loading/batch.py:1: cat.loading (floor 6) imports cat.training (floor 7)"]


def test_generic_code_names_no_model_family():
    """The model families are found by name (`cat.models.registry.FAMILIES`)."""
    from cat.models.registry import FAMILIES

    assert all(FLOORS[module.split(".")[1]] > FLOORS["decoding"]
               for module in FAMILIES.values())


# Where a model kind or a family's module may be named in code: the one definition of the
# kinds (`model_kind`), the registry that maps them to families, and the translation of
# CAT's own experiment files, whose format names CAT's families.
NAMING_FAMILIES = {"core/config.py", "models/registry.py", "utils/migrate_config.py",
                   "utils/migrate_hyper.py"}


def family_names(root: Path = CAT, kinds: tuple[str, ...] = ("ctc", "rnnt", "crf")
                 ) -> list[str]:
    """Every string in the code (docstrings aside) of a generic module (not a family's, not
    `testing` or `shared`, CAT's compatibility names) that is a model kind or names a
    family's module: generic code must find a family through the registry."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if (len(relative.parts) < 2 or relative.parts[0] in {*kinds, "testing", "shared"}
                or relative.as_posix() in NAMING_FAMILIES):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        documentation = {id(node.value) for node in ast.walk(tree)
                         if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in documentation
                    and (node.value in kinds
                         or any(node.value.startswith(f"cat.{kind}") for kind in kinds))):
                found.append(f"cat/{relative}:{node.lineno}: {node.value!r}")
    return found


def test_generic_code_names_no_kind_and_no_family_module():
    assert family_names() == []


def test_a_kind_named_in_generic_code_is_caught(tmp_path):
    (tmp_path / "decoding").mkdir()
    (tmp_path / "decoding" / "searcher.py").write_text(
        '"""Decoding "ctc" models is fine in a docstring."""\n'
        'kind = "rnnt" if bin == "cat.rnnt.train" else "ctc"\n')
    (tmp_path / "ctc").mkdir()
    (tmp_path / "ctc" / "model.py").write_text('KIND = "ctc"\n')
    assert sorted(family_names(tmp_path)) == [
        "cat/decoding/searcher.py:2: 'cat.rnnt.train'", "cat/decoding/searcher.py:2: 'ctc'",
        "cat/decoding/searcher.py:2: 'rnnt'"]
