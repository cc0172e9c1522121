"""Train a CTC model for one experiment (stage 3 of the recipes).

Reads `exp/<name>/hyper-p.json` (`train.option`, documented in
`cat/core/schemas/hyper-p.schema.json`) and `exp/<name>/config.json`; the training
loop, data loading and checkpoints are `cat.shared.manager`'s. Paths in the JSON files
are relative to the recipe directory, so run it from there.

Usage:
    python -m cat.ctc.train exp/ctc-v1 [--resume]
    torchrun --nproc-per-node 2 -m cat.ctc.train exp/ctc-v1
"""

from __future__ import annotations

from collections.abc import Sequence

from cat.training.cli import run_cli


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    run_cli("cat.ctc.train", None if argv is None else list(argv))


if __name__ == "__main__":
    main()
