"""Run a verb by its name: what CAT's command names in the families' packages do.

`python -m cat.ctc.train`, `cat.ctc.decode`, `cat.rnnt.stream`, ... are CAT's names of the
verbs (`cat/train.py`, `decode.py`, `stream.py`, `export.py`) for a family's kinds. They
live in the family's package because that is where CAT's users type them, but a family
stands below decoding and training, so its package does not import them: its command runs
the verb by name, as a console script entry point does (`run_verb("cat.ctc.decode")` ->
`cat.decode.main("cat.ctc.decode")`), and the verb checks the name against the
experiment's model kind (`cat.models.registry.check_command`). `tests/test_architecture.py`
holds `run_verb` to the `__main__` blocks and CAT's command modules, and counts its load as
their import, on the verbs' floor.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence


def verb_module(command: str) -> str:
    """The verb module that runs `command` (`cat.ctc.decode` -> `cat.decode`)."""
    package, _, verb = command.rpartition(".")
    if not (package == "cat" or package.startswith("cat.")) or not verb:
        raise ValueError(f"{command!r} is not a command name (cat.<verb> or "
                         "cat.<family>.<verb>)")
    return f"cat.{verb}"


def run_verb(command: str, argv: Sequence[str] | None = None) -> int:
    """Run `command`'s verb under that name (see the module docstring); its exit status."""
    main = importlib.import_module(verb_module(command)).main
    return main(command=command, argv=None if argv is None else list(argv)) or 0
