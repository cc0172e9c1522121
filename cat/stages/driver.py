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
  `torchrun` with `--nproc` > 1; with `--cmd` naming the slurm backend, one Slurm job of
  `--nnodes` nodes, `cat.training.jobs`); an interrupted run is resumed from its last
  checkpoint. SIGINT and SIGTERM are passed on to the training, which saves and stops
  (on Slurm: the job is cancelled for good, `scancel`); the command then exits with status
  75, saying how to resume, and the stage is not marked done. A Slurm job cancelled by a
  user ends stage 3 the same way.
* `decode` (stage 4): averages checkpoints (`inference.avgmodel`), decodes every
  `data.test` set with `inference.infer` and scores it with `cat.scoring`; the table of
  results goes to `exp/<name>/RESULTS.md`. When every hypothesis of a set is empty or
  one token repeated (a model that outputs only blanks), RESULTS.md says it is not a
  result and the stage fails, naming the checkpoint and its updates.
* `feature-dirs` (for stage 1): prints the feature dirs (`data/fbank/<set>`) that
  `data.train`, `data.dev` and `data.test` name, one per line, so that stage 1 extracts
  only what the experiment reads: with audio shards (`data.shards.audio`) `data.train`
  names Kaldi data dirs, and the training set needs no stage-1 features; `front-end`
  prints the front end stage 1 computes them with (`data.front_end`), which stages 2 and
  4 check against each feature dir's `fbank.json`.
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
    python -m cat.stages.driver prepare exp/synth-ctc
    python -m cat.stages.driver train exp/synth-ctc --nproc 1
    python -m cat.stages.driver train exp/ctc-v1 --cmd "$train_cmd" --nnodes 2 \
        --gpus-per-node 4
    python -m cat.stages.driver decode exp/synth-ctc --nj 2
    python -m cat.stages.driver lm exp/synth-ctc --nj 2
    python -m cat.stages.driver feature-dirs exp/synth-ctc  # what stage 1 must extract
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from cat.core.config import (
    CONFIG_NAME,
    HYPER_NAME,
    ConfigError,
    apply_env,
    as_list,
)
from cat.core.io import PathLike, atomic_write, setup_logging
from cat.core.launch import (
    ArrayJobError,
    Interrupted,
    Launcher,
    LaunchError,
    add_cmd_argument,
)
from cat.core.stages import is_done, mark_done, signature
from cat.stages.lm import decode_lm
from cat.stages.plan import Plan, feature_files, phone_references, select_checkpoint, set_name
from cat.training.preemption import STOPPED_EXIT_STATUS

logger = logging.getLogger(__name__)


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
    texts = feature_files(plan.section("train"), ["text"])
    logger.info("training a %s tokenizer on %s", kind, ", ".join(map(str, texts)))
    if kind == "sentencepiece":
        tokenizer = tokenizers.train_sentencepiece(texts, **option)
    elif kind == "lexicon":
        from cat.text.lexicon import lexicon_tokenizer

        tokenizer = lexicon_tokenizer(option["lexicon"], texts)
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

    scps = feature_files(feature_dirs, ["feats.scp"])
    texts = feature_files(feature_dirs, ["text"])
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
    check_front_ends(plan, feature_dirs(exp_dir))
    tokenizer = prepare_tokenizer(plan)
    options = plan.options
    if not options.large_dataset:
        prepare_pack(plan.section("train"), options.trset[0], tokenizer,
                     plan.data.get("filter"))
    if not options.dev_large_dataset:
        prepare_pack(plan.section("dev"), options.devset[0], tokenizer, None)
    prepare_model_kind(plan, tokenizer)


def check_front_ends(plan: Plan, directories: Iterable[str]) -> None:
    """ConfigError when a feature dir's features are not of the experiment's front end
    (`data.front_end`; each dir's `fbank.json`, stage 1's record)."""
    from cat.features.fbank import check_front_end, experiment_front_end

    source = str(plan.exp_dir / HYPER_NAME)
    options = experiment_front_end(plan.hyper)
    for directory in directories:
        if (Path(directory) / "feats.scp").is_file():
            try:
                check_front_end(directory, options, source)
            except ValueError as error:
                raise ConfigError(str(error)) from None


