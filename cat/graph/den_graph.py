"""Build an experiment's CTC-CRF denominator graph (stage 2; CAT's `prep_den_lm.sh`).

The training transcripts are encoded with the experiment's tokenizer (phones for a
lexicon tokenizer); a token n-gram (order 4 by default, as CAT's) is estimated on them,
by default with the un-smoothed rule of Kaldi's `chain-est-phone-lm` that CAT uses
(`--estimator chain`; histories of 3 tokens or more: the 1,000 most frequent), or with
the project's Kneser-Ney estimator, back-off expanded (`--estimator kneser-ney`), and
composed with the CTC topology (`cat.graph.denominator`). Transcripts holding `<unk>`
(a character no lexicon entry covers) are left out of the LM and counted. The graph goes
to `trainer.den_lm` of `config.json`; its size is logged and kept in the file's header.

Usage:
    python -m cat.graph.den_graph --tokenizer exp/crf/tokenizer.tknz \
        --text data/fbank/train/text --out exp/crf/den_lm.npz [--order 4] [--estimator chain]
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from cat.core.io import PathLike, setup_logging
from cat.graph.denominator import ESTIMATORS, DenGraph, build_den_graph, save_den_graph
from cat.text.tokenizer import UNK_ID, iter_transcripts
from cat.text.tokenizer import load as load_tokenizer

logger = logging.getLogger(__name__)


def build_for_tokenizer(tokenizer_file: PathLike, text_files: Sequence[PathLike],
                        out: PathLike, order: int = 4,
                        extra_states: int | None = 1000, estimator: str = "chain"
                        ) -> DenGraph:
    """Encode `text_files` with the tokenizer, build the graph, write it to `out`."""
    tokenizer = load_tokenizer(tokenizer_file)
    sequences, with_unk, empty = [], 0, 0
    for transcript in iter_transcripts(text_files):
        ids = tokenizer.encode(transcript)
        if not ids:
            empty += 1
        elif UNK_ID in ids:
            with_unk += 1
        else:
            sequences.append(ids)
    if with_unk or empty:
        logger.warning("denominator LM: %d transcripts hold <unk> and %d encode to nothing; "
                       "left out (%d used)", with_unk, empty, len(sequences))
    units = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    graph = build_den_graph(sequences, tokenizer.vocab_size, order=order, units=units,
                            extra_states=extra_states, estimator=estimator)
    graph.info.update({"left_out_unk": with_unk, "left_out_empty": empty})
    save_den_graph(graph, out)
    logger.info("denominator graph %s: %s (%.1f MB)", out, graph.info,
                Path(out).stat().st_size / 2**20)
    return graph


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True,
                        help="the experiment's lexicon tokenizer file (exp/<name>/tokenizer.tknz)")
    parser.add_argument("--text", nargs="+", required=True, help="Kaldi text files")
    parser.add_argument("--out", required=True,
                        help="the graph file to write (trainer.den_lm, e.g. exp/<name>/den_lm.npz)")
    parser.add_argument("--order", type=int, default=4,
                        help="order of the token n-gram (trainer.den_lm_order)")
    parser.add_argument("--extra-states", type=int, default=1000,
                        help="histories of 3+ tokens kept (the most frequent)")
    parser.add_argument("--estimator", choices=ESTIMATORS, default="chain",
                        help="token LM estimator (trainer.den_lm_estimator)")
    args = parser.parse_args(argv)
    setup_logging()
    build_for_tokenizer(args.tokenizer, args.text, args.out, args.order, args.extra_states,
                        args.estimator)


if __name__ == "__main__":
    main()
