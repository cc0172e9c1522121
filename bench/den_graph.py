"""Sizes and build times of CTC-CRF denominator graphs: the chain estimator (un-smoothed,
Kaldi's chain-est-phone-lm rule, CAT's) against the Kneser-Ney one (back-off expanded).

The token sequences are a recipe's training transcripts encoded with its lexicon
(`--text` and `--lexicon`, phone units as stage 2 builds them; transcripts with `<unk>`
left out) or, without them, sentences of 10-40 tokens from a random sparse Markov chain
over `--classes` tokens (each with 8 successors). Each case builds the token LM and its
composition with the CTC topology (`build_den_graph`) in this process, one after another;
the time is the wall-clock time of that call.

Usage:
    python bench/den_graph.py --text egs/aishell/data/fbank/train_sp/text \
        --lexicon egs/aishell/data/local/lexicon.txt
    python bench/den_graph.py --sentences 100000 --classes 150
    python bench/den_graph.py --sentences 2000 --estimators chain   # quick
"""

from __future__ import annotations

import argparse
import time

from cat.graph.denominator import ESTIMATORS, build_den_graph
from cat.testing.lm import token_sentences

CASES = ((4, 1000), (3, None))  # (order, extra_states)


def encoded(text: list[str], lexicon: str) -> tuple[list[list[int]], int]:
    from cat.text.lexicon import lexicon_tokenizer
    from cat.text.tokenizer import UNK_ID, iter_transcripts

    tokenizer = lexicon_tokenizer(lexicon)
    sequences = [ids for transcript in iter_transcripts(text)
                 if (ids := tokenizer.encode(transcript)) and UNK_ID not in ids]
    return sequences, tokenizer.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", nargs="*", default=[], help="Kaldi text files")
    parser.add_argument("--lexicon", help="the lexicon that encodes --text")
    parser.add_argument("--sentences", type=int, default=20000,
                        help="synthetic sentences (without --text)")
    parser.add_argument("--classes", type=int, default=150, help="synthetic vocabulary")
    parser.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=ESTIMATORS)
    args = parser.parse_args()
    if args.text:
        if not args.lexicon:
            parser.error("--text needs --lexicon")
        sequences, classes = encoded(args.text, args.lexicon)
    else:
        sequences = token_sentences(args.sentences, args.classes, seed=0, successors=8,
                                    min_len=10, max_len=40)
        classes = args.classes
    tokens = sum(map(len, sequences))
    print(f"{len(sequences):,} sentences, {tokens:,} tokens, {classes} classes")
    print("| estimator | order | extra states | lm states | lm arcs | den states | den arcs "
          "| build s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for order, extra in CASES:
        for estimator in args.estimators:
            start = time.perf_counter()
            graph = build_den_graph(sequences, classes, order=order, extra_states=extra,
                                    estimator=estimator)
            seconds = time.perf_counter() - start
            info = graph.info
            print(f"| {estimator} | {order} | {extra if extra is not None else 'all'} "
                  f"| {info['lm_states']:,} | {info['lm_arcs']:,} | {info['den_states']:,} "
                  f"| {info['den_arcs']:,} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
