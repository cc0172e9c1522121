"""Model registry: build the model a `config.json` describes.

`config.json` (schema: `cat/core/schemas/config.schema.json`, checked by
`cat.core.config.load_config`)::

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

The generic parts (the encoder, SpecAugment) are built here. The rest is the model
family's: `FAMILIES` maps a model kind to the module of its family, imported by name when
a model of that kind is built, so that generic code (this registry, the trainer, the
decoder) never imports a family. A family module provides `build_model(config, encoder,
num_classes, specaug, source)` and its own registries (predictors, joiners).

Usage::

    config = load_config("exp/ctc-tiny/config.json")      # raises ConfigError naming the key
    model = build_model(config, num_classes=tokenizer_vocab_size)

Classes are looked up in explicit dicts (`ENCODERS`, the families' registries); names from
the config are never evaluated.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType, ModuleType
from typing import Any

from torch import nn

from cat.core.config import ConfigError, model_kind, validate_config
from cat.models.encoder import ConformerNet
from cat.models.specaug import SpecAugment

# Read-only registries: config names map to classes and modules here and nowhere else.
ENCODERS: Mapping[str, type[nn.Module]] = MappingProxyType({"ConformerNet": ConformerNet})
FAMILIES: Mapping[str, str] = MappingProxyType({"ctc": "cat.ctc.model",
                                                "rnnt": "cat.rnnt.model",
                                                "crf": "cat.crf.model"})


def family(kind: str) -> ModuleType:
    """The module of the model family `kind` (`ctc`, `rnnt`, `crf`)."""
    return importlib.import_module(FAMILIES[kind])


def build_specaug(config: dict[str, Any]) -> SpecAugment | None:
    """SpecAugment of `config["specaug"]`, or None when the section is absent."""
    return SpecAugment(**config["specaug"]) if "specaug" in config else None


def build_component(registry: Mapping[str, type[nn.Module]], section: dict[str, Any],
                    where: str, source: str, *args: Any) -> nn.Module:
    """`registry[section["type"]](*args, **section["kwargs"])`; errors name `where`."""
    try:
        return registry[section["type"]](*args, **section.get("kwargs", {}))
    except ValueError as error:
        raise ConfigError(f"{source}: {where}: {error}") from None


def build_model(config: dict[str, Any], num_classes: int,
                source: str = "config.json") -> nn.Module:
    """Validate `config` and build its model for a vocabulary of `num_classes` (incl. blank)."""
    validate_config(config, source)
    kind = model_kind(config, source)
    try:
        specaug = build_specaug(config)
    except ValueError as error:
        raise ConfigError(f"{source}: specaug: {error}") from None
    encoder = build_component(ENCODERS, config["encoder"], "encoder.kwargs", source)
    try:
        return family(kind).build_model(config, encoder, num_classes, specaug, source)
    except ValueError as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{source}: {error}") from None


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
