"""What stages 2-5 read from an experiment: its `hyper-p.json`, its data, its model to decode.

Usage:
    plan = Plan.load("exp/synth-ctc")
    train_dirs = plan.section("train")
    checkpoint = select_checkpoint(plan)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cat.core.config import (
    HYPER_NAME,
    TrainOptions,
    as_list,
    load_hyper,
    resolve_train_options,
)
from cat.core.io import PathLike, atomic_write
from cat.core.stages import is_done, mark_done, signature

logger = logging.getLogger(__name__)



# ---------------------------------------------------------------------------- helpers


def set_name(feature_dir: str) -> str:
    """`data/fbank/test` -> `test`."""
    return Path(feature_dir).name


def feature_files(feature_dirs: Sequence[str], names: Sequence[str]) -> list[Path]:
    files = []
    for directory in feature_dirs:
        for name in names:
            path = Path(directory) / name
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist (run stage 1 first)")
            files.append(path)
    return files


@dataclasses.dataclass
class Plan:
    """What stages 2-4 read from an experiment's `hyper-p.json`."""

    exp_dir: Path
    hyper: dict[str, Any]
    options: TrainOptions

    @classmethod
    def load(cls, exp_dir: PathLike) -> Plan:
        exp_dir = Path(exp_dir)
        hyper = load_hyper(exp_dir / HYPER_NAME)
        if "train" not in hyper:
            raise ValueError(f"{exp_dir / HYPER_NAME}: train: missing")
        options = resolve_train_options(hyper, exp_dir, str(exp_dir / HYPER_NAME))
        return cls(exp_dir, hyper, options)

    @property
    def data(self) -> dict[str, Any]:
        return self.hyper.get("data", {})

    def section(self, name: str) -> list[str]:
        value = as_list(self.data.get(name))
        if not value:
            raise ValueError(f"{self.exp_dir / HYPER_NAME}: data.{name} is not set")
        return value


# ----------------------------------------------------------------------------- stage 4


def select_checkpoint(plan: Plan) -> Path:
    """The model to decode: an average per `inference.avgmodel`, else the best checkpoint."""
    import torch

    from cat.training.checkpoint import CheckpointManager
    from cat.utils.avgmodel import average_checkpoints

    manager = CheckpointManager(plan.exp_dir / "check")
    average = plan.hyper.get("inference", {}).get("avgmodel")
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
