"""Turn a CAT v3 experiment (thu-spmi/CAT `hyper-p.json` + `config.json`) into this toolkit's.

Usage:
    python -m cat.migrate OLD_EXP NEW_EXP [--metainfo data/metainfo.json] [--force]
    python -m cat.migrate ../CAT/egs/aishell/exp/ctc-v1 exp/cat-ctc-v1

Every key of the two files is either mapped (renamed or converted to this toolkit's
key, `cat/core/schemas/*.json`), dropped (this toolkit sets it another way, e.g.
`num_classes` comes from the tokenizer, `dist_url` from the launcher), or named as not
mapped (a CAT setting with no equivalent here, or a key CAT itself does not read). Keys
only CTC-CRF uses are reported as pending until the model schema has them
(`cat.migrate.config.CTC_CRF_TRAINER_KEYS`). The report is printed and written to
`NEW_EXP/migration.txt`; the new files are validated against the schemas, and the model
is built once to report its parameter count. hyper-p.json is translated by
`cat.migrate.hyper`, config.json by `cat.migrate.config`, each recording
every key it reads (`cat.migrate.record`).

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

Converted, with the change in the report: CAT's Conformer pads an even `kernel_size` one
frame more on the right (`cat/shared/layer.py` ConvModule), the convolution here takes odd
kernels only, so an even kernel k becomes k + 1, whose window holds CAT's
(`cat.migrate.config._migrate_kernel`); CAT's `SchedulerNoamEarlyStop` becomes Noam's schedule
stopping at its `min_step` (no early stopping here); CAT's `JiebaComposeLexiconTokenizer`
becomes the lexicon tokenizer (`cat.text.lexicon`; the differences are in
`cat.migrate.hyper.LEXICON_DIFFERENCES`). CUSIDE's keys (`cat.migrate.config.CUSIDE_TRAINER_KEYS`)
keep their names in config.json's `trainer` (`cat.models.cuside`, simulation network
included); `train_unified` is the family's training, and CAT's `streaming: true` decoding
becomes stage 4's `chunk_size` (the trained chunk in encoder frames).

Not carried over, by design: CAT's `data.filter` keeps `lo <= frames <= hi` when packing,
ours is half-open, so `hi` becomes `hi + 1`; CAT's Noam peak `peak_factor /
sqrt(dim_model * warmup_step)` becomes `peak_lr` (the optimizer's own `lr` is overridden
by the schedule in both); CAT's `batch_size` is global over all GPUs, ours per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from cat.core.config import (
    CONFIG_NAME,
    HYPER_NAME,
    ConfigError,
    read_json,
    validate_config,
    validate_hyper,
)
from cat.core.io import atomic_write
from cat.migrate.config import CAT_CUSIDE_CHUNK, config_kind, migrate_config
from cat.migrate.hyper import STREAMING_CHUNK, crf_tokenizer, find_metainfo, migrate_hyper
from cat.migrate.record import STATUS_ORDER, Entry, Recorder

REPORT_NAME = "migration.txt"


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


class MigrationError(ValueError):
    """The migration cannot be written where it was asked to be."""


def migrate(hyper: dict[str, Any], config: dict[str, Any], new_exp: str,
            metainfo: dict[str, Any] | None = None) -> Migration:
    """Migrate CAT's `hyper` and `config`; the new files are validated against the schemas."""
    record = Recorder()
    new_config, classes = migrate_config(config, record)
    if "den_lm" in new_config.get("trainer", {}):
        new_config["trainer"]["den_lm"] = f"{new_exp}/den_lm.npz"
    kind = config_kind(config)
    new_hyper, vocab = migrate_hyper(hyper, new_exp, kind, metainfo, record)
    _resolve_cuside(hyper, new_hyper, new_config, kind, record)
    if new_config.get("trainer", {}).get("use_crf") and "tokenizer" not in new_hyper:
        new_hyper["tokenizer"] = crf_tokenizer(new_exp, record)
    if classes is not None:
        num_classes, source = classes, "config.json num_classes"
    else:
        num_classes, source = vocab, "tokenizer.option-train.vocab_size"
    validate_hyper(new_hyper, f"{new_exp}/{HYPER_NAME} (migrated)")
    validate_config(new_config, f"{new_exp}/{CONFIG_NAME} (migrated)")
    return Migration(new_hyper, new_config, record.entries, kind, num_classes, source)


def _resolve_cuside(hyper: dict[str, Any], new_hyper: dict[str, Any],
                    new_config: dict[str, Any], kind: str, record: Recorder) -> None:
    """CAT's unified training without CUSIDE keys gets CAT's default chunk; CAT's
    streaming decoding becomes stage 4's `chunk_size`, the trained chunk in encoder frames."""
    trainer = new_config.setdefault("trainer", {})
    if hyper.get("train", {}).get("bin") == f"cat.{kind}.train_unified" and (
            "chunk_size" not in trainer):
        trainer["chunk_size"] = CAT_CUSIDE_CHUNK
        record.add("mapped", CONFIG_NAME, "trainer.chunk_size",
                   f"(absent) -> {CAT_CUSIDE_CHUNK}: CAT's default for train_unified")
    if not trainer:
        del new_config["trainer"]
    option = new_hyper.get("inference", {}).get("infer", {}).get("option", {})
    if option.get("chunk_size") != STREAMING_CHUNK:
        return
    if "chunk_size" not in trainer:
        del option["chunk_size"]
        record.add("dropped", HYPER_NAME, "inference.infer.option.chunk_size",
                   "CAT's streaming decoding of a model without CUSIDE (trainer.chunk_size)")
        return
    rate = 4 * new_config["encoder"]["kwargs"].get("time_reduction_factor", 1)
    option["chunk_size"] = trainer["chunk_size"] // rate


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
        prog="python -m cat.migrate",
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


def cli() -> None:
    """`python -m cat.migrate`: `main`, a migration that cannot be done ending the process
    with its error in one line (status 1)."""
    try:
        sys.exit(main())
    except (ConfigError, MigrationError, FileNotFoundError, FileExistsError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    cli()
