"""Training step time with 1 and 2 torch threads, idle and beside CPU-bound processes.

The model is egs/aishell's exp/synth-ctc (Conformer CTC, 3.2 M parameters), one update
(forward, backward, AdamW step) of a batch of 16 utterances x 500 frames. Each setting
runs in a fresh process, since the OpenMP runtime reads its wait policy once, when torch
is imported:

* before: the old settings, torch imported before `cat` with no `OMP_WAIT_POLICY` (the
  OpenMP runtime's default: waiting threads spin);
* after: `cat` imported first, which sets `OMP_WAIT_POLICY=PASSIVE`
  (`cat.core.threads`).

"loaded" runs each setting beside `--hogs` CPU-bound processes that the bench starts and
kills itself. Prints the median step time of `--steps` updates after a warm-up, and the
ratios loaded/idle and before/after. The machine's own load counts too: quote `uptime`.

Usage:
    python bench/threads.py --steps 3 --hogs 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "egs" / "aishell" / "exp" / "synth-ctc" / "config.json"
HOG = "while True: pass"


def child(policy: str, threads: int, steps: int, batch: int, frames: int) -> None:
    """One setting: print the step times (seconds) as JSON."""
    if policy == "before":
        import torch  # first: the runtime keeps its default wait policy
    sys.path.insert(0, str(REPO))
    import torch

    from cat.models.registry import build_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = json.loads(CONFIG.read_text(encoding="utf-8"))
    model = build_model(config, 500, str(CONFIG))
    normalizer = getattr(model.encoder, "normalizer", None)
    if normalizer is not None:
        normalizer.set_stats(torch.zeros(80), torch.ones(80))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    feats = torch.randn(batch, frames, 80)
    feat_lens = torch.full((batch,), frames, dtype=torch.long)
    labels = torch.randint(1, 500, (batch, 30))
    label_lens = torch.full((batch,), 30, dtype=torch.long)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss, _ = model(feats, feat_lens, labels, label_lens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                      "threads": torch.get_num_threads(), "times": times[1:]}))


def run_setting(policy: str, threads: int, args: argparse.Namespace) -> float:
    """Median step time of one setting, in a fresh process."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    command = [sys.executable, __file__, "--child", policy, "--threads", str(threads),
               "--steps", str(args.steps), "--batch", str(args.batch),
               "--frames", str(args.frames)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True,
                            check=True, timeout=3600)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return statistics.median(report["times"])


def measure(args: argparse.Namespace, loaded: bool) -> dict[tuple[str, int], float]:
    """Median step time per (policy, threads), with or without the CPU-bound processes."""
    hogs = []
    try:
        if loaded:
            hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
        return {(policy, threads): run_setting(policy, threads, args)
                for policy in ("before", "after") for threads in (1, 2)}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def main() -> None:
    # A kill (e.g. `timeout`) ends the bench through `finally`, which kills the hogs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--frames", type=int, default=500)
    parser.add_argument("--child", choices=("before", "after"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.threads, args.steps, args.batch, args.frames)
        return
    print(f"load before: {os.getloadavg()[0]:.2f}; exp/synth-ctc step, batch {args.batch} x "
          f"{args.frames} frames, median of {args.steps}")
    idle = measure(args, loaded=False)
    loaded = measure(args, loaded=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"{'setting':<16}{'idle s':>9}{f'+{args.hogs} hogs s':>12}{'loaded/idle':>13}")
    for (policy, threads), seconds in idle.items():
        busy = loaded[(policy, threads)]
        print(f"{policy + f', {threads} thr':<16}{seconds:>9.2f}{busy:>12.2f}"
              f"{busy / seconds:>13.2f}")
    for threads in (1, 2):
        print(f"before/after, {threads} thread(s): idle "
              f"{idle[('before', threads)] / idle[('after', threads)]:.2f}, loaded "
              f"{loaded[('before', threads)] / loaded[('after', threads)]:.2f}")


if __name__ == "__main__":
    main()
