"""The shipped experiments derived from CAT's agree with CAT's own files, key by key.

Each CAT file (`cat_v3/`, verbatim) is migrated (`cat.migrate`) and compared with the
shipped experiment after schema defaults are filled in on both sides; every difference
must be named in `INTENDED` (or `COMMON`) with its reason, and every entry there must
still be a difference.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

import pytest

from cat.core.config import as_list, load_config_schema, read_json, train_option_defaults
from cat.migrate.experiment import migrate

CAT_EXPS = Path(__file__).with_name("cat_v3")
RECIPES = Path(__file__).parents[2] / "egs"
ABSENT = "<absent>"

# Shipped experiment -> the CAT experiment it was derived from (the recipes' READMEs).
DERIVED = {
    "aishell/exp/ctc-v1": "aishell-ctc-v1",
    "aishell/exp/rnnt-v1": "aishell-rnnt-v1",
    "aishell/exp/crf-v1": "aishell-ctc-crf-cuside",
    "aishell/exp/ctc-crf-cuside": "aishell-ctc-crf-cuside",
    "aishell/exp/rnnt-cuside": "aishell-rnnt-cuside",
    "aishell/exp/ctc-stream": "aishell-ctc-v1",
    "aishell/exp/rnnt-stream": "aishell-rnnt-v1",
    "wenetspeech/exp/train_m/ctc-v1": "wenetspeech-train_m-ctc-v1",
    "wenetspeech/exp/train_m/crf-v1": "wenetspeech-train_m-crf-v1",
    "wenetspeech/exp/train_l/crf-v1": "wenetspeech-train_l-crf-v1",
    "wenetspeech/exp/train_l/rnnt-v1": "wenetspeech-train_l-rnnt-v1",
}

# Differences every derived experiment may have (key patterns, fnmatch).
COMMON = {
    "hyper-p.json: train.option.workers": "loader settings of this toolkit (CAT: argparse "
    "defaults of its own loader)",
    "hyper-p.json: train.option.prefetch": "loader settings of this toolkit",
    "hyper-p.json: train.option.shuffle_buffer": "loader settings of this toolkit",
    "hyper-p.json: train.option.sort_buffer": "loader settings of this toolkit",
    "hyper-p.json: train.option.keep_checkpoints": "checkpoints kept for averaging",
    "hyper-p.json: train.option.epochs": "an upper bound; the schedule's stop_step ends "
    "training, as in CAT",
    "hyper-p.json: train.option.max_frames": "batches bounded by frames per rank here; "
    "CAT's batch_size / bucket is global over all GPUs",
    "hyper-p.json: train.option.batch_size": "per rank here, global over all GPUs in CAT",
    "hyper-p.json: train.option.grad_accum": "set with batch_size for the GPUs at hand",
    "hyper-p.json: data.filter": "utterances of 10 to 1,999 frames (CAT's filters vary; "
    "the shipped shards are packed in these length groups)",
    "hyper-p.json: inference.infer.option.nj": "decoding jobs for the machine at hand",
    "hyper-p.json: inference.infer.option.device": "decoding device for the machine at hand",
    "hyper-p.json: inference.lm.*": "stage 5's language-model settings; CAT keeps its LMs "
    "in separate experiments and decodes them by hand",
    "config.json: encoder.kwargs.global_cmvn": "global CMVN held in the model (CAT's "
    "experiments: torchaudio fbank without CMVN)",
    "config.json: scheduler.optimizer.type": "AdamW (decoupled weight decay) here; CAT's "
    "Adam adds weight_decay to the gradient",
    "config.json: scheduler.kwargs.peak_lr": "this toolkit's schedule for the release, "
    "not yet checked against CAT's (CAT's peaks are 2.8e-4 to 1.4e-3)",
    "config.json: scheduler.kwargs.stop_step": "this toolkit's schedule for the release",
    "config.json: specaug.*": "this toolkit's SpecAugment (5 time masks of up to 10 %, "
    "5 frames of time warp); CAT's varies by experiment",
    "config.json: ctc.dropout": "dropout before the CTC classifier (CAT: none)",
    "config.json: decoder.kwargs.dropout": "dropout on the predictor's embedding (CAT: "
    "between LSTM layers, of which there is one)",
    "hyper-p.json: tokenizer.option-train.add_dummy_prefix": "a char model's pieces hold "
    "no spaces: the prefix changes nothing",
}
SHARDS = "streaming shards of opus audio, packed by stage 2 (CAT v3 named its shards on "
"the command line)"
WENETSPEECH = {
    "hyper-p.json: data.shards.*": SHARDS,
    "hyper-p.json: train.option.trset": SHARDS,
    "hyper-p.json: data.train": "the audio data dir the shards are packed from",
    "hyper-p.json: train.option.audio.speed_perturb": "online speed perturbation of the "
    "audio shards",
}
AISHELL_STREAM = {
    "config.json: encoder.kwargs.causal_conv": "chunk training (egs/aishell/README.md: "
    "ctc-v1 / rnnt-v1 with U2-style chunks, not CAT's CUSIDE)",
    "config.json: encoder.kwargs.max_chunk_size": "chunk training",
    "config.json: encoder.kwargs.subsampling": "the streaming encoder (models.chunked) "
    "feeds chunks overlapping by the unpadded conv2d subsampling's 3 frames",
}
INTENDED: dict[str, dict[str, str]] = {
    "aishell/exp/ctc-v1": {
        "hyper-p.json: inference.infer.option.beam_size": "beam 16, CAT's RNN-T beam "
        "(its CTC decoding used 32)",
    },
    "aishell/exp/rnnt-v1": {},
    "aishell/exp/crf-v1": {
        "config.json: encoder.kwargs.num_cells": "the ctc-v1 Conformer with CAT's CTC-CRF "
        "loss (egs/aishell/README.md); CAT's only AISHELL CTC-CRF experiment is "
        "ctc-crf-cuside, 17 cells of kernel 32 trained with CUSIDE",
        "config.json: encoder.kwargs.num_heads": "the ctc-v1 Conformer",
        "config.json: encoder.kwargs.kernel_size": "the ctc-v1 Conformer",
        "config.json: encoder.kwargs.dropout": "the ctc-v1 Conformer",
        "config.json: encoder.kwargs.dropout_attn": "the ctc-v1 Conformer",
        "config.json: encoder.kwargs.subsampling": "the ctc-v1 Conformer (VGG2L)",
        "hyper-p.json: train.option.grad_norm": "ctc-v1's training settings",
        "hyper-p.json: tokenizer.option-train.lexicon": "the same file, AISHELL's "
        "resource_aishell/lexicon.txt, where this recipe's stage 0 puts it",
        "hyper-p.json: data.test": "dev and test decoded, as in ctc-v1",
        "hyper-p.json: inference.avgmodel.*": "ctc-v1's averaging",
        "hyper-p.json: inference.er.cer": "CER scoring, as in ctc-v1",
        "hyper-p.json: inference.infer.*": "stage 4 decodes the phones (phone error rate); "
        "CAT's cal_logit feeds its WFST decoding, which is stage 5 here",
        "config.json: trainer.chunk_size": "trained without CUSIDE (CAT's CUSIDE experiment "
        "is exp/ctc-crf-cuside)",
        "config.json: trainer.context_size_*": "trained without CUSIDE",
        "config.json: trainer.jitter_range": "trained without CUSIDE",
        "config.json: trainer.simu*": "trained without CUSIDE",
    },
    "aishell/exp/ctc-crf-cuside": {
        "hyper-p.json: tokenizer.option-train.lexicon": "the same file, AISHELL's "
        "resource_aishell/lexicon.txt, where this recipe's stage 0 puts it",
        "hyper-p.json: data.test": "dev and test decoded",
        "hyper-p.json: inference.er.cer": "CER scoring",
        "hyper-p.json: inference.infer.option.beam_size": "stage 4 decodes the phones "
        "(prefix beam 16); CAT's cal_logit feeds its WFST decoding, which is stage 5 here, "
        "in the same chunks (chunk_size)",
        "hyper-p.json: inference.infer.bin": "CAT's cal_logit (logits for its WFST decoding) "
        "is stage 4's decoding and stage 5's TLG here",
    },
    "aishell/exp/rnnt-cuside": {
        "hyper-p.json: data.test": "dev and test decoded",
    },
    "aishell/exp/ctc-stream": {
        **AISHELL_STREAM,
        "hyper-p.json: inference.infer.option.beam_size": "as ctc-v1",
    },
    "aishell/exp/rnnt-stream": {
        **AISHELL_STREAM,
        "config.json: decoder.*": "icefall's stateless predictor, which sherpa-onnx's "
        "transducer runs (egs/aishell/README.md)",
        "config.json: encoder.kwargs.time_reduction_*": "chunk training needs the extra "
        "reduction before the first block (models.encoder: time_reduction_position 0)",
    },
    "wenetspeech/exp/train_m/ctc-v1": {
        **WENETSPEECH,
        "hyper-p.json: train.option.large_dataset": SHARDS,
        "hyper-p.json: data.test": "the same sets in the order of the results table",
        "hyper-p.json: train.option.check_freq": "checkpoints every 1,000 updates",
        "hyper-p.json: inference.infer.*": "CTC beam search (CAT's file has inference.decode, "
        "a key its v3 pipeline does not read)",
    },
    "wenetspeech/exp/train_m/crf-v1": {
        **WENETSPEECH,
        "hyper-p.json: train.option.large_dataset": SHARDS,
        "hyper-p.json: train.option.check_freq": "checkpoints every 1,000 updates",
        "hyper-p.json: inference.avgmodel.mode": "best checkpoints by dev loss (CAT took "
        "the last ten: its dev set was processed in error, its readme says)",
        "hyper-p.json: inference.er.cer": "CER scoring",
        "hyper-p.json: inference.infer.*": "stage 4 decodes the phones; WFST decoding is "
        "stage 5",
    },
    "wenetspeech/exp/train_l/crf-v1": {
        **WENETSPEECH,
        "hyper-p.json: train.option.large_dataset": SHARDS,
        "hyper-p.json: data.test": "CAT's file says dtest (a key of its older code); the "
        "same sets without AISHELL's",
        "hyper-p.json: train.option.check_freq": "checkpoints every 1,000 updates",
        "hyper-p.json: inference.er.cer": "CER scoring",
        "hyper-p.json: inference.infer.*": "stage 4 decodes the phones; WFST decoding is "
        "stage 5",
    },
    "wenetspeech/exp/train_l/rnnt-v1": {
        **WENETSPEECH,
        "hyper-p.json: train.option.filter": "CAT's data.filter 10:1000 (inclusive) kept for "
        "training",
        "hyper-p.json: inference.avgmodel.num": "CAT's readme reports the average of the "
        "5 best",
    },
}


def _flatten(document: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _with_defaults(section: dict[str, Any] | None, definition: str) -> dict[str, Any]:
    properties = load_config_schema()["$defs"][definition].get("properties", {})
    filled = {k: spec["default"] for k, spec in properties.items() if "default" in spec}
    return {**filled, **(section or {})}


def _normalised_config(config: dict[str, Any]) -> dict[str, Any]:
    config = json.loads(json.dumps(config))
    encoder = config["encoder"]
    encoder["kwargs"] = _with_defaults(encoder.get("kwargs"), encoder["type"])
    for name in ("ctc", "specaug"):
        if name in config:
            config[name] = _with_defaults(config[name], name)
    config["trainer"] = _with_defaults(config.get("trainer"), "trainer")
    if not config["trainer"]["use_crf"]:  # the CRF's keys mean nothing without it
        config["trainer"] = {k: v for k, v in config["trainer"].items()
                             if not k.startswith(("lamb", "den_lm"))}
    for name in ("decoder", "joiner"):
        if name in config:
            config[name]["kwargs"] = _with_defaults(config[name].get("kwargs"),
                                                    config[name]["type"])
    config["trainer"].pop("den_lm", None)  # where stage 2 writes the graph
    return config


def _normalised_hyper(hyper: dict[str, Any]) -> dict[str, Any]:
    hyper = json.loads(json.dumps(hyper))
    for part in ("train", "dev", "test"):
        if part in hyper.get("data", {}):
            hyper["data"][part] = as_list(hyper["data"][part])
    defaults = {k: v for k, v in train_option_defaults().items() if v is not None}
    hyper["train"]["option"] = {**defaults, **hyper["train"]["option"]}
    hyper["train"].pop("bin", None)  # an alias of the verb; config.json decides the kind
    return hyper


def differences(exp: str, hyper: dict[str, Any] | None = None,
                config: dict[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """{'<file>: <key>': (CAT's migrated value, the shipped value)} where they differ;
    `hyper` / `config` replace the shipped files."""
    cat = CAT_EXPS / DERIVED[exp]
    new_exp = "exp/" + exp.split("/exp/", 1)[1]
    migration = migrate(read_json(cat / "hyper-p.json"), read_json(cat / "config.json"),
                        new_exp)
    shipped = RECIPES / exp
    hyper = hyper if hyper is not None else read_json(shipped / "hyper-p.json")
    config = config if config is not None else read_json(shipped / "config.json")
    found: dict[str, tuple[Any, Any]] = {}
    for name, theirs, ours in (
            ("hyper-p.json", _normalised_hyper(migration.hyper), _normalised_hyper(hyper)),
            ("config.json", _normalised_config(migration.config), _normalised_config(config))):
        theirs, ours = _flatten(theirs), _flatten(ours)
        for key in sorted(set(theirs) | set(ours)):
            pair = (theirs.get(key, ABSENT), ours.get(key, ABSENT))
            if pair[0] != pair[1]:
                found[f"{name}: {key}"] = pair
    return found


def _unexplained(exp: str, found: dict[str, tuple[Any, Any]]) -> list[str]:
    allowed = {**COMMON, **INTENDED[exp]}
    return [f"{key}: CAT {json.dumps(pair[0])}, shipped {json.dumps(pair[1])}"
            for key, pair in found.items()
            if not any(fnmatch.fnmatchcase(key, pattern) for pattern in allowed)]


@pytest.mark.parametrize("exp", sorted(DERIVED))
def test_shipped_experiment_differs_from_cats_only_as_documented(exp):
    found = differences(exp)
    assert _unexplained(exp, found) == []
    stale = [pattern for pattern in INTENDED[exp]
             if not any(fnmatch.fnmatchcase(key, pattern) for key in found)]
    assert stale == [], "documented differences that are no longer differences"


def test_every_release_experiment_is_compared():
    # The experiments for the real releases are CAT's (the READMEs' tables); synth-* and
    # tiny-* are this toolkit's own, for the synthetic corpora and CI; gap-* are
    # bench/stream_gap.py's variants.
    shipped = {str(p.parent.relative_to(RECIPES)) for p in RECIPES.glob("*/exp/**/config.json")
               if not p.parent.name.startswith(("synth-", "tiny-", "gap-"))}
    assert shipped == set(DERIVED)


@pytest.mark.parametrize(("exp", "file", "key", "value"), [
    ("wenetspeech/exp/train_m/crf-v1", "hyper", "train.option.grad_norm", 2.0),
    ("wenetspeech/exp/train_m/crf-v1", "config", "scheduler.optimizer.kwargs.weight_decay",
     5e-6),
    ("wenetspeech/exp/train_m/ctc-v1", "hyper", "train.option.grad_norm", 5.0),
    ("aishell/exp/rnnt-v1", "config", "encoder.kwargs.kernel_size", 31),
])
def test_a_value_off_cats_is_named(exp, file, key, value):
    documents = {name: read_json(RECIPES / exp / f"{name}.json")
                 for name in ("hyper-p", "config")}
    name = "hyper-p" if file == "hyper" else "config"
    *parents, last = key.split(".")
    section = documents[name]
    for part in parents:
        section = section[part]
    section[last] = value
    found = differences(exp, documents["hyper-p"], documents["config"])
    assert _unexplained(exp, found) == [
        f"{name}.json: {key}: CAT {json.dumps(found[f'{name}.json: {key}'][0])}, shipped "
        f"{json.dumps(value)}"]


@pytest.mark.parametrize(("exp", "same_as"), [
    ("aishell/exp/crf-v1", "aishell/exp/ctc-v1"),
    ("wenetspeech/exp/train_m/crf-v1", "wenetspeech/exp/train_m/ctc-v1"),
    ("wenetspeech/exp/train_l/crf-v1", "wenetspeech/exp/train_m/ctc-v1"),
])
def test_ctc_crf_experiments_have_the_ctc_conformer(exp, same_as):
    # The READMEs: "the ctc-v1 Conformer over phones", "the same Conformer over phones".
    encoders = [read_json(RECIPES / e / "config.json")["encoder"] for e in (exp, same_as)]
    assert encoders[0] == encoders[1]
