"""Turn a CAT v3 experiment (thu-spmi/CAT `hyper-p.json` + `config.json`) into this toolkit's.

Usage:
    python -m cat.utils.migrate OLD_EXP NEW_EXP [--metainfo data/metainfo.json] [--force]
    python -m cat.utils.migrate ../CAT/egs/aishell/exp/ctc-v1 exp/cat-ctc-v1

Every key of the two files is either mapped (renamed or converted to this toolkit's
key, `cat/core/schemas/*.json`), dropped (this toolkit sets it another way, e.g.
`num_classes` comes from the tokenizer, `dist_url` from the launcher), or named as not
mapped (a CAT setting with no equivalent here, or a key CAT itself does not read). Keys
only CTC-CRF uses are reported as pending until the model schema has them
(`CTC_CRF_TRAINER_KEYS`). The report is printed and written to
`NEW_EXP/migration.txt`; the new files are validated against the schemas, and the model
is built once to report its parameter count.

CAT's data names are keys of its recipe's `data/metainfo.json`. With that file (given
by `--metainfo`, or found as `<recipe>/data/metainfo.json`, where `<recipe>` is the
parent of OLD_EXP's `exp` folder), a name maps to the directory of its `scp` entry (a
Kaldi-style dir holding `feats.scp` and `text`). Without it, a name maps by rule to this
toolkit's stage-1 layout `data/fbank/<set>`: a `thaudio-` prefix (CAT's torchaudio copies)
is removed; `X-3sp` (Kaldi 3-way speed perturbation) and `X-sp<factor>` become
`data/fbank/X_sp`, which also holds the unperturbed `X` (so `X` next to them in a train
list is dropped); any other name `X` becomes `data/fbank/X`. A name is a name, not a path:
one that would leave the data tree (absolute, or holding `..`) is an error naming its key.
NEW_EXP is written whole (with `--force`, replacing what is there): it may be neither
OLD_EXP, nor inside it, nor hold it.

Vocabulary size used for the parameter count: config.json's `num_classes` (CAT's stage 3
writes the trained tokenizer's size there), else `tokenizer.option-train.vocab_size`.
A char SentencePiece model with `use_all_vocab` keeps every character; here that is
`vocab_size: 0`.

Not carried over, by design: CAT's `data.filter` keeps `lo <= frames <= hi` when packing,
ours is half-open, so `hi` becomes `hi + 1`; CAT's Noam peak `peak_factor /
sqrt(dim_model * warmup_step)` becomes `peak_lr` (the optimizer's own `lr` is overridden
by the schedule in both); CAT's `batch_size` is global over all GPUs, ours per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shutil
import sys
from pathlib import Path, PurePosixPath
from typing import Any

from cat.core.config import (
    CONFIG_NAME,
    HYPER_NAME,
    ConfigError,
    load_config_schema,
    read_json,
    validate_config,
    validate_hyper,
)
from cat.core.io import atomic_write
from cat.formats.tables import FrameRange

REPORT_NAME = "migration.txt"

# Keys of CAT's `trainer` section that only its CTC-CRF loss reads. They are mapped to
# config.json `trainer.<key>` as soon as the config schema defines them there, and
# reported as pending until then: the one place to look when CTC-CRF lands.
CTC_CRF_TRAINER_KEYS = ("use_crf", "lamb", "den_lm")

TOKENIZER_TYPES = {"SentencePieceTokenizer": "sentencepiece", "JiebaTokenizer": "jieba"}
# CAT's hyper-p.json train.option keys (v3.0 and later) with the same meaning here.
SAME_TRAIN_OPTIONS = ("amp", "batch_size", "grad_norm", "seed", "workers", "tokenizer")
# train.option keys this toolkit's launcher or pipeline sets (CAT's argparse defaults).
LAUNCHER_OPTIONS = ("dist_url", "dist_backend", "world_size", "rank", "gpu", "dir", "config",
                    "debug", "verbose", "print_freq")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One line of the report: what happened to `key` of `file`."""

    status: str  # mapped | dropped | not mapped | pending
    file: str
    key: str
    detail: str


STATUS_ORDER = ("not mapped", "pending", "dropped", "mapped")


@dataclasses.dataclass
class Migration:
    """The migrated files and the report of every key."""

    hyper: dict[str, Any]
    config: dict[str, Any]
    entries: list[Entry]
    kind: str
    num_classes: int | None
    vocab_source: str

    def by_status(self, status: str) -> list[Entry]:
        return [e for e in self.entries if e.status == status]

    def report(self, old: str = "OLD_EXP", new: str = "NEW_EXP",
               parameters: int | None = None) -> str:
        """The report: a summary line per status, then one line per key, worst first."""
        lines = [f"CAT experiment {old} -> {new} ({self.kind.upper()} model)"]
        if parameters is not None:
            lines.append(f"parameters: {parameters / 1e6:.2f} M ({parameters}) with "
                         f"{self.num_classes} classes ({self.vocab_source})")
        counts = ", ".join(f"{len(self.by_status(s))} {s}" for s in STATUS_ORDER)
        lines.append(f"keys: {counts}")
        for status in STATUS_ORDER:
            for entry in self.by_status(status):
                lines.append(f"{status:<10}  {entry.file}: {entry.key}: {entry.detail}")
        return "\n".join(lines) + "\n"


class _Recorder:
    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def add(self, status: str, file: str, key: str, detail: str) -> None:
        self.entries.append(Entry(status, file, key, detail))

    def respell(self, start: int, prefix: str, spellings: dict[str, str]) -> None:
        """Show the keys recorded since entry `start` under `prefix` as CAT's file spells them."""
        for index in range(start, len(self.entries)):
            entry = self.entries[index]
            if entry.key.startswith(prefix):
                name, dot, rest = entry.key[len(prefix):].partition(".")
                key = prefix + spellings.get(name, name) + dot + rest
                self.entries[index] = dataclasses.replace(entry, key=key)

    def rest(self, file: str, prefix: str, section: dict[str, Any], why: str) -> None:
        """Name every key left in `section` as not mapped."""
        for key, value in section.items():
            self.add("not mapped", file, f"{prefix}{key}", f"{json.dumps(value)}: {why}")


