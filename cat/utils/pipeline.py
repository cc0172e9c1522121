"""Stages 2-5 of the recipes for one experiment, driven by `exp/<name>/hyper-p.json`.

* `prepare` (stage 2): trains the tokenizer (`tokenizer`: type, option-train, file)
  from the `text` files of `data.train`, unless the file exists, and writes map-style
  packs (`cat.formats.mappack`) of the training set (unless
  `train.option.large_dataset`) and of the dev set(s) to `exp/<name>/pack/`. The tar
  shards of `large_dataset` are written by the recipe's `local/prep_wds.py pack-exp`
  (`cat.formats.prep_wds`), from `data.shards`. Test sets get no pack: decoding reads
  their `feats.scp` directly, in the test set's own order and with its own ids, and
  scores against its `text`, so a pack (whose labels are token ids of the training
  tokenizer, made for training) would be written and never read.
* `train` (stage 3): runs `train.bin` (`python -m cat.ctc.train exp/<name>`, under
  `torchrun` with `--nproc` > 1); an interrupted run is resumed from its last checkpoint.
* `decode` (stage 4): averages checkpoints (`inference.avgmodel`), decodes every
  `data.test` set with `inference.infer` and scores it with `cat.utils.wer`; the table of
  results goes to `exp/<name>/RESULTS.md`.
* `lm` (stage 5): trains the n-gram LMs that `inference.lm` names (`cat.lm.train`), tunes
  each setting's weights on the dev set (grid search: shallow fusion and LODR weights by
  decoding, rescoring weights on the kept N-best lists), writes them to
  `exp/<name>/decode-lm/<setting>/weights.json`, decodes and scores every test set with
  them, and writes `exp/<name>/RESULTS-lm.md` (a no-LM row first). First passes are kept
  in `exp/<name>/decode-lm/first-pass/<set>/<pass>/` (`hyp`, `nbest.jsonl`, `decode.log`).

Each step records a signature of its inputs next to its output (`.done` files), so a
re-run skips finished work and redoes work whose inputs changed. Paths are relative to
the recipe directory, where the commands run.

Usage:
    python -m cat.utils.pipeline prepare exp/synth-ctc
    python -m cat.utils.pipeline train exp/synth-ctc --nproc 1
    python -m cat.utils.pipeline decode exp/synth-ctc --nj 2
    python -m cat.utils.pipeline lm exp/synth-ctc --nj 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cat.core.config import (
    CONFIG_NAME,
    HYPER_NAME,
    TrainOptions,
    apply_env,
    as_list,
    load_hyper,
    resolve_train_options,
)
from cat.core.io import PathLike, atomic_write, setup_logging
from cat.core.stages import is_done, mark_done, signature

logger = logging.getLogger(__name__)



# ---------------------------------------------------------------------------- helpers


def _set_name(feature_dir: str) -> str:
    """`data/fbank/test` -> `test`."""
    return Path(feature_dir).name


def _feature_files(feature_dirs: Sequence[str], names: Sequence[str]) -> list[Path]:
    files = []
    for directory in feature_dirs:
        for name in names:
            path = Path(directory) / name
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist (run stage 1 first)")
            files.append(path)
    return files


@dataclasses.dataclass
class Plan:
    """What stages 2-4 read from an experiment's `hyper-p.json`."""

    exp_dir: Path
    hyper: dict[str, Any]
    options: TrainOptions

    @classmethod
    def load(cls, exp_dir: PathLike) -> Plan:
        exp_dir = Path(exp_dir)
        hyper = load_hyper(exp_dir / HYPER_NAME)
        if "train" not in hyper:
            raise ValueError(f"{exp_dir / HYPER_NAME}: train: missing")
        options = resolve_train_options(hyper, exp_dir, str(exp_dir / HYPER_NAME))
        return cls(exp_dir, hyper, options)

    @property
    def data(self) -> dict[str, Any]:
        return self.hyper.get("data", {})

    def section(self, name: str) -> list[str]:
        value = as_list(self.data.get(name))
        if not value:
            raise ValueError(f"{self.exp_dir / HYPER_NAME}: data.{name} is not set")
        return value


# ----------------------------------------------------------------------------- stage 2


