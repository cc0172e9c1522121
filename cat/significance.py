"""Compare two systems' error rates on one test set: paired bootstrap intervals.

Usage: python -m cat.significance --cer data/test/text exp/synth-ctc/decode/test/hyp \
           exp/synth-crctc/decode/test/hyp

The utterances are resampled with replacement (Bisani and Ney, 2004: the same resampled
set for both systems, so the difference keeps their pairing), `--samples` times with a
fixed `--seed`; each resample gives each system's error rate (its errors over the
resample's reference units) and their difference. Printed: each system's rate on the
whole set with its 95 % interval, the difference (second minus first) with its interval,
and the share of resamples where the second system is better (P(B better)). An interval of
the difference that excludes 0 says the ranking holds on this test set; it says nothing of
how much another training run (seed) would move either system.

Utterances are matched by id as `cat.scoring` scores them (a missing hypothesis is all
deletions).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from cat.core.io import read_table
from cat.scoring import align, tokenize

CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
    """A rate (per 100 reference units) on the whole set and its bootstrap interval."""

    value: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.value:.2f} [{self.low:.2f}, {self.high:.2f}]"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Two systems on one test set: `a`, `b`, `delta` (b - a) and P(b better)."""

    a: Interval
    b: Interval
    delta: Interval
    b_better: float
    utterances: int
    units: int
    samples: int


def utterance_errors(refs: Mapping[str, str], hyps: Mapping[str, str],
                     unit: str = "char") -> tuple[np.ndarray, np.ndarray]:
    """Per-utterance (errors, reference units), in sorted id order of `refs`."""
    errors, units = [], []
    for utt in sorted(refs):
        ref = tokenize(refs[utt], unit)
        alignment = align(ref, tokenize(hyps.get(utt, ""), unit))
        errors.append(sum(alignment.count(op) for op in ("S", "I", "D")))
        units.append(len(ref))
    return np.asarray(errors, dtype=np.int64), np.asarray(units, dtype=np.int64)


def _interval(value: float, draws: np.ndarray) -> Interval:
    tail = (1.0 - CONFIDENCE) / 2
    low, high = np.quantile(draws, [tail, 1.0 - tail])
    return Interval(value, float(low), float(high))


def compare(refs: Mapping[str, str], hyps_a: Mapping[str, str], hyps_b: Mapping[str, str],
            unit: str = "char", samples: int = 1000, seed: int = 0) -> Comparison:
    """Paired bootstrap of two systems' error rates (see the module docstring)."""
    if not refs:
        raise ValueError("no reference utterances to compare on")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    errors_a, units = utterance_errors(refs, hyps_a, unit)
    errors_b, _ = utterance_errors(refs, hyps_b, unit)
    if units.sum() == 0:
        raise ValueError("the references have no units to score")
    draws = np.random.default_rng(seed).integers(0, len(units), size=(samples, len(units)))
    resampled_units = np.maximum(units[draws].sum(axis=1), 1)
    rate_a = 100.0 * errors_a[draws].sum(axis=1) / resampled_units
    rate_b = 100.0 * errors_b[draws].sum(axis=1) / resampled_units
    whole_a = 100.0 * errors_a.sum() / units.sum()
    whole_b = 100.0 * errors_b.sum() / units.sum()
    return Comparison(_interval(whole_a, rate_a), _interval(whole_b, rate_b),
                      _interval(whole_b - whole_a, rate_b - rate_a),
                      float(np.mean(rate_b < rate_a)), len(units), int(units.sum()), samples)


def format_comparison(result: Comparison, names: Sequence[str] = ("A", "B"),
                      unit: str = "char") -> str:
    """The printed report: one line per system, the difference and P(B better)."""
    name = "%CER" if unit == "char" else "%WER"
    a, b = names
    percent = round(100 * CONFIDENCE)
    return (f"{name} with {percent} % paired-bootstrap intervals ({result.samples} resamples "
            f"of {result.utterances} utterances, {result.units} units)\n"
            f"{a}: {result.a}\n{b}: {result.b}\n"
            f"{b} - {a}: {result.delta}\n"
            f"P({b} better): {result.b_better:.3f}")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cat.significance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cer", action="store_true",
                        help="score characters with all whitespace removed (default: words)")
    parser.add_argument("--samples", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the resampling")
    parser.add_argument("ref", help="reference text table (<utt-id> <transcript>)")
    parser.add_argument("hyp_a", help="first system's hypotheses (A)")
    parser.add_argument("hyp_b", help="second system's hypotheses (B)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Print the comparison of `hyp_b` against `hyp_a`."""
    args = build_parser().parse_args(argv)
    unit = "char" if args.cer else "word"
    refs, hyps_a, hyps_b = (read_table(path, allow_empty_value=True)
                            for path in (args.ref, args.hyp_a, args.hyp_b))
    result = compare(refs, hyps_a, hyps_b, unit, args.samples, args.seed)
    print(format_comparison(result, (args.hyp_a, args.hyp_b), unit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
