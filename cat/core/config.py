"""Experiment configuration: load and validate `hyper-p.json` + `config.json`, fill defaults.

An experiment directory `exp/<name>/` holds two JSON files:

* `hyper-p.json` (pipeline; schema `cat/core/schemas/hyper-p.schema.json`), with the
  sections `data` (Kaldi feature dirs `train`/`dev`/`test`, frame range `filter`),
  `tokenizer` (`type`, `option-train`, `file`), `env` (environment variables),
  `train` (`bin` = `cat.train`, or its aliases `cat.ctc.train` | `cat.rnnt.train`; `option` = the
  manager's options)
  and `inference` (`avgmodel`, `infer`, `er`). Every key is documented in the schema.
* `config.json` (model; schema `cat/core/schemas/config.schema.json`, checked by
  `load_config`; the model kind is `ctc` with a `ctc` section, `rnnt` with `decoder` and
  `joiner`). Validation needs neither torch nor a model family.

Unknown or misspelled keys are errors naming the file, the key path and the allowed keys,
e.g. ``hyper-p.json: train.option: unknown key 'large-dataset' (did you mean
'large_dataset'?); allowed keys: amp, batch_size, ...``. Every configuration JSON the
toolkit reads (these two, `lm.json`, CAT's files in `cat.migrate`, the schemas)
goes through `read_json`, where a key given twice in one object is an error naming the
file, the line and the key path (JSON readers keep the last silently, so
``"epochs": 1, "epochs": 3`` would train 3 epochs):
``hyper-p.json:9: train.option: duplicate key 'epochs' (first on line 8)``.

`train.option` is defined once, in the schema (`$defs.trainOption`): each key's type,
`default` and `description`. `TrainOptions`, the frozen dataclass the trainer reads, is
derived from it when first used (`options_class`): one field per key, typed from the
JSON types, defaulting to the schema's default. Adding an option means adding it to the
schema only. The schema is the source rather than the dataclass because it is what users
and their editors see (`.vscode/settings.json` maps `hyper-p.json` files to it for
completion and validation), it says more than Python types can (ranges, patterns,
enums, descriptions), and the loader already validates every file against it; a
dataclass written by hand would repeat all of that. `null` placeholders are resolved
here: `trset` -> `exp/<name>/pack/train.npz` (map-style only), `devset` ->
`exp/<name>/pack/dev.npz`, `tokenizer` -> `tokenizer.file`, `filter` -> `data.filter`.
Paths stay relative to the recipe directory (the working directory).

`save_resolved` writes `exp/<name>/resolved.json`: the git commit of the code (or
"unknown" outside a git checkout), the resolved `hyper-p.json` and the `config.json`.

Usage:
    experiment = load_experiment("exp/ctc-v1")
    experiment.options.batch_size, experiment.config["encoder"]
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import operator
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema

import cat
from cat.core.io import PathLike, atomic_write

HYPER_SCHEMA_PATH = Path(__file__).with_name("schemas") / "hyper-p.schema.json"
HYPER_NAME = "hyper-p.json"
CONFIG_NAME = "config.json"
RESOLVED_NAME = "resolved.json"
CONFIG_SCHEMA_PATH = Path(__file__).with_name("schemas") / "config.schema.json"

if TYPE_CHECKING:
    # At run time `TrainOptions` is a dataclass derived from the schema (module __getattr__).
    TrainOptions = Any


class ConfigError(ValueError):
    """A model configuration is invalid; the message names the file and the key."""


def load_config_schema() -> dict[str, Any]:
    """The JSON Schema of `config.json`."""
    return read_json(CONFIG_SCHEMA_PATH)


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


def schema_defaults(section: str) -> dict[str, Any]:
    """{key: default} of the keys of config.json section `section` (a `$defs` entry of the
    schema: 'trainer', 'ctc', ...) that have one: the schema is where a key's default is
    given, so that code reading an optional key takes it from here."""
    properties = load_config_schema()["$defs"][section]["properties"]
    return {key: spec["default"] for key, spec in properties.items() if "default" in spec}


def cuside_keys(role: str | None = None) -> dict[str, Any]:
    """{key: default (None without one)} of the `trainer` keys of CUSIDE, those the
    config.json schema marks `x-cuside` (`cat.models.cuside`), in schema order: of `role`
    ('chunking': the settings of its chunked forward, 'check': CAT's keys checked against
    the encoder), or all of them. The schema is the one list of the keys and their
    defaults; `chunk_size` turns CUSIDE on."""
    properties = load_config_schema()["$defs"]["trainer"]["properties"]
    return {key: spec.get("default") for key, spec in properties.items()
            if "x-cuside" in spec and role in (None, spec["x-cuside"])}


def model_kind(config: dict[str, Any], source: str = "config.json") -> str:
    """The model kind of a config.json, the one place it is worked out: 'rnnt' when it has
    `decoder` and `joiner` (a `ctc` section is then an auxiliary CTC head with its
    `weight`), else 'ctc' when it has a `ctc` section (with or without an `attention`
    decoder head; 'crf' with `trainer.use_crf`)."""
    has_ctc = "ctc" in config
    ctc = config["ctc"] if isinstance(config.get("ctc"), dict) else {}
    rnnt_keys = [key for key in ("decoder", "joiner") if key in config]
    transducer = len(rnnt_keys) == 2
    if len(rnnt_keys) == 1:
        raise ConfigError(f"{source}: (top level): an RNN-T model needs both 'decoder' and "
                          f"'joiner'; found only {rnnt_keys[0]!r}")
    if transducer and has_ctc and "weight" not in ctc:
        raise ConfigError(f"{source}: ctc.weight: in an RNN-T model ('decoder' and "
                          f"'joiner') the 'ctc' section is an auxiliary CTC head and needs "
                          f"its weight in the loss (e.g. 0.3); remove 'ctc' for RNN-T alone")
    if not transducer and "weight" in ctc:
        raise ConfigError(f"{source}: ctc.weight: only for the auxiliary CTC head of an RNN-T "
                          f"model ('decoder' and 'joiner'); a CTC model's loss is its CTC")
    if "attention" in config and (transducer or not has_ctc):
        raise ConfigError(f"{source}: attention: an attention decoder head is trained with a "
                          f"CTC model's head (U2): give 'ctc' without 'decoder' and 'joiner', "
                          f"or remove 'attention'")
    trainer = config.get("trainer", {}) if isinstance(config.get("trainer"), dict) else {}
    if not transducer and "simple_loss_scale" in trainer:
        raise ConfigError(f"{source}: trainer.simple_loss_scale: only used by RNN-T models "
                          f"('decoder' and 'joiner')")
    cuside = [key for key in cuside_keys() if key != "chunk_size" and key in trainer]
    if cuside and "chunk_size" not in trainer:
        raise ConfigError(f"{source}: trainer.{cuside[0]}: a CUSIDE setting, used only with "
                          f"trainer.chunk_size (which turns CUSIDE on)")
    if trainer.get("use_crf") is True:
        if not has_ctc or transducer:
            raise ConfigError(f"{source}: trainer.use_crf: CTC-CRF needs a 'ctc' section and "
                              f"no 'decoder' and 'joiner'")
        if "den_lm" not in trainer:
            raise ConfigError(f"{source}: trainer.den_lm: CTC-CRF (trainer.use_crf) needs "
                              f"its denominator graph")
        return "crf"
    unused = [key for key in ("lamb", "den_lm", "den_lm_order", "den_lm_extra_states",
                              "den_lm_estimator") if key in trainer]
    if unused:
        raise ConfigError(f"{source}: trainer.{unused[0]}: only used by CTC-CRF; set "
                          f"trainer.use_crf to true or remove it")
    if transducer:
        return "rnnt"
    if has_ctc:
        return "ctc"
    raise ConfigError(f"{source}: (top level): the model kind is undefined: give a 'ctc' "
                      f"section (CTC) or both 'decoder' and 'joiner' (RNN-T); found "
                      f"{', '.join(map(repr, config)) or 'no keys'}")


def experiment_kind(exp_dir: PathLike) -> str:
    """The model kind of the experiment `exp_dir` (`model_kind` of its `config.json`)."""
    path = Path(exp_dir) / CONFIG_NAME
    return model_kind(load_config(path), str(path))


def validate_config(config: Any, source: str = "config.json") -> str:
    """Raise ConfigError when `config` does not follow the config.json schema; its model
    kind (`model_kind`) when it does."""
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    kind = model_kind(config, source)
    check_against_schema(config, load_config_schema(), source)
    return kind


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a `config.json`; errors name the file, the line or the key."""
    config = read_json(Path(path))
    validate_config(config, str(path))
    return config