def prepare_tokenizer(plan: Plan) -> Path:
    """Train the tokenizer from `data.train` unless its file already exists."""
    from cat.text import tokenizer as tokenizers

    path = Path(plan.options.tokenizer)
    if path.is_file():
        logger.info("tokenizer %s exists; delete it to train a new one", path)
        return path
    section = plan.hyper.get("tokenizer", {})
    kind = section.get("type", "sentencepiece")
    option = dict(section.get("option-train", {}))
    texts = _feature_files(plan.section("train"), ["text"])
    logger.info("training a %s tokenizer on %s", kind, ", ".join(map(str, texts)))
    if kind == "sentencepiece":
        tokenizer = tokenizers.train_sentencepiece(texts, **option)
    else:
        tokenizer = tokenizers.train_jieba(texts, **option)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizers.save(tokenizer, path)
    logger.info("tokenizer %s: %d ids", path, tokenizer.vocab_size)
    return path


def prepare_pack(feature_dirs: Sequence[str], out: PathLike, tokenizer: PathLike,
                 frame_range: str | None) -> None:
    """A map-style pack of `feature_dirs` (skipped when up to date)."""
    from cat.formats.mappack import write_map_pack
    from cat.formats.tables import FrameRange

    scps = _feature_files(feature_dirs, ["feats.scp"])
    texts = _feature_files(feature_dirs, ["text"])
    sig = signature("pack", frame_range, files=[*scps, *texts, Path(tokenizer)])
    if is_done(out, sig):
        logger.info("%s is up to date", out)
        return
    counts = write_map_pack(scps, texts, tokenizer, out,
                            FrameRange.parse(frame_range) if frame_range else None)
    logger.info("packed %s: %s", out, counts)
    mark_done(out, sig)


def prepare(exp_dir: PathLike) -> None:
    """Stage 2 for one experiment: tokenizer and map-style packs (the tar shards are
    `cat.formats.prep_wds pack-exp`'s)."""
    plan = Plan.load(exp_dir)
    tokenizer = prepare_tokenizer(plan)
    options = plan.options
    if not options.large_dataset:
        prepare_pack(plan.section("train"), options.trset[0], tokenizer,
                     plan.data.get("filter"))
    if not options.dev_large_dataset:
        prepare_pack(plan.section("dev"), options.devset[0], tokenizer, None)


# ----------------------------------------------------------------------------- stage 3


def train(exp_dir: PathLike, nproc: int = 1) -> None:
    """Stage 3: run `train.bin` (resuming an interrupted run); skipped once finished."""
    plan = Plan.load(exp_dir)
    exp_dir = plan.exp_dir
    check = exp_dir / "check"
    config = exp_dir / CONFIG_NAME
    sig = signature("train", plan.hyper["train"], nproc, files=[exp_dir / HYPER_NAME, config])
    if is_done(check, sig):
        logger.info("%s is already trained; remove %s to train again", exp_dir, check)
        return
    command = [sys.executable, "-m", plan.hyper["train"]["bin"], str(exp_dir)]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", "-m", plan.hyper["train"]["bin"], str(exp_dir)]
    if (check / "checkpoints.json").is_file():
        logger.info("resuming the interrupted training of %s", exp_dir)
        command.append("--resume")
    apply_env(plan.hyper)
    logger.info("running %s", " ".join(command))
    subprocess.run(command, check=True)
    mark_done(check, sig)


# ----------------------------------------------------------------------------- stage 4


def select_checkpoint(plan: Plan) -> Path:
    """The model to decode: an average per `inference.avgmodel`, else the best checkpoint."""
    import torch

    from cat.training.checkpoint import CheckpointManager
    from cat.utils.avgmodel import average_checkpoints

    manager = CheckpointManager(plan.exp_dir / "check")
    average = plan.hyper.get("inference", {}).get("avgmodel")
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
    sig = signature("avgmodel", [p.name for p in paths], files=paths)
    if not is_done(out, sig):
        averaged = average_checkpoints(paths)
        with atomic_write(out, "wb") as f:
            torch.save({"model": averaged, "averaged_from": [p.name for p in paths]}, f)
        mark_done(out, sig)
        logger.info("averaged %d %s checkpoints into %s", len(paths), mode, out)
    return out


