"""Seconds per training update of experiments' models, measured side by side in one run.

Each `config.json` is built by `cat.models.registry` for a vocabulary of `--classes`
(352: the synthetic AISHELL corpus's characters), and trained for `--steps` updates
(forward, backward, AdamW step) on one fixed batch of random features and label
sequences shaped like the recipe's batches (`--batch` utterances of `--frames` frames and
`--labels` labels, as `max_frames` 8,000 forms them from 2.5 s utterances). The models
take turns, one update each, so that a busy machine slows them alike; printed: the median
seconds per update and the ratio to the first experiment.

Usage:
    python bench/update_time.py egs/aishell/exp/synth-ctc egs/aishell/exp/synth-u2 \
        egs/aishell/exp/synth-rnnt egs/aishell/exp/synth-rnnt-ctc
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.core.config import load_config, model_kind
from cat.models.registry import build_model, count_parameters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="+", help="experiment directories (config.json)")
    parser.add_argument("--classes", type=int, default=352, help="vocabulary, blank included")
    parser.add_argument("--batch", type=int, default=32, help="utterances per batch")
    parser.add_argument("--frames", type=int, default=250, help="input frames per utterance")
    parser.add_argument("--labels", type=int, default=12, help="labels per utterance")
    parser.add_argument("--steps", type=int, default=12, help="timed updates per model")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    feats = torch.randn(args.batch, args.frames, 80, generator=generator)
    feat_lens = torch.full((args.batch,), args.frames)
    labels = torch.randint(1, args.classes, (args.batch, args.labels), generator=generator)
    label_lens = torch.full((args.batch,), args.labels)
    runs = []
    for directory in args.experiments:
        config = load_config(Path(directory) / "config.json")
        config.pop("specaug", None)  # the same work in every update
        torch.manual_seed(0)
        model = build_model(config, args.classes).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs.append((directory, model_kind(config), model, optimizer, []))

    def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        start = time.perf_counter()
        loss, _ = model(feats, feat_lens, labels, label_lens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    for _, _, model, optimizer, _ in runs:  # warm-up
        update(model, optimizer)
    for _ in range(args.steps):
        for _, _, model, optimizer, times in runs:
            times.append(update(model, optimizer))
    print(f"batch {args.batch} x {args.frames} frames x {args.labels} labels, "
          f"{args.classes} classes, {args.threads} thread(s), median of {args.steps} updates")
    print(f"{'experiment':<34} {'kind':<5} {'parameters':>11} {'s/update':>9} {'ratio':>6}")
    first = None
    for directory, kind, model, _, times in runs:
        median = statistics.median(times)
        first = first or median
        print(f"{directory:<34} {kind:<5} {count_parameters(model):>11,} {median:>9.3f} "
              f"{median / first:>6.2f}")


if __name__ == "__main__":
    main()
