"""Hotwords on a test set: recall of the listed words, and what the list costs elsewhere.

    cd egs/aishell
    python ../../bench/hotwords.py EXP CKPT --data data/fbank/test --text data/test/text \
        --train-text data/train/text --lexicon data/local/lexicon.txt \
        [--num-words 30] [--scores 0 1.5 3] [--method beam] [--beam-size 4]
    python ../../bench/hotwords.py EXP CKPT ... --tlg exp/synth-lm-word-3gram/lm.arpa \
        --lm-weight 0.5      # WFST decoding (CTC, CTC-CRF): the list boosted in the graph
        [--oov]              # ... with the listed words taken out of the LM first

The list: the `--num-words` words of the lexicon (two characters or more) that occur in
the test transcripts and least often in the training transcripts (rare words, as names and
terms are). The false-alarm list: as many lexicon words that no test transcript holds
(the first in the lexicon's order).
For each score per token (`--hotwords-score`; 0: no list), `python -m cat.decode` decodes
the set with the list, and once more with the false-alarm list (with `--tlg`: the model's
log-posteriors, computed once, decoded with the TLG of the word LM, built for each list and
score with the list boosted, `cat.decoding.wfst`; `--oov`: every n-gram holding a listed
word taken out of the LM first, as for names the LM has never seen); printed per run:

* recall: occurrences of listed words in the references that the hypothesis of the same
  utterance holds too (counted with multiplicity, each capped by the reference's count);
* %CER of every utterance, and of the utterances whose references hold no listed word
  (what the list may not raise);
* false alarms: occurrences of false-alarm words in the hypotheses.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.core.io import read_table
from cat.scoring import score


def lexicon_words(path: Path) -> list[str]:
    """Chinese words of two characters or more of a lexicon file (word, then its phones)."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if fields and len(fields[0]) >= 2 and all("\u4e00" <= c <= "\u9fff" for c in fields[0]):
            words.append(fields[0])
    return sorted(set(words))


def choose_lists(words: list[str], refs: dict[str, str], train: list[str],
                 count: int) -> tuple[list[str], list[str]]:
    """(rare words of the test set, words no test transcript holds)."""
    test_text = "\n".join(refs.values())
    train_text = "\n".join(train)
    present = [w for w in words if w in test_text]
    present.sort(key=lambda w: (train_text.count(w), w))
    absent = [w for w in words if w not in test_text][:count]
    return present[:count], absent


def occurrences(text: str, word: str) -> int:
    return "".join(text.split()).count(word)


def measure(refs: dict[str, str], hyps: dict[str, str], listed: list[str],
            false_alarm: list[str]) -> dict[str, float]:
    found = total = alarms = 0
    for key, ref in refs.items():
        hyp = hyps.get(key, "")
        for word in listed:
            in_ref = occurrences(ref, word)
            total += in_ref
            found += min(in_ref, occurrences(hyp, word))
        alarms += sum(occurrences(hyp, word) for word in false_alarm)
    without = [key for key in refs if not any(occurrences(refs[key], w) for w in listed)]
    rest = score({k: refs[k] for k in without}, {k: hyps.get(k, "") for k in without})
    return {"recall": 100.0 * found / max(total, 1), "found": found, "total": total,
            "cer": score(refs, hyps).error_rate, "cer_rest": rest.error_rate,
            "rest_utts": len(without), "alarms": alarms}


