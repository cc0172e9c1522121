"""One training update of our Conformer CTC model against ESPnet's model of the same size,
on the same batch, timed in one run.

Ours: `egs/aishell/exp/ctc-v1` built by `cat.models.registry` (12 x 512 Conformer, 4 heads,
feed-forward 2048, convolution kernel 15, VGG2L 4x subsampling, CTC over AISHELL-1's 4,233
characters: 79.5 M parameters); with `--ours conv2d` also the same config with a conv2d
front end as wide as ESPnet's (two 3x3 stride-2 convolutions of 512 channels), so that
both sides have the same layers and sizes. The peer: ESPnet's `ConformerEncoder` (espnet2;
relative positional self-attention in its "latest" form, macaron feed-forward, convolution
module with ctc-v1's kernel, its conv2d 4x subsampling, ctc-v1's dimensions, heads and
dropout rates) and its `CTC` over the same classes. ESPnet's conv2d front end is its only
4x one (its VGG2L reduces time 6x); its 512 channels make the peer 5.8 M parameters (7 %)
larger than ctc-v1. Everything after the front end has the same size on both sides, but
for ESPnet's final LayerNorm; the script prints the front ends' parameters apart.

An update is `bench/gpu.py`'s `update_function` for both: forward, backward, clipping to
ctc-v1's `grad_norm`, the experiment's AdamW step and Noam schedule. SpecAugment is left
out (the peer has none). The batch is `bench/gpu.py`'s `step_batch` of random features
(`--batch` utterances of 300-600 frames; `--quick`: 2 of 60-90 frames, a 2 x 32 encoder).
After the warm-up updates the models take turns (ours, peer, ours, peer, ...), so that a
busy machine slows them alike. Printed: the median and best seconds per update and the
ratio peer / ours (above 1: ours is faster). On the CPU fp32 only, every model with the
same torch threads; on CUDA (`--device cuda`) also fp16 autocast with a GradScaler and bf16
autocast, with each model's peak memory (its parameters, gradients, optimizer state and
the update's activations).

ESPnet is not a dependency of the project: the script takes it from bench/out/peer/site
(git-ignored), after the project's site-packages on sys.path, so that it runs on the
project's torch. Install it there, without its dependencies (pip would otherwise downgrade
pinned packages of the environment, such as sentencepiece and pypinyin):

    pip install --no-deps --target bench/out/peer/site espnet==202511 typeguard==4.6.1

(`--install` does it, unless it is done: the test set-up, `tools/install.sh --dev`, runs
it.) Without it the script prints that command and exits with status 2.

Usage:
    python bench/peer_update.py --quick                     # tiny encoder, seconds
    python bench/peer_update.py --batch 16                  # 12 x 512 on the CPU, minutes
    python bench/peer_update.py --device cuda --json bench/out/peer_update.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import inspect
import io
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import (
    AISHELL,
    AISHELL_CHARS,
    FULL,
    MODES,
    TINY,
    Sizes,
    autocast_problem,
    ctc_v1_config,
    device_text,
    hyper_option,
    reset_peak,
    step_batch,
    update_function,
    write_json,
)
from timing import REPO_ROOT

PEER_SITE = REPO_ROOT / "bench/out/peer/site"
PEER_PACKAGES = "espnet==202511 typeguard==4.6.1"  # typeguard: the one import it lacks


def install_command(site: Path = PEER_SITE) -> str:
    """The command that installs the peer into `site`, from the repository root."""
    target = site if site.resolve() != PEER_SITE else site.relative_to(REPO_ROOT)
    return f"pip install --no-deps --target {target} {PEER_PACKAGES}"


INSTALL = install_command()


def install_peer(site: Path = PEER_SITE) -> None:
    """Install the peer into `site` unless these packages are there (`--install`: the
    test set-up, `tools/install.sh --dev`, runs it)."""
    stamp = site / ".packages"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == PEER_PACKAGES:
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", "--no-deps", "--target", str(site),
                    *PEER_PACKAGES.split()], check=True)
    stamp.write_text(PEER_PACKAGES, encoding="utf-8")
# Our encoder with the config's front end, or with a conv2d one of hdim channels (ESPnet's).
OURS = {"ctc-v1": {}, "conv2d": {"subsampling": "conv2d", "subsampling_channels": None}}
# The largest relative difference of parameters between ours and the peer: outside the
# front end (ESPnet's extra LayerNorm), and in all when the front ends are alike (conv2d).
SAME_LAYERS_TOLERANCE = 1e-3
QUICK = dataclasses.replace(TINY, encoder={"hdim": 32, "num_cells": 2, "num_heads": 2},
                            warmup_steps=1, timed_steps=5)
# ctc-v1's batch (128 utterances) takes minutes per update on 2 cores; a CPU has no lazy
# initialisation for more than one warm-up update to pay for.
CPU_FULL = dataclasses.replace(FULL, step_batch=16, warmup_steps=1)


class PeerMissing(Exception):
    """ESPnet cannot be imported; the message says why."""


@dataclasses.dataclass(frozen=True)
class Peer:
    """The ESPnet classes the peer is built of, and ESPnet's version."""

    encoder_class: type
    ctc_class: type
    version: str