def prepare_model_kind(plan: Plan, tokenizer: PathLike) -> None:
    """What the experiment's model kind needs before training, the hook its family gives the
    registry (`cat.models.registry.before_training`; CTC-CRF: the denominator graph
    `trainer.den_lm` from the training transcripts, skipped when up to date)."""
    from cat.core.config import load_config, model_kind
    from cat.models.registry import before_training

    path = plan.exp_dir / CONFIG_NAME
    config = load_config(path)
    hook = before_training(model_kind(config, str(path)))
    if hook is not None:
        hook(config, feature_files(plan.section("train"), ["text"]), tokenizer)


# ----------------------------------------------------------------------------- stage 3


class TrainingInterrupted(RuntimeError):
    """Stage 3 stopped on a signal after its ranks saved a checkpoint: re-run to resume."""


class TrainingFailed(RuntimeError):
    """Stage 3's training processes (or its Slurm job) failed."""


def train(exp_dir: PathLike, nproc: int = 1, launcher: Launcher | None = None,
          nnodes: int = 1, gpus_per_node: int = 0) -> None:
    """Stage 3: run `train.bin` (resuming an interrupted run); skipped once finished.

    Here with `nproc` ranks (torchrun when > 1), or, with a slurm `launcher`, as one Slurm
    job of `nnodes` nodes with a rank per GPU (`gpus_per_node`) or `nproc` CPU ranks per
    node (`cat.training.jobs`). A run stopped by a signal (saved, status 75) raises
    `TrainingInterrupted`; the stage is marked done only when training finished.
    """
    from cat.training.jobs import (
        SLURM_LOG,
        resume_command,
        run_here,
        run_on_slurm,
        train_command,
    )

    plan = Plan.load(exp_dir)
    exp_dir = plan.exp_dir
    check = exp_dir / "check"
    config = exp_dir / CONFIG_NAME
    on_slurm = launcher is not None and not launcher.is_local
    ranks = (nnodes * (gpus_per_node or nproc)) if on_slurm else nproc
    sig = signature("train", plan.hyper["train"], ranks, files=[exp_dir / HYPER_NAME, config])
    if is_done(check, sig):
        logger.info("%s is already trained; remove %s to train again", exp_dir, check)
        return
    train_bin = plan.hyper["train"]["bin"]
    apply_env(plan.hyper)
    forwarded: list[str] = []
    resume = f"run stage 3 again to resume it: {resume_command(str(exp_dir))}"
    if on_slurm:
        try:
            end = run_on_slurm(launcher, train_bin, str(exp_dir), nnodes,
                               gpus_per_node or nproc, gpus_per_node)
        except (Interrupted, KeyboardInterrupt) as error:
            raise TrainingInterrupted(
                f"training of {exp_dir} stopped: {error or 'SIGINT received'}, its Slurm job "
                f"cancelled; its checkpoints are kept ({trained_updates(exp_dir)} updates); "
                f"{resume}") from None
        status = end.status
        where = exp_dir / SLURM_LOG
        if end.state == "CANCELLED" and status != 0:
            raise TrainingInterrupted(
                f"training of {exp_dir} stopped: its Slurm job {end.job_id} was cancelled "
                f"(scancel), not requeued; its checkpoints are kept "
                f"({trained_updates(exp_dir)} updates); {resume}")
    else:
        resumed = (check / "checkpoints.json").is_file()
        if resumed:
            logger.info("resuming the interrupted training of %s", exp_dir)
        status, forwarded = run_here(train_command(train_bin, str(exp_dir), nproc, resumed))
        where = exp_dir / "log"
    if status == STOPPED_EXIT_STATUS or (forwarded and status != 0):
        raise TrainingInterrupted(
            f"training of {exp_dir} stopped on {', '.join(forwarded) or 'a signal'} after "
            f"saving a checkpoint ({trained_updates(exp_dir)} updates); {resume}")
    if status != 0:
        ended = "ended without a status (cancelled, or killed by Slurm: time limit, memory, " \
                "node failure)" if status is None else f"failed with status {status}"
        raise TrainingFailed(f"training of {exp_dir} {ended}; see {where}")
    mark_done(check, sig)


