"""Word times of a trained model against the boundaries the synthetic generator knows.

    cd egs/aishell
    python ../../bench/timestamps.py exp/synth-ctc [--checkpoint CKPT] \
        --corpus corpus/synthetic --set test --num-utts 60 --methods greedy beam
    python ../../bench/timestamps.py exp/synth-ctc --methods tlg \
        --tlg exp/synth-ctc/decode-lm/word-3gram-tlg/graph --lm-weight 0.5

Makes (once) the alignment set of `--num-utts` utterances of the corpus's `--set`
(`cat.data.alignment`: the words spoken one at a time with pauses, their boundaries known
to the sample) under `bench/out/alignment/<set>`, transcribes it with `python -m
cat.decode EXP --wav-scp ... --format ctm` for each method (`tlg`: WFST decoding with the
graph of `--tlg` at `--lm-weight`, whose words are the word LM's), and prints per method:

* %CER of the set (the words are spoken alone, so this is not the corpus's CER);
* the mean absolute error of word starts, of word ends, and of both (ms), over the
  reference words whose characters the hypothesis has, and how many those are;
* the bias of starts and of ends: their mean signed error (ms; negative: early);
* the baseline: the same words with the hypothesis's characters spread evenly over the
  utterance's audio (what times would be without an alignment).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.core.io import read_table
from cat.data.alignment import Word, boundary_errors, make_alignment_set, read_ctm
from cat.scoring import score

OUT = Path(__file__).resolve().parent / "out"


def even_times(hypothesis: dict[str, list[Word]], wavs: dict[str, str]
               ) -> dict[str, list[Word]]:
    """The hypothesis's characters spread evenly over each utterance's audio."""
    spread = {}
    for utt, words in hypothesis.items():
        chars = [char for word in words for char in word.text]
        seconds = soundfile.info(wavs[utt]).duration
        step = seconds / max(len(chars), 1)
        spread[utt] = [Word(char, index * step, (index + 1) * step)
                       for index, char in enumerate(chars)]
    return spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exp_dir")
    parser.add_argument("--checkpoint")
    parser.add_argument("--corpus", default="corpus/synthetic")
    parser.add_argument("--set", default="test")
    parser.add_argument("--num-utts", type=int, default=60)
    parser.add_argument("--methods", nargs="+", default=["greedy", "beam"],
                        help="greedy, beam, ... or tlg (with --tlg)")
    parser.add_argument("--tlg", help="method tlg: the TLG graph directory")
    parser.add_argument("--lm-weight", type=float, default=1.0, help="method tlg: LM weight")
    args = parser.parse_args()
    if "tlg" in args.methods and not args.tlg:
        parser.error("method tlg needs --tlg")
    aligned = make_alignment_set(args.corpus, OUT / "alignment" / args.set, args.set,
                                 args.num_utts)
    reference = read_ctm(aligned / "words.ctm")
    wavs = read_table(aligned / "wav.scp")
    print(f"{args.exp_dir}: {len(reference)} utterances, "
          f"{sum(map(len, reference.values()))} words of {args.set}")
    print("| method | %CER | start ms | end ms | mean ms | start bias ms | end bias ms | "
          "words compared | even spread: mean ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for method in args.methods:
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, "-m", "cat.decode", args.exp_dir, "--wav-scp",
                       str(aligned / "wav.scp"), "--format", "ctm", "--out", out, "--nj", "1"]
            command += (["--tlg", args.tlg, "--lm-weight", str(args.lm_weight)]
                        if method == "tlg" else ["--method", method])
            if args.checkpoint:
                command += ["--checkpoint", args.checkpoint]
            subprocess.run(command, check=True, stderr=subprocess.DEVNULL)
            hypothesis = read_ctm(Path(out) / "hyp.ctm")
            cer = score(read_table(aligned / "text"),
                        read_table(Path(out) / "hyp", allow_empty_value=True))
        errors = boundary_errors(reference, hypothesis)
        baseline = boundary_errors(reference, even_times(hypothesis, wavs))
        mean = lambda values: 1000 * sum(values) / len(values)  # noqa: E731
        print(f"| {method} | {cer.error_rate:.2f} | {mean(errors.starts):.0f} | "
              f"{mean(errors.ends):.0f} | {errors.mean_ms:.0f} | "
              f"{mean(errors.start_shifts):+.0f} | {mean(errors.end_shifts):+.0f} | "
              f"{len(errors.starts)} of {errors.num_words} | {baseline.mean_ms:.0f} |")


if __name__ == "__main__":
    main()
