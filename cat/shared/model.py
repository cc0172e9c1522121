"""Model registry: validate `config.json` and build CTC / RNN-T models from it.

`config.json` (schema: `cat/shared/schemas/config.schema.json`)::

    {
      "specaug":   {SpecAugment kwargs},                         # optional
      "encoder":   {"type": "ConformerNet", "kwargs": {...}},
      "ctc":       {"dropout": 0.0},                             # CTC model, or:
      "decoder":   {"type": "LSTMPredictor" | "StatelessPredictor", "kwargs": {...}},
      "joiner":    {"type": "JointNet", "kwargs": {"hdim": 320}},  # ... RNN-T model
      "trainer":   {"loss_normalization": "utterance" | "token"},  # optional
      "scheduler": {"type": "SchedulerNoam", "kwargs": {...},
                    "optimizer": {"type": "AdamW", "kwargs": {...}}}
    }

Usage::

    config = load_config("exp/ctc-tiny/config.json")      # raises ConfigError naming the key
    model = build_model(config, num_classes=tokenizer_vocab_size)
    scheduler = cat.shared.scheduler.build_scheduler(config["scheduler"], model.parameters())

Classes are looked up in explicit dicts (`ENCODERS`, `PREDICTORS`, `JOINERS`,
`MODELS`); names from the config are never evaluated.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jsonschema
from torch import nn

from cat.ctc.model import CTCModel
from cat.rnnt.model import JointNet, LSTMPredictor, StatelessPredictor, TransducerModel
from cat.shared.encoder import ConformerNet
from cat.shared.specaug import SpecAugment

SCHEMA_PATH = Path(__file__).with_name("schemas") / "config.schema.json"

# Read-only registries: config names map to classes here and nowhere else.
ENCODERS: Mapping[str, type[nn.Module]] = MappingProxyType({"ConformerNet": ConformerNet})
PREDICTORS: Mapping[str, type[nn.Module]] = MappingProxyType({
    "LSTMPredictor": LSTMPredictor,
    "StatelessPredictor": StatelessPredictor,
})
JOINERS: Mapping[str, type[nn.Module]] = MappingProxyType({"JointNet": JointNet})
MODELS: Mapping[str, type[nn.Module]] = MappingProxyType({"ctc": CTCModel, "rnnt": TransducerModel})


class ConfigError(ValueError):
    """A model configuration is invalid; the message names the file and the key."""


def load_schema() -> dict[str, Any]:
    """The JSON Schema of `config.json`."""
    with open(SCHEMA_PATH, encoding="utf-8") as f:
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


def check_against_schema(instance: Any, schema: dict[str, Any], source: str) -> None:
    """Validate `instance` against a draft 2020-12 `schema`; raise ConfigError listing all errors.

    Unknown keys are reported with their path, the allowed keys and a close match.
    """
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
    check_against_schema(config, load_schema(), source)


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


def build_specaug(config: dict[str, Any]) -> SpecAugment | None:
    """SpecAugment of `config["specaug"]`, or None when the section is absent."""
    return SpecAugment(**config["specaug"]) if "specaug" in config else None


def _build(registry: Mapping[str, type[nn.Module]], section: dict[str, Any], where: str,
           source: str, *args: Any) -> nn.Module:
    try:
        return registry[section["type"]](*args, **section.get("kwargs", {}))
    except ValueError as error:
        raise ConfigError(f"{source}: {where}: {error}") from None


def build_model(config: dict[str, Any], num_classes: int,
                source: str = "config.json") -> CTCModel | TransducerModel:
    """Validate `config` and build its model for a vocabulary of `num_classes` (incl. blank)."""
    validate_config(config, source)
    kind = model_kind(config, source)
    try:
        specaug = build_specaug(config)
    except ValueError as error:
        raise ConfigError(f"{source}: specaug: {error}") from None
    encoder = _build(ENCODERS, config["encoder"], "encoder.kwargs", source)
    trainer = config.get("trainer", {})
    if kind == "ctc":
        components: tuple[nn.Module, ...] = (encoder, num_classes, specaug)
        options = {**config["ctc"], **trainer}
    else:
        predictor = _build(PREDICTORS, config["decoder"], "decoder.kwargs", source, num_classes)
        joiner = _build(JOINERS, config["joiner"], "joiner.kwargs", source,
                        encoder.output_dim, predictor.output_dim, num_classes)
        components = (encoder, predictor, joiner, specaug)
        options = dict(trainer)
    try:
        return MODELS[kind](*components, **options)
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
