"""The CTC-CRF loss (cat.crf.loss) against torch.nn.functional.ctc_loss at the same shapes,
and against the loss of a git revision (`--before`) on the same graph, in one run.

Times forward + backward of a batch (best of --repeats) and the peak memory the call adds:
on CUDA torch's peak allocation, on CPU the peak resident set of a fresh process per case
above the same process before the call. The token 4-gram of the denominator is estimated
on sentences drawn from a random sparse Markov chain over the tokens (each token has 8
successors, as phones have few), so its size grows with the vocabulary as a phone LM's
does. Rows:

* `before`: the loss of `--before` (exported with git archive) on the Kneser-Ney graph;
* `after kn`: this checkout's loss on the same Kneser-Ney graph (back-off expanded: every
  LM state has an arc per token);
* `after chain`: this checkout's loss on the graph stage 2 builds by default (the
  un-smoothed chain-style LM: arcs only for what the text holds);
* `ctc_loss`: torch's CTC loss.

Usage:
    python bench/crf_loss.py                     # CPU, 3 shapes
    python bench/crf_loss.py --quick             # one small shape, 1 repeat
    python bench/crf_loss.py --device cuda --before ""   # no before row
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import REPO_ROOT, best_time, export_revision


def sentences(classes: int, count: int, seed: int) -> list[list[int]]:
    """Sentences of 10-40 tokens from a Markov chain where each token has 8 successors."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(1, classes, size=(classes, 8))
    out = []
    for _ in range(count):
        token = int(rng.integers(1, classes))
        sentence = [token]
        for _ in range(int(rng.integers(10, 40))):
            token = int(successors[token, rng.integers(0, 8)])
            sentence.append(token)
        out.append(sentence)
    return out


def case(kind: str, batch: int, frames: int, classes: int, labels_len: int, order: int,
         device: str, repeats: int, estimator: str = "") -> dict:
    from cat.crf.loss import CtcCrfLoss
    from cat.graph.denominator import build_den_graph

    torch.manual_seed(0)
    options = {"estimator": estimator} if estimator else {}  # `before` has no such option
    graph = build_den_graph(sentences(classes, 2000, 0), classes, order=order, **options)
    x = torch.log_softmax(torch.randn(batch, frames, classes, device=device), -1)
    label_seqs = sentences(classes, batch, 1)
    labels = torch.tensor([s[:labels_len] + [1] * (labels_len - len(s[:labels_len]))
                           for s in label_seqs], device=device)
    lengths = torch.full((batch,), frames, device=device)
    label_lens = torch.full((batch,), labels_len, device=device)
    loss = CtcCrfLoss(graph, 0.01)

    def run_crf() -> None:
        xg = x.clone().requires_grad_(True)
        losses, _ = loss(xg, lengths, labels, label_lens)
        losses.sum().backward()

    def run_ctc() -> None:
        xg = x.clone().requires_grad_(True)
        torch.nn.functional.ctc_loss(xg.transpose(0, 1), labels, lengths, label_lens,
                                     reduction="sum").backward()

    run = run_ctc if kind == "ctc" else run_crf
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = best_time(lambda: (run(), sync()), repeats)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"kind": kind, "seconds": seconds, "peak_mb": peak / 2**20, **graph.info}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--before", default="3bb52b9",
                        help="git revision whose loss is the 'before' row ('' for none)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:  # one measurement in this (fresh) process
        spec = json.loads(args.case)
        torch.set_num_threads(1)
        print(json.dumps(case(device=args.device, repeats=args.repeats, **spec)))
        return
    # (batch, frames, classes incl. blank, label length, order); the last is a batch of
    # the synthetic AISHELL CTC-CRF experiment (154 phone classes, 8x subsampling)
    shapes = [(4, 100, 40, 20, 4)] if args.quick else \
        [(8, 150, 40, 25, 4), (8, 150, 72, 25, 4), (16, 80, 154, 20, 4)]
    repeats = 1 if args.quick else args.repeats
    rows = [("before", "crf", ""), ("after kn", "crf", "kneser-ney"),
            ("after chain", "crf", "chain"), ("ctc_loss", "ctc", "chain")]
    if not args.before:
        rows = rows[1:]
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"before": export_revision(args.before, Path(tmp) / "before")
                 if args.before else None}
        print(f"{'B':>3} {'T':>4} {'V':>4} {'U':>3} {'row':<12} {'den states':>10} "
              f"{'den arcs':>9} {'seconds':>8} {'x ctc_loss':>10} {'peak MB':>8}")
        for batch, frames, classes, labels_len, order in shapes:
            results = {}
            for label, kind, estimator in rows:
                root = roots.get(label) or REPO_ROOT
                spec = {"kind": kind, "batch": batch, "frames": frames, "classes": classes,
                        "labels_len": labels_len, "order": order, "estimator": estimator}
                out = subprocess.run([sys.executable, __file__, "--device", args.device,
                                      "--repeats", str(repeats), "--case", json.dumps(spec)],
                                     check=True, capture_output=True, text=True,
                                     env={**os.environ, "PYTHONPATH": str(root)}).stdout
                results[label] = json.loads(out.strip().splitlines()[-1])
            ctc = results["ctc_loss"]["seconds"]
            for label, _, _ in rows:
                r = results[label]
                states, arcs = ("", "") if label == "ctc_loss" else (r["den_states"],
                                                                      r["den_arcs"])
                print(f"{batch:>3} {frames:>4} {classes:>4} {labels_len:>3} {label:<12} "
                      f"{states:>10} {arcs:>9} {r['seconds']:>8.4f} "
                      f"{r['seconds'] / ctc:>10.1f} {r['peak_mb']:>8.1f}")


if __name__ == "__main__":
    main()
