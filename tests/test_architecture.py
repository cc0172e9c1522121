"""The package plan of docs/architecture.md holds: every module of `cat/` has a floor, and
a module imports only modules on floors below its own (or of its own package or module
floor), counting the imports inside functions and the modules the registry loads by name
(`cat.models.registry`: heads, streaming searches, exports and stage-2 hooks) as imports of the
registry, and the streaming strategies `cat.models.streaming` loads as its imports; and
the generic streaming code (online decoding, export, serving) names no strategy."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import cat
from cat.core.commands import verb_module

CAT = Path(cat.__file__).resolve().parent

#: The floor of the verbs: the top-level commands (`cat/train.py`, ...) and CAT's names of
#: them in a family's package (`cat.ctc.train`, ...; `registry.ALIASES`) that the registry
#: does not load, and what a module runs in its `if __name__ == "__main__":` block.
VERBS = "(verbs)"

# Bottom to top, as docs/architecture.md draws them. A key is a package, or a module that
# stands on a floor of its own above its package's; units on one floor do not import each
# other. The families (their heads, searches, streaming searches) stand below the registry
# that loads them, and the registry below training and decoding, which use it. `utils` holds
# only the former names of commands (re-exports), so it stands with the verbs.
FLOORS = {
    "core": 0,
    "text": 1, "scoring": 1,
    "significance": 2,
    "audio": 2, "lm": 2, "storage": 2,
    "data": 3, "graph": 3,
    "features": 4,
    "formats": 5,
    "loading": 6, "models": 6,
    "ctc": 7, "rnnt": 7,
    "crf": 8,
    "models.registry": 9,
    "training": 10, "migrate": 10,
    "decoding": 11,
    "shared": 12, "serving": 12,
    "stages": 13,
    "utils": 14, VERBS: 14,
    "testing": 15,
}

#: Upward imports that are known and still to be removed (none now). The test fails when
#: one of them goes, so that it is taken off.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def module_name(path: Path, root: Path) -> str:
    """`ctc/head.py` -> `ctc.head`, `ctc/__init__.py` -> `ctc`, `train.py` -> `train`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, root: Path) -> str:
    """The module (under `cat`) that dotted `name` (without `cat.`) is, or that holds it
    (`ctc.head.CTCHead` -> `ctc.head`)."""
    parts = name.split(".")
    while parts and not ((root / Path(*parts)).with_suffix(".py").is_file()
                         or (root / Path(*parts) / "__init__.py").is_file()):
        parts.pop()
    return ".".join(parts)


def _is_main_guard(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__"
                    for c in test.comparators))


def imports_of(path: Path, root: Path = CAT, by_name: bool = True
               ) -> list[tuple[int, str, bool]]:
    """(line, module under `cat`, in the `__main__` block) of every import of `cat` in the
    module at `path`, at any depth (functions, `TYPE_CHECKING` blocks): `from cat.x import y`
    is an import of `x.y` when that is a module, else of `x`; with `by_name`, a verb that
    `run_verb` loads is one too."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    main_block = {id(node) for statement in tree.body if _is_main_guard(statement)
                  for node in ast.walk(statement)}
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = ".".join(["cat", *package[:len(package) + 1 - node.level]])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names]
        verb = _verb_run_by_name(node) if by_name else None
        if verb:
            names = [verb]
        for name in names:
            parts = name.split(".")
            if parts[0] == "cat" and len(parts) > 1:
                target = _resolve(".".join(parts[1:]), root)
                if target:
                    found.append((node.lineno, target, id(node) in main_block))
    return found


def _verb_run_by_name(node: ast.AST) -> str | None:
    """The verb module a `run_verb("cat.<family>.<verb>")` call loads by name
    (`cat.core.commands`), else None."""
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_verb"):
        return None
    name = node.args[0] if node.args else None
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        raise AssertionError(f"line {node.lineno}: run_verb takes a literal command name")
    return verb_module(name.value)


def registry_loads() -> dict[str, list[str]]:
    """The modules `cat.models.registry` imports by name: each head's module
    (`HEADS`, `KIND_HEADS`, `SECTION_HEADS`), each family's parts (`FAMILIES` x
    `FAMILY_PARTS`) and the kinds' stage-2 hooks (`BEFORE_TRAINING`)."""
    from cat.models import registry

    loaded = {module for _, module in registry.HEADS.values()}
    loaded |= {module for table in (registry.KIND_HEADS, registry.SECTION_HEADS)
               for heads in table.values() for module in heads.values()}
    loaded |= {f"{registry.FAMILIES[registry.DECODES_AS.get(kind, kind)]}.{part}"
               for kind in registry.FAMILIES for part in registry.FAMILY_PARTS}
    loaded |= set(registry.BEFORE_TRAINING.values())
    from cat.models import streaming

    return {"models.registry": sorted(name.removeprefix("cat.") for name in loaded),
            "models.streaming": sorted(module.removeprefix("cat.")
                                       for module, _ in streaming.STRATEGIES.values())}


