"""Average the model weights of several checkpoints.

Usage: python -m cat.utils.avgmodel --out check/avg-3.pt check/ep1.pt check/ep2.pt check/ep3.pt

Each checkpoint is a dict saved with `torch.save` holding at least
`{"model": state_dict}`; it is loaded with `torch.load(..., weights_only=True)`
(no arbitrary code runs). Floating-point tensors are averaged (accumulated in
float64, stored in their own dtype); integer and boolean tensors, such as
BatchNorm's `num_batches_tracked`, are taken from the last checkpoint given.
All checkpoints must hold the same keys with the same shapes and dtypes.
The output `{"model": averaged, "averaged_from": [paths]}` is written to a
temporary file and renamed, so a failed run leaves no partial file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import torch

from cat.core.io import PathLike, atomic_write, setup_logging
from cat.training.checkpoint import read_model_state

logger = logging.getLogger(__name__)


def _check_compatible(reference: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                      reference_name: str, name: str) -> None:
    if state.keys() != reference.keys():
        only_here = sorted(state.keys() - reference.keys())[:5]
        only_there = sorted(reference.keys() - state.keys())[:5]
        raise ValueError(f"{name}: model keys differ from {reference_name}: only in {name}: "
                         f"{only_here}; only in {reference_name}: {only_there}")
    for key, value in state.items():
        expected = reference[key]
        if value.shape != expected.shape or value.dtype != expected.dtype:
            raise ValueError(f"{name}: {key!r} is {value.dtype} {tuple(value.shape)} but "
                             f"{expected.dtype} {tuple(expected.shape)} in {reference_name}")


def average_checkpoints(paths: Sequence[PathLike]) -> dict[str, torch.Tensor]:
    """Average the `model` state dicts of `paths` (see the module docstring)."""
    if not paths:
        raise ValueError("no checkpoints to average")
    first = read_model_state(paths[0])
    sums = {key: value.to(torch.float64) for key, value in first.items()
            if value.is_floating_point()}
    last = first
    for path in paths[1:]:
        state = read_model_state(path)
        _check_compatible(first, state, str(paths[0]), str(path))
        for key in sums:
            sums[key] += state[key].to(torch.float64)
        last = state
    return {key: ((sums[key] / len(paths)).to(value.dtype) if key in sums else value.clone())
            for key, value in last.items()}


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cat.utils.avgmodel",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output checkpoint file")
    parser.add_argument("checkpoints", nargs="+", help="checkpoint files to average")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Average the checkpoints and write the result; returns the exit status."""
    args = build_parser().parse_args(argv)
    setup_logging()
    averaged = average_checkpoints(args.checkpoints)
    with atomic_write(args.out, "wb") as f:
        torch.save({"model": averaged,
                    "averaged_from": [os.fspath(p) for p in args.checkpoints]}, f)
    logger.info("averaged %d checkpoints (%d tensors) into %s", len(args.checkpoints),
                len(averaged), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
