"""N-best lists on disk and their rescoring with a word-level n-gram.

N-best file (`nbest.jsonl`, written by the decoders next to `hyp`): one JSON object per
utterance, sorted by utterance id:
``{"utt": "BAC009S0764W0121", "hyps": [["今天天气", -3.2], ["今天天器", -4.0]]}``,
hypotheses best first with their first-pass scores (acoustic log-probability, plus the
weighted fusion score when the first pass used an LM).

Rescoring adds `alpha * ln p_word(hypothesis) + beta * number of words` to each first-pass
score and keeps the best hypothesis. The word LM scores do not depend on `alpha`/`beta`,
so `NBestScores` computes them once and a grid of weights costs only array arithmetic.

Usage:
    python -m cat.lm.rescore exp/synth-ctc/decode-lm/first-pass/test/nolm/nbest.jsonl \
        --lm exp/lm-word-3gram/lm.arpa --unit word --alpha 0.3 --beta 0.5 --out hyp
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from cat.core.io import PathLike, atomic_write, setup_logging
from cat.lm.scorer import WordRescorer
from cat.lm.text import UNITS, make_splitter

NBEST_NAME = "nbest.jsonl"


def write_nbest(path: PathLike, items: Iterable[tuple[str, Sequence[tuple[str, float]]]]) -> None:
    """Write (utt, [(text, score), ...]) pairs, sorted by utterance id (atomically)."""
    with atomic_write(path) as f:
        for utt, hyps in sorted(items):
            f.write(json.dumps({"utt": utt, "hyps": [[text, round(float(score), 6)]
                                                     for text, score in hyps]},
                               ensure_ascii=False) + "\n")


def read_nbest(path: PathLike) -> dict[str, list[tuple[str, float]]]:
    """{utt: [(text, score), ...]}; errors name the file and line."""
    result: dict[str, list[tuple[str, float]]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                utt = record["utt"]
                hyps = [(str(text), float(score)) for text, score in record["hyps"]]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{lineno}: not an N-best record "
                                 f'{{"utt": ..., "hyps": [[text, score], ...]}}: {error}') \
                    from None
            if utt in result:
                raise ValueError(f"{path}:{lineno}: utterance {utt} appears twice")
            result[utt] = hyps
    return result


@dataclasses.dataclass
class NBestScores:
    """Every hypothesis of an N-best set with its first-pass score and word-LM score."""

    utts: list[str]
    texts: list[list[str]]
    first_pass: list[np.ndarray]
    lm: list[np.ndarray]
    lengths: list[np.ndarray]

    @classmethod
    def compute(cls, nbest: dict[str, list[tuple[str, float]]],
                rescorer: WordRescorer) -> NBestScores:
        utts = sorted(nbest)
        texts, first, lm, lengths = [], [], [], []
        cache: dict[str, tuple[float, int]] = {}
        for utt in utts:
            hyps = nbest[utt]
            texts.append([text for text, _ in hyps])
            first.append(np.array([score for _, score in hyps], dtype=np.float64))
            for text, _ in hyps:
                if text not in cache:
                    cache[text] = rescorer.score(text)
            scored = [cache[text] for text, _ in hyps]
            lm.append(np.array([s for s, _ in scored], dtype=np.float64))
            lengths.append(np.array([n for _, n in scored], dtype=np.float64))
        return cls(utts, texts, first, lm, lengths)

    def best(self, alpha: float, beta: float) -> dict[str, str]:
        """{utt: best hypothesis} under `first + alpha * lm + beta * words`."""
        result = {}
        for utt, texts, first, lm, lengths in zip(self.utts, self.texts, self.first_pass,
                                                  self.lm, self.lengths, strict=True):
            if not texts:
                result[utt] = ""
                continue
            total = first + alpha * lm + beta * lengths
            result[utt] = texts[int(np.argmax(total))]
        return result


def write_hyp(path: PathLike, hyps: dict[str, str]) -> None:
    """`<utt> <text>` lines, sorted (an empty hypothesis as the id alone, as the decoders do)."""
    with atomic_write(path) as f:
        for utt in sorted(hyps):
            f.write(f"{utt} {hyps[utt]}\n" if hyps[utt] else f"{utt}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cat.lm.rescore",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("nbest", help="N-best file (nbest.jsonl)")
    parser.add_argument("--lm", required=True, help="ARPA or kenlm binary file")
    parser.add_argument("--unit", choices=UNITS, default="word", help="the LM's units")
    parser.add_argument("--tokenizer", help="tokenizer file for unit 'tokenizer'")
    parser.add_argument("--alpha", type=float, required=True, help="LM weight")
    parser.add_argument("--beta", type=float, default=0.0, help="bonus per LM unit")
    parser.add_argument("--out", required=True, help="output hypothesis file")
    args = parser.parse_args(argv)
    setup_logging()
    rescorer = WordRescorer(args.lm, make_splitter(args.unit, args.tokenizer))
    scores = NBestScores.compute(read_nbest(args.nbest), rescorer)
    write_hyp(Path(args.out), scores.best(args.alpha, args.beta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
