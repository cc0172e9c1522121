"""The model an experiment decodes with: checkpoint averaging and stage 4's choice.

`select_checkpoint(exp_dir, hyper)` is what stage 4 (`cat.stages.driver decode`) and
`python -m cat.<family>.decode` without `--checkpoint` decode with: with
`inference.avgmodel` (`{"mode": "best" | "last", "num": N}`) the average of the N best
(by dev loss) or last checkpoints of `exp/<name>/check/`, written once to
`check/avg-<mode>-<N>.pt` (with a `.done` signature of its inputs, so it is redone when
they change); without it, the best checkpoint (else the latest).

`average_checkpoints` averages the `model` state dicts of checkpoint files: floating-point
tensors are averaged (accumulated in float64, stored in their own dtype); integer and
boolean tensors, such as BatchNorm's `num_batches_tracked`, are taken from the last file.
All must hold the same keys with the same shapes and dtypes. `averaged_checkpoint` is the
file an average is written as (here and by `cat.decoding.avgmodel`, its command line): the
weights, `averaged_from`, and the `meta` of the last file, so the average records the
`config.json` it was trained with as its checkpoints do (a warning names the keys when
the checkpoints averaged record different ones).

`check_model_config` compares the experiment's `config.json` with the one a checkpoint
records, every section but `scheduler`: decoding, transcribing, streaming and exporting
(`cat.decoding.searcher.load_model`) build the model from the experiment's file, and a
key changed since training (`causal_conv`, a time reduction without parameters, ...)
builds another model from the same weights. It compares as well what else defines the
model's input and output with what the checkpoint records (the front end of
`hyper-p.json: data.front_end`, with its fbank options, and the tokenizer's digest:
`cat.training.checkpoint.INTERFACE`), and `check_feature_dir` the front end of a feature
dir to decode (its `fbank.json`) with the model's. A difference is `ModelConfigChangedError`
naming each key (old -> new), unless the change is accepted explicitly
(`allow_config_change`), then it is logged as a warning. A checkpoint written before
checkpoints recorded their config (or an average of such) is decoded with a warning
that only its parameter shapes could be checked.

Usage:
    checkpoint = select_checkpoint("exp/synth-ctc", load_hyper("exp/synth-ctc/hyper-p.json"))
    averaged = average_checkpoints(["check/ckpt-e002.pt", "check/ckpt-e003.pt"])
    check_model_config(meta, config, "check/avg-best-5.pt", "exp/synth-ctc/config.json")
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cat.core.io import PathLike, atomic_write
from cat.core.stages import is_done, mark_done, signature
from cat.features.fbank import FRONT_END_FILE, FbankOptions, front_end_name, read_front_end
from cat.training.checkpoint import (
    CheckpointManager,
    config_changes,
    interface_changes,
    model_config,
    read_model_checkpoint,
    recorded_config,
    recorded_front_end,
)

logger = logging.getLogger(__name__)

#: Part of the signature of an average: averages of an earlier format are made again.
AVERAGE_FORMAT = 2


class ModelConfigChangedError(ValueError):
    """The experiment's config.json differs from the one the checkpoint was trained with."""


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