def _option_key(key: str) -> str:
    # CAT's argparse accepts '-' and '_' alike.
    return key.replace("-", "_")


class MigrationError(ValueError):
    """The migration cannot be written where it was asked to be."""


# --- data names -------------------------------------------------------------------------

def check_data_name(name: Any, key: str) -> str:
    """`name`, a CAT data name under hyper-p.json's `key`, when it stays inside the data
    tree; a ConfigError naming the key and the name when it is no name or leaves it."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{HYPER_NAME}: {key}: {json.dumps(name)} is not a data name")
    path = PurePosixPath(name)
    why = ("is an absolute path" if path.is_absolute()
           else "holds '..'" if ".." in path.parts else None)
    if why:
        raise ConfigError(f"{HYPER_NAME}: {key}: data name {name!r} {why}: it would leave "
                          "the data tree; CAT's data names are names of its "
                          "data/metainfo.json (e.g. 'train_sp', 'dev'), not paths")
    return name


def find_metainfo(old_exp: Path) -> Path | None:
    """`<recipe>/data/metainfo.json`, the recipe being the parent of OLD_EXP's `exp` folder."""
    for parent in old_exp.resolve().parents:
        if parent.name == "exp":
            path = parent.parent / "data" / "metainfo.json"
            return path if path.is_file() else None
    return None


def data_dir(name: str, metainfo: dict[str, Any] | None) -> tuple[str, str]:
    """(Kaldi data dir, how it was found) of CAT's data name `name` (see the module doc)."""
    if metainfo is not None and isinstance(metainfo.get(name), dict) \
            and "scp" in metainfo[name]:
        return str(Path(metainfo[name]["scp"]).parent), "data/metainfo.json"
    base = name.removeprefix("thaudio-")
    perturbed = re.fullmatch(r"(.+)-(3sp|sp[0-9.]+)", base)
    if perturbed:
        return f"data/fbank/{perturbed.group(1)}_sp", "rule: speed-perturbed set"
    return f"data/fbank/{base}", "rule"


def _migrate_data(data: dict[str, Any], metainfo: dict[str, Any] | None,
                  record: _Recorder) -> dict[str, Any]:
    data = dict(data)
    out: dict[str, Any] = {}
    for part in ("train", "dev", "test"):
        if part not in data:
            continue
        value = data.pop(part)
        names = value if isinstance(value, list) else [value]
        dirs: list[str] = []
        for index, name in enumerate(names):
            key = f"data.{part}[{index}]" if isinstance(value, list) else f"data.{part}"
            directory, how = data_dir(check_data_name(name, key), metainfo)
            if directory not in dirs:
                dirs.append(directory)
            record.add("mapped", HYPER_NAME, f"data.{part}",
                       f"{name!r} -> {directory!r} ({how})")
        if part == "train":
            for directory in list(dirs):
                if f"{directory}_sp" in dirs:
                    dirs.remove(directory)
                    record.add("mapped", HYPER_NAME, "data.train",
                               f"{directory!r} left out: {directory}_sp holds it too")
        out[part] = dirs[0] if isinstance(value, str) and len(dirs) == 1 else dirs
    if "filter" in data:
        spec = data.pop("filter")
        try:
            frames = FrameRange.parse(spec)
            high = None if frames.high is None else frames.high + 1
            out["filter"] = str(FrameRange(frames.low, high))
            record.add("mapped", HYPER_NAME, "data.filter",
                       f"{spec!r} -> {out['filter']!r} (CAT keeps lo <= frames <= hi, "
                       "ours lo <= frames < hi)")
        except ValueError as error:
            record.add("not mapped", HYPER_NAME, "data.filter", str(error))
    if "lang" in data:
        record.add("dropped", HYPER_NAME, "data.lang", f"{data.pop('lang')!r}: CAT does not "
                   "read it either")
    record.rest(HYPER_NAME, "data.", data, "no such data key here")
    return out


# --- tokenizer --------------------------------------------------------------------------

