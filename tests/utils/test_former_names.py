"""`cat.utils` keeps the former names of commands (`python -m cat.utils.stage_driver`, CAT's
`cat.utils.wer` and `cat.utils.avgmodel`, ...): each is a re-export of the module that now
holds the command, and runs it."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cat.utils

UTILS = Path(cat.utils.__file__).resolve().parent
#: former name -> the module that holds the command now.
FORMER_NAMES = {
    "cat.utils.stage_driver": "cat.stages.driver",
    "cat.utils.migrate": "cat.migrate.experiment",
    "cat.utils.wer": "cat.scoring",
    "cat.utils.avgmodel": "cat.decoding.avgmodel",
}


def test_every_module_of_utils_is_a_former_name():
    modules = {f"cat.utils.{path.stem}" for path in UTILS.glob("*.py")} - {"cat.utils.__init__"}
    assert modules == set(FORMER_NAMES)


@pytest.mark.parametrize("former", sorted(FORMER_NAMES))
def test_a_former_name_only_re_exports(former):
    """Its code is imports of the new module and the `__main__` block that runs it: no
    logic of its own to drift from the command's."""
    new = FORMER_NAMES[former]
    tree = ast.parse((UTILS / f"{former.rsplit('.', 1)[1]}.py").read_text(encoding="utf-8"))
    docstring, *imports, guard = tree.body
    assert isinstance(docstring, ast.Expr) and new.removesuffix(".experiment") in \
        docstring.value.value
    assert all(isinstance(node, ast.ImportFrom) and node.module == new for node in imports)
    assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'"
    assert len(guard.body) == 1


@pytest.mark.parametrize("former", sorted(FORMER_NAMES))
def test_a_former_name_holds_the_same_objects(former):
    old, new = importlib.import_module(former), importlib.import_module(FORMER_NAMES[former])
    public = [name for name, value in vars(new).items()
              if not name.startswith("_") and getattr(value, "__module__", None) == new.__name__]
    assert public and all(getattr(old, name) is getattr(new, name) for name in public)


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(UTILS.parents[1])}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_a_former_name_runs_the_command(tmp_path):
    (tmp_path / "ref").write_text("u1 今天 天气\nu2 好\n", encoding="utf-8")
    (tmp_path / "hyp").write_text("u1 今天 天汽\nu2 好\n", encoding="utf-8")
    scored = [_run(module, "--cer", "ref", "hyp", cwd=tmp_path)
              for module in ("cat.scoring", "cat.utils.wer")]
    assert [proc.returncode for proc in scored] == [0, 0]
    assert scored[0].stdout == scored[1].stdout
    assert scored[0].stdout.startswith("%CER 20.00 [ 1 / 5, 0 ins, 0 del, 1 sub ]")
    # A migration that cannot be done: the same one-line error and status 1.
    refused = [_run(*module, "old", "new", cwd=tmp_path)
               for module in (("cat.migrate",), ("cat.utils.migrate",))]
    assert [proc.returncode for proc in refused] == [1, 1]
    assert refused[0].stderr == refused[1].stderr and refused[0].stderr.startswith("error: ")
