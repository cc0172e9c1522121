"""Benchmark: n-gram estimation at scale, kenlm's lmplz against the in-memory estimator.

Writes synthetic training text (sentences of jieba-dictionary words, about 10 characters
each, `cat.testing.lm`) of each `--chars` size, then times `python -m cat.lm.train` on a
char `--order`-gram of it with `estimator` lmplz and ngram (`cat.lm.ngram`), each in a
fresh process: wall seconds and the peak RSS of the process tree (lmplz included). Also
lmplz alone on the same text already split into characters (`lmplz -S <memory>`).

The in-memory estimator needs about 200 bytes per n-gram: above `--ngram-max-chars` it
runs under an address-space limit of `--ngram-limit-gb` (so a shared machine is not
pushed into swap) and the line says whether it finished; the projection from the smaller
size is printed beside it.

Usage:
    python bench/lm_scale.py --chars 5.9e6 60e6 --order 5 --memory 1G
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cat.lm.lmplz import find_program
from cat.testing.lm import lm_sentences

MEAN_CHARS = 10.5  # of lm_sentences' defaults (4..16 characters; the last word overshoots)


def write_text(directory: Path, chars: float, seed: int) -> tuple[Path, Path, int, int]:
    """A Kaldi text of about `chars` characters, and the same split into characters."""
    text, split = directory / "text", directory / "text.chars"
    sentences = lm_sentences(max(1, round(chars / MEAN_CHARS)), seed)
    with open(text, "w", encoding="utf-8") as f, open(split, "w", encoding="utf-8") as g:
        for number, sentence in enumerate(sentences):
            f.write(f"utt{number:08d} {sentence}\n")
            g.write(" ".join(sentence) + "\n")
    return text, split, len(sentences), sum(map(len, sentences))


def run(command: list[str], limit_bytes: int | None = None, stdin: Path | None = None
        ) -> dict[str, float | bool | str]:
    """Wall seconds and peak RSS (the process tree's largest) of `command`."""

    def limit() -> None:
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    start = time.perf_counter()
    with open(stdin or os.devnull, "rb") as source:
        proc = subprocess.Popen(command, stdin=source, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, preexec_fn=limit)
        _, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    # ru_maxrss of the waited children: the largest RSS of any process in the tree.
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    tail = stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    return {"seconds": seconds, "peak_rss": peak, "ok": proc.returncode == 0,
            "error": "" if proc.returncode == 0 else tail[0][-160:]}


def measure_in_child(command: list[str], limit_bytes: int | None = None,
                     stdin: Path | None = None) -> dict:
    """`run` in a fresh Python process, so RUSAGE_CHILDREN holds this command alone."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from lm_scale import run; "
            "print(json.dumps(run(json.loads(sys.argv[2]), json.loads(sys.argv[3]), "
            "json.loads(sys.argv[4]))))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent),
                          json.dumps(command), json.dumps(limit_bytes),
                          json.dumps(str(stdin) if stdin else None)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=float, nargs="+", default=[5.9e6, 60e6],
                        help="training text sizes in characters")
    parser.add_argument("--order", type=int, default=5)
    parser.add_argument("--memory", default="1G", help="lmplz's -S (lm.json memory)")
    parser.add_argument("--ngram-max-chars", type=float, default=7e6,
                        help="largest text the in-memory estimator runs on unlimited")
    parser.add_argument("--ngram-limit-gb", type=float, default=6.0,
                        help="address-space limit of the in-memory estimator above that")
    parser.add_argument("--workdir", help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    lmplz = find_program("lmplz")
    if lmplz is None:
        sys.exit("kenlm's lmplz is not built: bash tools/build_kenlm_binary.sh lmplz")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-lm-"))
    print(f"{'text':>14s} {'method':34s} {'seconds':>8s} {'peak RSS GB':>11s}  note")
    per_char: dict[str, float] = {}
    try:
        for index, chars in enumerate(args.chars):
            directory = workdir / str(index)
            directory.mkdir(parents=True, exist_ok=True)
            text, split, sentences, total = write_text(directory, chars, seed=index)
            label = f"{total / 1e6:.1f} M chars"
            rows = []
            for estimator in ("lmplz", "ngram"):
                lm_dir = directory / estimator
                lm_dir.mkdir(exist_ok=True)
                (lm_dir / "lm.json").write_text(json.dumps({
                    "unit": "char", "order": args.order, "text": [str(text)],
                    "estimator": estimator, "memory": args.memory}))
                limited = estimator == "ngram" and total > args.ngram_max_chars
                limit = int(args.ngram_limit_gb * 1e9) if limited else None
                result = measure_in_child([sys.executable, "-m", "cat.lm.train", str(lm_dir)],
                                          limit)
                note = f"-S {args.memory}" if estimator == "lmplz" else ""
                if limited:
                    note = (f"limit {args.ngram_limit_gb:g} GB address space: "
                            + ("finished" if result["ok"] else f"failed ({result['error']})"))
                    if "ngram" in per_char:
                        note += (f"; projected {per_char['ngram'] * total / 1e9:.1f} GB, "
                                 f"{per_char['ngram_s'] * total:.0f} s")
                elif not result["ok"]:
                    note = f"failed ({result['error']})"
                if result["ok"] and not limited:
                    report = json.loads((lm_dir / "train.json").read_text())
                    note += f" {sum(report['ngrams']) / 1e6:.1f} M n-grams"
                    if estimator == "ngram":
                        per_char["ngram"] = result["peak_rss"] / total
                        per_char["ngram_s"] = result["seconds"] / total
                rows.append((f"cat.lm.train estimator {estimator}", result, note))
            alone = measure_in_child([lmplz, "-o", str(args.order), "-S", args.memory,
                                      "-T", f"{directory}/", "--arpa",
                                      str(directory / "alone.arpa")], stdin=split)
            rows.append((f"lmplz alone (-S {args.memory})", alone, ""))
            for name, result, note in rows:
                print(f"{label:>14s} {name:34s} {result['seconds']:8.1f} "
                      f"{result['peak_rss'] / 1e9:11.2f}  {note}", flush=True)
            print(f"{label:>14s} ({sentences} sentences)", flush=True)
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