def _migrate_tokenizer(tokenizer: dict[str, Any], new_exp: str,
                       record: _Recorder) -> tuple[dict[str, Any], int | None]:
    tokenizer = dict(tokenizer)
    out: dict[str, Any] = {}
    cat_type = tokenizer.pop("type", None)
    if cat_type in TOKENIZER_TYPES:
        out["type"] = TOKENIZER_TYPES[cat_type]
        record.add("mapped", HYPER_NAME, "tokenizer.type", f"{cat_type!r} -> {out['type']!r}")
    elif cat_type is not None:
        record.add("not mapped", HYPER_NAME, "tokenizer.type",
                   f"{cat_type!r}: tokenizers here are {', '.join(TOKENIZER_TYPES)}")
    train = dict(tokenizer.pop("option-train", {}))
    new_train: dict[str, Any] = {}
    where = "tokenizer.option-train."
    vocab = train.pop("vocab_size", None)
    all_vocab = train.pop("use_all_vocab", False)
    model_type = train.pop("model_type", None)
    if model_type is not None:
        if model_type in ("char", "unigram", "bpe"):
            new_train["model_type"] = model_type
            record.add("mapped", HYPER_NAME, where + "model_type", repr(model_type))
        else:
            record.add("not mapped", HYPER_NAME, where + "model_type",
                       f"{model_type!r}: model types here are char, unigram, bpe")
    if all_vocab and model_type == "char":
        new_train["vocab_size"] = 0
        record.add("mapped", HYPER_NAME, where + "use_all_vocab",
                   f"true -> vocab_size 0 (every character; CAT's vocab_size {vocab} is "
                   "kept only for the parameter count)")
        if vocab is not None:
            record.add("dropped", HYPER_NAME, where + "vocab_size",
                       f"{vocab}: use_all_vocab keeps every character")
    else:
        if vocab is not None:
            new_train["vocab_size"] = vocab
            record.add("mapped", HYPER_NAME, where + "vocab_size", str(vocab))
        if all_vocab:
            record.add("not mapped", HYPER_NAME, where + "use_all_vocab",
                       f"true with model_type {model_type!r}: only char models keep every "
                       "symbol here (vocab_size 0)")
    if "add_dummy_prefix" in train:
        new_train["add_dummy_prefix"] = bool(train.pop("add_dummy_prefix"))
        record.add("mapped", HYPER_NAME, where + "add_dummy_prefix",
                   json.dumps(new_train["add_dummy_prefix"]))
    if "character_coverage" in train:
        new_train["character_coverage"] = train.pop("character_coverage")
        record.add("mapped", HYPER_NAME, where + "character_coverage",
                   str(new_train["character_coverage"]))
    if "model_prefix" in train:
        record.add("dropped", HYPER_NAME, where + "model_prefix",
                   f"{train.pop('model_prefix')!r}: the model is stored in tokenizer.file")
    if "user_defined_symbols" in train:
        symbols = train.pop("user_defined_symbols")
        if isinstance(symbols, str) and not Path(symbols).suffix:
            new_train["user_symbols"] = [s for s in symbols.split(",") if s]
            record.add("mapped", HYPER_NAME, where + "user_defined_symbols",
                       f"-> user_symbols {new_train['user_symbols']}")
        else:
            record.add("not mapped", HYPER_NAME, where + "user_defined_symbols",
                       f"{symbols!r}: give the symbols as the list user_symbols")
    for key, default in (("bos_id", 0), ("unk_id", 1), ("eos_id", -1)):
        if key in train:
            value = train.pop(key)
            status = "dropped" if value == default else "not mapped"
            record.add(status, HYPER_NAME, where + key,
                       f"{value}: ids here are fixed (blank 0, <unk> 1, no eos)")
    train.pop("f_text", None)
    record.rest(HYPER_NAME, where, train, "no such tokenizer option here")
    if new_train:
        out["option-train"] = new_train
    out["file"] = f"{new_exp}/tokenizer.tknz"
    for key in ("file", "|V|"):
        if key in tokenizer:
            record.add("dropped", HYPER_NAME, f"tokenizer.{key}",
                       f"{tokenizer.pop(key)!r}: CAT's pickled tokenizer is not read here; "
                       f"stage 2 trains {out['file']}")
    record.rest(HYPER_NAME, "tokenizer.", tokenizer, "no such tokenizer key here")
    return out, vocab


# --- train.option -----------------------------------------------------------------------

def _migrate_train_option(option: dict[str, Any], data: dict[str, Any],
                          record: _Recorder) -> dict[str, Any]:
    start, spellings = len(record.entries), {_option_key(k): k for k in option}
    out = _migrate_train_options({_option_key(k): v for k, v in option.items()}, data, record)
    record.respell(start, "train.option.", spellings)
    return out


def _migrate_train_options(option: dict[str, Any], data: dict[str, Any],
                           record: _Recorder) -> dict[str, Any]:
    out: dict[str, Any] = {}
    where = "train.option."
    for key in SAME_TRAIN_OPTIONS:
        if key in option:
            out[key] = option.pop(key)
            note = " (CAT: global over all GPUs; here per rank)" if key == "batch_size" else ""
            record.add("mapped", HYPER_NAME, where + key, f"{json.dumps(out[key])}{note}")
    for cat_key, key in (("grad_accum_fold", "grad_accum"),
                         ("ld_shuffle_buffer", "shuffle_buffer")):
        if cat_key in option:
            out[key] = option.pop(cat_key)
            record.add("mapped", HYPER_NAME, where + cat_key, f"-> {key} {out[key]}")
    if "check_freq" in option:
        value = option.pop("check_freq")
        out["check_freq"] = max(value, 0)
        record.add("mapped", HYPER_NAME, where + "check_freq",
                   f"{value} -> {out['check_freq']}" + (" (per epoch)" if value < 0 else ""))
    _migrate_batching(option, out, record)
    large = bool(option.pop("large_dataset", False))
    if "ld" in option:
        large = True
        out["trset"] = option.pop("ld")
        record.add("mapped", HYPER_NAME, where + "ld", f"-> large_dataset true, trset "
                   f"{out['trset']!r}")
    if large:
        out["large_dataset"] = True
        if "trset" not in out:
            out["trset"] = _shard_pattern(option.pop("trset", None), data, record)
        record.add("mapped", HYPER_NAME, where + "large_dataset", "true")
    for key in ("trset", "devset"):
        if key in option:
            record.add("dropped", HYPER_NAME, where + key,
                       f"{option.pop(key)!r}: stage 2 writes exp/<name>/pack/{key[:-3]}.npz")
    for key in LAUNCHER_OPTIONS:
        if key in option:
            record.add("dropped", HYPER_NAME, where + key,
                       f"{json.dumps(option.pop(key))}: set by this toolkit's launcher")
    record.rest(HYPER_NAME, where, option, "no such training option here "
                "(cat/core/schemas/hyper-p.schema.json trainOption)")
    return out


