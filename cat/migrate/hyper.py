"""CAT v3 `hyper-p.json` into this toolkit's: data names, tokenizer, training and inference
options (`cat.migrate`, whose docstring says how data names map)."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

from cat.core.config import HYPER_NAME, ConfigError
from cat.formats.tables import FrameRange
from cat.migrate.record import Recorder, option_key

TOKENIZER_TYPES = {"SentencePieceTokenizer": "sentencepiece", "JiebaTokenizer": "jieba",
                   "JiebaComposeLexiconTokenizer": "lexicon"}
# How this toolkit's lexicon tokenizer (cat.text.lexicon) differs from CAT's
# JiebaComposeLexiconTokenizer (cat/shared/tokenizer.py), which has the same units.
LEXICON_DIFFERENCES = (
    "same units (<blk> for CAT's <s> 0, <unk> 1, then the phones; here sorted, CAT's in set "
    "order) and first pronunciations; segmentation here is jieba's default dictionary plus "
    "the lexicon's words (CAT: its userdict, else jieba's default), and a word missing from "
    "the lexicon is spelled from its longest lexicon pieces (CAT: <unk> for the whole word)")
# The recipes' lexicon, what a CAT experiment naming none gets.
RECIPE_LEXICON = "data/local/lexicon.txt"
# CAT's hyper-p.json train.option keys (v3.0 and later) with the same meaning here.
SAME_TRAIN_OPTIONS = ("amp", "batch_size", "grad_norm", "seed", "workers", "tokenizer")
# train.option keys this toolkit's launcher or pipeline sets (CAT's argparse defaults).
LAUNCHER_OPTIONS = ("dist_url", "dist_backend", "world_size", "rank", "gpu", "dir", "config",
                    "debug", "verbose", "print_freq")


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
                  record: Recorder) -> dict[str, Any]:
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
                       record: Recorder) -> tuple[dict[str, Any], int | None]:
    tokenizer = dict(tokenizer)
    out: dict[str, Any] = {}
    cat_type = tokenizer.pop("type", None)
    if cat_type in TOKENIZER_TYPES:
        out["type"] = TOKENIZER_TYPES[cat_type]
    if cat_type == "JiebaComposeLexiconTokenizer":
        record.add("mapped", HYPER_NAME, "tokenizer.type",
                   f"{cat_type!r} -> 'lexicon': {LEXICON_DIFFERENCES}")
        out["option-train"] = _lexicon_options(dict(tokenizer.pop("option-init", {})), record)
    elif cat_type in TOKENIZER_TYPES:
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


def crf_tokenizer(new_exp: str, record: Recorder) -> dict[str, Any]:
    """The lexicon tokenizer of a CTC-CRF experiment whose hyper-p.json names no tokenizer
    (CAT's older experiments took their phones from the data preparation)."""
    record.add("not mapped", HYPER_NAME, "tokenizer",
               f"(absent): CAT's CTC-CRF experiment names no tokenizer; its phones came from "
               f"its data preparation. Set: the lexicon tokenizer of {RECIPE_LEXICON}")
    return {"type": "lexicon", "option-train": {"lexicon": RECIPE_LEXICON},
            "file": f"{new_exp}/tokenizer.tknz"}


def _lexicon_options(init: dict[str, Any], record: Recorder) -> dict[str, Any]:
    """option-train of the lexicon tokenizer for CAT's JiebaComposeLexiconTokenizer
    `option-init` (its constructor's arguments)."""
    where = "tokenizer.option-init."
    lexicon = init.pop("lexicon", "")
    if lexicon:
        record.add("mapped", HYPER_NAME, where + "lexicon", f"-> option-train.lexicon {lexicon!r}")
    else:
        lexicon = RECIPE_LEXICON
        record.add("not mapped", HYPER_NAME, where + "lexicon",
                   f"{json.dumps(init.get('lexicon', ''))}: CAT names no lexicon file; "
                   f"option-train.lexicon is the recipe's {RECIPE_LEXICON}")
    userdict = init.pop("userdict", None)
    if userdict:
        record.add("not mapped", HYPER_NAME, where + "userdict",
                   f"{userdict!r}: CAT segments with this jieba dictionary instead of jieba's "
                   "own; here jieba's default dictionary plus the lexicon's words")
    elif userdict is not None:
        record.add("dropped", HYPER_NAME, where + "userdict",
                   f"{json.dumps(userdict)}: no dictionary, jieba's default, as here")
    for key, default, why in (("add_special_token", True, "<blk> 0 and <unk> 1 are always "
                               "added here"),
                              ("bos_interface", "<s>", "the id-0 unit is <blk> here"),
                              ("unk_interface", "<unk>", "the unknown unit is <unk> here")):
        if key in init:
            value = init.pop(key)
            record.add("dropped" if value == default else "not mapped", HYPER_NAME,
                       where + key, f"{json.dumps(value)}: {why}")
    record.rest(HYPER_NAME, where, init, "no such lexicon tokenizer option here")
    return {"lexicon": lexicon}


# --- train.option -----------------------------------------------------------------------

def _migrate_train_option(option: dict[str, Any], data: dict[str, Any],
                          record: Recorder) -> dict[str, Any]:
    start, spellings = len(record.entries), {option_key(k): k for k in option}
    out = _migrate_train_options({option_key(k): v for k, v in option.items()}, data, record)
    record.respell(start, "train.option.", spellings)
    return out


def _migrate_train_options(option: dict[str, Any], data: dict[str, Any],
                           record: Recorder) -> dict[str, Any]:
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


def _migrate_batching(option: dict[str, Any], out: dict[str, Any], record: Recorder) -> None:
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


def _shard_pattern(trset: Any, data: dict[str, Any], record: Recorder) -> str:
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

def _migrate_inference(inference: dict[str, Any], record: Recorder) -> dict[str, Any]:
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
        elif infer.get("bin") == "cat.ctc.cal_logit":
            record.add("not mapped", HYPER_NAME, "inference.infer.bin",
                       f"{infer.pop('bin')!r}: CAT writes log-posteriors for its Kaldi WFST "
                       "decoding; here stage 5 decodes with a TLG graph (inference.lm "
                       "settings with 'wfst')")
        cat_option = dict(infer.pop("option", {}))
        start, spellings = len(record.entries), {option_key(k): k for k in cat_option}
        option = {option_key(k): v for k, v in cat_option.items()}
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
        if option.pop("streaming", False) is True:
            new_option["chunk_size"] = STREAMING_CHUNK
            record.add("mapped", HYPER_NAME, "inference.infer.option.streaming",
                       "true -> chunk_size (CUSIDE's trained chunk in encoder frames, "
                       "set by migrate): stage 4 decodes in chunks with simulated right "
                       "context, as CAT's chunk_infer")
        for key in ("unified", "built_model_by"):
            if key in option:
                record.add("dropped", HYPER_NAME, f"inference.infer.option.{key}",
                           f"{json.dumps(option.pop(key))}: the model's config.json says "
                           "how it was trained (trainer.chunk_size: CUSIDE)")
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


#: Placeholder of `inference.infer.option.chunk_size` for CAT's `streaming: true`, which
#: `cat.migrate.migrate` replaces with the CUSIDE chunk in encoder frames.
STREAMING_CHUNK = -1


def migrate_hyper(hyper: dict[str, Any], new_exp: str, kind: str,
                  metainfo: dict[str, Any] | None,
                  record: Recorder) -> tuple[dict[str, Any], int | None]:
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
    if cat_bin == f"cat.{kind}.train_unified":
        record.add("mapped", HYPER_NAME, "train.bin",
                   f"{cat_bin!r} -> {out['train']['bin']!r}: CUSIDE's unified training is "
                   "config.json's trainer.chunk_size")
    elif cat_bin != out["train"]["bin"]:
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