@dataclasses.dataclass
class Runner:
    """A model in the turns: its update, sizes and what its updates measured."""

    name: str
    model: torch.nn.Module
    front_end: torch.nn.Module
    update: Callable[[Sequence[torch.Tensor]], float] | None = None
    resident_bytes: int = 0  # on CUDA: parameters, buffers and optimizer state
    times: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    peaks: list[float] = dataclasses.field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {"parameters": count(self.model), "front_end": count(self.front_end),
                "median_seconds": statistics.median(self.times),
                "best_seconds": min(self.times), "step_times": self.times,
                "last_loss": self.losses[-1], "peak_mb": max(self.peaks, default=None)}


class PeerModel(torch.nn.Module):
    """ESPnet's Conformer encoder and CTC, called as our models are: `(loss, extras)`."""

    def __init__(self, encoder: torch.nn.Module, ctc: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.ctc = ctc

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        hidden, lengths, _ = self.encoder(feats, feat_lens)
        return self.ctc(hidden, lengths, labels, label_lens), {}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def import_peer(site: Path) -> Peer:
    """ESPnet's encoder and CTC classes, from `site` after the environment's packages."""
    if str(site) not in sys.path:
        sys.path.append(str(site))
    try:
        # ESPnet prints that flash-attn is absent; no flash attention runs for relative
        # positional attention anyway.
        with contextlib.redirect_stdout(io.StringIO()):
            from espnet2.asr.ctc import CTC
            from espnet2.asr.encoder.conformer_encoder import ConformerEncoder
        version = importlib.metadata.version("espnet")
    except ImportError as error:
        raise PeerMissing(f"ESPnet, the peer, cannot be imported from {site} or the "
                          f"environment ({error})") from None
    return Peer(ConformerEncoder, CTC, version)


def encoder_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """The encoder arguments of `config`, with `ConformerNet`'s defaults filled in."""
    from cat.models.encoder import ConformerNet

    defaults = {name: parameter.default for name, parameter
                in inspect.signature(ConformerNet).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    return {**defaults, **config["encoder"]["kwargs"]}


def build_peer(peer: Peer, config: dict[str, Any]) -> PeerModel:
    """ESPnet's Conformer CTC model with the dimensions and dropout of `config`."""
    ours = encoder_kwargs(config)
    encoder = peer.encoder_class(
        ours["idim"], output_size=ours["hdim"], attention_heads=ours["num_heads"],
        linear_units=ours["ffn_mult"] * ours["hdim"], num_blocks=ours["num_cells"],
        dropout_rate=float(ours["dropout"]), positional_dropout_rate=float(ours["dropout"]),
        attention_dropout_rate=float(ours["dropout_attn"]), input_layer="conv2d",
        normalize_before=True, macaron_style=True, rel_pos_type="latest",
        pos_enc_layer_type="rel_pos", selfattention_layer_type="rel_selfattn",
        activation_type="swish", use_cnn_module=True, cnn_module_kernel=ours["kernel_size"],
        use_flash_attn=False)
    ctc = peer.ctc_class(AISHELL_CHARS, ours["hdim"],
                         dropout_rate=float(config["ctc"].get("dropout", 0.0)))
    return PeerModel(encoder, ctc)


def build_runners(peer: Peer, sizes: Sizes, ours: Sequence[str]) -> list[Runner]:
    """Our models (one per `ours` variant) and the peer's, freshly initialised."""
    from cat.models.registry import build_model

    runners = []
    for variant in ours:
        config = ours_config(sizes, variant)
        torch.manual_seed(0)
        model = build_model(config, AISHELL_CHARS)
        runners.append(Runner(f"ours:{variant}", model, model.encoder.subsampling))
    torch.manual_seed(0)
    model = build_peer(peer, ours_config(sizes, "ctc-v1"))
    runners.append(Runner("peer", model, model.encoder.embed))
    return runners


def ours_config(sizes: Sizes, variant: str) -> dict[str, Any]:
    """ctc-v1's config at `sizes`, without SpecAugment, with the `variant`'s front end."""
    config = ctc_v1_config(sizes)
    config.pop("specaug", None)
    kwargs = config["encoder"]["kwargs"]
    kwargs.update(OURS[variant])
    if kwargs.get("subsampling_channels") is None:
        kwargs.pop("subsampling_channels", None)
    return config


def timed_update(runner: Runner, batch: Sequence[torch.Tensor], device: torch.device,
                 record: bool) -> None:
    """One update of `runner`: its seconds, loss and (CUDA) peak memory when `record`."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    loss = runner.update(batch)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if cuda:
        # The other models' tensors were allocated before and after: only this model's
        # resident tensors and what its update allocated count.
        peak = runner.resident_bytes + torch.cuda.max_memory_allocated(device) - before
        runner.resident_bytes += torch.cuda.memory_allocated(device) - before
    if record:
        runner.times.append(seconds)
        runner.losses.append(loss)
        if cuda:
            runner.peaks.append(peak / 2**20)


def run_mode(peer: Peer, sizes: Sizes, mode: str, ours: Sequence[str],
             batch: Sequence[torch.Tensor], device: torch.device) -> list[Runner]:
    """Fresh models trained in `mode`, taking turns: warm-up, then timed updates."""
    reset_peak(device)
    runners = build_runners(peer, sizes, ours)
    config = ours_config(sizes, "ctc-v1")
    grad_norm = hyper_option(AISHELL / "ctc-v1")["grad_norm"]
    for runner in runners:
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        runner.model.to(device).train()
        if device.type == "cuda":
            runner.resident_bytes = torch.cuda.memory_allocated(device) - before
        runner.update = update_function(runner.model, runner.model, config, device,
                                        MODES[mode], grad_norm)
    on_device = [t.to(device) for t in batch]
    for step in range(sizes.warmup_steps + sizes.timed_steps):
        for runner in runners:
            timed_update(runner, on_device, device, record=step >= sizes.warmup_steps)
        if step >= sizes.warmup_steps:
            print(f"{mode} update {step - sizes.warmup_steps + 1}: " + ", ".join(
                f"{runner.name} {runner.times[-1]:.3f} s" for runner in runners), flush=True)
    return runners


def comparisons(mode: str, runners: list[Runner]) -> list[dict[str, Any]]:
    """A row per variant of ours: its figures beside the peer's, and the ratio."""
    peer = runners[-1].figures()
    rows = []
    for runner in runners[:-1]:
        ours = runner.figures()
        rows.append({"mode": mode, "status": "ok", "ours": runner.name.split(":")[1],
                     **{f"{key}_ours": value for key, value in ours.items()},
                     **{f"{key}_peer": value for key, value in peer.items()},
                     "ratio": peer["median_seconds"] / ours["median_seconds"]})
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table: per mode and variant of ours, parameters, seconds and the ratio."""
    print(f"{'mode':<5} {'ours':<7} {'parameters ours / peer':>24} "
          f"{'front end ours / peer':>22} {'median s ours / peer':>21} "
          f"{'best s ours / peer':>19} {'peer/ours':>9} {'peak MB ours / peer':>20}")
    for row in rows:
        if row["status"] != "ok":
            print(f"{row['mode']:<5} skipped: {row['reason']}")
            continue
        peaks = " / ".join("n/a" if row[k] is None else f"{row[k]:,.0f}"
                           for k in ("peak_mb_ours", "peak_mb_peer"))
        print(f"{row['mode']:<5} {row['ours']:<7} "
              f"{row['parameters_ours']:>11,} / {row['parameters_peer']:>10,} "
              f"{row['front_end_ours']:>10,} / {row['front_end_peer']:>9,} "
              f"{row['median_seconds_ours']:>10.3f} / {row['median_seconds_peer']:>8.3f} "
              f"{row['best_seconds_ours']:>9.3f} / {row['best_seconds_peer']:>7.3f} "
              f"{row['ratio']:>9.2f} {peaks:>20}")


def choose_sizes(args: argparse.Namespace, cuda: bool) -> Sizes:
    """QUICK, or FULL (CPU_FULL on the CPU), with the batch and steps of the options."""
    sizes = QUICK if args.quick else FULL if cuda else CPU_FULL
    changes = {name: value for name, value in (("step_batch", args.batch),
                                               ("warmup_steps", args.warmup),
                                               ("timed_steps", args.steps))
               if value is not None}
    return dataclasses.replace(sizes, **changes)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true",
                        help="a 2 x 32 encoder and a batch of 2 short utterances")
    parser.add_argument("--batch", type=int,
                        help=f"utterances (0: ctc-v1's batch; default {CPU_FULL.step_batch} on "
                             "the CPU, ctc-v1's on CUDA)")
    parser.add_argument("--warmup", type=int, help="untimed updates of each model first")
    parser.add_argument("--steps", type=int, help="timed updates of each model")
    parser.add_argument("--ours", default=",".join(OURS),
                        help=f"comma-separated variants of ours (of {', '.join(OURS)})")
    parser.add_argument("--modes", help="comma-separated modes (default: fp32 on the CPU, "
                                        f"{','.join(MODES)} on CUDA)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: the usable CPUs)")
    parser.add_argument("--peer-site", type=Path, default=PEER_SITE,
                        help="the folder ESPnet was installed to (pip --target)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--install", action="store_true",
                        help="install the peer into --peer-site (unless it is there) and exit")
    args = parser.parse_args(argv)
    args.ours = [name for name in args.ours.split(",") if name]
    args.modes = (args.modes.split(",") if args.modes
                  else list(MODES) if args.device == "cuda" else ["fp32"])
    if set(args.ours) - set(OURS) or not args.ours:
        parser.error(f"--ours takes variants of {', '.join(OURS)}")
    if (args.steps is not None and args.steps < 1) or (args.warmup or 0) < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if set(args.modes) - set(MODES):
        parser.error(f"--modes takes modes of {', '.join(MODES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.install:
        install_peer(args.peer_site)
        return 0
    try:
        peer = import_peer(args.peer_site)
    except PeerMissing as error:
        print(f"{error}.\nInstall it there, without its dependencies, from the repository "
              f"root:\n    {install_command(args.peer_site)}", file=sys.stderr)
        return 2
    from cat.core.threads import choose_threads

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    threads = choose_threads(args.threads)
    torch.set_num_threads(threads)
    sizes = choose_sizes(args, device.type == "cuda")
    batch = step_batch(sizes, seed=0)
    load_before = os.getloadavg()
    print(f"device: {device_text(device)}; torch {torch.__version__}, {threads} thread(s); "
          f"ESPnet {peer.version}; load average {load_before[0]:.2f}")
    print(f"batch: {len(batch[1])} utterances, {int(batch[1].sum()):,} input frames "
          f"(longest {batch[0].shape[1]}), {int(batch[3].sum()):,} labels; "
          f"{AISHELL_CHARS} classes; encoder {ours_config(sizes, 'ctc-v1')['encoder']['kwargs']}")
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        problem = autocast_problem(device, MODES[mode])
        if problem:
            rows.extend({"mode": mode, "status": "skipped", "reason": problem,
                         "ours": name} for name in args.ours)
            continue
        rows.extend(comparisons(mode, run_mode(peer, sizes, mode, args.ours, batch, device)))
    load_after = os.getloadavg()
    print_rows(rows)
    print(f"median and best of {sizes.timed_steps} updates after {sizes.warmup_steps} "
          f"warm-up update(s) each, in turns; peer/ours above 1: ours is faster; load "
          f"average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    bad = [f"{row['mode']} {row['ours']}" for row in rows if row["status"] == "ok"
           and not all(map(math.isfinite, (row["last_loss_ours"], row["last_loss_peer"])))]
    if bad:
        print(f"non-finite loss: {', '.join(bad)}")
    if args.json:
        write_json(args.json, {
            "device": device_text(device), "device_type": device.type,
            "torch": torch.__version__, "espnet": peer.version, "threads": threads,
            "sizes": "quick" if args.quick else "full", "batch_utterances": len(batch[1]),
            "batch_frames": int(batch[1].sum()), "warmup_steps": sizes.warmup_steps,
            "timed_steps": sizes.timed_steps, "load_average_before": load_before,
            "load_average_after": load_after, "rows": rows})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
