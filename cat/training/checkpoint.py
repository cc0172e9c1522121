"""Training checkpoints: atomic files, a list with dev losses, pruning, resume state.

Files in `exp/<name>/check/`:

    ckpt-e<EEE>-s<SSSSSSSS>.pt   one checkpoint (epoch to run next, optimizer updates done)
    checkpoints.json             {"format": "cat-checkpoint-list", "version": 1,
                                  "checkpoints": [{"file", "epoch", "step", "dev_loss"}, ...]}
                                 ordered by step; the decoding stage picks files from it
                                 (`select("best" | "last", num)`)

A checkpoint is a dict saved with `torch.save` that `torch.load(weights_only=True)` reads
(tensors, numbers, strings, lists and dicts only), so `cat.decoding.avgmodel` can average it:

    format, version     "cat-checkpoint", 1
    model               state dict of the bare model (no DDP "module." prefix)
    scheduler           cat.training.scheduler state (update count + optimizer state)
    scaler              torch.amp.GradScaler state (empty when AMP is off)
    epoch, step         the epoch to continue (1-based) and optimizer updates done
    dev_loss            mean dev loss at this point (float)
    data                {"kind": "map" | "stream", "seed", "epoch", "epoch_seed": [seed, epoch],
                         "world_size", "identity", "epoch_start_step",
                         "ranks": [per-rank state] | None, "skipped", "infeasible"}
                        `identity`: what decides the data (`identity()` of the training
                        data in `cat.training.train_data`), compared on resume. Per rank,
                        map: {"batches", "trained", "logs"}; stream: {"progress": worker
                        positions and totals (`cat.loading.progress`), "logs"}; `logs`
                        holds the sizes of the epoch's log files. `ranks` is None when
                        the epoch has not started (resume at its beginning); so are
                        `skipped` and `infeasible`, else per rank the epoch's utterances
                        of skipped updates (and those updates) and of infeasible ones.
    rng                 per rank {"torch": ByteTensor, "cuda": ByteTensor | None}
    meta                {"num_classes", "train_bin", "elapsed_seconds",
                         "settings": {"config.json": the config it was trained with,
                                      "hyper-p.json": the update settings,
                                      "front_end": its features' front end (name and
                                                   fbank options),
                                      "tokenizer": {"digest", "vocab_size"}}}

Every file is written to a temporary name and renamed; the list is rewritten (atomically)
after the new file exists, and only then are pruned files removed. Kept: the `keep` most
recent checkpoints plus the `keep` best by dev loss.

An average of checkpoints (`cat.decoding.checkpoint`, `cat.decoding.avgmodel`) holds `model`,
`averaged_from` and the `meta` of the last checkpoint averaged. `read_model_checkpoint`
gives the weights and the `config.json` recorded with them (`recorded_config`; None for
files written before checkpoints recorded it), which decoding compares with the
experiment's (`model_config`: every section but `scheduler`, `config_changes`), and what
else defines the model's input and output (`INTERFACE`: the front end and the tokenizer,
`model_interface`, `interface_changes`).

`load_model_state` puts a checkpoint's weights into a model built from `config.json`; a
checkpoint that does not fit (the config or the tokenizer changed since it was written) is
an error naming the checkpoint, the config and the first mismatching parameter.

Usage:
    manager = CheckpointManager("exp/asr/check", keep=5)
    manager.save(state, epoch=2, step=1000, dev_loss=1.23)
    state = load_checkpoint(manager.latest())
    load_model_state(model, state["model"], manager.latest(), "exp/asr/config.json")
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from cat.core.io import PathLike, atomic_write, remove_stale_temporaries
from cat.features.fbank import FbankOptions, front_end_name
from cat.models.model import upgrade_state_dict
from cat.text.tokenizer import Tokenizer
from cat.text.tokenizer import digest as tokenizer_digest

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "cat-checkpoint"
CHECKPOINT_VERSION = 1
LIST_NAME = "checkpoints.json"
LIST_FORMAT = "cat-checkpoint-list"
SELECT_MODES = ("best", "last")


def _load_error(path: PathLike, error: Exception) -> str:
    """Why a weights-only `torch.load` failed, in our words: never torch's advice to load
    the file with `weights_only=False`, which would run any code its pickle holds."""
    text = str(error)
    found = re.search(r"GLOBAL\s+([\w.]+)", text)
    if isinstance(error, pickle.UnpicklingError) and found:
        return (f"{path}: refused: not a plain checkpoint, it holds pickled Python objects "
                f"other than tensors and plain data (it refers to {found.group(1)}); loading "
                "them could run code, so it is not loaded. Use a checkpoint written by this "
                "toolkit (cat.training.checkpoint), or re-save the model's state dict alone "
                "from a trusted copy")
    cause = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n|$)", text)
    if cause:
        detail = f"not a weights-only torch.save file: {cause.group(1)}"
    else:
        paragraphs = [part.strip() for part in re.split(r"\n\s*\n", text) if part.strip()]
        kept = [part for part in paragraphs
                if not re.search(r"weights.only|Check the documentation", part, re.IGNORECASE)]
        detail = "; ".join(kept) or type(error).__name__
        if isinstance(error, pickle.UnpicklingError):
            detail = f"not a weights-only torch.save file: {detail}"
    return f"{path}: not a readable checkpoint ({detail})"


def save_checkpoint(path: PathLike, state: dict[str, Any]) -> None:
    """Write `state` to `path` through a temporary file."""
    with atomic_write(path, "wb") as f:
        torch.save(state, f)


def load_checkpoint(path: PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by this module (weights-only unpickling)."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path} does not exist") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise ValueError(_load_error(path, error)) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a {CHECKPOINT_FORMAT} file")
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint version {state.get('version')!r}")
    return state


def _read_model_file(path: PathLike) -> dict[str, Any]:
    """A checkpoint or an average (weights-only), its `model` checked to be tensors."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path} does not exist") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise ValueError(_load_error(path, error)) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict):
        raise ValueError(f"{path}: not a checkpoint dict with a 'model' state dict")
    for key, value in checkpoint["model"].items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path}: model entry {key!r} is a {type(value).__name__}, "
                             f"not a tensor")
    # Checkpoints of the one-class-per-family layout load with the heads' names.
    checkpoint["model"] = upgrade_state_dict(checkpoint["model"])
    return checkpoint