_JSON_TYPES: dict[str, type] = {"boolean": bool, "integer": int, "number": float,
                                 "string": str, "object": dict, "array": list,
                                 "null": type(None)}


def _python_type(spec: dict[str, Any], defs: dict[str, Any]) -> Any:
    """The Python type of a schema property: JSON types, `anyOf` unions and `$ref`s."""
    if "$ref" in spec:
        return _python_type(defs[spec["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in spec:
        parts = [_python_type(part, defs) for part in spec["anyOf"]]
    elif "type" in spec:
        names = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
        parts = [_JSON_TYPES[name] for name in names]
    else:
        return Any
    return functools.reduce(operator.or_, dict.fromkeys(parts))


def _field(name: str, spec: dict[str, Any], defs: dict[str, Any]) -> tuple[str, Any, Any]:
    default = spec["default"]
    if isinstance(default, (dict, list)):
        value = dataclasses.field(default_factory=functools.partial(copy.deepcopy, default))
    else:
        value = dataclasses.field(default=default)
    return name, _python_type(spec, defs), value


def options_class(schema: dict[str, Any]) -> type:
    """A frozen dataclass with one field per `trainOption` key of the hyper-p.json `schema`."""
    defs = schema["$defs"]
    properties = defs["trainOption"]["properties"]
    missing = sorted(key for key, spec in properties.items() if "default" not in spec)
    if missing:
        raise ConfigError(f"{HYPER_SCHEMA_PATH}: $defs.trainOption: {', '.join(missing)} "
                          "without a 'default'")
    cls = dataclasses.make_dataclass(
        "TrainOptions", [_field(name, spec, defs) for name, spec in properties.items()],
        frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = ("`hyper-p.json:train.option` with every default filled, derived from "
                   "the schema (`$defs.trainOption`, where each key is described). "
                   "`trset` and `devset` are lists of paths or shard patterns once "
                   "resolved; `filter` may be None.")
    return cls


@functools.cache
def train_options_class() -> type:
    """`TrainOptions`, built once from the hyper-p.json schema."""
    return options_class(load_hyper_schema())


def __getattr__(name: str) -> Any:
    # `TrainOptions` is derived from the schema when first asked for, not at import.
    if name == "TrainOptions":
        return train_options_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass
class Experiment:
    """One experiment: its directory, resolved `hyper-p.json`, `config.json` and options, and
    its model kind (`model_kind` of `config.json`, worked out once here and carried)."""

    directory: Path
    hyper: dict[str, Any]
    config: dict[str, Any]
    options: TrainOptions
    train_bin: str
    kind: str


def load_hyper_schema() -> dict[str, Any]:
    """The JSON Schema of `hyper-p.json`."""
    return read_json(HYPER_SCHEMA_PATH)


class _DuplicateKey(Exception):
    """Raised by `_unique_keys` inside the JSON decoder; `parse_json` locates the key."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict (`object_pairs_hook`); a key given twice raises _DuplicateKey."""
    document = dict(pairs)
    if len(document) < len(pairs):
        raise _DuplicateKey
    return document


@dataclasses.dataclass
class _Container:
    """An object or array open at the scanner's position in `_first_duplicate_key`."""

    path: list[Any]
    keys: dict[str, int] | None  # an object's keys and their offsets; None for an array
    expect_key: bool = True
    member: Any = 0  # the current key (object) or index (array)

    def child_path(self) -> list[Any]:
        return [*self.path, self.member]


def _first_duplicate_key(text: str) -> tuple[int, int, str, list[Any]] | None:
    """(offset, offset of the first one, key, path of its object) of the first key given
    twice in one object of the valid JSON `text`, in the order of the text; None if none.
    """
    stack: list[_Container] = []
    position = 0
    while position < len(text):
        char = text[position]
        top = stack[-1] if stack else None
        if char == '"':
            key, end = json.decoder.scanstring(text, position + 1)
            if top is not None and top.keys is not None and top.expect_key:
                if key in top.keys:
                    return position, top.keys[key], key, top.path
                top.keys[key], top.expect_key, top.member = position, False, key
            position = end
            continue
        if char in "{[":
            path = top.child_path() if top is not None else []
            stack.append(_Container(path, {} if char == "{" else None))
        elif char in "}]":
            stack.pop()
        elif char == "," and top is not None:
            if top.keys is None:
                top.member += 1
            else:
                top.expect_key = True
        position += 1
    return None


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def parse_json(text: str, source: str) -> Any:
    """The JSON document `text` read from `source`, every object's keys unique.

    Invalid JSON, or a key given twice in one object (which JSON readers resolve silently
    to the last), is a ConfigError naming `source`, the line, and for a duplicate the key
    and the path of its object.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{source}:{error.lineno}:{error.colno}: invalid JSON: {error.msg}") \
            from None
    except _DuplicateKey:
        found = _first_duplicate_key(text)
    if found is None:  # unreachable for JSON the decoder parsed up to the duplicate
        raise ConfigError(f"{source}: a key is given twice in one object")
    offset, first, key, path = found
    raise ConfigError(f"{source}:{_line(text, offset)}: {_json_path(path)}: duplicate key "
                      f"{key!r} (first on line {_line(text, first)}); JSON keeps only the "
                      "last: remove one")


def read_json(path: PathLike) -> Any:
    """A configuration JSON file (see `parse_json`); a missing file, invalid JSON or a key
    given twice is an error naming the file (and the line)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    return parse_json(text, str(path))


def validate_hyper(hyper: Any, source: str = HYPER_NAME) -> None:
    """Raise ConfigError naming the key when `hyper` does not follow the schema."""
    if not isinstance(hyper, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    check_against_schema(hyper, load_hyper_schema(), source)
    data = hyper.get("data", {})
    audio = (data.get("shards") or {}).get("audio") or hyper.get("train", {}).get(
        "option", {}).get("audio")
    if data.get("front_end", "kaldi") != "kaldi" and audio:
        raise ConfigError(f"{source}: data.front_end: {data['front_end']!r} with audio "
                          "shards: the loader computes their features with Kaldi's front "
                          "end only; use feature dirs of stage 1 (run.sh --stage 1)")


def load_hyper(path: PathLike) -> dict[str, Any]:
    """Read and validate a `hyper-p.json`."""
    hyper = read_json(Path(path))
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
    return train_options_class()(**option)


def load_experiment(exp_dir: PathLike) -> Experiment:
    """Load, validate and resolve `exp_dir/hyper-p.json` and `exp_dir/config.json`."""
    exp_dir = Path(exp_dir)
    hyper_path = exp_dir / HYPER_NAME
    hyper = load_hyper(hyper_path)
    if "train" not in hyper:
        raise ConfigError(f"{hyper_path}: train: missing (needed for training: "
                          "{\"bin\": \"cat.ctc.train\", \"option\": {...}})")
    train_bin = hyper["train"]["bin"]
    options = resolve_train_options(hyper, exp_dir, str(hyper_path))
    config_path = exp_dir / CONFIG_NAME
    config = read_json(config_path)
    kind = validate_config(config, str(config_path))
    resolved = json.loads(json.dumps(hyper))
    resolved["train"]["option"] = dataclasses.asdict(options)
    return Experiment(exp_dir, resolved, config, options, train_bin, kind)


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