def decode(exp_dir: PathLike, nj: int = 1, launcher: Launcher | None = None) -> Path:
    """Stage 4: decode and score every test set; returns the results table's path. With a
    `launcher` each set is decoded by `nj` tasks of an array job (`cat.core.launch`)."""
    from cat.core.io import read_table
    from cat.decoding.inference import DecodeOptions, decode_set
    from cat.models.registry import check_command
    from cat.scoring import format_summary, score, write_alignments

    plan = Plan.load(exp_dir)
    inference = plan.hyper.get("inference", {})
    infer = inference.get("infer", {})
    kind = plan.kind
    check_command(infer.get("bin", "cat.decode"), kind,
                  f"{plan.exp_dir / HYPER_NAME}: inference.infer.bin")
    option = {"nj": nj, **infer.get("option", {})}
    options = DecodeOptions.from_dict(option, f"{plan.exp_dir / HYPER_NAME}: "
                                              "inference.infer.option")
    er = inference.get("er", {})
    unit = "char" if er.get("cer", True) else "word"
    checkpoint = select_checkpoint(plan)
    rows = []
    degenerate = []
    check_front_ends(plan, plan.section("test"))
    for test in plan.section("test"):
        name = set_name(test)
        out = plan.exp_dir / "decode" / name
        # The hotwords file's content decides the hypotheses too, not only its name.
        hotwords = [Path(options.hotwords)] if options.hotwords else []
        graph = [Path(options.tlg) / "TLG.fst"] if options.tlg else []
        sig = signature("decode", option,
                        files=[checkpoint, Path(test) / "feats.scp", *hotwords, *graph])
        if not is_done(out / "hyp", sig):
            decode_set(plan.exp_dir, test, checkpoint, out, options, launcher)
            mark_done(out / "hyp", sig)
        refs = read_table(Path(test) / "text", allow_empty_value=True)
        hyps = read_table(out / "hyp", allow_empty_value=True)
        alignments: dict[str, Any] = {}
        # A phone model's own searches give phones (a phone error rate); TLG gives words.
        phones = None if options.tlg else phone_references(plan, refs)
        if phones is not None:
            refs, unit = phones, "phone"
        result = score(refs, hyps, "word" if unit == "phone" else unit, alignments)
        summary = format_summary(result)
        with atomic_write(out / "score.txt") as f:
            f.write(summary + "\n")
        if er.get("per_utt"):
            write_alignments(out / "alignments.txt", alignments)
        rtf = json.loads((out / "decode.log").read_text(encoding="utf-8"))["rtf"]
        logger.info("%s: %s", name, summary.replace("\n", " | "))
        rows.append((name, result, rtf))
        if is_degenerate(hyps.values()):
            degenerate.append(name)
    table = _results_table(plan, checkpoint, options, unit, rows)
    problem = None
    if degenerate:
        updates = trained_updates(plan.exp_dir)
        problem = (f"the model {checkpoint} (trained for {updates} updates) is degenerate: "
                   f"every hypothesis of {', '.join(degenerate)} is empty or one token "
                   "repeated, so these figures measure no trained model (too few updates, "
                   "or non-finite training?)")
        table += f"\n**Not a result**: {problem}.\n"
    path = plan.exp_dir / "RESULTS.md"
    with atomic_write(path) as f:
        f.write(table)
    if problem and er.get("allow_degenerate"):
        logger.warning("%s; see %s (inference.er.allow_degenerate: recorded, not stopped)",
                       problem, path)
    elif problem:
        raise DegenerateModelError(f"{problem}; see {path}")
    return path


class DegenerateModelError(RuntimeError):
    """Stage 4 decoded only empty (or one-token) hypotheses for a test set."""