def _migrate_batching(option: dict[str, Any], out: dict[str, Any], record: _Recorder) -> None:
    where = "train.option."
    mode = option.pop("dynamic_batch_mode", None)
    bucket_key = next((k for k in ("dynamic_bucket_size", "bucket_size") if k in option), None)
    bucket = option.pop(bucket_key) if bucket_key else None
    head_mode = option.pop("batching_mode", None)
    if head_mode is not None:
        mode = {"bucket": 0, "batch": 1}.get(head_mode, head_mode)
    key = where + ("dynamic_batch_mode" if head_mode is None else "batching_mode")
    shown = repr(head_mode) if head_mode is not None else str(mode)
    if mode == 0:
        record.add("mapped", HYPER_NAME, key,
                   f"{shown} (bucket): batches bounded by max_frames")
        if bucket is not None and bucket > 0:
            out["max_frames"] = bucket
            record.add("mapped", HYPER_NAME, where + bucket_key,
                       f"{bucket} -> max_frames {bucket} (CAT's bucket is global over all "
                       "GPUs; here per rank)")
            bucket = None
    elif mode in (1, -1):
        out["max_frames"] = 0
        record.add("mapped", HYPER_NAME, key,
                   f"{shown} (fixed batch size) -> max_frames 0 (batch_size only)")
    elif mode is not None:
        record.add("not mapped", HYPER_NAME, key, f"{shown}: not a CAT batching mode")
    if bucket is not None:
        record.add("dropped", HYPER_NAME, where + bucket_key,
                   f"{bucket}: CAT uses it in bucket mode only")
    if "batching_uneven" in option:
        record.add("not mapped", HYPER_NAME, where + "batching_uneven",
                   f"{json.dumps(option.pop('batching_uneven'))}: batches are split evenly")


def _shard_pattern(trset: Any, data: dict[str, Any], record: _Recorder) -> str:
    if isinstance(trset, str) and trset.endswith(".tar"):
        record.add("mapped", HYPER_NAME, "train.option.trset", f"{trset!r} (tar shards)")
        return trset
    train = data.get("train")
    first = train if isinstance(train, str) else (train or ["data/fbank/train"])[0]
    shard_dir = f"data/wds/{Path(first).name}"
    groups = [data["filter"]] if "filter" in data else []
    data["shards"] = {"dir": shard_dir, **({"filter_group": groups} if groups else {})}
    folder = f"{FrameRange.parse(groups[0]).name}/" if groups else ""
    pattern = f"{shard_dir}/{folder}data-*.tar"
    record.add("mapped", HYPER_NAME, "train.option.large_dataset",
               f"CAT v3 named the shards on its command line: stage 2 packs data.shards "
               f"{json.dumps(data['shards'])}, streamed as trset {pattern!r}")
    return pattern


# --- inference --------------------------------------------------------------------------

def _migrate_inference(inference: dict[str, Any], record: _Recorder) -> dict[str, Any]:
    inference = dict(inference)
    out: dict[str, Any] = {}
    if "avgmodel" in inference:
        avg = dict(inference.pop("avgmodel"))
        out["avgmodel"] = {k: avg.pop(k) for k in ("mode", "num") if k in avg}
        record.add("mapped", HYPER_NAME, "inference.avgmodel", json.dumps(out["avgmodel"]))
        record.rest(HYPER_NAME, "inference.avgmodel.", avg, "no such averaging option here")
    if "infer" in inference:
        infer = dict(inference.pop("infer"))
        new: dict[str, Any] = {}
        if infer.get("bin") in ("cat.ctc.decode", "cat.rnnt.decode"):
            new["bin"] = infer.pop("bin")
            record.add("mapped", HYPER_NAME, "inference.infer.bin", repr(new["bin"]))
        cat_option = dict(infer.pop("option", {}))
        start, spellings = len(record.entries), {_option_key(k): k for k in cat_option}
        option = {_option_key(k): v for k, v in cat_option.items()}
        new_option: dict[str, Any] = {"method": "beam"}
        for key in ("beam_size", "nj"):
            if key in option:
                new_option[key] = option.pop(key)
                record.add("mapped", HYPER_NAME, f"inference.infer.option.{key}",
                           str(new_option[key]))
        for key, device in (("cpu", "cpu"), ("gpu", "cuda")):
            if option.get(key):
                option.pop(key)
                new_option["device"] = device
                record.add("mapped", HYPER_NAME, f"inference.infer.option.{key}",
                           f"true -> device {device!r}")
        for key in ("alpha", "beta", "lm_path", "lm_config", "lm_check", "ilm_weight"):
            if key in option:
                record.add("not mapped", HYPER_NAME, f"inference.infer.option.{key}",
                           f"{json.dumps(option.pop(key))}: language models are set in "
                           "inference.lm (stage 5)")
        for key in ("resume", "tokenizer", "input_scp", "output_prefix", "config", "silent"):
            if key in option:
                record.add("dropped", HYPER_NAME, f"inference.infer.option.{key}",
                           f"{json.dumps(option.pop(key))}: set by stage 4")
        record.rest(HYPER_NAME, "inference.infer.option.", option, "no such decoding option")
        record.respell(start, "inference.infer.option.", spellings)
        new["option"] = new_option
        record.rest(HYPER_NAME, "inference.infer.", infer, "no such key here")
        out["infer"] = new
    if "er" in inference:
        er = dict(inference.pop("er"))
        out["er"] = {}
        if "cer" in er:
            out["er"]["cer"] = bool(er.pop("cer"))
            record.add("mapped", HYPER_NAME, "inference.er.cer", json.dumps(out["er"]["cer"]))
        record.rest(HYPER_NAME, "inference.er.", er, "no such scoring option here")
    record.rest(HYPER_NAME, "inference.", inference, "no such inference key here")
    return out


def migrate_hyper(hyper: dict[str, Any], new_exp: str, kind: str,
                  metainfo: dict[str, Any] | None,
                  record: _Recorder) -> tuple[dict[str, Any], int | None]:
    """This toolkit's hyper-p.json of CAT's `hyper` (a `kind` model); and CAT's vocab size."""
    hyper = dict(hyper)
    out: dict[str, Any] = {}
    if "data" in hyper:
        out["data"] = _migrate_data(hyper.pop("data"), metainfo, record)
    vocab = None
    if "tokenizer" in hyper:
        out["tokenizer"], vocab = _migrate_tokenizer(hyper.pop("tokenizer"), new_exp, record)
    if "env" in hyper:
        out["env"] = {k: str(v) for k, v in hyper.pop("env").items()}
        record.add("mapped", HYPER_NAME, "env", ", ".join(out["env"]) or "(empty)")
    train = dict(hyper.pop("train", {}))
    cat_bin = train.pop("bin", None)
    out["train"] = {"bin": f"cat.{kind}.train"}
    if cat_bin != out["train"]["bin"]:
        record.add("mapped", HYPER_NAME, "train.bin",
                   f"{cat_bin!r} -> {out['train']['bin']!r} (config.json describes a "
                   f"{kind.upper()} model)")
    out["train"]["option"] = _migrate_train_option(train.pop("option", {}),
                                                   out.get("data", {}), record)
    record.rest(HYPER_NAME, "train.", train, "no such key here")
    if "inference" in hyper:
        out["inference"] = _migrate_inference(hyper.pop("inference"), record)
    if "commit" in hyper:
        record.add("dropped", HYPER_NAME, "commit",
                   f"{hyper.pop('commit')!r}: resolved.json records the commit")
    record.rest(HYPER_NAME, "", hyper, "no such top-level key here")
    return out, vocab


