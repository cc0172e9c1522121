"""Language models: decoding speed with and without an LM, LM memory and load time, and the
n-gram estimator's speed.

Run from a recipe directory after stages 0-4 of an experiment (and its LMs, stage 5).
Decoding runs the same test set several ways in one process tree, each in its own run
(`cat.decoding.inference.decode_passes`, `--nj` CPU workers): beam search without LM (the
baseline), with shallow fusion of the token LM, and, when given, with LODR; N-best
rescoring is timed on the baseline's N-best lists. Ratios are against the baseline of
the same run. Memory: the resident-set growth of a fresh process loading each LM with
kenlm (ARPA, and kenlm binaries that `--binary` names), and its load time. Estimator:
seconds and peak memory of `cat.lm.ngram.estimate` on an LM experiment's text.

Usage (egs/aishell, after `bash run.sh --synthetic true --stage 2 --exp exp/synth-ctc-short`):
    python ../../bench/lm.py --exp exp/synth-ctc-short --data data/fbank/test \
        --lm exp/synth-lm-char-5gram --alpha 0.5 --beta 1.0 --rescore exp/synth-lm-word-3gram \
        --rescore-alpha 0.3 --rescore-beta 0.5 --nj 2 --binary lm.probing.bin lm.trie.bin
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEMORY_PROBE = """
import json, sys, time, kenlm
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024
before = rss()
start = time.perf_counter()
model = kenlm.Model(sys.argv[1])
seconds = time.perf_counter() - start
print(json.dumps({"rss_bytes": rss() - before, "load_seconds": seconds, "order": model.order}))
"""

ESTIMATOR_PROBE = """
import json, resource, sys, time
from cat.lm.ngram import estimate
from cat.lm.text import iter_text, make_splitter
from cat.lm.train import load_lm_config
config = load_lm_config(sys.argv[1])
split = make_splitter(config["unit"], config.get("tokenizer"))
sentences = [split(t) for t in iter_text(config.get("text", []))]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
fallback = config.get("discount_fallback")
model = estimate(sentences, config["order"], tuple(fallback) if fallback else None)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "tokens": sum(map(len, sentences)),
                  "ngrams": sum(len(g) for g in model.grams),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss_before_bytes": before * 1024}))
"""


def probe(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exp", required=True, help="trained ASR experiment")
    parser.add_argument("--data", required=True, help="feature dir to decode")
    parser.add_argument("--lm", required=True, help="token LM experiment dir (lm.arpa)")
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--lodr", help="LODR LM experiment dir")
    parser.add_argument("--lodr-weight", type=float, default=0.2)
    parser.add_argument("--rescore", help="word LM experiment dir for N-best rescoring")
    parser.add_argument("--rescore-alpha", type=float, default=0.3)
    parser.add_argument("--rescore-beta", type=float, default=0.5)
    parser.add_argument("--binary", nargs="*", default=[],
                        help="kenlm binaries of the token LM, to compare with its ARPA")
    parser.add_argument("--nj", type=int, default=2)
    args = parser.parse_args()

    from cat.core.config import load_hyper
    from cat.decoding.inference import DecodeOptions, FusionSpec, decode_passes
    from cat.lm.rescore import NBestScores, read_nbest
    from cat.lm.scorer import WordRescorer
    from cat.lm.text import make_splitter
    from cat.lm.train import load_lm_config
    from cat.stages.plan import Plan, select_checkpoint

    plan = Plan.load(args.exp)
    hyper = load_hyper(Path(args.exp) / "hyper-p.json")
    kind = "rnnt" if hyper["train"]["bin"] == "cat.rnnt.train" else "ctc"
    option = {**hyper["inference"]["infer"].get("option", {}), "nj": args.nj}
    options = DecodeOptions.from_dict(option, "hyper-p.json")
    checkpoint = select_checkpoint(plan)
    arpa = str(Path(args.lm) / "lm.arpa")
    runs = [("no LM (baseline)", None),
            (f"fusion alpha {args.alpha:g} beta {args.beta:g}",
             FusionSpec(arpa, args.alpha, args.beta))]
    if args.lodr:
        runs.append((f"fusion + LODR weight {args.lodr_weight:g}",
                     FusionSpec(arpa, args.alpha, args.beta, str(Path(args.lodr) / "lm.arpa"),
                                args.lodr_weight)))
    print(f"{kind} {args.exp}, {args.data}, beam {options.beam_size}, {args.nj} workers")
    print(f"{'decoding':42s} {'seconds':>8s} {'RTF':>8s} {'x baseline':>10s}")
    baseline = None
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, spec) in enumerate(runs):
            out = Path(scratch) / str(index)
            summary = decode_passes(args.exp, args.data, checkpoint, options,
                                    [(spec, out)])[0]
            baseline = baseline or summary.decode_seconds
            print(f"{name:42s} {summary.decode_seconds:8.2f} {summary.rtf:8.4f} "
                  f"{summary.decode_seconds / baseline:10.2f}")
            if spec is None and args.rescore:
                config = load_lm_config(args.rescore)
                start = time.perf_counter()
                rescorer = WordRescorer(Path(args.rescore) / "lm.arpa",
                                        make_splitter(config["unit"], config.get("tokenizer")))
                scores = NBestScores.compute(read_nbest(out / "nbest.jsonl"), rescorer)
                scores.best(args.rescore_alpha, args.rescore_beta)
                seconds = time.perf_counter() - start
                total = summary.decode_seconds + seconds
                print(f"{'no LM + word rescoring (load, score, pick)':42s} {total:8.2f} "
                      f"{total / summary.audio_seconds:8.4f} {total / baseline:10.2f}")
    print()
    print(f"{'LM file':46s} {'MB on disk':>10s} {'RSS MB':>8s} {'load s':>7s}")
    files = [Path(args.lm) / "lm.arpa"]
    files += [Path(p) / "lm.arpa" for p in (args.lodr, args.rescore) if p]
    files += [Path(p) for p in args.binary]
    for path in files:
        memory = probe(MEMORY_PROBE, str(path))
        print(f"{path!s:46s} {path.stat().st_size / 1e6:10.1f} "
              f"{memory['rss_bytes'] / 1e6:8.1f} {memory['load_seconds']:7.2f}")
    print()
    for lm_dir in [args.lm, *(p for p in (args.lodr, args.rescore) if p)]:
        result = probe(ESTIMATOR_PROBE, lm_dir)
        print(f"estimator {lm_dir}: {result['tokens']} tokens -> {result['ngrams']} n-grams in "
              f"{result['seconds']:.1f} s, peak RSS {result['peak_rss_bytes'] / 1e6:.0f} MB "
              f"({result['rss_before_bytes'] / 1e6:.0f} MB before estimating)")


if __name__ == "__main__":
    main()
