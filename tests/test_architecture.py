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
    "shared": 10, "crf": 10,
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