def decode(exp_dir: PathLike, nj: int = 1) -> Path:
    """Stage 4: decode and score every test set; returns the results table's path."""
    from cat.core.io import read_table
    from cat.decoding.inference import DecodeOptions, decode_set
    from cat.utils.wer import format_summary, score, write_alignments

    plan = Plan.load(exp_dir)
    inference = plan.hyper.get("inference", {})
    infer = inference.get("infer", {})
    kind = "rnnt" if plan.hyper["train"]["bin"] == "cat.rnnt.train" else "ctc"
    decoder = infer.get("bin", f"cat.{kind}.decode")
    if decoder != f"cat.{kind}.decode":
        raise ValueError(f"{plan.exp_dir / HYPER_NAME}: inference.infer.bin is {decoder}, "
                         f"but the model is trained by {plan.hyper['train']['bin']}")
    option = {"nj": nj, **infer.get("option", {})}
    options = DecodeOptions.from_dict(option, f"{plan.exp_dir / HYPER_NAME}: "
                                              "inference.infer.option")
    er = inference.get("er", {})
    unit = "char" if er.get("cer", True) else "word"
    checkpoint = select_checkpoint(plan)
    rows = []
    for test in plan.section("test"):
        name = _set_name(test)
        out = plan.exp_dir / "decode" / name
        sig = signature("decode", option, files=[checkpoint, Path(test) / "feats.scp"])
        if not is_done(out / "hyp", sig):
            decode_set(plan.exp_dir, test, checkpoint, out, kind, options)
            mark_done(out / "hyp", sig)
        refs = read_table(Path(test) / "text", allow_empty_value=True)
        hyps = read_table(out / "hyp", allow_empty_value=True)
        alignments: dict[str, Any] = {}
        result = score(refs, hyps, unit, alignments)
        summary = format_summary(result)
        with atomic_write(out / "score.txt") as f:
            f.write(summary + "\n")
        if er.get("per_utt"):
            write_alignments(out / "alignments.txt", alignments)
        rtf = json.loads((out / "decode.log").read_text(encoding="utf-8"))["rtf"]
        logger.info("%s: %s", name, summary.replace("\n", " | "))
        rows.append((name, result, rtf))
    table = _results_table(plan, checkpoint, options, unit, rows)
    path = plan.exp_dir / "RESULTS.md"
    with atomic_write(path) as f:
        f.write(table)
    return path


