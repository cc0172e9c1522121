"""Score hypotheses against references: Kaldi-style %WER / %CER and %SER.

Usage: python -m cat.scoring --cer --per-utt per_utt.txt data/test/text exp/ctc/decode/test.txt

Both files are Kaldi text tables (`<utt-id> <transcript>`, an empty transcript
is valid). Utterances are matched by id, never by line order:

  * a reference id without a hypothesis counts as all deletions; such ids are
    counted and a few are named in the log;
  * a hypothesis id without a reference is reported and ignored.

Units: `--cer` removes all whitespace and scores characters; otherwise the
text is split on whitespace and words are scored. The edit operations come
from `rapidfuzz.distance.Levenshtein` (minimum edit distance; among equally
short alignments the split into substitutions/insertions/deletions is the
library's choice). Output, as Kaldi's compute-wer prints it::

    %CER 4.67 [ 4893 / 104765, 66 ins, 172 del, 4655 sub ]
    %SER 31.02 [ 2226 / 7176 ]
    Scored 7176 sentences, 0 not present in hyp, 0 extra in hyp.

`--per-utt FILE` writes four lines per utterance (sorted by id): the reference
and hypothesis aligned with `*` for gaps, the operations (C/S/I/D) and the
counts (`#csid`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Mapping, Sequence

from rapidfuzz.distance import Levenshtein

from cat.core.io import PathLike, atomic_write, read_table, setup_logging

logger = logging.getLogger(__name__)

UNITS = ("char", "word")
GAP = "*"
MAX_IDS_LOGGED = 5


@dataclasses.dataclass
class ScoreResult:
    """Error counts of a scored set; `total` is the number of reference units."""

    unit: str = "char"
    insertions: int = 0
    deletions: int = 0
    substitutions: int = 0
    total: int = 0
    sentences: int = 0
    sentence_errors: int = 0
    missing: list[str] = dataclasses.field(default_factory=list)
    extra: list[str] = dataclasses.field(default_factory=list)

    @property
    def errors(self) -> int:
        """Insertions + deletions + substitutions."""
        return self.insertions + self.deletions + self.substitutions

    @property
    def error_rate(self) -> float:
        """Errors per 100 reference units (inf when there are errors but no reference units)."""
        return _percent(self.errors, self.total)

    @property
    def sentence_error_rate(self) -> float:
        """Sentences with at least one error, per 100 sentences."""
        return _percent(self.sentence_errors, self.sentences)


@dataclasses.dataclass
class Alignment:
    """One utterance: aligned units (`None` for a gap) and the operation per column."""

    ref: list[str | None]
    hyp: list[str | None]
    ops: list[str]  # "C", "S", "I", "D"

    def count(self, op: str) -> int:
        """Number of columns with operation `op`."""
        return self.ops.count(op)


def _percent(numerator: int, denominator: int) -> float:
    if denominator == 0:
        return 0.0 if numerator == 0 else float("inf")
    return 100.0 * numerator / denominator


def tokenize(text: str, unit: str = "char") -> list[str]:
    """Characters without any whitespace (unit "char") or whitespace-separated words ("word")."""
    if unit == "char":
        return list("".join(text.split()))
    if unit == "word":
        return text.split()
    raise ValueError(f"unknown scoring unit {unit!r}; allowed: {', '.join(UNITS)}")


def align(ref: Sequence[str], hyp: Sequence[str]) -> Alignment:
    """Minimum-edit-distance alignment of two unit sequences."""
    alignment = Alignment([], [], [])
    for tag, ref_start, ref_end, hyp_start, hyp_end in Levenshtein.opcodes(ref, hyp):
        ref_part, hyp_part = list(ref[ref_start:ref_end]), list(hyp[hyp_start:hyp_end])
        if tag == "equal":
            alignment.ref.extend(ref_part)
            alignment.hyp.extend(hyp_part)
            alignment.ops.extend("C" * len(ref_part))
            continue
        # Other blocks substitute their overlap, then delete or insert the rest.
        paired = min(len(ref_part), len(hyp_part))
        alignment.ref.extend(ref_part[:paired])
        alignment.hyp.extend(hyp_part[:paired])
        alignment.ops.extend("S" * paired)
        for unit in ref_part[paired:]:
            alignment.ref.append(unit)
            alignment.hyp.append(None)
            alignment.ops.append("D")
        for unit in hyp_part[paired:]:
            alignment.ref.append(None)
            alignment.hyp.append(unit)
            alignment.ops.append("I")
    return alignment


def score(refs: Mapping[str, str], hyps: Mapping[str, str], unit: str = "char",
          alignments: dict[str, Alignment] | None = None) -> ScoreResult:
    """Score hypotheses against references matched by utterance id.

    Missing hypotheses count as empty (all deletions) and are listed in
    `result.missing`; hypotheses without a reference are listed in
    `result.extra` and ignored. When `alignments` is a dict it receives each
    utterance's alignment.
    """
    if unit not in UNITS:
        raise ValueError(f"unknown scoring unit {unit!r}; allowed: {', '.join(UNITS)}")
    result = ScoreResult(unit=unit)
    result.extra = sorted(set(hyps) - set(refs))
    for utt in sorted(refs):
        if utt not in hyps:
            result.missing.append(utt)
        ref_units = tokenize(refs[utt], unit)
        alignment = align(ref_units, tokenize(hyps.get(utt, ""), unit))
        insertions, deletions = alignment.count("I"), alignment.count("D")
        substitutions = alignment.count("S")
        result.insertions += insertions
        result.deletions += deletions
        result.substitutions += substitutions
        result.total += len(ref_units)
        result.sentences += 1
        result.sentence_errors += int(insertions + deletions + substitutions > 0)
        if alignments is not None:
            alignments[utt] = alignment
    return result


def format_summary(result: ScoreResult) -> str:
    """Kaldi compute-wer style summary: the %WER/%CER line, the %SER line and the counts."""
    name = "%CER" if result.unit == "char" else "%WER"
    return (
        f"{name} {result.error_rate:.2f} [ {result.errors} / {result.total}, "
        f"{result.insertions} ins, {result.deletions} del, {result.substitutions} sub ]\n"
        f"%SER {result.sentence_error_rate:.2f} [ {result.sentence_errors} / {result.sentences} ]\n"
        f"Scored {result.sentences} sentences, {len(result.missing)} not present in hyp, "
        f"{len(result.extra)} extra in hyp."
    )


def write_alignments(path: PathLike, alignments: Mapping[str, Alignment]) -> None:
    """Write per-utterance alignments (ref / hyp / op / #csid lines per utterance), atomically."""
    with atomic_write(path) as f:
        for utt in sorted(alignments):
            alignment = alignments[utt]
            counts = [alignment.count(op) for op in ("C", "S", "I", "D")]
            for label, row in (("ref", alignment.ref), ("hyp", alignment.hyp),
                               ("op", alignment.ops)):
                f.write(" ".join([utt, label, *(GAP if unit is None else unit for unit in row)])
                        + "\n")
            f.write(" ".join([utt, "#csid", *map(str, counts)]) + "\n")


def _log_ids(message: str, ids: Sequence[str]) -> None:
    if ids:
        shown = ", ".join(ids[:MAX_IDS_LOGGED]) + (", ..." if len(ids) > MAX_IDS_LOGGED else "")
        logger.warning("%s: %d (%s)", message, len(ids), shown)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cat.scoring",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cer", action="store_true",
                        help="score characters with all whitespace removed (default: words)")
    parser.add_argument("--per-utt", metavar="FILE",
                        help="write per-utterance alignments to FILE")
    parser.add_argument("ref", help="reference text table (<utt-id> <transcript>)")
    parser.add_argument("hyp", help="hypothesis text table (<utt-id> [<transcript>])")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Score and print the summary; returns the exit status."""
    args = build_parser().parse_args(argv)
    setup_logging()
    refs = read_table(args.ref, allow_empty_value=True)
    hyps = read_table(args.hyp, allow_empty_value=True)
    alignments: dict[str, Alignment] | None = {} if args.per_utt else None
    result = score(refs, hyps, "char" if args.cer else "word", alignments)
    _log_ids(f"reference ids without a hypothesis in {args.hyp} (scored as deletions)",
             result.missing)
    _log_ids(f"hypothesis ids without a reference in {args.ref} (ignored)", result.extra)
    if alignments is not None:
        write_alignments(args.per_utt, alignments)
    print(format_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
