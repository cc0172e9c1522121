"""Experiment configuration: load and validate `hyper-p.json` + `config.json`, fill defaults.

An experiment directory `exp/<name>/` holds two JSON files:

* `hyper-p.json` (pipeline; schema `cat/core/schemas/hyper-p.schema.json`), with the
  sections `data` (Kaldi feature dirs `train`/`dev`/`test`, frame range `filter`),
  `tokenizer` (`type`, `option-train`, `file`), `env` (environment variables),
  `train` (`bin` = `cat.ctc.train` | `cat.rnnt.train`, `option` = the manager's options)
  and `inference` (`avgmodel`, `infer`, `er`). Every key is documented in the schema.
* `config.json` (model; schema `cat/core/schemas/config.schema.json`, checked by
  `load_config`; the model kind is `ctc` with a `ctc` section, `rnnt` with `decoder` and
  `joiner`). Validation needs neither torch nor a model family.

Unknown or misspelled keys are errors naming the file, the key path and the allowed keys,
e.g. ``hyper-p.json: train.option: unknown key 'large-dataset' (did you mean
'large_dataset'?); allowed keys: amp, batch_size, ...``.

`train.option` defaults come from the schema's `default` values; `null` placeholders are
resolved here: `trset` -> `exp/<name>/pack/train.npz` (map-style only), `devset` ->
`exp/<name>/pack/dev.npz`, `tokenizer` -> `tokenizer.file`, `filter` -> `data.filter`.
Paths stay relative to the recipe directory (the working directory).

`save_resolved` writes `exp/<name>/resolved.json`: the git commit of the code (or
"unknown" outside a git checkout), the resolved `hyper-p.json` and the `config.json`.

Usage:
    experiment = load_experiment("exp/ctc-v1")
    experiment.options.batch_size, experiment.config["encoder"]
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema

import cat
from cat.core.io import PathLike, atomic_write

HYPER_SCHEMA_PATH = Path(__file__).with_name("schemas") / "hyper-p.schema.json"
HYPER_NAME = "hyper-p.json"
CONFIG_NAME = "config.json"
RESOLVED_NAME = "resolved.json"
CONFIG_SCHEMA_PATH = Path(__file__).with_name("schemas") / "config.schema.json"


class ConfigError(ValueError):
    """A model configuration is invalid; the message names the file and the key."""


def load_config_schema() -> dict[str, Any]:
    """The JSON Schema of `config.json`."""
    with open(CONFIG_SCHEMA_PATH, encoding="utf-8") as f:
        return json.load(f)


def _json_path(path: Iterable[Any]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _unknown_keys_message(error: jsonschema.ValidationError) -> str:
    allowed = sorted(error.schema.get("properties", {}))
    parts = []
    for key in sorted(k for k in error.instance if k not in allowed):
        hint = difflib.get_close_matches(key, allowed, n=1)
        note = f" (did you mean {hint[0]!r}?)" if hint else ""
        if key == "num_classes":
            note = " (num_classes comes from the tokenizer when the model is built)"
        parts.append(f"unknown key {key!r}{note}")
    return f"{'; '.join(parts)}; allowed keys: {', '.join(allowed) or '(none)'}"


def _non_finite_paths(value: Any, path: list[Any]) -> Iterable[tuple[list[Any], float]]:
    """(path, value) of every NaN or infinite number in a JSON value."""
    if isinstance(value, float) and not math.isfinite(value):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite_paths(item, [*path, key])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _non_finite_paths(item, [*path, index])


def check_against_schema(instance: Any, schema: dict[str, Any], source: str) -> None:
    """Validate `instance` against a draft 2020-12 `schema`; raise ConfigError listing all errors.

    Unknown keys are reported with their path, the allowed keys and a close match.
    """
    non_finite = list(_non_finite_paths(instance, []))
    if non_finite:
        # JSON readers accept NaN and Infinity, and they pass every numeric bound.
        raise ConfigError("\n".join(f"{source}: {_json_path(path)}: {value!r} is not a "
                                     "finite number" for path, value in non_finite))
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(instance),
                    key=lambda e: ([str(p) for p in e.absolute_path], e.message))
    if not errors:
        return
    lines = []
    for error in errors:
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            message = _unknown_keys_message(error)
        else:
            message = error.message
        lines.append(f"{source}: {_json_path(error.absolute_path)}: {message}")
    raise ConfigError("\n".join(dict.fromkeys(lines)))


def model_kind(config: dict[str, Any], source: str = "config.json") -> str:
    """'ctc' when the config has a `ctc` section, 'rnnt' when it has `decoder` and `joiner`."""
    has_ctc = "ctc" in config
    rnnt_keys = [key for key in ("decoder", "joiner") if key in config]
    if has_ctc and rnnt_keys:
        raise ConfigError(f"{source}: (top level): a CTC model ('ctc') cannot also have "
                          f"{' and '.join(map(repr, rnnt_keys))}; keep 'ctc' for CTC, or "
                          f"'decoder' and 'joiner' for RNN-T")
    if has_ctc:
        return "ctc"
    if len(rnnt_keys) == 2:
        return "rnnt"
    raise ConfigError(f"{source}: (top level): the model kind is undefined: give a 'ctc' "
                      f"section (CTC) or both 'decoder' and 'joiner' (RNN-T); found "
                      f"{', '.join(map(repr, config)) or 'no keys'}")


def validate_config(config: Any, source: str = "config.json") -> None:
    """Raise ConfigError when `config` does not follow the config.json schema."""
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    model_kind(config, source)
    check_against_schema(config, load_config_schema(), source)


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a `config.json`; errors name the file, the line or the key."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}:{error.lineno}:{error.colno}: invalid JSON: {error.msg}") \
            from None
    validate_config(config, str(path))
    return config


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """`hyper-p.json:train.option` with every default filled (meanings: see the schema).

    `trset` and `devset` are lists of paths or shard patterns; `filter` may be None.
    """

    large_dataset: bool
    trset: list[str]
    devset: list[str]
    dev_large_dataset: bool
    tokenizer: str
    filter: str | None
    batch_size: int
    max_frames: int
    seed: int
    workers: int
    prefetch: int
    shuffle_buffer: int
    sort_buffer: int
    read_ahead_mb: int
    utts_per_shard_estimate: int
    strict_shards: bool
    audio: dict[str, Any] | None
    read_timeout: float
    read_retries: int
    bad_shard_limit: float
    epochs: int
    max_steps: int
    grad_accum: int
    grad_norm: float
    amp: bool
    check_freq: int
    max_skipped_updates: float
    keep_checkpoints: int
    time_budget_minutes: float
    dist_timeout_seconds: float
    stall_seconds: float
    threads: int
    log_interval: int
    log_utterances: bool


@dataclasses.dataclass
class Experiment:
    """One experiment: its directory, resolved `hyper-p.json`, `config.json` and options."""

    directory: Path
    hyper: dict[str, Any]
    config: dict[str, Any]
    options: TrainOptions
    train_bin: str


def load_hyper_schema() -> dict[str, Any]:
    """The JSON Schema of `hyper-p.json`."""
    with open(HYPER_SCHEMA_PATH, encoding="utf-8") as f:
        return json.load(f)


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}:{error.lineno}:{error.colno}: invalid JSON: {error.msg}") \
            from None


def validate_hyper(hyper: Any, source: str = HYPER_NAME) -> None:
    """Raise ConfigError naming the key when `hyper` does not follow the schema."""
    if not isinstance(hyper, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    check_against_schema(hyper, load_hyper_schema(), source)


def load_hyper(path: PathLike) -> dict[str, Any]:
    """Read and validate a `hyper-p.json`."""
    hyper = _read_json(Path(path))
    validate_hyper(hyper, str(path))
    return hyper


def train_option_defaults() -> dict[str, Any]:
    """Default value of every `train.option` key, from the schema."""
    properties = load_hyper_schema()["$defs"]["trainOption"]["properties"]
    return {key: spec["default"] for key, spec in properties.items()}


def as_list(value: str | list[str] | None) -> list[str]:
    """A path or pattern list from a hyper-p.json value: one string, a list, or nothing."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def tokenizer_file(hyper: dict[str, Any], source: str) -> str:
    """The experiment's tokenizer: `train.option.tokenizer`, else `tokenizer.file`."""
    path = (hyper.get("train", {}).get("option", {}).get("tokenizer")
            or hyper.get("tokenizer", {}).get("file"))
    if path is None:
        raise ConfigError(f"{source}: train.option.tokenizer: not set, and tokenizer.file "
                          "is missing too")
    return path


