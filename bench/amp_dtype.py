"""Does bfloat16 train as well as float32? A small Conformer CTC model trained twice from the
same seed on the same batches, once in float32 and once under bfloat16 autocast (and,
on CUDA, once in float16 with a GradScaler), through `cat.training.update.Updater`: the
training loss of every update and the dev loss every `--eval-every` updates, side by side.

The task is learnable, so that the dev loss measures what was learnt: each of `--vocab`
tokens has an 80-dimensional prototype, an utterance is 4-10 tokens, each held for 4-8
frames of its prototype plus noise, with 0-3 frames of noise between them.

The Updater autocasts on CUDA only (`train.option.amp`); on a CPU this script sets its
autocast dtype itself, which is what `amp_dtype` would choose there if CPUs trained
with AMP. Printed: the losses at each evaluation, and the last evaluation's relative
differences from float32.

Usage:
    python bench/amp_dtype.py                        # CPU: 400 updates, about 4 minutes
    python bench/amp_dtype.py --device cuda --updates 2000 --hdim 256 --cells 6
    python bench/amp_dtype.py --updates 40 --eval-every 20   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from cat.core.config import TrainOptions, train_option_defaults
from cat.loading.batch import Batch
from cat.models.registry import build_model
from cat.testing.training import tiny_model_config
from cat.training.distributed import DistributedContext
from cat.training.update import Updater

FEAT_DIM = 80


def utterances(count: int, vocab: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(features [T, 80], labels [U]) of `count` utterances of the prototype task."""
    prototypes = np.random.default_rng(1234).normal(0.0, 1.0, (vocab, FEAT_DIM))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        labels = rng.integers(1, vocab, int(rng.integers(4, 11)))
        frames = []
        for label in labels:
            frames += [np.zeros(FEAT_DIM)] * int(rng.integers(0, 4))
            frames += [prototypes[label]] * int(rng.integers(4, 9))
        feats = np.stack(frames) + rng.normal(0.0, 0.7, (len(frames), FEAT_DIM))
        out.append((feats.astype(np.float32), labels))
    return out


def batches(data: list[tuple[np.ndarray, np.ndarray]], size: int) -> list[Batch]:
    """Padded batches of `size` consecutive utterances."""
    out = []
    for start in range(0, len(data) - size + 1, size):
        part = data[start:start + size]
        frames = max(len(f) for f, _ in part)
        labels = max(len(u) for _, u in part)
        feats = torch.zeros(size, frames, FEAT_DIM)
        label_rows = torch.zeros(size, labels, dtype=torch.long)
        for row, (f, u) in enumerate(part):
            feats[row, :len(f)] = torch.from_numpy(f)
            label_rows[row, :len(u)] = torch.from_numpy(u)
        out.append(Batch([f"u{start + i}" for i in range(size)], feats,
                         torch.tensor([len(f) for f, _ in part]), label_rows,
                         torch.tensor([len(u) for _, u in part])))
    return out


def train(mode: str, args: argparse.Namespace, train_batches: list[Batch],
          dev_batches: list[Batch]) -> dict[str, list[float]]:
    """Train a fresh model in `mode` (fp32, bf16, fp16): losses and the seconds taken."""
    device = torch.device(args.device)
    config = tiny_model_config("ctc", FEAT_DIM, peak_lr=args.lr, warmup_steps=args.warmup)
    config["encoder"]["kwargs"].update(hdim=args.hdim, num_cells=args.cells, num_heads=4,
                                       subsampling_channels=16, kernel_size=7)
    torch.manual_seed(args.seed)
    model = build_model(config, args.vocab).to(device)
    dtype = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}[mode]
    options = TrainOptions(**{**train_option_defaults(), "trset": [], "devset": [],
                              "tokenizer": "unused", "grad_norm": 5.0,
                              "amp": dtype is not None and device.type == "cuda",
                              "amp_dtype": dtype or "auto"})
    updater = Updater(model, config["scheduler"], options, DistributedContext(device=device))
    if dtype is not None and device.type == "cpu":  # see the module docstring
        updater.amp, updater.amp_dtype = True, getattr(torch, dtype)
    torch.manual_seed(args.seed)  # the same dropout and SpecAugment draws in every mode
    curve: dict[str, list[float]] = {"train": [], "dev": [], "dev_step": []}
    start = time.perf_counter()
    for step in range(1, args.updates + 1):
        batch = train_batches[(step - 1) % len(train_batches)]
        stats = updater.update([batch], float(len(batch)))
        curve["train"].append(stats["loss"])
        if step % args.eval_every == 0:
            curve["dev"].append(updater.evaluate(dev_batches))
            curve["dev_step"].append(step)
    curve["seconds"] = [time.perf_counter() - start]
    return curve


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", default="fp32,bf16",
                        help="comma-separated: fp32, bf16, fp16 (fp16: CUDA only)")
    parser.add_argument("--updates", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--train-utts", type=int, default=640)
    parser.add_argument("--dev-utts", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=30)
    parser.add_argument("--hdim", type=int, default=64)
    parser.add_argument("--cells", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    train_batches = batches(utterances(args.train_utts, args.vocab, 1), args.batch_size)
    dev_batches = batches(utterances(args.dev_utts, args.vocab, 2), args.batch_size)
    modes = [m for m in args.modes.split(",") if m]
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; Conformer {args.cells} x {args.hdim}, {args.vocab} classes; "
          f"{len(train_batches)} training batches of {args.batch_size}, "
          f"{len(dev_batches)} dev batches; {args.updates} updates", flush=True)
    curves = {mode: train(mode, args, train_batches, dev_batches) for mode in modes}
    print(f"{'update':>6} " + " ".join(f"{m + ' train':>11} {m + ' dev':>9}" for m in modes))
    for index, step in enumerate(curves[modes[0]]["dev_step"]):
        window = slice(max(0, step - args.eval_every), step)
        print(f"{step:>6} " + " ".join(
            f"{statistics.mean(curves[m]['train'][window]):>11.4f} "
            f"{curves[m]['dev'][index]:>9.4f}" for m in modes))
    print("train: mean training loss of the updates since the previous row; dev: dev loss")
    base = curves[modes[0]]
    last = slice(-args.eval_every, None)
    for mode in modes[1:]:
        train_diff = (statistics.mean(curves[mode]["train"][last])
                      / statistics.mean(base["train"][last]) - 1)
        dev_diff = curves[mode]["dev"][-1] / base["dev"][-1] - 1
        print(f"{mode} against {modes[0]} at update {args.updates}: train {train_diff:+.2%}, "
              f"dev {dev_diff:+.2%}")
    print("seconds: " + ", ".join(f"{m} {curves[m]['seconds'][0]:.1f}" for m in modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
