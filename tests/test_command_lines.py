"""Every option of every command line of the package says what it is for (`--help`)."""

import ast
from pathlib import Path

import cat

PACKAGE = Path(cat.__file__).resolve().parent


def _options_without_help() -> list[str]:
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"
                    and "help" not in {keyword.arg for keyword in node.keywords}):
                names = [a.value for a in node.args if isinstance(a, ast.Constant)]
                missing.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {names}")
    return missing


def test_every_command_line_option_has_help_text():
    assert _options_without_help() == []


def test_decode_options_take_their_help_from_the_option_schema(capsys):
    import pytest

    from cat.decoding.inference import build_parser
    from cat.decoding.searcher import options_schema

    with pytest.raises(SystemExit):
        build_parser("cat.decode").parse_args(["--help"])
    # argparse may wrap a line after a word's hyphen ("log-likelihood").
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    for name, spec in options_schema()["properties"].items():
        assert f"--{name.replace('_', '-')}" in text
        assert " ".join(spec["description"].split()).replace("- ", "-") in text
