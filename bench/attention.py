"""The relative-position attention through `scaled_dot_product_attention` against its softmax
written out (as before): forward + backward of a Conformer encoder on one batch (or, with
`--inference`, its eval-mode forward without gradients, as decoding runs it), the two
taking turns in one process, median of `--rounds`.

Usage:
    python bench/attention.py                                  # 12 x 512, 8 x 600 frames
    python bench/attention.py --dropout-attn 0.3               # exp/ctc-v1's dropout
    python bench/attention.py --cells 2 --hdim 256 --rounds 5  # quicker
    python bench/attention.py --inference                      # eval-mode forward only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import attention_variant

from cat.models.encoder import ConformerNet

FEAT_DIM = 80


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hdim", type=int, default=512)
    parser.add_argument("--cells", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=600)
    parser.add_argument("--dropout-attn", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inference", action="store_true",
                        help="eval-mode forward without gradients")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    # A small subsampling convolution: the blocks are what is compared.
    encoder = ConformerNet(FEAT_DIM, args.hdim, args.cells, num_heads=4, dropout=0.1,
                           dropout_attn=args.dropout_attn, subsampling_channels=32).to(device)
    feats = torch.randn(args.batch, args.frames, FEAT_DIM, device=device)
    lengths = torch.randint(args.frames // 2, args.frames + 1, (args.batch,))
    lengths[0] = args.frames

    if args.inference:
        encoder.eval()

    def step() -> float:
        encoder.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if args.inference:
            with torch.no_grad():
                encoder(feats, lengths)
        else:
            out, _ = encoder(feats, lengths)
            out.square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"explicit": [], "sdpa": []}
    for variant in times:  # warm-up
        with attention_variant(variant):
            step()
    for _ in range(args.rounds):
        for variant, values in times.items():
            with attention_variant(variant):
                values.append(step())
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"thread(s); encoder {args.cells} x {args.hdim}, batch {args.batch} x {args.frames} "
          f"frames, dropout_attn {args.dropout_attn}; "
          f"{'eval-mode forward' if args.inference else 'forward + backward'}, median of "
          f"{args.rounds}")
    for variant, values in times.items():
        print(f"{variant:<9} {medians[variant]:8.3f} s   ({' '.join(f'{t:.3f}' for t in values)})")
    print(f"sdpa / explicit: {medians['sdpa'] / medians['explicit']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
