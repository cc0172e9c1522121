"""Does `train.option.compile` pay? A Conformer CTC update eager against the same model with
its blocks compiled (`ConformerNet.compile_blocks`: `torch.compile`, dynamic shapes), in
one process, taking turns: the first update at each new batch shape (compiling, for the
compiled model), then the median of `--rounds` updates per shape, and the graphs compiled.

Usage:
    python bench/compile.py                                  # CPU, 4 x 144, 3 shapes
    python bench/compile.py --device cuda --hdim 512 --cells 12 --shapes 64x600,64x700,48x800
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from cat.models.registry import build_model
from cat.testing.training import tiny_model_config

FEAT_DIM, VOCAB = 80, 30


def update_function(args: argparse.Namespace, compiled: bool) -> Callable[[int, int], None]:
    """One update (forward, backward, AdamW step) of a fresh model at a batch shape."""
    device = torch.device(args.device)
    config = tiny_model_config("ctc", FEAT_DIM)
    config["encoder"]["kwargs"].update(hdim=args.hdim, num_cells=args.cells, num_heads=4,
                                       subsampling_channels=16, kernel_size=15)
    torch.manual_seed(0)
    model = build_model(config, VOCAB).to(device)
    if compiled:
        model.encoder.compile_blocks()
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)

    def update(utterances: int, frames: int) -> None:
        generator = torch.Generator().manual_seed(utterances * frames)
        feats = torch.randn(utterances, frames, FEAT_DIM, generator=generator).to(device)
        labels = torch.randint(1, VOCAB, (utterances, 6), generator=generator)
        loss, _ = model(feats, torch.full((utterances,), frames), labels,
                        torch.full((utterances,), 6))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return update


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hdim", type=int, default=144)
    parser.add_argument("--cells", type=int, default=4)
    parser.add_argument("--shapes", default="8x300,8x360,6x420",
                        help="comma-separated batch shapes, utterances x input frames")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    updates = {"eager": update_function(args, False),
               "compiled": update_function(args, True)}
    first: dict[str, list[float]] = {name: [] for name in updates}
    for shape in shapes:
        for name, update in updates.items():
            start = time.perf_counter()
            update(*shape)
            first[name].append(time.perf_counter() - start)
    times: dict[tuple[str, tuple[int, int]], list[float]] = {}
    for _ in range(args.rounds):
        for shape in shapes:
            for name, update in updates.items():
                start = time.perf_counter()
                update(*shape)
                times.setdefault((name, shape), []).append(time.perf_counter() - start)
    from torch._dynamo.utils import counters

    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"thread(s); Conformer {args.cells} x {args.hdim}; shapes {args.shapes}")
    print("first update at each new shape, s: " + "; ".join(
        f"{name} " + " ".join(f"{s:.2f}" for s in values) for name, values in first.items()))
    print(f"{'shape':>8} {'eager s':>8} {'compiled s':>10} {'compiled/eager':>14}")
    for shape in shapes:
        eager = statistics.median(times[("eager", shape)])
        compiled = statistics.median(times[("compiled", shape)])
        print(f"{shape[0]}x{shape[1]:<5} {eager:>8.4f} {compiled:>10.4f} {compiled / eager:>14.2f}")
    print(f"graphs compiled: {counters['stats'].get('unique_graphs', 0)}; median of "
          f"{args.rounds} updates per shape")
    return 0


if __name__ == "__main__":
    sys.exit(main())