def is_degenerate(hyps: Iterable[str]) -> bool:
    """True when every hypothesis is empty or repeats one token, the same one for all
    (e.g. a CTC model that outputs only blanks); False for an empty set."""
    tokens: set[str] = set()
    count = 0
    for hyp in hyps:
        count += 1
        tokens.update(hyp.split() if " " in hyp.strip() else hyp.strip())
        if len(tokens) > 1:
            return False
    return count > 0


def trained_updates(exp_dir: Path) -> int | str:
    """Optimizer updates of the experiment's latest checkpoint ('unknown' without one)."""
    from cat.training.checkpoint import CheckpointManager

    try:
        records = CheckpointManager(exp_dir / "check").records
    except (OSError, ValueError):
        return "unknown"
    return max((int(r["step"]) for r in records), default="unknown")


def _results_table(plan: Plan, checkpoint: Path, options: Any, unit: str,
                   rows: list[tuple[str, Any, float]]) -> str:
    metric = {"char": "CER", "phone": "PER"}.get(unit, "WER")
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



# ----------------------------------------------------------------------------- CLI


def feature_dirs(exp_dir: PathLike) -> list[str]:
    """The feature dirs the experiment reads (data dirs with a `feats.scp` to be made),
    in `data.train`, `data.dev`, `data.test` order, each once."""
    plan = Plan.load(exp_dir)
    audio = (plan.data.get("shards") or {}).get("audio") is not None
    found: list[str] = []
    for section in ("train", "dev", "test"):
        if section == "train" and audio:
            continue  # Kaldi data dirs, packed as audio
        for directory in as_list(plan.data.get(section)):
            if directory not in found:
                found.append(directory)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cat.stages.driver",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("prepare", "stage 2: tokenizer and map-style packs"),
                            ("train", "stage 3: training"),
                            ("decode", "stage 4: decoding and scoring"),
                            ("lm", "stage 5: language models, decoding with them"),
                            ("feature-dirs", "the feature dirs stage 1 must extract"),
                            ("front-end", "the fbank front end stage 1 extracts them with")):
        command = sub.add_parser(name, help=help_text)
        command.add_argument("exp_dir", help="experiment directory, e.g. exp/synth-ctc")
        if name in ("feature-dirs", "front-end"):
            continue
        if name == "train":
            command.add_argument("--nproc", type=int, default=1,
                                 help="training processes (torchrun when > 1; on Slurm "
                                      "without GPUs: CPU ranks per node)")
            add_cmd_argument(command)
            command.add_argument("--nnodes", type=int, default=1,
                                 help="nodes of the Slurm training job")
            command.add_argument("--gpus-per-node", type=int, default=0,
                                 help="GPUs per node of the Slurm job, a rank each")
        elif name != "prepare":
            command.add_argument("--nj", type=int, default=1,
                                 help="parallel jobs (cluster jobs with --cmd)")
            add_cmd_argument(command)
        else:
            command.add_argument("--nj", type=int, default=1, help="parallel jobs")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        _run(args)
    except TrainingInterrupted as error:
        logger.error("%s", error)
        return STOPPED_EXIT_STATUS
    except (TrainingFailed, ArrayJobError, LaunchError) as error:  # named with its log
        logger.error("%s", error)
        return 1
    return 0


def _run(args: argparse.Namespace) -> None:
    if args.command == "prepare":
        prepare(args.exp_dir)
    elif args.command == "train":
        train(args.exp_dir, args.nproc, Launcher.from_cmd(args.cmd), args.nnodes,
              args.gpus_per_node)
    elif args.command == "feature-dirs":
        print("\n".join(feature_dirs(args.exp_dir)))
    elif args.command == "front-end":
        from cat.features.fbank import experiment_front_end, front_end_name

        print(front_end_name(experiment_front_end(Plan.load(args.exp_dir).hyper)))
    elif args.command == "lm":
        table = decode_lm(args.exp_dir, args.nj, Launcher.from_cmd(args.cmd))
        if table is not None:
            print(table.read_text(encoding="utf-8"), end="")
    else:
        decode(args.exp_dir, args.nj, Launcher.from_cmd(args.cmd))


if __name__ == "__main__":
    sys.exit(main())