def alias_commands() -> set[str]:
    """CAT's names of the verbs in the families' packages (`cat.ctc.train`, ...) that are
    commands only: the registry loads the others (`stream`, `export`)."""
    from cat.models import registry

    return ({f"{package}.{verb}".removeprefix("cat.") for package in registry.ALIASES
             for verb in registry.VERBS}
            - set(registry_loads()["models.registry"]))


def floor_of(module: str, floors: Mapping[str, int], commands: Iterable[str] = ()
             ) -> tuple[str, int]:
    """(unit, floor) of `module`: its own key in `floors`, or its package's; a command's
    the verbs'. KeyError for a module of no floor."""
    if module in commands or ("." not in module and module not in floors):
        return VERBS, floors[VERBS]
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in floors:
            return key, floors[key]
    raise KeyError(f"cat.{module} has no floor")


def upward_imports(root: Path = CAT, floors: Mapping[str, int] = FLOORS,
                   loads: Mapping[str, Iterable[str]] | None = None,
                   commands: Iterable[str] | None = None) -> dict[tuple[str, str], str]:
    """(importing module, imported module) -> what is wrong, for every import (or a load by
    name, `loads`: module -> the modules it loads) of a module on a floor above the
    importer's, or of another unit on the importer's floor."""
    loads = registry_loads() if loads is None else loads
    commands = alias_commands() if commands is None else set(commands)
    edges = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        if not module:
            continue  # cat/__init__.py
        for line, target, in_main in imports_of(path, root):
            edges.append((module, f"cat/{path.relative_to(root)}:{line}", target,
                          VERBS if in_main else None))
        for target in loads.get(module, ()):
            edges.append((module, f"cat/{path.relative_to(root)}: loads by name", target,
                          None))
    problems = {}
    for module, where, target, as_unit in edges:
        unit, floor = ((as_unit, floors[as_unit]) if as_unit
                       else floor_of(module, floors, commands))
        target_unit, target_floor = floor_of(target, floors, commands)
        if target_floor > floor or (target_floor == floor and target_unit != unit):
            problems.setdefault((module, target), (
                f"{where}: cat.{module} ({unit}, floor {floor}) imports cat.{target} "
                f"({target_unit}, floor {target_floor})"))
    return problems


def test_every_package_has_a_floor():
    packages = {p.name for p in CAT.iterdir() if (p / "__init__.py").is_file()}
    assert packages - set(FLOORS) == set()


def test_modules_import_only_downward():
    problems = upward_imports()
    assert {edge: text for edge, text in problems.items() if edge not in KNOWN_UPWARD} == {}
    assert set(problems) == KNOWN_UPWARD, "a known upward import is gone: take it off"


def test_the_registry_loads_modules_that_exist():
    assert all(_resolve(module, CAT) == module for module in registry_loads()["models.registry"])


def test_the_families_stand_below_decoding_and_training():
    """A head, a search and a streaming search import nothing of decoding or training:
    the registry loads them, and decoding and training use the registry."""
    loaded = [floor_of(module, FLOORS)[1] for module in registry_loads()["models.registry"]]
    assert max(loaded) < FLOORS["models.registry"] < FLOORS["training"] < FLOORS["decoding"]


def family_imports_above(family: str, root: Path = CAT) -> list[str]:
    """The imports, anywhere in the package of `family` (its CAT command names and
    `__main__` blocks included, as a reader of the import lines sees them), of a module on
    its floor or above, other than its own package's."""
    found = []
    for path in sorted((root / family).rglob("*.py")):
        for line, target, _ in imports_of(path, root, by_name=False):
            unit, floor = floor_of(target, FLOORS)
            if unit != family and floor >= FLOORS[family]:
                found.append(f"cat/{path.relative_to(root)}:{line}: cat.{target}")
    return found