def read_model_state(path: PathLike) -> dict[str, torch.Tensor]:
    """The `model` state dict (on CPU) of a checkpoint or of an average of checkpoints."""
    return _read_model_file(path)["model"]


def read_model_checkpoint(path: PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The `model` state dict (on CPU) of a checkpoint or an average, and its `meta` (empty
    when it has none)."""
    checkpoint = _read_model_file(path)
    meta = checkpoint.get("meta")
    return checkpoint["model"], meta if isinstance(meta, dict) else {}


def recorded_config(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The `config.json` a checkpoint's `meta` records it was trained with (None: written
    before checkpoints recorded it)."""
    settings = meta.get("settings")
    config = settings.get("config.json") if isinstance(settings, dict) else None
    return config if isinstance(config, dict) else None


#: Sections of config.json that do not describe the model: how it was optimised.
NOT_MODEL_SECTIONS = ("scheduler",)


def model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The sections of `config.json` that describe the model (all but NOT_MODEL_SECTIONS)."""
    return {key: value for key, value in config.items() if key not in NOT_MODEL_SECTIONS}


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a.b.c": leaf}` of nested dicts (an empty dict is a leaf)."""
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def config_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: old -> new` (values as JSON, `(absent)` for a missing key) for each key that
    differs, sorted by key."""
    old, new = flatten(recorded), flatten(current)

    def shown(values: dict[str, Any], key: str) -> str:
        return json.dumps(values[key], ensure_ascii=False) if key in values else "(absent)"

    return [f"{key}: {shown(old, key)} -> {shown(new, key)}"
            for key in sorted(set(old) | set(new)) if shown(old, key) != shown(new, key)]


#: What, besides `config.json`, defines a model's input and output, as checkpoints record
#: it in `meta["settings"]` (`model_interface`), with how messages name it: the front end
#: its features were computed with (hyper-p.json data.front_end, its fbank options) and
#: the tokenizer its output ids belong to (its digest and size). Its global CMVN
#: statistics are buffers of its weights, so they travel with them.
INTERFACE = {"front_end": "hyper-p.json: data.front_end", "tokenizer": "the tokenizer"}


def model_interface(front_end: FbankOptions, tokenizer: Tokenizer) -> dict[str, Any]:
    """The `INTERFACE` entries of a model trained on `front_end` features to `tokenizer`'s
    ids, as checkpoints record them."""
    return {"front_end": {"name": front_end_name(front_end) or "(options of its own)",
                          **dataclasses.asdict(front_end)},
            "tokenizer": {"digest": tokenizer_digest(tokenizer),
                          "vocab_size": tokenizer.vocab_size}}


def interface_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`<what>: key: old -> new` for each `INTERFACE` entry of `current` that differs from
    the checkpoint's settings `recorded`; an entry a checkpoint does not record (written
    before checkpoints recorded it) is not compared."""
    return [f"{what}: {change}" for name, what in INTERFACE.items() if name in recorded
            for change in config_changes(recorded[name], current[name])]


def recorded_front_end(meta: dict[str, Any]) -> FbankOptions | None:
    """The front end a checkpoint's `meta` records its model was trained on (None: not
    recorded)."""
    settings = meta.get("settings")
    front_end = settings.get("front_end") if isinstance(settings, dict) else None
    if not isinstance(front_end, dict):
        return None
    return FbankOptions(**{key: value for key, value in front_end.items() if key != "name"})


class CheckpointMismatchError(ValueError):
    """A checkpoint's weights do not fit the model built from the current config."""


def _shape(tensor: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, tensor.shape)) + ")"


def state_mismatch(model_state: dict[str, torch.Tensor], state: dict[str, torch.Tensor]
                   ) -> list[str]:
    """How `state` differs from `model_state` (keys and shapes), first difference first
    (in the model's parameter order); empty when it fits."""
    problems = []
    for name, tensor in model_state.items():
        if name not in state:
            problems.append(f"{name!r} is missing from the checkpoint")
        elif tuple(state[name].shape) != tuple(tensor.shape):
            problems.append(f"{name!r} has shape {_shape(state[name])} in the checkpoint but "
                            f"{_shape(tensor)} in the model")
    problems += [f"{name!r} is in the checkpoint but not in the model"
                 for name in state if name not in model_state]
    return problems


def upgrade_training_checkpoint(state: dict[str, Any], model: torch.nn.Module) -> None:
    """A training checkpoint of the one-class-per-family layout made fit for `model`, in
    place: its model keys renamed (`upgrade_state_dict`) and its optimizer state, which is
    indexed by parameter position, reordered from the saved model's parameter order (its
    state dict's) to `model`'s. A checkpoint of the current layout is left as it is."""
    saved = list(state["model"])
    state["model"] = upgrade_state_dict(state["model"])
    parameters = [name for name, _ in model.named_parameters()]
    known = set(parameters)
    saved_order = [name for name in state["model"] if name in known]
    if saved_order == parameters or sorted(saved_order) != sorted(parameters):
        return  # nothing to reorder, or a mismatch that load_model_state names
    position = {name: index for index, name in enumerate(parameters)}
    optimizer = state["scheduler"]["optimizer"]
    optimizer["state"] = {position[saved_order[int(index)]]: value
                          for index, value in optimizer["state"].items()}
    logger.info("checkpoint of the earlier model layout: %d keys renamed, optimizer state "
                "reordered", sum(a != b for a, b in zip(saved, state["model"], strict=True)))


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor],
                     checkpoint_path: PathLike, config_path: PathLike) -> None:
    """Load `state` (read from `checkpoint_path`) into `model` (built from `config_path`).

    Raises `CheckpointMismatchError` naming both files and the first mismatching
    parameter (name, checkpoint shape vs model shape, or a missing/unexpected key).
    """
    problems = state_mismatch(model.state_dict(), state)
    if problems:
        more = f" ({len(problems) - 1} more differences)" if len(problems) > 1 else ""
        raise CheckpointMismatchError(
            f"{checkpoint_path} does not fit the model built from {config_path}: "
            f"{problems[0]}{more}. Was {Path(config_path).name} (or the tokenizer) changed "
            "after the checkpoint was written? Restore it, or train in a new experiment "
            "directory")
    model.load_state_dict(state)


def checkpoint_name(epoch: int, step: int) -> str:
    """File name of the checkpoint written before `epoch` continues, after `step` updates."""
    return f"ckpt-e{epoch:03d}-s{step:08d}.pt"


class CheckpointManager:
    """Writes checkpoints into one directory and keeps its list (see the module doc)."""

    def __init__(self, directory: PathLike, keep: int = 5) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        # Checkpoints (and the list) of a run killed while saving; the next ones have
        # other names, so atomic_write alone would never remove them.
        if self.directory.is_dir():
            remove_stale_temporaries(self.directory)
        self.records: list[dict[str, Any]] = self._read_list()

    def _read_list(self) -> list[dict[str, Any]]:
        path = self.directory / LIST_NAME
        if not path.is_file():
            return []
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON: {error}") from None
        if not isinstance(document, dict) or document.get("format") != LIST_FORMAT:
            raise ValueError(f"{path}: not a {LIST_FORMAT} file")
        records = document.get("checkpoints")
        if not isinstance(records, list) or not all(
                isinstance(r, dict) and {"file", "epoch", "step", "dev_loss"} <= set(r)
                for r in records):
            raise ValueError(f"{path}: 'checkpoints' must be a list of "
                             "{file, epoch, step, dev_loss} objects")
        return records

    def _write_list(self) -> None:
        with atomic_write(self.directory / LIST_NAME) as f:
            json.dump({"format": LIST_FORMAT, "version": 1, "checkpoints": self.records}, f,
                      indent=1)
            f.write("\n")

    def save(self, state: dict[str, Any], epoch: int, step: int,
             dev_loss: float | None) -> Path:
        """Write a checkpoint, record it, prune; returns its path."""
        name = checkpoint_name(epoch, step)
        path = self.directory / name
        save_checkpoint(path, state)
        loss = None if dev_loss is None or not math.isfinite(dev_loss) else float(dev_loss)
        self.records = [r for r in self.records if r["file"] != name]
        self.records.append({"file": name, "epoch": epoch, "step": step, "dev_loss": loss})
        self.records.sort(key=lambda r: (r["step"], r["epoch"]))
        removed = self._prune()
        self._write_list()
        for record in removed:
            (self.directory / record["file"]).unlink(missing_ok=True)
        return path

    def _prune(self) -> list[dict[str, Any]]:
        keep = {r["file"] for r in self.records[-self.keep:]}
        keep |= {r["file"] for r in self._best(self.keep)}
        removed = [r for r in self.records if r["file"] not in keep]
        self.records = [r for r in self.records if r["file"] in keep]
        return removed

    def _best(self, num: int) -> list[dict[str, Any]]:
        scored = [r for r in self.records if r["dev_loss"] is not None]
        return sorted(scored, key=lambda r: (r["dev_loss"], -r["step"]))[:num]

    def latest(self) -> Path | None:
        """The most recent checkpoint (by step), or None."""
        return self.directory / self.records[-1]["file"] if self.records else None

    def best(self) -> Path | None:
        """The checkpoint with the lowest dev loss, or None."""
        best = self._best(1)
        return self.directory / best[0]["file"] if best else None

    def select(self, mode: str, num: int) -> list[Path]:
        """`num` checkpoints: "best" (lowest dev loss first) or "last" (most recent last)."""
        if mode not in SELECT_MODES:
            raise ValueError(f"unknown checkpoint selection {mode!r}; allowed: {SELECT_MODES}")
        records = self._best(num) if mode == "best" else self.records[-num:]
        if len(records) < num:
            logger.warning("%s: asked for %d %s checkpoints, only %d available",
                           self.directory, num, mode, len(records))
        return [self.directory / r["file"] for r in records]
