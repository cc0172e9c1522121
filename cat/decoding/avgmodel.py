"""Average the model weights of several checkpoints.

Usage: python -m cat.decoding.avgmodel --out check/avg-3.pt check/ep1.pt check/ep2.pt check/ep3.pt

Each checkpoint is a dict saved with `torch.save` holding at least
`{"model": state_dict}`; it is loaded with `torch.load(..., weights_only=True)`
(no arbitrary code runs). Floating-point tensors are averaged (accumulated in
float64, stored in their own dtype); integer and boolean tensors, such as
BatchNorm's `num_batches_tracked`, are taken from the last checkpoint given.
All checkpoints must hold the same keys with the same shapes and dtypes.
The output `{"model": averaged, "averaged_from": [paths], "meta": ...}` is written to a
temporary file and renamed, so a failed run leaves no partial file; `meta` is the last
checkpoint's, with the `config.json` it was trained with, which decoding compares with
the experiment's (`cat.decoding.checkpoint.check_model_config`). The averaging is
`cat.decoding.checkpoint.averaged_checkpoint`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

from cat.core.io import atomic_write, setup_logging
from cat.decoding.checkpoint import average_checkpoints, averaged_checkpoint

__all__ = ["average_checkpoints", "averaged_checkpoint", "build_parser", "main"]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cat.decoding.avgmodel",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output checkpoint file")
    parser.add_argument("checkpoints", nargs="+", help="checkpoint files to average")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Average the checkpoints and write the result; returns the exit status."""
    args = build_parser().parse_args(argv)
    setup_logging()
    averaged = averaged_checkpoint(args.checkpoints)
    with atomic_write(args.out, "wb") as f:
        torch.save(averaged, f)
    logger.info("averaged %d checkpoints (%d tensors) into %s", len(args.checkpoints),
                len(averaged["model"]), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