def test_no_file_of_a_family_imports_decoding_or_training():
    """Not even CAT's command names (`cat.ctc.decode`) or a `__main__` block: they run their
    verb by name (`cat.core.commands.run_verb`), so the package as a whole stands below
    decoding and training."""
    assert {family: family_imports_above(family) for family in ("ctc", "rnnt", "crf")} == {
        "ctc": [], "rnnt": [], "crf": []}


def test_verbs_are_run_by_name_only_from_commands_and_main_blocks(tmp_path):
    """`run_verb` loads a verb by name: anywhere else it would hide an upward import."""
    assert run_verb_outside_commands() == []
    root = _tree(tmp_path, {
        "ctc/decode.py": "from cat.core.commands import run_verb\nrun_verb('cat.ctc.decode')\n",
        "ctc/head.py": "def f():\n    run_verb('cat.ctc.decode')\n",
        "ctc/stream.py": "if __name__ == '__main__':\n    run_verb('cat.ctc.stream')\n",
    })
    assert run_verb_outside_commands(root, commands={"ctc.decode"}) == ["cat/ctc/head.py:2"]
    assert [target for _, target, _ in imports_of(root / "ctc/stream.py", root)] == []
    (root / "stream.py").write_text("")
    assert imports_of(root / "ctc/stream.py", root) == [(2, "stream", True)]


def run_verb_outside_commands(root: Path = CAT, commands: Iterable[str] | None = None
                              ) -> list[str]:
    """Where `run_verb` is called outside CAT's command modules and `__main__` blocks."""
    commands = alias_commands() if commands is None else set(commands)
    found = []
    for path in sorted(root.rglob("*.py")):
        if module_name(path, root) in commands:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        main_block = {id(node) for statement in tree.body if _is_main_guard(statement)
                      for node in ast.walk(statement)}
        found += [f"cat/{path.relative_to(root)}:{node.lineno}" for node in ast.walk(tree)
                  if _verb_run_by_name(node) and id(node) not in main_block]
    return found


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if parent != Path(".") and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("")
        path.write_text(text)
    return root


def test_an_upward_import_is_caught_at_any_depth(tmp_path):
    root = _tree(tmp_path, {
        "loading/batch.py": "def f():\n    from cat.training import manager\n",
        "training/manager.py": "import cat.loading.batch\n",
        "models/heads.py": "from cat.models.registry import build_model\n",
        "models/registry.py": "from cat.models import heads\n",
        "ctc/stream.py": ("from cat.models import heads\n"
                          "if __name__ == '__main__':\n    from cat.decoding import online\n"),
        "decoding/online.py": "from cat.ctc.stream import ChunkSearch\n",
        "train.py": "from cat.training import manager\n",
        "testing/run.py": "from cat import train\n",
    })
    assert sorted(upward_imports(root, loads={}, commands=()).values()) == [
        "cat/loading/batch.py:2: cat.loading.batch (loading, floor 6) imports "
        "cat.training.manager (training, floor 10)",
        "cat/models/heads.py:1: cat.models.heads (models, floor 6) imports "
        "cat.models.registry (models.registry, floor 9)"]


def test_a_loop_through_the_registry_is_caught(tmp_path):
    """decoding -> registry -> (by name) a head -> decoding: the head's import is upward;
    with the head above the registry, the registry's load is."""
    root = _tree(tmp_path, {
        "decoding/searcher.py": "from cat.models.registry import build_model\n",
        "models/registry.py": "import importlib\n",
        "ctc/head.py": "from cat.decoding.timestamps import Span\n",
        "decoding/timestamps.py": "Span = tuple\n",
    })
    loads = {"models.registry": ["ctc.head"]}
    assert list(upward_imports(root, loads=loads, commands=()).values()) == [
        "cat/ctc/head.py:1: cat.ctc.head (ctc, floor 7) imports cat.decoding.timestamps "
        "(decoding, floor 11)"]
    above = {**FLOORS, "ctc": 12}
    assert sorted(upward_imports(root, above, loads, ()).values()) == [
        "cat/models/registry.py: loads by name: cat.models.registry (models.registry, "
        "floor 9) imports cat.ctc.head (ctc, floor 12)"]


def test_the_commands_of_a_family_stand_with_the_verbs(tmp_path):
    root = _tree(tmp_path, {
        "ctc/train.py": "from cat.training.cli import run_cli\n",
        "training/cli.py": "from cat.testing import factory\n",
        "testing/factory.py": "",
    })
    assert list(upward_imports(root, loads={}, commands={"ctc.train"}).values()) == [
        "cat/training/cli.py:1: cat.training.cli (training, floor 10) imports "
        "cat.testing.factory (testing, floor 15)"]
    assert len(upward_imports(root, loads={}, commands=())) == 2