def _results_table(plan: Plan, checkpoint: Path, options: Any, unit: str,
                   rows: list[tuple[str, Any, float]]) -> str:
    metric = "CER" if unit == "char" else "WER"
    lines = [
        f"# Results of {plan.exp_dir}",
        "",
        f"Model: `{checkpoint}`; decoding: {options.method}"
        + (f", beam {options.beam_size}" if options.method == "beam" else ""),
        "",
        f"| set | %{metric} | errors / {unit}s | ins | del | sub | %SER | missing hyps | RTF |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result, rtf in rows:
        lines.append(
            f"| {name} | {result.error_rate:.2f} | {result.errors} / {result.total} | "
            f"{result.insertions} | {result.deletions} | {result.substitutions} | "
            f"{result.sentence_error_rate:.2f} | {len(result.missing)} | {rtf:.4f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- stage 5

LM_DIR_NAME = "decode-lm"
LM_RESULTS_NAME = "RESULTS-lm.md"


def train_lm(lm_dir: PathLike) -> Path:
    """Estimate `lm_dir/lm.json`'s n-gram unless `lm_dir/lm.arpa` is up to date; returns the
    file the decoders load (`lm.bin` when lm.json sets `binary`, else `lm.arpa`)."""
    from cat.lm.train import ARPA_NAME, input_files, load_lm_config, model_file
    from cat.lm.train import train as train_ngram

    lm_dir = Path(lm_dir)
    config = load_lm_config(lm_dir)
    for path in input_files(config):
        if not path.is_file():
            raise FileNotFoundError(f"{lm_dir / 'lm.json'}: {path} does not exist (the "
                                    "data stages, or the synthetic LM text, come first)")
    arpa = lm_dir / ARPA_NAME
    sig = signature("lm", config, files=input_files(config))
    if is_done(arpa, sig) and model_file(lm_dir, config).is_file():
        logger.info("%s is up to date", arpa)
        return model_file(lm_dir, config)
    train_ngram(lm_dir)
    mark_done(arpa, sig)
    return model_file(lm_dir, config)


def _grid(value: float | list[float] | None, default: float = 0.0) -> list[float]:
    if value is None:
        return [default]
    return [float(v) for v in value] if isinstance(value, list) else [float(value)]


def _pass_name(spec: Any) -> str:
    if spec is None:
        return "nolm"
    name = f"{Path(spec.lm).parent.name}-a{spec.alpha:g}-b{spec.beta:g}"
    if spec.lodr:
        name += f"-{Path(spec.lodr).parent.name}-w{spec.lodr_weight:g}"
    return name


@dataclasses.dataclass
class LMRun:
    """Stage 5 of one experiment: its plan, checkpoint, decoding options and LMs."""

    plan: Plan
    checkpoint: Path
    kind: str
    option: dict[str, Any]
    options: Any
    unit: str
    models: dict[str, Path] = dataclasses.field(default_factory=dict)

    @property
    def root(self) -> Path:
        return self.plan.exp_dir / LM_DIR_NAME

    def where(self, key: str) -> str:
        return f"{self.plan.exp_dir / HYPER_NAME}: inference.lm.{key}"

    def lm(self, lm_dir: str, key: str, token_level: bool) -> Path:
        """The model file of an LM experiment (trained when needed); fusion needs ASR
        tokens."""
        from cat.core.config import ConfigError
        from cat.lm.train import load_lm_config

        if lm_dir not in self.models:
            unit = load_lm_config(lm_dir)["unit"]
            if token_level and unit == "word":
                raise ConfigError(f"{self.where(key)}: {lm_dir} is a word-level model; shallow "
                                  "fusion scores the ASR tokens (unit char or tokenizer); use "
                                  "word models under 'rescore'")
            self.models[lm_dir] = train_lm(lm_dir)
        return self.models[lm_dir]

    def first_passes(self, data_dir: str, specs: list[Any]) -> list[Path]:
        """Output dirs of first passes of `data_dir` (decoding those not up to date in one
        run, sharing the network forward)."""
        from cat.decoding.inference import decode_passes

        outs = []
        missing: dict[Path, tuple[Any, str]] = {}
        for spec in specs:
            out = self.root / "first-pass" / _set_name(data_dir) / _pass_name(spec)
            files = [self.checkpoint, Path(data_dir) / "feats.scp"]
            if spec is not None:
                files += [Path(spec.lm)] + ([Path(spec.lodr)] if spec.lodr else [])
            sig = signature("lm-pass", self.option,
                            dataclasses.asdict(spec) if spec is not None else None, files=files)
            outs.append(out)
            if not is_done(out / "hyp", sig):
                missing[out] = (spec, sig)
        if missing:
            decode_passes(self.plan.exp_dir, data_dir, self.checkpoint, self.kind, self.options,
                          [(spec, out) for out, (spec, _) in missing.items()])
            for out, (_, sig) in missing.items():
                mark_done(out / "hyp", sig)
        return outs

    def score(self, data_dir: str, hyps: dict[str, str]) -> Any:
        from cat.core.io import read_table
        from cat.utils.wer import score

        refs = read_table(Path(data_dir) / "text", allow_empty_value=True)
        return score(refs, hyps, self.unit)


def _fusion_specs(run: LMRun, name: str, fusion: dict[str, Any]) -> list[Any]:
    from cat.decoding.inference import FusionSpec

    key = f"settings.{name}.fusion"
    lm = str(run.lm(fusion["lm"], f"{key}.lm", token_level=True))
    lodr = str(run.lm(fusion["lodr"], f"{key}.lodr", token_level=True)) \
        if "lodr" in fusion else None
    return [FusionSpec(lm, alpha, beta, lodr, weight)
            for alpha in _grid(fusion["alpha"]) for beta in _grid(fusion.get("beta"))
            for weight in _grid(fusion.get("lodr_weight"))]


def tune_setting(run: LMRun, name: str, setting: dict[str, Any], dev: str) -> dict[str, Any]:
    """Choose a setting's weights on `dev`; returns (and writes) `weights.json`."""
    from cat.core.io import read_table
    from cat.lm.rescore import NBEST_NAME, NBestScores, read_nbest
    from cat.lm.scorer import WordRescorer
    from cat.lm.text import make_splitter
    from cat.lm.train import load_lm_config

    report: dict[str, Any] = {"dev": dev, "fusion": None, "rescore": None,
                              "fusion_grid": [], "rescore_grid": []}
    specs = _fusion_specs(run, name, setting["fusion"]) if "fusion" in setting else [None]
    outs = run.first_passes(dev, specs)
    best_spec, best_out, best_error = None, outs[0], float("inf")
    for spec, out in zip(specs, outs, strict=True):
        result = run.score(dev, read_table(out / "hyp", allow_empty_value=True))
        if spec is not None:
            report["fusion_grid"].append({**_spec_weights(spec), "error_rate": result.error_rate})
        if result.error_rate < best_error:
            best_spec, best_out, best_error = spec, out, result.error_rate
    report["fusion"] = _spec_weights(best_spec) if best_spec is not None else None
    if "rescore" in setting:
        rescore = setting["rescore"]
        arpa = run.lm(rescore["lm"], f"settings.{name}.rescore.lm", token_level=False)
        config = load_lm_config(rescore["lm"])
        rescorer = WordRescorer(arpa, make_splitter(config["unit"], config.get("tokenizer")))
        scores = NBestScores.compute(read_nbest(best_out / NBEST_NAME), rescorer)
        best = None
        for alpha in _grid(rescore["alpha"]):
            for beta in _grid(rescore.get("beta")):
                error = run.score(dev, scores.best(alpha, beta)).error_rate
                report["rescore_grid"].append({"alpha": alpha, "beta": beta,
                                               "error_rate": error})
                if best is None or error < best[2]:
                    best = (alpha, beta, error)
        report["rescore"] = {"alpha": best[0], "beta": best[1]}
        best_error = best[2]
    report["dev_error_rate"] = best_error
    path = run.root / name / "weights.json"
    with atomic_write(path) as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    logger.info("%s: weights chosen on %s: fusion %s, rescoring %s (%.2f %%)", name, dev,
                report["fusion"], report["rescore"], best_error)
    return report


def _chosen_spec(run: LMRun, name: str, setting: dict[str, Any], weights: dict[str, Any]) -> Any:
    """The fusion spec of a setting's grid that `weights` (from `tune_setting`) chose."""
    return next(spec for spec in _fusion_specs(run, name, setting["fusion"])
                if _spec_weights(spec) == weights["fusion"])


def _spec_weights(spec: Any) -> dict[str, float]:
    weights = {"alpha": spec.alpha, "beta": spec.beta}
    if spec.lodr:
        weights["lodr_weight"] = spec.lodr_weight
    return weights


def decode_setting(run: LMRun, name: str, setting: dict[str, Any] | None,
                   weights: dict[str, Any] | None, test: str) -> tuple[Any, float]:
    """Decode and score one test set with a setting's chosen weights: (result, RTF)."""
    import time

    from cat.core.io import read_table
    from cat.lm.rescore import NBEST_NAME, NBestScores, read_nbest, write_hyp
    from cat.lm.scorer import WordRescorer
    from cat.lm.text import make_splitter
    from cat.lm.train import load_lm_config
    from cat.utils.wer import format_summary

    spec = None
    if setting is not None and "fusion" in setting:
        spec = _chosen_spec(run, name, setting, weights)
    out = run.first_passes(test, [spec])[0]
    target = run.root / name / _set_name(test)
    rescore = setting.get("rescore") if setting is not None else None
    files = [out / "hyp", out / NBEST_NAME]
    if rescore is not None:
        files.append(run.lm(rescore["lm"], f"settings.{name}.rescore.lm", token_level=False))
    sig = signature("lm-setting", weights, files=files)
    if is_done(target / "hyp", sig):
        hyps = read_table(target / "hyp", allow_empty_value=True)
        rtf = json.loads((target / "decode.json").read_text(encoding="utf-8"))["rtf"]
    else:
        log = json.loads((out / "decode.log").read_text(encoding="utf-8"))
        seconds = log["decode_seconds"]
        hyps = read_table(out / "hyp", allow_empty_value=True)
        if rescore is not None:
            start = time.perf_counter()
            config = load_lm_config(rescore["lm"])
            rescorer = WordRescorer(files[-1], make_splitter(config["unit"],
                                                             config.get("tokenizer")))
            scores = NBestScores.compute(read_nbest(out / NBEST_NAME), rescorer)
            hyps = scores.best(weights["rescore"]["alpha"], weights["rescore"]["beta"])
            seconds += time.perf_counter() - start
        rtf = seconds / log["audio_seconds"] if log["audio_seconds"] else 0.0
        write_hyp(target / "hyp", hyps)
        with atomic_write(target / "decode.json") as f:
            json.dump({"first_pass": str(out), "weights": weights, "seconds": round(seconds, 2),
                       "rtf": round(rtf, 4)}, f, indent=1)
            f.write("\n")
        mark_done(target / "hyp", sig)
    result = run.score(test, hyps)
    with atomic_write(target / "score.txt") as f:
        f.write(format_summary(result) + "\n")
    return result, rtf


def decode_lm(exp_dir: PathLike, nj: int = 1) -> Path | None:
    """Stage 5: tune, decode and score every `inference.lm` setting; returns the table's
    path, or None when the experiment names no language model."""
    from cat.decoding.inference import DecodeOptions

    plan = Plan.load(exp_dir)
    inference = plan.hyper.get("inference", {})
    section = inference.get("lm")
    if not section:
        logger.info("%s sets no inference.lm: no language model to decode with",
                    plan.exp_dir / HYPER_NAME)
        return None
    kind = "rnnt" if plan.hyper["train"]["bin"] == "cat.rnnt.train" else "ctc"
    option = {"nj": nj, **inference.get("infer", {}).get("option", {})}
    options = DecodeOptions.from_dict(option, f"{plan.exp_dir / HYPER_NAME}: "
                                              "inference.infer.option")
    unit = "char" if inference.get("er", {}).get("cer", True) else "word"
    run = LMRun(plan, select_checkpoint(plan), kind, option, options, unit)
    dev = section.get("dev") or plan.section("dev")[0]
    tests = plan.section("test")
    settings = section["settings"]
    # Every first pass a set needs is decoded in one run, sharing the network forward.
    run.first_passes(dev, [None, *(spec for name, setting in settings.items()
                                   if "fusion" in setting
                                   for spec in _fusion_specs(run, name, setting["fusion"]))])
    chosen = {name: tune_setting(run, name, setting, dev) for name, setting in settings.items()}
    for test in tests:
        run.first_passes(test, [None, *(_chosen_spec(run, name, setting, chosen[name])
                                        for name, setting in settings.items()
                                        if "fusion" in setting)])
    rows = [("none", None, [decode_setting(run, "none", None, None, t) for t in tests])]
    rows += [(name, chosen[name], [decode_setting(run, name, setting, chosen[name], t)
                                   for t in tests]) for name, setting in settings.items()]
    path = plan.exp_dir / LM_RESULTS_NAME
    with atomic_write(path) as f:
        f.write(_lm_table(run, dev, tests, rows))
    return path


def _lm_table(run: LMRun, dev: str, tests: list[str],
              rows: list[tuple[str, Any, list[tuple[Any, float]]]]) -> str:
    metric = "CER" if run.unit == "char" else "WER"
    lines = [f"# Results of {run.plan.exp_dir} with language models", "",
             f"Model: `{run.checkpoint}`; beam {run.options.beam_size}; weights chosen on "
             f"`{dev}` (`{LM_DIR_NAME}/<setting>/weights.json`).", "",
             "| setting | weights | " + " | ".join(f"{_set_name(t)} %{metric} | RTF"
                                                  for t in tests) + " |",
             "|---|---|" + "---:|---:|" * len(tests)]
    for name, weights, results in rows:
        described = "-"
        if weights:
            parts = []
            if weights["fusion"]:
                parts.append("fusion " + ", ".join(f"{k} {v:g}"
                                                   for k, v in weights["fusion"].items()))
            if weights["rescore"]:
                parts.append("rescore " + ", ".join(f"{k} {v:g}"
                                                    for k, v in weights["rescore"].items()))
            described = "; ".join(parts)
        cells = " | ".join(f"{r.error_rate:.2f} | {rtf:.4f}" for r, rtf in results)
        lines.append(f"| {name} | {described} | {cells} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cat.utils.pipeline",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("prepare", "stage 2: tokenizer and map-style packs"),
                            ("train", "stage 3: training"),
                            ("decode", "stage 4: decoding and scoring"),
                            ("lm", "stage 5: language models, decoding with them")):
        command = sub.add_parser(name, help=help_text)
        command.add_argument("exp_dir", help="experiment directory, e.g. exp/synth-ctc")
        if name == "train":
            command.add_argument("--nproc", type=int, default=1,
                                 help="training processes (torchrun when > 1)")
        else:
            command.add_argument("--nj", type=int, default=1, help="parallel jobs")
    args = parser.parse_args(argv)
    setup_logging()
    if args.command == "prepare":
        prepare(args.exp_dir)
    elif args.command == "train":
        train(args.exp_dir, args.nproc)
    elif args.command == "lm":
        table = decode_lm(args.exp_dir, args.nj)
        if table is not None:
            print(table.read_text(encoding="utf-8"), end="")
    else:
        decode(args.exp_dir, args.nj)
    return 0


if __name__ == "__main__":
    sys.exit(main())