# --- config.json ------------------------------------------------------------------------

def _migrate_specaug(specaug: dict[str, Any], record: _Recorder) -> dict[str, Any]:
    specaug = dict(specaug)
    out: dict[str, Any] = {}
    where = "specaug."
    for axis in ("freq", "time"):
        count = specaug.pop(f"num_{axis}_mask", 2)
        width = specaug.pop(f"{axis}_mask_width_range", 0.15 if axis == "freq" else 0.1)
        if isinstance(width, list):
            if len(width) == 2 and width[0] == 0:
                width = width[1]
            else:
                record.add("not mapped", CONFIG_NAME, f"{where}{axis}_mask_width_range",
                           f"{width}: mask widths here start at 0")
                width = width[-1]
        if not specaug.pop(f"apply_{axis}_mask", True):
            count = 0
            record.add("mapped", CONFIG_NAME, f"{where}apply_{axis}_mask",
                       f"false -> num_{axis}_masks 0")
        out[f"num_{axis}_masks"] = count
        out[f"max_{axis}_mask_ratio"] = width
        record.add("mapped", CONFIG_NAME, f"{where}num_{axis}_mask / {axis}_mask_width_range",
                   f"-> num_{axis}_masks {count}, max_{axis}_mask_ratio {width}")
    window = specaug.pop("time_warp_window", 0.2)
    if not specaug.pop("apply_time_warp", True) or window <= 0:
        out["max_time_warp"] = 0
        record.add("mapped", CONFIG_NAME, where + "apply_time_warp", "false -> max_time_warp 0")
    else:
        record.add("not mapped", CONFIG_NAME, where + "time_warp_window",
                   f"{window}: CAT warps by up to this share of each utterance; "
                   "max_time_warp here is in frames (default 0 = off): set it by hand")
    if specaug.pop("delta_feats", False):
        record.add("not mapped", CONFIG_NAME, where + "delta_feats",
                   "true: features here have no delta channels")
    record.rest(CONFIG_NAME, where, specaug, "no such SpecAugment option here")
    return out


def _component(section: dict[str, Any], name: str, cat_type_here: str, why: str,
               record: _Recorder) -> tuple[Any, dict[str, Any]]:
    """(CAT's type, a copy of its kwargs) of config.json's `name` section; its other keys
    are recorded as unknown, a type other than `cat_type_here` as not mapped (`why`)."""
    section = dict(section)
    cat_type = section.pop("type", None)
    kwargs = dict(section.pop("kwargs", {}))
    record.rest(CONFIG_NAME, f"{name}.", section, f"no such {name} key here")
    if cat_type != cat_type_here:
        record.add("not mapped", CONFIG_NAME, f"{name}.type", f"{cat_type!r}: {why}")
    return cat_type, kwargs


def _migrate_encoder(encoder: dict[str, Any], kind: str,
                     record: _Recorder) -> tuple[dict[str, Any], int | None]:
    _, kwargs = _component(encoder, "encoder", "ConformerNet",
                           "the encoder here is ConformerNet", record)
    where = "encoder.kwargs."
    out: dict[str, Any] = {}
    for key in ("num_cells", "idim", "hdim", "num_heads", "kernel_size", "dropout",
                "dropout_attn"):
        if key in kwargs:
            out[key] = kwargs.pop(key)
            record.add("mapped", CONFIG_NAME, where + key, json.dumps(out[key]))
    out.setdefault("kernel_size", 32)  # CAT's default
    conv = kwargs.pop("conv", "conv2d")
    subsampling = {"conv2d": "conv2d_padded", "vgg2l": "vgg2l"}.get(conv)
    if subsampling is None:
        record.add("not mapped", CONFIG_NAME, where + "conv",
                   f"{conv!r}: subsamplings here are conv2d and vgg2l")
    else:
        out["subsampling"] = subsampling
        record.add("mapped", CONFIG_NAME, where + "conv", f"{conv!r} -> subsampling "
                   f"{subsampling!r}")
    if "conv_multiplier" in kwargs:
        out["subsampling_channels"] = kwargs.pop("conv_multiplier")
        record.add("mapped", CONFIG_NAME, where + "conv_multiplier",
                   f"-> subsampling_channels {out['subsampling_channels']}")
    factor = kwargs.pop("time_reduction_factor", 1)
    position = kwargs.pop("time_reduction_pos", -1)
    if factor > 1:
        out.update(time_reduction_factor=factor, time_reduction_mode="subsample",
                   time_reduction_position=out.get("num_cells", 1) if position < 0 else position)
        record.add("mapped", CONFIG_NAME, where + "time_reduction_factor / time_reduction_pos",
                   f"{factor} at {position} -> time_reduction_factor {factor}, "
                   f"time_reduction_position {out['time_reduction_position']}, "
                   "time_reduction_mode 'subsample'")
    with_head = kwargs.pop("with_head", True)
    if with_head != (kind == "ctc"):
        record.add("not mapped", CONFIG_NAME, where + "with_head",
                   f"{json.dumps(with_head)}: a {kind.upper()} encoder here has "
                   f"{'a' if kind == 'ctc' else 'no'} classifier")
    else:
        record.add("mapped", CONFIG_NAME, where + "with_head",
                   f"{json.dumps(with_head)} -> " + ("the 'ctc' section's head" if with_head
                                                     else "no classifier (RNN-T)"))
    num_classes = kwargs.pop("num_classes", None)
    if num_classes is not None:
        record.add("dropped", CONFIG_NAME, where + "num_classes",
                   f"{num_classes}: the tokenizer sets the number of classes")
    for key, default, why in (("res_factor", 0.5, "half-step feed-forward residuals"),
                              ("d_head", -1, "head size hdim / num_heads"),
                              ("multiplier", 1, "depthwise convolution multiplier 1"),
                              ("subsample_norm", "none", "no normalisation in subsampling"),
                              ("delta_feats", False, "no delta features")):
        if key in kwargs:
            value = kwargs.pop(key)
            status = "dropped" if value == default else "not mapped"
            record.add(status, CONFIG_NAME, where + key, f"{json.dumps(value)}: always {why} "
                       "here")
    if "dropout_in" in kwargs:
        record.add("not mapped", CONFIG_NAME, where + "dropout_in",
                   f"{kwargs.pop('dropout_in')}: the subsampled input uses 'dropout' here")
    record.rest(CONFIG_NAME, where, kwargs, "no such ConformerNet option here")
    return {"type": "ConformerNet", "kwargs": out}, num_classes


