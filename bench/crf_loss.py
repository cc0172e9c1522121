"""The CTC-CRF loss (cat.crf.loss) against torch.nn.functional.ctc_loss at the same shapes.

Times forward + backward of a batch (best of --repeats) and the peak memory the call adds:
on CUDA torch's peak allocation, on CPU the peak resident set of a fresh process per case
above the same process before the call. `crf` runs the shared denominator in the
probability semiring with per-frame scales (the default), `log s` the same loss with it in
the log semiring. The denominator graph is a token 4-gram estimated
on sentences drawn from a random sparse Markov chain over the tokens, so its size grows
with the vocabulary as a phone LM's does.

Usage:
    python bench/crf_loss.py                     # CPU, 3 shapes
    python bench/crf_loss.py --quick             # one small shape, 1 repeat
    python bench/crf_loss.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import best_time

from cat.crf import loss as crf_loss
from cat.crf.loss import CtcCrfLoss
from cat.graph.denominator import build_den_graph


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
         device: str, repeats: int) -> dict:
    torch.manual_seed(0)
    graph = build_den_graph(sentences(classes, 2000, 0), classes, order=order)
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
    crf_loss.SCALED_DENOMINATOR = kind != "crf-log"
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
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:  # one measurement in this (fresh) process
        spec = json.loads(args.case)
        torch.set_num_threads(1)
        print(json.dumps(case(device=args.device, repeats=args.repeats, **spec)))
        return
    # (batch, frames, classes incl. blank, label length, order)
    shapes = [(4, 100, 40, 20, 4)] if args.quick else \
        [(8, 150, 40, 25, 4), (8, 150, 72, 25, 4), (8, 250, 160, 40, 4)]
    repeats = 1 if args.quick else args.repeats
    print(f"{'B':>3} {'T':>4} {'V':>4} {'U':>3} {'den states':>10} {'den arcs':>9} "
          f"{'crf s':>7} {'log s':>7} {'ctc s':>7} {'ratio':>6} {'crf MB':>7} {'ctc MB':>7}")
    for batch, frames, classes, labels_len, order in shapes:
        results = {}
        for kind in ("crf", "crf-log", "ctc"):
            spec = {"kind": kind, "batch": batch, "frames": frames, "classes": classes,
                    "labels_len": labels_len, "order": order}
            out = subprocess.run([sys.executable, __file__, "--device", args.device,
                                  "--repeats", str(repeats), "--case", json.dumps(spec)],
                                 check=True, capture_output=True, text=True).stdout
            results[kind] = json.loads(out.strip().splitlines()[-1])
        crf, log, ctc = results["crf"], results["crf-log"], results["ctc"]
        print(f"{batch:>3} {frames:>4} {classes:>4} {labels_len:>3} {crf['den_states']:>10} "
              f"{crf['den_arcs']:>9} {crf['seconds']:>7.3f} {log['seconds']:>7.3f} "
              f"{ctc['seconds']:>7.4f} "
              f"{crf['seconds'] / ctc['seconds']:>6.0f} {crf['peak_mb']:>7.1f} "
              f"{ctc['peak_mb']:>7.1f}")


if __name__ == "__main__":
    main()
