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
    experiment_kind,
    load_hyper,
    resolve_train_options,
)
from cat.core.io import PathLike

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

    @property
    def kind(self) -> str:
        """The model kind (`config.json`'s, `cat.core.config.model_kind`)."""
        return experiment_kind(self.exp_dir)

    def section(self, name: str) -> list[str]:
        value = as_list(self.data.get(name))
        if not value:
            raise ValueError(f"{self.exp_dir / HYPER_NAME}: data.{name} is not set")
        return value


# ----------------------------------------------------------------------------- stage 4


def select_checkpoint(plan: Plan) -> Path:
    """The model to decode: an average per `inference.avgmodel`, else the best checkpoint
    (`cat.decoding.checkpoint.select_checkpoint`)."""
    from cat.decoding.checkpoint import select_checkpoint as select

    return select(plan.exp_dir, plan.hyper)


def phone_references(plan: Plan, refs: dict[str, str]) -> dict[str, str] | None:
    """With a lexicon (phone) tokenizer, the references as space-separated phones (its
    hypotheses before WFST decoding are phones: scored as the phone error rate); else
    None."""
    from cat.text.lexicon import LexiconTokenizer
    from cat.text.tokenizer import load as load_tokenizer

    tokenizer = load_tokenizer(plan.options.tokenizer)
    if not isinstance(tokenizer, LexiconTokenizer):
        return None
    return {key: tokenizer.decode(tokenizer.encode(text)) for key, text in refs.items()}