def resolve_train_options(hyper: dict[str, Any], exp_dir: PathLike,
                          source: str = HYPER_NAME) -> TrainOptions:
    """Fill defaults and placeholders of `hyper["train"]["option"]` (see the module doc)."""
    exp_dir = Path(exp_dir)
    option = {**train_option_defaults(), **hyper.get("train", {}).get("option", {})}
    where = f"{source}: train.option"
    if option["trset"] is None:
        if option["large_dataset"]:
            raise ConfigError(f"{where}.trset: required when large_dataset is true "
                              "(tar shard patterns such as 'data/wds/train/*/data-*.tar')")
        option["trset"] = str(exp_dir / "pack" / "train.npz")
    if option["devset"] is None:
        if option["dev_large_dataset"]:
            raise ConfigError(f"{where}.devset: required when dev_large_dataset is true")
        option["devset"] = str(exp_dir / "pack" / "dev.npz")
    option["trset"] = as_list(option["trset"])
    option["devset"] = as_list(option["devset"])
    for key, large in (("trset", "large_dataset"), ("devset", "dev_large_dataset")):
        if not option[large] and len(option[key]) != 1:
            raise ConfigError(f"{where}.{key}: a map-style set is one pack file, got "
                              f"{len(option[key])} paths (set {large} for tar shards)")
    if 0 < option["dist_timeout_seconds"] <= option["stall_seconds"]:
        raise ConfigError(f"{where}.stall_seconds: {option['stall_seconds']:g} must be below "
                          f"dist_timeout_seconds ({option['dist_timeout_seconds']:g}), or a "
                          "stalled rank ends the job by a collective's timeout, unnamed")
    option["tokenizer"] = tokenizer_file(hyper, source)
    if option["filter"] is None:
        option["filter"] = hyper.get("data", {}).get("filter")
    return TrainOptions(**option)


