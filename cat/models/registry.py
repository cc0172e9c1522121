"""Model registry: build the model a `config.json` describes.

`config.json` (schema: `cat/core/schemas/config.schema.json`, checked by
`cat.core.config.load_config`)::

    {
      "specaug":   {SpecAugment kwargs},                         # optional
      "encoder":   {"type": "ConformerNet", "kwargs": {...}},
      "ctc":       {"dropout": 0.0},                             # CTC model, or:
      "decoder":   {"type": "LSTMPredictor" | "StatelessPredictor", "kwargs": {...}},
      "joiner":    {"type": "JointNet", "kwargs": {"hdim": 320}},  # ... RNN-T model
      "trainer":   {"loss_normalization": "utterance" | "token",   # optional
                    "chunk_size": 40, "simu": true, ...},  # CUSIDE (cat.models.cuside)
      "scheduler": {"type": "SchedulerNoam", "kwargs": {...},
                    "optimizer": {"type": "AdamW", "kwargs": {...}}}
    }

A model is an encoder and heads (`cat.models.model.AsrModel`). The encoder and SpecAugment
are built here; each head by the module `HEADS` names for its section, imported by name when
a model has that head, so that generic code (this registry, the trainer, decoding) never
imports a head's family: its `build_head(config, encoder_dim, num_classes, source)` returns
the head and its loss weight (None: what the other heads' weights leave). The first head
present in `HEADS`' order decodes. A model kind (`cat.core.config.model_kind`) can build a
head with another module (`KIND_HEADS`: CTC-CRF's CTC head has a graph loss), and so can a key
of the head's section (`SECTION_HEADS`: `ctc.cr_ctc`, CR-CTC's head). `FAMILIES`
maps a kind to the package of its streaming search and export (the verbs `python -m
cat.stream` and `cat.export` find them with `family(kind, part)`), and `BEFORE_TRAINING` a
kind to what stage 2 builds for it (`before_training(kind)`: CTC-CRF's denominator graph).
A head's module declares the decoding methods the head offers and their options
(`DECODE_METHODS`, `cat.models.heads.DecodeMethod`); `decode_methods()` collects them for
decoding's options, command line and `hyper-p.json` check (`cat.decoding.searcher`).

What an encoder and a head provide is declared in `cat.models.encoder` (`Encoder`) and
`cat.models.heads` (`Head`, `SearchHead`, `Rescorer`) and checked when a model is built.
Adding a head: its module (with `build_head`, and `DECODE_METHODS` when it decodes or
rescores), an entry here, its config section in the schema; a head that needs more than
one forward of the batch or the training progress says so itself
(`ProgressHead`: CR-CTC's second view, a loss warmed up with the step).

Usage::

    config = load_config("exp/ctc-tiny/config.json")      # raises ConfigError naming the key
    model = build_model(config, num_classes=tokenizer_vocab_size)

Classes are looked up in explicit dicts (`ENCODERS`, the families' registries); names from
the config are never evaluated.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType, ModuleType
from typing import Any

from torch import nn

from cat.core.config import ConfigError, validate_config
from cat.models.cuside import build_chunking
from cat.models.encoder import ConformerNet, Encoder
from cat.models.heads import DecodeMethod, Head, build_component
from cat.models.model import AsrModel
from cat.models.specaug import SpecAugment

# Read-only registries: config names map to classes and modules here and nowhere else.
ENCODERS: Mapping[str, type[nn.Module]] = MappingProxyType({"ConformerNet": ConformerNet})
#: The heads of a model, in decoding priority (the first one present decodes): name (the
#: model's attribute and state-dict prefix) -> (the config section that gives it, the module
#: whose `build_head` builds it).
HEADS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "transducer": ("joiner", "cat.rnnt.model"),
    "ctc": ("ctc", "cat.ctc.head"),
    "attention": ("attention", "cat.models.attention"),
})
#: Heads a model kind builds with another module: CTC-CRF's CTC head has a graph loss.
KIND_HEADS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "crf": MappingProxyType({"ctc": "cat.crf.model"})})
#: Heads a key of their config section builds with another module: `ctc.cr_ctc` is CR-CTC's
#: CTC head (a second augmented view and a consistency loss).
SECTION_HEADS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "ctc": MappingProxyType({"cr_ctc": "cat.ctc.crctc"})})
#: Model kinds (`cat.core.config.model_kind`, the one place a kind is worked out) to the
#: package of their streaming search and export.
FAMILIES: Mapping[str, str] = MappingProxyType({"ctc": "cat.ctc", "rnnt": "cat.rnnt",
                                                "crf": "cat.crf"})
#: Model kinds that need something built before training, to the module whose
#: `prepare(config, train_texts, tokenizer)` stage 2 calls (`before_training`): CTC-CRF's
#: denominator graph.
BEFORE_TRAINING: Mapping[str, str] = MappingProxyType({"crf": "cat.crf.stage"})
#: The modules of a family's package that `family` loads.
FAMILY_PARTS = ("stream", "export")
#: Kinds whose searches, streaming and export are another kind's: a CTC-CRF model has the
#: CTC model's head and decodes as one.
DECODES_AS: Mapping[str, str] = MappingProxyType({"crf": "ctc"})


#: The verbs every model has, `python -m cat.<verb> EXP`; CAT's per-family commands
#: (`python -m cat.ctc.train`, `cat.rnnt.decode`, ...) are aliases of them for the kinds
#: below (a CTC-CRF model trains with `cat.ctc.train`, as in CAT).
VERBS = ("train", "decode", "stream", "export")
ALIASES: Mapping[str, tuple[str, ...]] = MappingProxyType({"cat.ctc": ("ctc", "crf"),
                                                           "cat.rnnt": ("rnnt",)})


def check_command(command: str, kind: str, source: str) -> None:
    """ConfigError when `command` (a verb `cat.<verb>`, or an alias `cat.<family>.<verb>`,
    as run or as `hyper-p.json` names it) cannot handle a model of kind `kind` (from
    `source`)."""
    package, _, verb = command.rpartition(".")
    kinds = ALIASES.get(package)
    if (package != "cat" and kinds is None) or verb not in VERBS:
        raise ConfigError(f"{source}: {command} is not a command of this toolkit; the verbs "
                          f"are {', '.join(f'cat.{v}' for v in VERBS)}")
    if kinds is not None and kind not in kinds:
        raise ConfigError(f"{source}: describes a {kind} model, but {command} handles "
                          f"{' and '.join(kinds)} models; run python -m cat.{verb}")


def family(kind: str, part: str) -> ModuleType:
    """The module `part` of the family of model kind `kind`: its `stream` (its
    `ChunkSearch`) or `export` (its `export_model` and `sherpa_model_config`, the hooks
    `cat.decoding.export` calls), those of `DECODES_AS[kind]` when the kind decodes as
    another."""
    if part not in FAMILY_PARTS:
        raise ValueError(f"{part!r} is not a family's part; the parts are "
                         f"{', '.join(FAMILY_PARTS)}")
    return importlib.import_module(f"{FAMILIES[DECODES_AS.get(kind, kind)]}.{part}")


def before_training(kind: str) -> Callable[..., None] | None:
    """The `prepare(config, train_texts, tokenizer)` hook of model kind `kind`, what stage 2
    runs for it after the tokenizer and packs (`BEFORE_TRAINING`); None when the kind
    needs nothing more."""
    module = BEFORE_TRAINING.get(kind)
    return None if module is None else importlib.import_module(module).prepare


def head_modules() -> dict[str, list[str]]:
    """Head name -> the modules its head can be built with (`HEADS`, then `KIND_HEADS` and
    `SECTION_HEADS`), in `HEADS`' order."""
    modules: dict[str, list[str]] = {}
    for name, (_, module) in HEADS.items():
        variants = [table[name] for table in (*KIND_HEADS.values(), *SECTION_HEADS.values())
                    if name in table]
        modules[name] = list(dict.fromkeys([module, *variants]))
    return modules


