"""The model an experiment decodes with: checkpoint averaging and stage 4's choice.

`select_checkpoint(exp_dir, hyper)` is what stage 4 (`cat.utils.pipeline decode`) and
`python -m cat.<family>.decode` without `--checkpoint` decode with: with
`inference.avgmodel` (`{"mode": "best" | "last", "num": N}`) the average of the N best
(by dev loss) or last checkpoints of `exp/<name>/check/`, written once to
`check/avg-<mode>-<N>.pt` (with a `.done` signature of its inputs, so it is redone when
they change); without it, the best checkpoint (else the latest).

`average_checkpoints` averages the `model` state dicts of checkpoint files: floating-point
tensors are averaged (accumulated in float64, stored in their own dtype); integer and
boolean tensors, such as BatchNorm's `num_batches_tracked`, are taken from the last file.
All must hold the same keys with the same shapes and dtypes (`cat.utils.avgmodel` is its
command line).

Usage:
    checkpoint = select_checkpoint("exp/synth-ctc", load_hyper("exp/synth-ctc/hyper-p.json"))
    averaged = average_checkpoints(["check/ckpt-e002.pt", "check/ckpt-e003.pt"])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cat.core.io import PathLike, atomic_write
from cat.core.stages import is_done, mark_done, signature
from cat.training.checkpoint import CheckpointManager, read_model_state

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


def select_checkpoint(exp_dir: PathLike, hyper: dict[str, Any]) -> Path:
    """The model to decode: an average per `inference.avgmodel`, else the best checkpoint."""
    manager = CheckpointManager(Path(exp_dir) / "check")
    average = hyper.get("inference", {}).get("avgmodel")
    if not average:
        best = manager.best() or manager.latest()
        if best is None:
            raise FileNotFoundError(f"{manager.directory}: no checkpoint (run stage 3 first)")
        return best
    mode, num = average.get("mode", "best"), average.get("num", 5)
    paths = manager.select(mode, num)
    if not paths:
        raise FileNotFoundError(f"{manager.directory}: no checkpoint (run stage 3 first)")
    out = manager.directory / f"avg-{mode}-{num}.pt"
    sig = signature("avgmodel", [p.name for p in paths], files=paths)
    if not is_done(out, sig):
        averaged = average_checkpoints(paths)
        with atomic_write(out, "wb") as f:
            torch.save({"model": averaged, "averaged_from": [p.name for p in paths]}, f)
        mark_done(out, sig)
        logger.info("averaged %d %s checkpoints into %s", len(paths), mode, out)
    return out