def load_experiment(exp_dir: PathLike, expected_bin: str | None = None) -> Experiment:
    """Load, validate and resolve `exp_dir/hyper-p.json` and `exp_dir/config.json`.

    With `expected_bin` (e.g. "cat.ctc.train"), `train.bin` must name it.
    """
    exp_dir = Path(exp_dir)
    hyper_path = exp_dir / HYPER_NAME
    hyper = load_hyper(hyper_path)
    if "train" not in hyper:
        raise ConfigError(f"{hyper_path}: train: missing (needed for training: "
                          "{\"bin\": \"cat.ctc.train\", \"option\": {...}})")
    train_bin = hyper["train"]["bin"]
    if expected_bin is not None and train_bin != expected_bin:
        raise ConfigError(f"{hyper_path}: train.bin is {train_bin!r}, but this is "
                          f"{expected_bin}; run 'python -m {train_bin} {exp_dir}'")
    options = resolve_train_options(hyper, exp_dir, str(hyper_path))
    config = load_config(exp_dir / CONFIG_NAME)
    resolved = json.loads(json.dumps(hyper))
    resolved["train"]["option"] = dataclasses.asdict(options)
    return Experiment(exp_dir, resolved, config, options, train_bin)


def apply_env(hyper: dict[str, Any]) -> None:
    """Export `hyper["env"]` into the process environment."""
    for name, value in hyper.get("env", {}).items():
        os.environ[name] = value


def git_commit(directory: PathLike | None = None) -> str:
    """Commit hash of the checkout holding `directory` (default: the `cat` package).

    A `+dirty` suffix marks uncommitted changes to tracked files; "unknown" outside a
    git checkout or without git.
    """
    directory = Path(directory or Path(cat.__file__).resolve().parent)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, check=True,
                                capture_output=True, text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=directory, check=True, capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}+dirty" if dirty else commit


def save_resolved(experiment: Experiment, extra: dict[str, Any] | None = None) -> Path:
    """Write `exp/<name>/resolved.json` (commit, resolved hyper-p.json, config.json)."""
    path = experiment.directory / RESOLVED_NAME
    document = {"commit": git_commit(), "hyper-p": experiment.hyper,
                "config": experiment.config, **(extra or {})}
    with atomic_write(path) as f:
        json.dump(document, f, ensure_ascii=False, indent=2)
        f.write("\n")
    return path