def decode_methods() -> list[tuple[str, str, DecodeMethod]]:
    """(head name, method, declaration) of every decoding method a head can offer: the
    `DECODE_METHODS` of the modules of `head_modules()`, in `HEADS`' order (a module
    that declares none, or the same declarations as one before it, adds nothing: CTC-CRF's
    and CR-CTC's heads decode as the CTC head)."""
    found: list[tuple[str, str, DecodeMethod]] = []
    for name, modules in head_modules().items():
        for module in modules:
            for method, declaration in getattr(importlib.import_module(module),
                                               "DECODE_METHODS", {}).items():
                if not any(seen is declaration for _, _, seen in found):
                    found.append((name, method, declaration))
    return found


def build_specaug(config: dict[str, Any]) -> SpecAugment | None:
    """SpecAugment of `config["specaug"]`, or None when the section is absent."""
    return SpecAugment(**config["specaug"]) if "specaug" in config else None


def build_model(config: dict[str, Any], num_classes: int, source: str = "config.json",
                kind: str | None = None) -> AsrModel:
    """Validate `config` and build its model for a vocabulary of `num_classes` (incl. blank).
    `kind`: the model kind of a `config` validated already (`validate_config`'s, carried as
    `cat.core.config.Experiment.kind`), which is then not validated again."""
    if kind is None:
        kind = validate_config(config, source)
    try:
        specaug = build_specaug(config)
    except ValueError as error:
        raise ConfigError(f"{source}: specaug: {error}") from None
    encoder = build_component(ENCODERS, config["encoder"], "encoder.kwargs", source)
    _check_interface(encoder, Encoder, f"{source}: encoder: {config['encoder']['type']}")
    heads: dict[str, nn.Module] = {}
    weights: dict[str, float | None] = {}
    for name, (section, module) in HEADS.items():
        if section not in config:
            continue
        module = KIND_HEADS.get(kind, {}).get(name, module)
        for key, variant in SECTION_HEADS.get(name, {}).items():
            if key in config[section]:
                if name in KIND_HEADS.get(kind, {}):
                    raise ConfigError(f"{source}: {section}.{key}: not for a {kind} model, "
                                      f"whose {name} head is {module}'s")
                module = variant
        try:
            heads[name], weights[name] = importlib.import_module(module).build_head(
                config, encoder.output_dim, num_classes, source)
        except ValueError as error:
            if isinstance(error, ConfigError):
                raise
            raise ConfigError(f"{source}: {error}") from None
        _check_interface(heads[name], Head, f"{source}: {section}: the {name} head")
    given = [weight for weight in weights.values() if weight is not None]
    rest = 1 - sum(given)
    trainer = config.get("trainer", {})
    try:
        chunking = build_chunking(trainer, encoder, config["encoder"]["kwargs"]["idim"])
        return AsrModel(encoder, heads, {name: rest if weight is None else weight
                                         for name, weight in weights.items()}, specaug,
                        **({"loss_normalization": trainer["loss_normalization"]}
                           if "loss_normalization" in trainer else {}), chunking=chunking)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{source}: {error}") from None


def _check_interface(built: object, interface: type, what: str) -> None:
    """TypeError naming what `built` lacks of `interface` (a runtime-checkable Protocol)."""
    if not isinstance(built, interface):
        members = set(getattr(interface, "__annotations__", {})) | {
            name for name in vars(interface)
            if not name.startswith("_") or name == "__call__"}
        missing = [name for name in members if not hasattr(built, name)]
        raise TypeError(f"{what} ({type(built).__name__}) is not an {interface.__name__}: "
                        f"it lacks {', '.join(sorted(missing))}")


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
