"""What a package imports, read from its source (nothing is imported), for layering tests."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path


def imported_modules(package: str) -> dict[str, set[str]]:
    """Absolute names of the modules each file of `package` imports, by file name.

    Relative imports are resolved against the file's package; imports inside functions
    count too.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{package!r} is not a package")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        relative = path.relative_to(folder).with_suffix("").parts
        module = ".".join((package, *relative))
        if relative[-1] == "__init__":
            module = module[: -len(".__init__")]
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.rsplit(".", node.level - (relative[-1] == "__init__"))[0]
                    names.add(f"{base}.{node.module}" if node.module else base)
                else:
                    names.add(node.module or "")
        found[str(path.relative_to(folder))] = names
    return found


def disallowed_imports(package: str, allowed: set[str]) -> dict[str, set[str]]:
    """Imports of `package` that are neither the standard library, nor `package` itself,
    nor in `allowed` (a name allows its submodules), by file name."""
    def ok(name: str) -> bool:
        top = name.split(".")[0]
        return (top in sys.stdlib_module_names or top == "__future__"
                or any(name == a or name.startswith(a + ".") for a in {*allowed, package}))

    return {file: bad for file, names in imported_modules(package).items()
            if (bad := {name for name in names if not ok(name)})}