def decode(exp: str, checkpoint: str, data: str, out: Path, method: str, beam_size: int,
           hotwords: Path | None, hotwords_score: float) -> dict[str, str]:
    command = [sys.executable, "-m", "cat.decode", exp, "--data", data, "--out", str(out),
               "--checkpoint", checkpoint, "--device", "cpu", "--method", method,
               "--beam-size", str(beam_size)]
    if hotwords is not None:
        command += ["--hotwords", str(hotwords), "--hotwords-score", str(hotwords_score)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    return read_table(out / "hyp", allow_empty_value=True)


def without_words(arpa: str, words: list[str], out: Path) -> Path:
    """`arpa` without the n-grams that hold any of `words` (an LM that never saw them)."""
    from cat.lm.ngram import read_arpa, write_arpa_tables

    dropped = set(words)
    tables = [{gram: value for gram, value in table.items() if not dropped & set(gram)}
              for table in read_arpa(arpa)]
    write_arpa_tables(tables, out)
    return out


def tlg_decoder(exp: str, checkpoint: str, data: str, arpa: str | Path, lm_weight: float,
                beam: float):
    """`decode`'s counterpart for WFST decoding: a function of (hotwords file or None,
    score) -> hypotheses, the log-posteriors computed once."""
    from cat.core.config import load_hyper
    from cat.decoding.searcher import DecodeOptions
    from cat.decoding.wfst import decode_all, hotword_boosts, log_posteriors, pronouncer
    from cat.graph.tlg import build_tlg
    from cat.text.tokenizer import load as load_tokenizer

    hyper_path = Path(exp) / "hyper-p.json"
    hyper = load_hyper(hyper_path)
    options = DecodeOptions.of_experiment(hyper, str(hyper_path), {"device": "cpu"})
    posteriors = log_posteriors(exp, checkpoint, data, options)
    tokenizer = load_tokenizer(hyper["tokenizer"]["file"])

    def run(hotwords: Path | None, score: float) -> dict[str, str]:
        boosts = hotword_boosts(hotwords, tokenizer, score) if hotwords else None
        graph = build_tlg(pronouncer(tokenizer), tokenizer.vocab_size, arpa, boosts)
        return decode_all(graph, posteriors, 1.0, lm_weight, beam)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exp")
    parser.add_argument("checkpoint")
    parser.add_argument("--data", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--train-text", required=True)
    parser.add_argument("--lexicon", required=True)
    parser.add_argument("--num-words", type=int, default=30)
    parser.add_argument("--scores", type=float, nargs="+", default=[0.0, 1.5, 3.0])
    parser.add_argument("--method", default="beam")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--tlg", metavar="ARPA", help="WFST decoding with this word LM")
    parser.add_argument("--lm-weight", type=float, default=1.0, help="--tlg: the LM weight")
    parser.add_argument("--beam", type=float, default=16.0, help="--tlg: the decoder's beam")
    parser.add_argument("--oov", action="store_true",
                        help="--tlg: take the listed words out of the LM first")
    args = parser.parse_args(argv)
    refs = read_table(args.text, allow_empty_value=True)
    train = list(read_table(args.train_text, allow_empty_value=True).values())
    listed, false_alarm = choose_lists(lexicon_words(Path(args.lexicon)), refs, train,
                                       args.num_words)
    train_text = "\n".join(train)
    train_counts = Counter({w: train_text.count(w) for w in listed})
    print(f"listed ({len(listed)}): {' '.join(listed)}")
    print(f"their training occurrences: {sum(train_counts.values())} "
          f"(at most {max(train_counts.values(), default=0)} each)")
    print(f"false-alarm list ({len(false_alarm)}): {' '.join(false_alarm)}")
    lm_dir = tempfile.TemporaryDirectory() if args.tlg and args.oov else None
    arpa = (without_words(args.tlg, listed, Path(lm_dir.name) / "lm.arpa")
            if lm_dir is not None else args.tlg)
    tlg = (tlg_decoder(args.exp, args.checkpoint, args.data, arpa, args.lm_weight, args.beam)
           if args.tlg else None)
    print("| list | score | recall % (found / in refs) | %CER | %CER without listed words "
          "(utts) | false alarms |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as scratch:
        for name, words in (("rare test words", listed), ("absent words", false_alarm)):
            path = Path(scratch) / f"{name.replace(' ', '-')}.txt"
            path.write_text("".join(f"{w}\n" for w in words), encoding="utf-8")
            for value in args.scores:
                if value == 0 and name != "rare test words":
                    continue
                if tlg is not None:
                    hyps = tlg(path if value else None, value)
                else:
                    hyps = decode(args.exp, args.checkpoint, args.data,
                                  Path(scratch) / f"{name}-{value}".replace(" ", "-"),
                                  args.method, args.beam_size, path if value else None, value)
                row = measure(refs, hyps, listed, false_alarm)
                print(f"| {name if value else 'none'} | {value} | {row['recall']:.1f} "
                      f"({row['found']} / {row['total']}) | {row['cer']:.2f} | "
                      f"{row['cer_rest']:.2f} ({row['rest_utts']}) | {row['alarms']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