def _migrate_decoder(decoder: dict[str, Any],
                     record: _Recorder) -> tuple[dict[str, Any], int | None]:
    cat_type, kwargs = _component(decoder, "decoder", "LSTM",
                                  "the migrated predictor is LSTMPredictor (CAT's LSTM)",
                                  record)
    record.add("mapped", CONFIG_NAME, "decoder.type", f"{cat_type!r} -> 'LSTMPredictor'")
    where = "decoder.kwargs."
    out: dict[str, Any] = {"dropout": 0.0}
    if "hdim" in kwargs:
        hdim = kwargs.pop("hdim")
        out.update(embed_dim=hdim, hdim=hdim)
        record.add("mapped", CONFIG_NAME, where + "hdim", f"-> embed_dim {hdim}, hdim {hdim}")
    if "num_layers" in kwargs:
        out["num_layers"] = kwargs.pop("num_layers")
        record.add("mapped", CONFIG_NAME, where + "num_layers", str(out["num_layers"]))
    if "dropout" in kwargs:
        record.add("not mapped", CONFIG_NAME, where + "dropout",
                   f"{kwargs.pop('dropout')}: CAT's is between LSTM layers; ours is on the "
                   "embedding (set to 0.0)")
    num_classes = kwargs.pop("num_classes", None)
    if num_classes is not None:
        record.add("dropped", CONFIG_NAME, where + "num_classes",
                   f"{num_classes}: the tokenizer sets the number of classes")
    if kwargs.pop("with_head", False):
        record.add("not mapped", CONFIG_NAME, where + "with_head",
                   "true: the predictor here has no classifier")
    for key in ("variational_noise", "norm", "padding_idx"):
        if key in kwargs:
            record.add("not mapped", CONFIG_NAME, where + key,
                       f"{json.dumps(kwargs.pop(key))}: LSTMPredictor has no such option")
    record.rest(CONFIG_NAME, where, kwargs, "no such LSTMPredictor option here")
    return {"type": "LSTMPredictor", "kwargs": out}, num_classes


def _migrate_joiner(joiner: dict[str, Any], encoder_dim: int | None, predictor_dim: int | None,
                    record: _Recorder) -> tuple[dict[str, Any], int | None]:
    _, kwargs = _component(joiner, "joiner", "JointNet", "the joiner here is JointNet",
                           record)
    where = "joiner.kwargs."
    out: dict[str, Any] = {}
    hdim = kwargs.pop("hdim", -1)
    for key, expected in (("odim_enc", encoder_dim), ("odim_pred", predictor_dim)):
        if key in kwargs:
            value = kwargs.pop(key)
            status = "dropped" if value == expected else "not mapped"
            record.add(status, CONFIG_NAME, where + key, f"{value}: the joiner's input sizes "
                       f"come from the encoder and the predictor ({expected})")
    if hdim == -1:
        hdim = max(d for d in (encoder_dim, predictor_dim, 1) if d is not None)
    out["hdim"] = hdim
    record.add("mapped", CONFIG_NAME, where + "hdim", str(hdim))
    if "act" in kwargs:
        out["activation"] = kwargs.pop("act")
        record.add("mapped", CONFIG_NAME, where + "act", f"-> activation {out['activation']!r}")
    for key, default in (("join_mode", "add"), ("pre_project", True)):
        if key in kwargs:
            value = kwargs.pop(key)
            record.add("dropped" if value == default else "not mapped", CONFIG_NAME,
                       where + key, f"{json.dumps(value)}: always {json.dumps(default)} here")
    if "compact" in kwargs:
        record.add("dropped", CONFIG_NAME, where + "compact",
                   f"{json.dumps(kwargs.pop('compact'))}: a memory layout of CAT's loss")
    num_classes = kwargs.pop("num_classes", None)
    if num_classes is not None:
        record.add("dropped", CONFIG_NAME, where + "num_classes",
                   f"{num_classes}: the tokenizer sets the number of classes")
    record.rest(CONFIG_NAME, where, kwargs, "no such JointNet option here")
    return {"type": "JointNet", "kwargs": out}, num_classes