def test_every_family_declares_the_export_hooks():
    """`cat.decoding.export` reaches a family's export only through these hooks (no branch on
    the family): the loaded model to files, and its sherpa-onnx offline model type."""
    from cat.models.registry import FAMILIES, family

    for kind in FAMILIES:
        module = family(kind, "export")
        assert callable(module.export_model) and callable(module.sherpa_model_config), kind


def test_generic_code_names_no_model_family():
    """The model families are found by name (`cat.models.registry.FAMILIES`)."""
    from cat.models.registry import FAMILIES

    assert all(FLOORS[module.split(".")[1]] < FLOORS["models.registry"]
               for module in FAMILIES.values())


# Where a model kind or a family's module may be named in code: the one definition of the
# kinds (`model_kind`), the registry that maps them to families, and the translation of
# CAT's own experiment files, whose format names CAT's families.
NAMING_FAMILIES = {"core/config.py", "models/registry.py", "migrate/config.py",
                   "migrate/hyper.py"}


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


# The encoder owns its streaming: these modules stream or export any model, asking the
# model (`AsrModel.streaming`) or the export (`export.json`'s `streaming`) for its
# strategy; the families' export writers wrap the strategy's state layouts with their heads.
STREAMING_GENERIC = ("decoding/online.py", "decoding/export.py", "models/onnx_export.py",
                     "serving", "ctc/export.py", "rnnt/export.py")
#: The strategies' modules and names (`cat.models.streaming.STRATEGIES`), and what of a
#: model only one strategy or one encoder has: CUSIDE's `chunking`, U2's chunk settings,
#: the Conformer's blocks.
STRATEGY_MODULES = {"models.chunked", "models.cuside", "models.cuside_streaming"}
STRATEGY_NAMES = {"u2", "cuside"}
STRATEGY_ATTRIBUTES = {"chunking", "max_chunk_size", "left_chunks", "cells", "depthwise"}


def strategy_leaks(root: Path = CAT, generic: Iterable[str] = STREAMING_GENERIC) -> list[str]:
    """Where a generic streaming module imports a strategy's module, reads what only a
    strategy or an encoder has (`STRATEGY_ATTRIBUTES`: e.g. `model.chunking is not None`),
    or names a strategy in a string (`meta["streaming"] == "cuside"`; docstrings aside)."""
    paths = sorted(path for name in generic
                   for path in ([root / name] if name.endswith(".py")
                                else (root / name).rglob("*.py")))
    found = []
    for path in paths:
        where = f"cat/{path.relative_to(root).as_posix()}"
        if not path.is_file():  # moved: the check must follow it
            found.append(f"{where}: missing")
            continue
        found += list(dict.fromkeys(f"{where}:{line}: imports cat.{target}"
                                    for line, target, _ in imports_of(path, root)
                                    if target in STRATEGY_MODULES))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        documentation = {id(node.value) for node in ast.walk(tree)
                         if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in STRATEGY_ATTRIBUTES:
                found.append(f"{where}:{node.lineno}: reads .{node.attr}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in documentation and node.value.lower() in STRATEGY_NAMES):
                found.append(f"{where}:{node.lineno}: names {node.value!r}")
    return found


def test_the_strategies_are_those_the_check_knows():
    from cat.models.streaming import STRATEGIES

    assert set(STRATEGIES) == STRATEGY_NAMES
    assert {module.removeprefix("cat.") for module, _ in STRATEGIES.values()} | {
        "models.cuside"} == STRATEGY_MODULES


def test_generic_streaming_code_names_no_strategy():
    assert strategy_leaks() == []


def test_a_strategy_named_in_generic_streaming_code_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "models/cuside.py": "", "models/chunked.py": "",
        "decoding/online.py": (
            '"""A CUSIDE model ("cuside") streams in windows: fine in a docstring."""\n'
            "from cat.models.cuside import CusideStep\n"
            "def encoder(model):\n"
            "    if model.chunking is not None:\n"
            "        return CusideStep(model.encoder)\n"
            "    from cat.models import chunked\n"
            "    return chunked.StreamingEncoder(model.encoder)\n"),
        "serving/engine.py": 'def kind(meta):\n    return meta.get("streaming") == "cuside"\n',
        "decoding/export.py": "def layers(model):\n    return len(model.encoder.cells)\n",
    })
    generic = ("decoding/online.py", "decoding/export.py", "models/onnx_export.py", "serving")
    assert strategy_leaks(root, generic) == [
        "cat/decoding/export.py:2: reads .cells",
        "cat/decoding/online.py:2: imports cat.models.cuside",
        "cat/decoding/online.py:6: imports cat.models.chunked",
        "cat/decoding/online.py:4: reads .chunking",
        "cat/models/onnx_export.py: missing",
        "cat/serving/engine.py:2: names 'cuside'"]