def _average(paths: Sequence[PathLike]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The averaged weights of `paths` and the `meta` of the last."""
    if not paths:
        raise ValueError("no checkpoints to average")
    first, meta = read_model_checkpoint(paths[0])
    sums = {key: value.to(torch.float64) for key, value in first.items()
            if value.is_floating_point()}
    last = first
    for path in paths[1:]:
        state, next_meta = read_model_checkpoint(path)
        _check_compatible(first, state, str(paths[0]), str(path))
        _warn_config_differs(meta, next_meta, paths[0], path)
        for key in sums:
            sums[key] += state[key].to(torch.float64)
        last, meta = state, next_meta
    averaged = {key: ((sums[key] / len(paths)).to(value.dtype) if key in sums
                      else value.clone()) for key, value in last.items()}
    return averaged, meta


def _warn_config_differs(meta: dict[str, Any], other: dict[str, Any], name: PathLike,
                         other_name: PathLike) -> None:
    configs = [recorded_config(meta), recorded_config(other)]
    if None in configs:
        return
    changes = config_changes(model_config(configs[0]), model_config(configs[1]))
    if changes:
        logger.warning("averaging checkpoints trained with different model configs: %s -> "
                       "%s: %s; the average records the last one's", name, other_name,
                       "; ".join(changes))


def average_checkpoints(paths: Sequence[PathLike]) -> dict[str, torch.Tensor]:
    """Average the `model` state dicts of `paths` (see the module docstring)."""
    return _average(paths)[0]


def averaged_checkpoint(paths: Sequence[PathLike]) -> dict[str, Any]:
    """The file an average of `paths` is written as: `model`, `averaged_from` (the paths
    as given) and the `meta` of the last (see the module docstring)."""
    averaged, meta = _average(paths)
    checkpoint: dict[str, Any] = {"model": averaged,
                                  "averaged_from": [os.fspath(p) for p in paths]}
    if meta:
        checkpoint["meta"] = meta
    return checkpoint


#: How a change since training is accepted, for the messages.
ACCEPT = ("accept the change explicitly: --allow-config-change (the decode, stream and "
          "export commands), or inference.infer.option.allow_config_change: true in "
          "hyper-p.json (stage 4 and the decode command)")


def check_model_config(meta: dict[str, Any], config: dict[str, Any], checkpoint: PathLike,
                       config_path: PathLike, allow_config_change: bool = False,
                       interface: dict[str, Any] | None = None) -> None:
    """Compare `config` (read from `config_path`), and `interface` (the front end and the
    tokenizer decoding would use, `cat.training.checkpoint.model_interface`), with what the
    checkpoint's `meta` records; raise ModelConfigChangedError naming each changed key, or
    with `allow_config_change` log them (see the module docstring)."""
    recorded = recorded_config(meta)
    if recorded is None:
        logger.warning("%s records no config.json (written before checkpoints recorded "
                       "theirs): %s cannot be compared with the config it was trained with, "
                       "only the parameter shapes are", checkpoint, config_path)
        changes = []
    else:
        changes = config_changes(model_config(recorded), model_config(config))
    settings = meta.get("settings")
    interface_changed = (interface_changes(settings, interface)
                         if interface is not None and isinstance(settings, dict) else [])
    if not changes and not interface_changed:
        return
    problems = []
    if changes:
        problems.append(f"{config_path} changed since this model was trained: "
                        f"{'; '.join(changes)}. The model built from it would compute "
                        "something else with the same weights.")
    if interface_changed:
        problems.append(f"what defines the model's input and output changed since it was "
                        f"trained: {'; '.join(interface_changed)}. Features of another front "
                        "end, or ids of another tokenizer, give wrong text without an error.")
    if not allow_config_change:
        raise ModelConfigChangedError(f"{checkpoint}: {' '.join(problems)} Restore it, or "
                                      f"{ACCEPT}")
    if changes:
        logger.warning("%s: %s changed since this model was trained (accepted by "
                       "allow_config_change): %s", checkpoint, config_path, "; ".join(changes))
    if interface_changed:
        logger.warning("%s: what defines the model's input and output changed since it was "
                       "trained (accepted by allow_config_change): %s", checkpoint,
                       "; ".join(interface_changed))


def check_feature_dir(data_dir: PathLike, meta: dict[str, Any], front_end: FbankOptions,
                      checkpoint: PathLike, allow_config_change: bool = False) -> None:
    """ModelConfigChangedError when the features of `data_dir` (its `fbank.json`) are not of
    the front end the checkpoint's model was trained on (as its `meta` records it; else
    `front_end`, the experiment's), unless `allow_config_change` (then a warning)."""
    model_front_end = recorded_front_end(meta) or front_end
    found = read_front_end(data_dir)
    if found == model_front_end:
        return
    differences = config_changes(dataclasses.asdict(model_front_end),
                                 dataclasses.asdict(found))
    have = front_end_name(found) or "options of its own"
    want = front_end_name(model_front_end) or "options of its own"
    problem = (f"{data_dir}: its features were computed with the {have} front end "
               f"({FRONT_END_FILE}), but {checkpoint} was trained on the {want} front end "
               f"({'; '.join(differences)})")
    if not allow_config_change:
        raise ModelConfigChangedError(f"{problem}: it would decode them into wrong text "
                                      f"without an error. Extract them with that front end "
                                      f"(run.sh --front_end {want}), or {ACCEPT}")
    logger.warning("%s (accepted by allow_config_change)", problem)


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
    sig = signature("avgmodel", [p.name for p in paths], AVERAGE_FORMAT, files=paths)
    if not is_done(out, sig):
        checkpoint = averaged_checkpoint(paths)
        checkpoint["averaged_from"] = [p.name for p in paths]
        with atomic_write(out, "wb") as f:
            torch.save(checkpoint, f)
        mark_done(out, sig)
        logger.info("averaged %d %s checkpoints into %s", len(paths), mode, out)
    return out