def _migrate_trainer(trainer: dict[str, Any], source_key: str,
                     record: _Recorder) -> dict[str, Any]:
    trainer = dict(trainer)
    out: dict[str, Any] = {}
    where = f"{source_key}."
    schema_keys = set(load_config_schema()["$defs"]["trainer"].get("properties", {}))
    for key in CTC_CRF_TRAINER_KEYS:
        if key not in trainer:
            continue
        value = trainer.pop(key)
        if key == "den_lm" and key in schema_keys:
            out[key] = value  # `migrate` points it at the graph stage 2 builds
            record.add("mapped", CONFIG_NAME, where + key,
                       f"{json.dumps(value)} -> trainer.den_lm <NEW_EXP>/den_lm.npz: stage 2 "
                       "builds the denominator graph from the training transcripts "
                       "(cat.crf.den_graph), as CAT's prep_den_lm.sh did")
        elif key in schema_keys:
            out[key] = value
            record.add("mapped", CONFIG_NAME, where + key, f"-> trainer.{key} {json.dumps(value)}")
        else:
            record.add("pending", CONFIG_NAME, where + key,
                       f"{json.dumps(value)}: CTC-CRF only; mapped once config.json "
                       f"trainer.{key} exists")
    if "compact" in trainer:
        record.add("dropped", CONFIG_NAME, where + "compact",
                   f"{json.dumps(trainer.pop('compact'))}: a memory layout of CAT's loss")
    if "decoder" in trainer:
        record.add("not mapped", CONFIG_NAME, where + "decoder",
                   f"{json.dumps(trainer.pop('decoder'))}: no decoding during training here; "
                   "dev loss selects checkpoints")
    record.rest(CONFIG_NAME, where, trainer, "no such trainer option here")
    return out


def _migrate_scheduler(scheduler: dict[str, Any], record: _Recorder) -> dict[str, Any]:
    scheduler = dict(scheduler)
    where = "scheduler."
    cat_type = scheduler.pop("type", None)
    kwargs = dict(scheduler.pop("kwargs", {}))
    optimizer = dict(scheduler.pop("optimizer", {}))
    out: dict[str, Any] = {"type": "SchedulerNoam"}
    if cat_type == "SchedulerNoam":
        dim = kwargs.pop("dim_model", None)
        warmup = kwargs.pop("warmup_step", None)
        factor = kwargs.pop("peak_factor", 1.0)
        stop = kwargs.pop("stop_step", None)
        if dim is None or warmup is None or stop is None:
            raise ConfigError(f"{CONFIG_NAME}: scheduler.kwargs: SchedulerNoam needs "
                              "dim_model, warmup_step and stop_step")
        peak = factor / math.sqrt(dim * warmup)
        out["kwargs"] = {"peak_lr": float(f"{peak:.6g}"), "warmup_steps": warmup,
                         "stop_step": stop}
        record.add("mapped", CONFIG_NAME, where + "kwargs.peak_factor / dim_model",
                   f"{factor} / sqrt({dim} * {warmup}) -> peak_lr {out['kwargs']['peak_lr']}")
        record.add("mapped", CONFIG_NAME, where + "kwargs.warmup_step",
                   f"-> warmup_steps {warmup}")
        record.add("mapped", CONFIG_NAME, where + "kwargs.stop_step", str(stop))
    else:
        raise ConfigError(f"{CONFIG_NAME}: scheduler.type: {cat_type!r} cannot be migrated "
                          "(only SchedulerNoam has an equivalent here)")
    record.rest(CONFIG_NAME, where + "kwargs.", kwargs, "no such SchedulerNoam option here")
    opt_type = optimizer.pop("type", "Adam")
    if opt_type not in ("Adam", "AdamW", "SGD"):
        raise ConfigError(f"{CONFIG_NAME}: scheduler.optimizer.type: {opt_type!r} cannot be "
                          "migrated (Adam, AdamW, SGD)")
    opt_kwargs = dict(optimizer.pop("kwargs", {}))
    new_kwargs = {}
    if "lr" in opt_kwargs:
        record.add("dropped", CONFIG_NAME, where + "optimizer.kwargs.lr",
                   f"{opt_kwargs.pop('lr')}: the schedule sets the learning rate")
    allowed = (("betas", "eps", "weight_decay", "amsgrad") if opt_type != "SGD"
               else ("momentum", "dampening", "weight_decay", "nesterov"))
    for key in allowed:
        if key in opt_kwargs:
            new_kwargs[key] = opt_kwargs.pop(key)
            record.add("mapped", CONFIG_NAME, f"{where}optimizer.kwargs.{key}",
                       json.dumps(new_kwargs[key]))
    record.rest(CONFIG_NAME, where + "optimizer.kwargs.", opt_kwargs,
                f"no such {opt_type} option here")
    for key in ("zeroredundancy", "use_zero"):
        if key in optimizer:
            value = optimizer.pop(key)
            why = ("ZeroRedundancyOptimizer is not used here" if key == "zeroredundancy"
                   else "CAT does not read it either (its key is zeroredundancy)")
            record.add("not mapped", CONFIG_NAME, f"{where}optimizer.{key}",
                       f"{json.dumps(value)}: {why}")
    record.rest(CONFIG_NAME, where + "optimizer.", optimizer, "no such optimizer key here")
    record.rest(CONFIG_NAME, where, scheduler, "no such scheduler key here")
    out["optimizer"] = {"type": opt_type, "kwargs": new_kwargs}
    return out


def config_kind(config: dict[str, Any]) -> str:
    """'rnnt' when CAT's config has a predictor and a joiner, else 'ctc'."""
    return "rnnt" if "decoder" in config and "joiner" in config else "ctc"


