"""`cat.lm` sits below the model families and the loaders: it imports only the standard
library, numpy, kenlm, jieba and the floors beneath it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import cat.lm

ALLOWED_THIRD_PARTY = {"numpy", "kenlm", "jieba"}
ALLOWED_CAT = {"cat.lm", "cat.core.io", "cat.text.tokenizer", "cat.core.config",
               "cat.core.process"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_cat_lm_imports_only_downward():
    package = Path(cat.lm.__file__).parent
    files = sorted(package.rglob("*.py"))
    assert {f.name for f in files} >= {"ngram.py", "scorer.py", "rescore.py", "train.py"}
    for path in files:
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top == "cat":
                assert any(name == a or name.startswith(a + ".") for a in ALLOWED_CAT), \
                    f"{path.name} imports {name}"
            else:
                assert top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY or \
                    top == "__future__", f"{path.name} imports {name}"
