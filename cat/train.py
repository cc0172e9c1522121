"""Train any model (stage 3): the kind comes from `exp/<name>/config.json` (CTC, CTC with an
attention decoder, CTC-CRF, RNN-T).

Reads `exp/<name>/hyper-p.json` (`train.option`, documented in
`cat/core/schemas/hyper-p.schema.json`) and `config.json`; paths in them are relative to
the recipe directory, so run it from there. CAT's `python -m cat.ctc.train` and
`cat.rnnt.train` are aliases for their kinds (`cat.training.cli`).

Usage:
    python -m cat.train exp/synth-u2 [--resume]
    torchrun --nproc-per-node 2 -m cat.train exp/synth-u2
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from cat.training.cli import run_cli


def main(argv: Sequence[str] | None = None, command: str = "cat.train") -> int:
    """Command-line entry point (see the module docstring), run as `command` (CAT's
    `cat.ctc.train` and `cat.rnnt.train` run it under their names: `cat.core.commands`)."""
    run_cli(command, None if argv is None else list(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