def migrate_config(config: dict[str, Any],
                   record: _Recorder) -> tuple[dict[str, Any], int | None]:
    """This toolkit's config.json of CAT's `config`; and CAT's `num_classes` (or None)."""
    config = dict(config)
    kind = config_kind(config)
    out: dict[str, Any] = {}
    if "specaug" in config:
        out["specaug"] = _migrate_specaug(config.pop("specaug"), record)
    out["encoder"], classes = _migrate_encoder(config.pop("encoder", {}), kind, record)
    if kind == "ctc":
        out["ctc"] = {"dropout": 0.0}
    else:
        hdim = out["encoder"]["kwargs"].get("hdim")
        out["decoder"], predictor_classes = _migrate_decoder(config.pop("decoder"), record)
        out["joiner"], joiner_classes = _migrate_joiner(
            config.pop("joiner"), hdim, out["decoder"]["kwargs"].get("hdim"), record)
        classes = classes or joiner_classes or predictor_classes
    for key in ("trainer", "transducer"):
        if key in config:
            trainer = _migrate_trainer(config.pop(key), key, record)
            if key == "transducer":
                record.add("mapped", CONFIG_NAME, "transducer", "an older name of 'trainer'")
            if trainer:
                out.setdefault("trainer", {}).update(trainer)
    if "scheduler" in config:
        out["scheduler"] = _migrate_scheduler(config.pop("scheduler"), record)
    else:
        raise ConfigError(f"{CONFIG_NAME}: scheduler: missing")
    record.rest(CONFIG_NAME, "", config, "no such top-level key here")
    return out, classes


def migrate(hyper: dict[str, Any], config: dict[str, Any], new_exp: str,
            metainfo: dict[str, Any] | None = None) -> Migration:
    """Migrate CAT's `hyper` and `config`; the new files are validated against the schemas."""
    record = _Recorder()
    new_config, classes = migrate_config(config, record)
    if "den_lm" in new_config.get("trainer", {}):
        new_config["trainer"]["den_lm"] = f"{new_exp}/den_lm.npz"
    kind = config_kind(config)
    new_hyper, vocab = migrate_hyper(hyper, new_exp, kind, metainfo, record)
    if classes is not None:
        num_classes, source = classes, "config.json num_classes"
    else:
        num_classes, source = vocab, "tokenizer.option-train.vocab_size"
    validate_hyper(new_hyper, f"{new_exp}/{HYPER_NAME} (migrated)")
    validate_config(new_config, f"{new_exp}/{CONFIG_NAME} (migrated)")
    return Migration(new_hyper, new_config, record.entries, kind, num_classes, source)


def count_model_parameters(config: dict[str, Any], num_classes: int) -> int:
    """Parameters of the model `config` builds for `num_classes` classes.

    The model is built on torch's meta device: shapes only, no memory, no initialisation.
    """
    import torch

    from cat.models.registry import build_model, count_parameters
    with torch.device("meta"):
        return count_parameters(build_model(config, num_classes))



def staging_dir(new_exp: Path) -> Path:
    """Where NEW_EXP is written before it is renamed into place."""
    return new_exp.with_name(new_exp.name + ".tmp")


def check_directories(old_exp: Path, new_exp: Path) -> None:
    """Raise MigrationError when writing NEW_EXP (or its staging folder) would write into
    OLD_EXP or replace it (resolved paths, links followed)."""
    old = old_exp.resolve()
    for name, target in (("NEW_EXP", new_exp), ("NEW_EXP's staging folder",
                                                 staging_dir(new_exp))):
        resolved = target.resolve()
        if resolved == old or old in resolved.parents:
            where = "is" if resolved == old else "is inside"
            raise MigrationError(
                f"{name} {target} {where} OLD_EXP {old_exp} (resolved: {resolved}, "
                f"{old}): the migration would be written over CAT's experiment; choose a "
                "NEW_EXP outside it")
        if resolved in old.parents:
            raise MigrationError(
                f"OLD_EXP {old_exp} is inside {name} {target} (resolved: {old}, "
                f"{resolved}): writing NEW_EXP (--force replaces it) would delete CAT's "
                "experiment; choose a NEW_EXP outside it")


def write_experiment(migration: Migration, new_exp: Path, report: str, force: bool) -> None:
    """Write NEW_EXP (hyper-p.json, config.json, migration.txt) as a whole, then rename."""
    if new_exp.exists() and not force:
        raise FileExistsError(f"{new_exp} exists; choose another NEW_EXP or give --force")
    staging = staging_dir(new_exp)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name, document in ((HYPER_NAME, migration.hyper), (CONFIG_NAME, migration.config)):
        with atomic_write(staging / name) as f:
            json.dump(document, f, ensure_ascii=False, indent=2)
            f.write("\n")
    with atomic_write(staging / REPORT_NAME) as f:
        f.write(report)
    if new_exp.exists():
        shutil.rmtree(new_exp)
    staging.rename(new_exp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Turn a CAT v3 experiment (hyper-p.json + config.json) into this "
                    "toolkit's, naming every key that cannot be mapped.")
    parser.add_argument("old_exp", type=Path, help="CAT experiment dir (hyper-p.json, "
                        "config.json)")
    parser.add_argument("new_exp", type=Path, help="new experiment dir, written whole; its "
                        "path (relative to the recipe) also names the tokenizer file")
    parser.add_argument("--metainfo", type=Path, help="CAT's data/metainfo.json (default: "
                        "<recipe>/data/metainfo.json next to OLD_EXP's exp folder, if any)")
    parser.add_argument("--force", action="store_true", help="replace NEW_EXP if it exists")
    parser.add_argument("--no-count", action="store_true",
                        help="skip building the model to count its parameters")
    args = parser.parse_args(argv)
    check_directories(args.old_exp, args.new_exp)
    metainfo_path = args.metainfo or find_metainfo(args.old_exp)
    metainfo = read_json(metainfo_path) if metainfo_path else None
    migration = migrate(read_json(args.old_exp / HYPER_NAME),
                        read_json(args.old_exp / CONFIG_NAME), args.new_exp.as_posix(),
                        metainfo)
    parameters = None
    if not args.no_count and migration.num_classes:
        parameters = count_model_parameters(migration.config, migration.num_classes)
    report = migration.report(str(args.old_exp), str(args.new_exp), parameters)
    if metainfo_path:
        report += f"data names: {metainfo_path}\n"
    write_experiment(migration, args.new_exp, report, args.force)
    sys.stdout.write(report)
    print(f"wrote {args.new_exp}/{HYPER_NAME}, {CONFIG_NAME}, {REPORT_NAME}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ConfigError, MigrationError, FileNotFoundError, FileExistsError) as error:
        sys.exit(f"error: {error}")