# The generic decoding modules that must name no decoding method or option of a head: the
# heads declare them (`DECODE_METHODS`), the registry collects them and the searcher merges
# them without naming one.
METHOD_FREE = ("decoding/searcher.py", "decoding/inference.py")
#: How the heads' modules spell their methods, options and search internals, checked
#: besides what they declare now (`registry.decode_methods`), so that the check cannot pass
#: by a declaration going.
HEAD_DECODING_WORDS = ("blank_penalty", "attention_rescoring", "joint_rescoring",
                       "ctc_weight", "decoder_weight", "reverse_weight", "prefix_beam",
                       "prefix beam", "token_topk", "max_symbols_per_frame")
#: The methods every decoding head has (`cat.models.heads.SearchHead`), which generic
#: decoding may name.
EVERY_HEAD_METHODS = ("greedy", "beam")


def declared_decoding_words() -> set[str]:
    """The methods (all but `EVERY_HEAD_METHODS`) and options the heads declare."""
    from cat.models.registry import decode_methods

    words = set()
    for _, method, declaration in decode_methods():
        words |= {method, *declaration.options} - set(EVERY_HEAD_METHODS)
    return words


def method_names(root: Path = CAT, files: Iterable[str] = METHOD_FREE,
                 words: Iterable[str] = HEAD_DECODING_WORDS) -> list[str]:
    """`<file>:<line>: <word>` for every one of `words` in the text of `files` (code,
    strings, docstrings and comments alike), as a whole word."""
    import re

    pattern = re.compile(r"(?<![\w])(" + "|".join(sorted(map(re.escape, words), key=len,
                                                               reverse=True)) + r")(?![\w])")
    found = []
    for name in files:
        for number, line in enumerate((root / name).read_text(encoding="utf-8").splitlines(),
                                      1):
            found += [f"cat/{name}:{number}: {match}" for match in pattern.findall(line)]
    return found


def test_generic_decoding_names_no_method_or_option_of_a_head():
    """`cat.decoding.searcher` and `cat.decoding.inference` reach the heads' methods and
    options only through the registry: no method or option of a head is spelt there."""
    assert method_names() == []
    assert method_names(words=declared_decoding_words()) == []


def test_the_heads_declare_the_methods_and_options_they_take():
    """What a head's search and rescoring take is what its module declares; the names the
    check above looks for include every declared one."""
    from cat.models.heads import Rescorer, SearchHead
    from cat.models.registry import build_model, decode_methods
    from tests.models.test_attention import u2_config
    from tests.models.test_registry import rnnt_config

    declared = {(head, method): set(declaration.options)
                for head, method, declaration in decode_methods()}
    assert declared_decoding_words() - set(HEAD_DECODING_WORDS) == set()
    rnnt_ctc = {**rnnt_config(), "ctc": {"weight": 0.3}}
    for config in (u2_config(), rnnt_ctc):
        model = build_model(config, num_classes=6)
        for name, head in model.heads.items():
            if isinstance(head, SearchHead):
                for method in head.search_methods:
                    assert declared[name, method] == set(head.search_settings), (name, method)
            if isinstance(head, Rescorer):
                assert declared[name, head.rescoring_method] == set(head.rescoring_weights)


def test_a_method_named_in_generic_decoding_is_caught(tmp_path):
    (tmp_path / "decoding").mkdir()
    (tmp_path / "decoding" / "searcher.py").write_text(
        '"""Greedy or beam search."""\n'
        'if options.method == "attention_rescoring":  # weights: ctc_weight\n'
        '    penalty = options.blank_penalty_scale\n')
    (tmp_path / "decoding" / "inference.py").write_text("# a prefix beam search\n")
    assert method_names(tmp_path) == [
        "cat/decoding/searcher.py:2: attention_rescoring",
        "cat/decoding/searcher.py:2: ctc_weight",
        "cat/decoding/inference.py:1: prefix beam"]
