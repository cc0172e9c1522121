"""What a GPU changes, in one run: the CTC-CRF loss on the device against the CPU, an update
of the `exp/ctc-v1` Conformer in fp32 / fp16 / bf16 (its FLOPs, MFU and audio-hours per
device-hour, the attention before and after `scaled_dot_product_attention`, compiled, the
host's waits for the device), RNN-T loss memory at a WenetSpeech batch, the streaming
loader's data wait at the device's step time, and DDP over the GPUs.

Parts (each prints its rows, or why it did not run; `--json` writes the same figures):

1. `crf`: `cat.crf.loss.CtcCrfLoss` forward + backward on the device in float32, at the
   shapes of `exp/synth-crf` (the synthetic release's 153 phone classes, 8x frame rate
   reduction) and `exp/crf-v1` (AISHELL-1's phones, about 217 classes, 4x), with batches
   as their `hyper-p.json` forms them from utterances of typical length. The denominator
   is a chain 4-gram of Markov-chain sentences, as in bench/crf_loss.py. On the first
   utterances of the batch the losses and gradients are compared with the CPU's in
   float32 (when the device is not the CPU) and in float64 (the reference), each checked
   against a tolerance; the time is compared with `torch.nn.functional.ctc_loss` at the
   same shape.
2. `train_step`: one update (forward, backward, gradient clipping, AdamW step) of the
   `exp/ctc-v1` model built by `cat.models.registry` (79.5 M parameters with AISHELL-1's
   4,233 characters), in fp32, fp16 autocast with a GradScaler and bf16 autocast (what
   `cat.training.update` trains with `amp`: `amp_dtype` "auto" is bf16 where the GPU has
   it): median step time after warm-up and, on CUDA, peak memory per mode (a fresh model
   each), features on the device and lengths on the CPU as the trainer passes them. The
   update's FLOPs are counted once (`cat.training.throughput.count_model_flops`:
   FlopCounterMode, forward + backward, as the training log counts them; the seconds
   counting took are printed); per mode: achieved TFLOP/s, MFU against the GPU's dense
   datasheet peak in that dtype (`throughput.GPU_PEAKS`; "n/a" for an unknown GPU) or, on
   the CPU, against a measured matrix product (labelled "measured"), and audio-hours per
   device-hour. Rows beside them in the mode training runs: `+explicit`, the attention's
   softmax written out as it was before `scaled_dot_product_attention` (the same batch:
   before/after), and `+compile`, the encoder's blocks compiled (`train.option.compile`;
   on CUDA, or with `--compile`), with its compile seconds. Last, where the host waits
   for the device in an update of `cat.training.update.Updater`: on CUDA each
   synchronisation `torch.cuda.set_sync_debug_mode("warn")` reports, counted by place;
   on the CPU, where there is none, the reads of device data that
   `cat.testing.device_reads` finds (checked: one per update).
3. `rnnt`: the RNN-T model's loss path (`cat.rnnt.model.TransducerHead` of
   `egs/wenetspeech/exp/train_l/rnnt-v1`: predictor, joiner, `torchaudio`'s `rnnt_loss`)
   forward + backward from given encoder outputs at a WenetSpeech batch (32 x 250 encoder
   frames x 60 labels x 5,537 classes), fp32 and fp16 autocast: time and peak memory
   against the estimate of `cat.rnnt.model`'s docstring (a batch that does not fit is
   reported as out of memory, a finding rather than a failure).
4. `loader`: the streaming training data (`StreamTrainData` with its workers and the
   prefetcher, as training builds it, `bench/overlap.py`) over feature shards and Opus
   audio shards (speed perturbation) of one length mix, iterated with a simulated step:
   the step's compute is a sleep of part 2's update's seconds per input frame (fp16 on
   CUDA, fp32 on the CPU: what training runs there) times the batch's frames, or
   `--step-ms` per `--step-frames`; `exp/ctc-v1`'s batches and workers. Printed: the
   device's batched fbank of Opus utterances against the workers' (checked within 1e-4);
   one worker's Opus utterances per second with the fbank in the worker and on the
   device; per shard kind and variant (`before`: each batch taken, pinned, copied and
   featurized when the step asks; `after`: the prefetcher), the share of wall time spent
   waiting for batches over a steady-state epoch (its first batch apart), the padding
   share, and the workers that would keep up when the loader is the bound.
5. `ddp`: the fp16 update of part 2 under DistributedDataParallel over every GPU (NCCL,
   one process each, `torch.multiprocessing.spawn`) against one process without DDP, the
   same batch size per GPU; the parameters of every rank must agree afterwards. On the
   CPU, two gloo processes; on one GPU it is skipped, with the reason.

`--device cpu` runs every part at tiny sizes (well under a minute on 2 cores), so that a
fast test keeps the script working. A part that raises, or a check beyond its tolerance,
makes the exit status 1; a part that cannot run says why.

Usage:
    python bench/gpu.py                                    # CUDA, full sizes (minutes)
    python bench/gpu.py --json bench/out/gpu.json          # the figures as JSON too
    python bench/gpu.py --device cpu                       # tiny sizes, every part
    python bench/gpu.py --device cpu --parts train_step --compile   # and the compiled row
    python bench/gpu.py --parts loader --step-ms 300 --step-frames 57600
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crf_loss import sentences
from timing import REPO_ROOT, best_time

AISHELL = REPO_ROOT / "egs/aishell/exp"
WENETSPEECH_RNNT = REPO_ROOT / "egs/wenetspeech/exp/train_l/rnnt-v1"
PARTS = ("crf", "train_step", "rnnt", "loader", "ddp")
MODES: dict[str, torch.dtype | None] = {"fp32": None, "fp16": torch.float16,
                                        "bf16": torch.bfloat16}
# Largest allowed |loss difference| / max(1, |reference loss|) and |gradient difference|
# between the device's float32 CTC-CRF loss and the CPU's (float32, or float64).
CRF_LOSS_TOLERANCE = 1e-4
CRF_GRAD_TOLERANCE = 1e-3
# AISHELL-1's characters with blank and <unk>: exp/ctc-v1 then has 79.53 M parameters
# (egs/aishell/README.md).
AISHELL_CHARS = 4233
FEAT_DIM = 80


@dataclasses.dataclass(frozen=True)
class CrfShape:
    """A CTC-CRF experiment's classes and a typical utterance of its corpus."""

    experiment: str
    classes: int
    utterance_frames: int  # input frames (10 ms)
    labels: int  # phones


CRF_SHAPES = (
    # The synthetic release: 151 phones + blank + <unk> (egs/aishell/README.md); its test
    # utterances average 3.5 s and 10.7 characters, about 2 phones each.
    CrfShape("synth-crf", 153, 350, 21),
    # AISHELL-1: the phones of resource_aishell/lexicon.txt + blank + <unk>, about 217;
    # utterances average 4.5 s and 14 characters.
    CrfShape("crf-v1", 217, 450, 27),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How large each part runs: `full` on CUDA, `tiny` on the CPU."""

    name: str
    crf_batch: int  # 0: the experiment's batch
    crf_check_utts: int  # utterances compared with the CPU
    crf_lm_sentences: int
    repeats: int  # timed calls of a loss (best kept)
    encoder: dict[str, Any]  # overrides of exp/ctc-v1's encoder kwargs
    step_batch: int  # 0: the experiment's batch
    step_frames: tuple[int, int]  # input frames per utterance, drawn uniformly
    step_labels: tuple[int, int]
    warmup_steps: int
    timed_steps: int
    rnnt_shape: tuple[int, int, int]  # utterances, encoder frames, labels
    feature_utts: int
    audio_utts: int
    utts_per_shard: int
    workers: int  # 0: exp/ctc-v1's
    loader_batch: int
    loader_frames: int
    step_scale: float  # of the measured update's seconds per frame, for the simulated step


FULL = Sizes("full", crf_batch=0, crf_check_utts=16, crf_lm_sentences=2000, repeats=3,
             encoder={}, step_batch=0, step_frames=(300, 600), step_labels=(8, 20),
             warmup_steps=3, timed_steps=5, rnnt_shape=(32, 250, 60),
             feature_utts=8000, audio_utts=3200, utts_per_shard=100, workers=0,
             loader_batch=128, loader_frames=60000, step_scale=1.0)
# The tiny Conformer's subsampling is a small conv2d: VGG2L's float16 convolution backward
# takes seconds on a CPU.
TINY = Sizes("tiny", crf_batch=2, crf_check_utts=2, crf_lm_sentences=300, repeats=1,
             encoder={"hdim": 32, "num_cells": 1, "num_heads": 2, "subsampling": "conv2d",
                      "subsampling_channels": 8}, step_batch=2,
             step_frames=(60, 90), step_labels=(3, 6), warmup_steps=1, timed_steps=2,
             rnnt_shape=(2, 12, 4), feature_utts=40, audio_utts=16, utts_per_shard=4,
             workers=1, loader_batch=4, loader_frames=0, step_scale=0.001)


class Skipped(Exception):
    """A part (or a row) that cannot run here; the message says why."""


@dataclasses.dataclass
class Context:
    """What the parts share: the device, the sizes, the results so far, the checks."""

    device: torch.device
    sizes: Sizes
    args: argparse.Namespace
    workdir: Path
    results: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def check(self, name: str, value: float, limit: float) -> bool:
        """Record the check `value <= limit` (a NaN fails); print it when it fails."""
        ok = bool(value <= limit)
        self.checks.append({"name": name, "value": value, "limit": limit, "ok": ok})
        if not ok:
            print(f"  CHECK FAILED: {name}: {value:.3g} > {limit:.3g}")
        return ok


# --------------------------------------------------------------------------- helpers


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory measurement (CUDA only)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device: torch.device) -> float | None:
    """Peak allocated MiB since `reset_peak` (None on the CPU: torch keeps no statistics)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def mb_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def median_times(call: Callable[[], object], sync: Callable[[], None], warmup: int,
                 timed: int) -> list[float]:
    """Seconds of `timed` calls of `call` after `warmup` untimed ones, synchronised."""
    for _ in range(warmup):
        call()
    sync()
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return times


def autocast_problem(device: torch.device, dtype: torch.dtype | None, lstm: bool = False
                     ) -> str | None:
    """Why autocast to `dtype` cannot train a convolution and a linear layer (and an LSTM,
    with `lstm`: the RNN-T predictor) on `device`, or None when it can."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        return f"torch has no autocast for {device.type}"
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name(device)} has no bf16"
    probes = {"Conv2d": (torch.nn.Conv2d(1, 2, 3), (1, 1, 8, 8)),
              "Linear": (torch.nn.Linear(8, 4), (2, 8))}
    if lstm:
        probes["LSTM"] = (torch.nn.LSTM(4, 4, batch_first=True), (2, 3, 4))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    for layer_name, (layer, shape) in probes.items():
        try:
            with torch.autocast(device.type, dtype=dtype):
                out = layer.to(device)(torch.randn(shape, device=device))
                out = out[0] if isinstance(out, tuple) else out
                scaler.scale(out.float().sum()).backward()
        except (RuntimeError, ValueError) as error:
            return (f"{name} autocast cannot train {layer_name} on {device.type}: "
                    f"{str(error).splitlines()[0]}")
    return None


def hyper_option(experiment: Path) -> dict[str, Any]:
    """`train.option` of an experiment's hyper-p.json."""
    hyper = json.loads((experiment / "hyper-p.json").read_text(encoding="utf-8"))
    return hyper["train"]["option"]


def experiment_batch(experiment: Path, utterance_frames: int) -> tuple[int, int]:
    """(utterances, encoder frames) of a batch of `utterance_frames`-frame utterances as
    the experiment forms it: `batch_size` capped by `max_frames`, the frame rate reduced
    4x by the subsampling times `time_reduction_factor`."""
    from cat.core.config import load_config

    kwargs = load_config(experiment / "config.json")["encoder"]["kwargs"]
    option = hyper_option(experiment)
    batch = option["batch_size"]
    if option.get("max_frames"):
        batch = min(batch, option["max_frames"] // utterance_frames)
    return batch, utterance_frames // (4 * kwargs.get("time_reduction_factor", 1))


# --------------------------------------------------------------------------- 1. CTC-CRF


def crf_batch(batch: int, frames: int, classes: int, labels: int, seed: int
              ) -> tuple[torch.Tensor, ...]:
    """(log-softmax x [B, T, V], lengths, labels [B, U], label lengths), lengths 3/4 to
    all of T and U (the first utterance the longest), labels from the LM's Markov chain."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.log_softmax(torch.randn(batch, frames, classes, generator=generator), -1)
    lengths = rng.integers(frames * 3 // 4, frames + 1, batch)
    label_lens = rng.integers(labels * 3 // 4, labels + 1, batch)
    lengths[0], label_lens[0] = frames, labels
    text = [token for sentence in sentences(classes, 2 * batch * labels // 10 + 2, seed + 1)
            for token in sentence]
    rows = torch.tensor(text[:batch * labels]).view(batch, labels)
    rows = rows.masked_fill(torch.arange(labels)[None] >= torch.tensor(label_lens)[:, None], 0)
    return x, torch.tensor(lengths), rows, torch.tensor(label_lens)


def crf_run(loss: torch.nn.Module, inputs: Sequence[torch.Tensor], device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-utterance losses and the gradient of their sum, computed on `device` in `dtype`,
    returned on the CPU in float64."""
    x, lengths, labels, label_lens = (t.to(device) for t in inputs)
    x = x.detach().to(dtype).clone().requires_grad_(True)
    losses, _ = loss(x, lengths, labels, label_lens)
    losses.sum().backward()
    return losses.detach().cpu().double(), x.grad.cpu().double()


def crf_differences(ctx: Context, shape: str, loss: torch.nn.Module,
                    inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The device's float32 losses and gradients on the first utterances against the
    CPU's float32 (device not the CPU) and float64, each checked."""
    count = min(ctx.sizes.crf_check_utts, len(inputs[0]))
    subset = [t[:count] for t in inputs]
    device_losses, device_grad = crf_run(loss, subset, ctx.device, torch.float32)
    out: dict[str, Any] = {"utterances": count, "loss_mean": float(device_losses.mean())}
    references = [("cpu_float64", torch.float64)]
    if ctx.device.type != "cpu":
        references.insert(0, ("cpu_float32", torch.float32))
    for name, dtype in references:
        ref_losses, ref_grad = crf_run(loss, subset, torch.device("cpu"), dtype)
        loss_diff = float((device_losses - ref_losses).abs().max())
        relative = loss_diff / max(1.0, float(ref_losses.abs().max()))
        grad_diff = float((device_grad - ref_grad).abs().max())
        out[name] = {"loss_max_diff": loss_diff, "loss_rel_diff": relative,
                     "grad_max_diff": grad_diff}
        ctx.check(f"crf {shape} loss {ctx.device.type} vs {name}", relative,
                  CRF_LOSS_TOLERANCE)
        ctx.check(f"crf {shape} gradient {ctx.device.type} vs {name}", grad_diff,
                  CRF_GRAD_TOLERANCE)
    return out


def crf_times(ctx: Context, loss: torch.nn.Module, inputs: Sequence[torch.Tensor]
              ) -> dict[str, Any]:
    """Forward + backward seconds (best of the repeats) of the CTC-CRF loss and of
    `ctc_loss` on the whole batch on the device, and the CRF's peak memory."""
    x, lengths, labels, label_lens = (t.to(ctx.device) for t in inputs)

    def run_crf() -> None:
        xg = x.clone().requires_grad_(True)
        loss(xg, lengths, labels, label_lens)[0].sum().backward()

    def run_ctc() -> None:
        xg = x.clone().requires_grad_(True)
        torch.nn.functional.ctc_loss(xg.transpose(0, 1), labels, lengths, label_lens,
                                     reduction="sum").backward()

    reset_peak(ctx.device)
    # CUDA's first calls pay for lazy initialisation; the CPU's tiny sizes need no warm-up.
    crf = best_time(lambda: (run_crf(), ctx.sync()), ctx.sizes.repeats, warm_up=ctx.cuda)
    crf_peak = peak_mb(ctx.device)
    ctc = best_time(lambda: (run_ctc(), ctx.sync()), ctx.sizes.repeats, warm_up=ctx.cuda)
    return {"crf_seconds": crf, "ctc_loss_seconds": ctc, "ratio": crf / ctc,
            "crf_peak_mb": crf_peak}


def part_crf(ctx: Context) -> dict[str, Any]:
    """Part 1 (see the module docstring)."""
    from cat.crf.loss import CtcCrfLoss
    from cat.graph.denominator import build_den_graph

    rows = []
    print(f"{'shape':<10} {'B':>4} {'T':>4} {'V':>4} {'U':>3} {'den arcs':>9} {'checked':>7} "
          f"{'vs cpu fp32: loss / grad':>25} {'vs cpu fp64: loss / grad':>25} "
          f"{'crf s':>8} {'ctc_loss s':>10} {'x ctc':>6} {'peak MB':>8}")
    for shape in CRF_SHAPES:
        batch, frames = experiment_batch(AISHELL / shape.experiment, shape.utterance_frames)
        batch = ctx.sizes.crf_batch or batch
        graph = build_den_graph(sentences(shape.classes, ctx.sizes.crf_lm_sentences, 0),
                                shape.classes, order=4)
        loss = CtcCrfLoss(graph, 0.01)
        inputs = crf_batch(batch, frames, shape.classes, shape.labels, seed=1)
        row = {"shape": shape.experiment, "batch": batch, "frames": frames,
               "classes": shape.classes, "labels": shape.labels, **graph.info,
               **crf_differences(ctx, shape.experiment, loss, inputs),
               **crf_times(ctx, loss, inputs)}
        rows.append(row)
        pairs = [f"{row[k]['loss_max_diff']:.1e} / {row[k]['grad_max_diff']:.1e}"
                 if k in row else "same device" for k in ("cpu_float32", "cpu_float64")]
        print(f"{shape.experiment:<10} {batch:>4} {frames:>4} {shape.classes:>4} "
              f"{shape.labels:>3} {graph.info['den_arcs']:>9,} {row['utterances']:>7} "
              f"{pairs[0]:>25} {pairs[1]:>25} {row['crf_seconds']:>8.4f} "
              f"{row['ctc_loss_seconds']:>10.5f} {row['ratio']:>6.0f} "
              f"{mb_text(row['crf_peak_mb']):>8}")
    print(f"loss / grad: largest |difference| of the per-utterance losses and of the "
          f"gradients; checked: loss difference / max(1, |loss|) <= {CRF_LOSS_TOLERANCE:g}, "
          f"gradient difference <= {CRF_GRAD_TOLERANCE:g}; times: best of "
          f"{ctx.sizes.repeats}, forward + backward of the whole batch on {ctx.device}")
    return {"rows": rows}


# --------------------------------------------------------------------------- 2. update


def ctc_v1_config(sizes: Sizes) -> dict[str, Any]:
    """`exp/ctc-v1`'s config.json, its encoder scaled down by `sizes.encoder`."""
    from cat.core.config import load_config

    config = copy.deepcopy(load_config(AISHELL / "ctc-v1/config.json"))
    config["encoder"]["kwargs"].update(sizes.encoder)
    return config


def step_batch(sizes: Sizes, seed: int, vocab: int = AISHELL_CHARS
               ) -> tuple[torch.Tensor, ...]:
    """(feats, feat_lens, labels, label_lens) of random utterances of `sizes.step_frames`
    and `sizes.step_labels`, as many as `exp/ctc-v1` batches (or `sizes.step_batch`)."""
    mean = sum(sizes.step_frames) // 2
    batch = sizes.step_batch or experiment_batch(AISHELL / "ctc-v1", mean)[0]
    rng = np.random.default_rng(seed)
    feat_lens = rng.integers(sizes.step_frames[0], sizes.step_frames[1] + 1, batch)
    label_lens = rng.integers(sizes.step_labels[0], sizes.step_labels[1] + 1, batch)
    feats = rng.normal(0.0, 1.0, (batch, int(feat_lens.max()), FEAT_DIM)).astype(np.float32)
    labels = rng.integers(2, vocab, (batch, int(label_lens.max())))
    labels[np.arange(labels.shape[1])[None] >= label_lens[:, None]] = 0
    return (torch.from_numpy(feats), torch.from_numpy(feat_lens), torch.from_numpy(labels),
            torch.from_numpy(label_lens))


def update_function(model: torch.nn.Module, module: torch.nn.Module, config: dict[str, Any],
                    device: torch.device, dtype: torch.dtype | None, grad_norm: float
                    ) -> Callable[[Sequence[torch.Tensor]], float]:
    """One update as `cat.training.update.Updater.update` makes it: forward `model` (DDP or
    the module) and backward under autocast to `dtype` (a GradScaler for fp16), unscale,
    clip `module`'s gradients, step the optimizer and the schedule."""
    from cat.training.scheduler import build_scheduler

    scheduler = build_scheduler(config["scheduler"], module.parameters())
    optimizer = scheduler.optimizer
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def update(batch: Sequence[torch.Tensor]) -> float:
        with torch.autocast(device.type, dtype=dtype or torch.float32,
                            enabled=dtype is not None):
            loss, _ = model(*batch)
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(module.parameters(), grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return float(loss.detach())

    return update


def explicit_attention(self: Any, x: torch.Tensor, pos_emb: torch.Tensor,
                       padding_mask: torch.Tensor, attn_mask: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """`RelPositionMultiHeadAttention.forward` as it was before scaled_dot_product_attention:
    scores, masked keys at the finite minimum, softmax, masked weights set to 0, dropout."""
    scores, value = self.scores(x, pos_emb)
    key_mask = padding_mask[:, None, None, :]
    if attn_mask is not None:
        key_mask = key_mask | attn_mask[None, None]
    scores = scores.masked_fill(key_mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).masked_fill(key_mask, 0.0)
    context = torch.matmul(self.dropout(weights), value)
    batch, _, time, _ = context.shape
    return self.linear_out(context.transpose(1, 2).reshape(batch, time, -1))


@contextlib.contextmanager
def attention_variant(variant: str) -> Iterator[None]:
    """The relative-position attention as trained ("sdpa") or the explicit softmax."""
    from cat.models.layer import RelPositionMultiHeadAttention

    forward = RelPositionMultiHeadAttention.forward
    if variant == "explicit":
        RelPositionMultiHeadAttention.forward = explicit_attention
    try:
        yield
    finally:
        RelPositionMultiHeadAttention.forward = forward


def training_mode(ctx: Context) -> str:
    """What training runs here: AMP in train.option.amp_dtype's "auto" dtype on CUDA
    (cat.training.update.amp_dtype), fp32 on the CPU."""
    if not ctx.cuda:
        return "fp32"
    from cat.training.update import amp_dtype

    return "bf16" if amp_dtype("auto", ctx.device) == torch.bfloat16 else "fp16"


def on_device(ctx: Context, batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The batch as the trainer hands it to the model: features on the device, lengths
    and labels on the CPU (cat.training.update)."""
    return [batch[0].to(ctx.device), *batch[1:]]


def train_mode(ctx: Context, mode: str, config: dict[str, Any],
               batch: Sequence[torch.Tensor], attention: str = "sdpa",
               compiled: bool = False) -> dict[str, Any]:
    """Step times and peak memory of a fresh model trained in `mode`."""
    from cat.models.registry import build_model, count_parameters

    problem = autocast_problem(ctx.device, MODES[mode])
    if problem:
        raise Skipped(problem)
    reset_peak(ctx.device)
    torch.manual_seed(0)
    model = build_model(config, AISHELL_CHARS).to(ctx.device)
    model.train()
    compile_seconds = None
    if compiled:
        model.encoder.compile_blocks()
    update = update_function(model, model, config, ctx.device, MODES[mode],
                             hyper_option(AISHELL / "ctc-v1")["grad_norm"])
    inputs = on_device(ctx, batch)
    losses: list[float] = []
    with attention_variant(attention):
        if compiled:  # the first update compiles: timed apart
            start = time.perf_counter()
            losses.append(update(inputs))
            ctx.sync()
            compile_seconds = time.perf_counter() - start
        times = median_times(lambda: losses.append(update(inputs)), ctx.sync,
                             ctx.sizes.warmup_steps, ctx.sizes.timed_steps)
    return {"mode": mode, "attention": attention, "compiled": compiled, "status": "ok",
            "parameters": count_parameters(model), "step_seconds": statistics.median(times),
            "step_times": times, "peak_mb": peak_mb(ctx.device), "last_loss": losses[-1],
            "compile_seconds": compile_seconds}


def mode_peak(ctx: Context, mode: str) -> tuple[float | None, str]:
    """(peak FLOP/s for updates in `mode`, what it is): CUDA's from the datasheet table
    (cat.training.throughput.GPU_PEAKS), the CPU's measured by a matrix product."""
    from cat.training.throughput import device_peak, measured_matmul_peak

    if ctx.cuda:
        return device_peak(ctx.device, MODES[mode])
    size = 1024 if MODES[mode] is None else 512  # emulated half precision is slow
    peak = measured_matmul_peak(ctx.device, MODES[mode] or torch.float32, size)
    return peak, f"measured: {size}x{size} matrix product on this CPU, {peak / 1e9:.1f} GFLOP/s"


def count_update_flops(ctx: Context, config: dict[str, Any],
                       batch: Sequence[torch.Tensor]) -> Any:
    """The FLOPs of an update of part 2's model on its batch, as training counts them
    (cat.training.throughput.count_model_flops), and the seconds that took."""
    from cat.models.registry import build_model
    from cat.training.throughput import UpdateFlops, count_model_flops

    torch.manual_seed(0)
    model = build_model(config, AISHELL_CHARS).to(ctx.device)
    model.train()
    count_model_flops(model, [on_device(ctx, batch)])  # warm-up (lazy initialisation)
    count = count_model_flops(model, [on_device(ctx, batch)])
    return UpdateFlops.from_count(count, [(len(batch[1]), batch[0].size(1))])


def host_waits(ctx: Context, config: dict[str, Any], batch: Sequence[torch.Tensor],
               mode: str) -> dict[str, Any]:
    """Where the host waits for the device in an update of cat.training.update.Updater (the
    second; the first initialises lazily): on CUDA the warnings of
    torch.cuda.set_sync_debug_mode("warn"), each a synchronisation; on the CPU the reads
    of device data that cat.testing.device_reads finds (torch's C++ code unseen)."""
    import warnings

    from cat.core.config import TrainOptions, train_option_defaults
    from cat.loading.batch import Batch
    from cat.models.registry import build_model
    from cat.testing.device_reads import DeviceReads
    from cat.training.distributed import DistributedContext
    from cat.training.update import Updater

    torch.manual_seed(0)
    model = build_model(config, AISHELL_CHARS).to(ctx.device)
    dtype = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}[mode]
    options = TrainOptions(**{
        **train_option_defaults(), "trset": [], "devset": [], "tokenizer": "unused",
        "grad_norm": hyper_option(AISHELL / "ctc-v1")["grad_norm"],
        "amp": dtype is not None, "amp_dtype": dtype or "auto"})
    updater = Updater(model, config["scheduler"], options, DistributedContext(device=ctx.device))
    feats, feat_lens, labels, label_lens = batch
    host = Batch([str(i) for i in range(len(feat_lens))], feats, feat_lens, labels, label_lens)
    updater.update([host], float(len(host)))
    ctx.sync()
    if ctx.cuda:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                updater.update([host], float(len(host)))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        places: dict[str, int] = {}
        for warning in caught:
            if "synchroniz" in str(warning.message):
                where = f"{Path(warning.filename).name}:{warning.lineno}"
                places[where] = places.get(where, 0) + 1
        return {"how": 'torch.cuda.set_sync_debug_mode("warn")', "count": sum(places.values()),
                "places": places}
    with DeviceReads(device=model, host=[feats, feat_lens, labels, label_lens]) as reads:
        updater.update([host], float(len(host)))
    return {"how": "cat.testing.device_reads (CUDA's sync debug mode needs a GPU)",
            "count": len(reads.found), "places": reads.summary()}


def print_mode_row(ctx: Context, label: str, row: dict[str, Any]) -> None:
    steps = " ".join(f"{t:.3f}" for t in row["step_times"])
    mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
    print(f"{label:<14} {row['parameters']:>11,} {row['step_seconds']:>9.4f} {steps:>28} "
          f"{mb_text(row['peak_mb']):>9} {row['last_loss']:>8.2f} {row['tflops']:>9.4g} "
          f"{mfu:>7} {row['audio_hours_per_hour']:>10,.4g}")


def part_train_step(ctx: Context) -> dict[str, Any]:
    """Part 2 (see the module docstring)."""
    from cat.training.throughput import audio_hours_per_device_hour, mfu

    config = ctc_v1_config(ctx.sizes)
    batch = step_batch(ctx.sizes, seed=0)
    frames = int(batch[1].sum())
    print(f"batch: {len(batch[1])} utterances, {frames:,} input frames (longest "
          f"{batch[0].shape[1]}), {int(batch[3].sum()):,} labels; {AISHELL_CHARS} classes; "
          f"encoder {config['encoder']['kwargs']['num_cells']} x "
          f"{config['encoder']['kwargs']['hdim']}")
    flops = count_update_flops(ctx, config, batch)
    print(f"counted: {flops.total / 1e9:,.4g} GFLOP per update (FlopCounterMode, forward + "
          f"backward; {flops.pairwise / flops.total:.1%} in attention over frame pairs); "
          f"counting took {flops.count_seconds:.2f} s")
    trained = training_mode(ctx)
    variants = [(mode, "sdpa", False) for mode in MODES]
    variants.append((trained, "explicit", False))
    compile_row = ctx.cuda or ctx.args.compile
    if compile_row:
        variants.append((trained, "sdpa", True))
    print(f"{'mode':<14} {'parameters':>11} {'step s':>9} {'steps s':>28} {'peak MB':>9} "
          f"{'loss':>8} {'TFLOP/s':>9} {'MFU':>7} {'audio h/h':>10}")
    rows, peaks = [], {}
    for mode, attention, compiled in variants:
        label = mode + ("+explicit" if attention == "explicit" else "") + (
            "+compile" if compiled else "")
        try:
            row = train_mode(ctx, mode, config, batch, attention, compiled)
        except Skipped as reason:
            row = {"mode": mode, "attention": attention, "compiled": compiled,
                   "status": "skipped", "reason": str(reason)}
        row["label"] = label
        rows.append(row)
        if row["status"] != "ok":
            print(f"{label:<14} skipped: {row['reason']}")
            continue
        if mode not in peaks:
            peaks[mode] = mode_peak(ctx, mode)
        peak, row["peak"] = peaks[mode]
        row["peak_flops"] = peak
        row["flops"] = flops.total
        row["tflops"] = flops.total / row["step_seconds"] / 1e12
        row["mfu"] = mfu(flops.total, row["step_seconds"], peak)
        row["audio_hours_per_hour"] = audio_hours_per_device_hour(frames, row["step_seconds"])
        ctx.check(f"train_step {label} loss finite (1 if not)",
                  0.0 if math.isfinite(row["last_loss"]) else 1.0, 0.0)
        print_mode_row(ctx, label, row)
    by_label = {row["label"]: row for row in rows if row["status"] == "ok"}
    for other in (f"{trained}+explicit", f"{trained}+compile"):
        if other in by_label and trained in by_label:
            print(f"{other} / {trained}: step time "
                  f"{by_label[other]['step_seconds'] / by_label[trained]['step_seconds']:.2f}"
                  + (f"; compiling took {by_label[other]['compile_seconds']:.1f} s"
                     if by_label[other]["compiled"] else ""))
    if not compile_row:
        print("+compile: not run on the CPU without --compile (compiling takes minutes here)")
    print(f"median of {ctx.sizes.timed_steps} steps after {ctx.sizes.warmup_steps} warm-up "
          "steps; fp16 with GradScaler, bf16 without; +explicit: the attention's softmax "
          "written out instead of scaled_dot_product_attention; +compile: the encoder's "
          "blocks compiled (train.option.compile); peak memory: "
          + ("torch.cuda.max_memory_allocated, reset per mode" if ctx.cuda
             else "not measured on the CPU (torch keeps no CPU allocation statistics)"))
    print("TFLOP/s: counted FLOPs / step s; MFU against " + "; ".join(
        f"{mode} {text}" for mode, (_, text) in peaks.items())
        + "; audio h/h: hours of audio (10 ms frames) per device-hour at this step time")
    waits = host_waits(ctx, config, batch, trained)
    places = ", ".join(f"{where} x{n}" for where, n in sorted(
        waits["places"].items(), key=lambda item: -item[1])) or "none"
    print(f"host waits in a {trained} update of cat.training.update.Updater: "
          f"{waits['count']}, found by {waits['how']}: {places}")
    if not ctx.cuda:
        ctx.check("train_step host reads of device data per update", waits["count"], 1)
    return {"batch_utterances": len(batch[1]), "batch_frames": frames, "rows": rows,
            "flops": dataclasses.asdict(flops), "training_mode": trained,
            "host_waits": waits}


# --------------------------------------------------------------------------- 3. RNN-T


class GivenEncoderOutput(torch.nn.Module):
    """An encoder whose output is its input: the RNN-T loss path from encoder outputs."""

    def __init__(self, output_dim: int) -> None:
        super().__init__()
        self.output_dim = output_dim

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return feats, feat_lens


def rnnt_row(ctx: Context, mode: str, vocab: int) -> dict[str, Any]:
    """Forward + backward of the RNN-T model's loss path in `mode`: time, peak memory."""
    from cat.core.config import load_config
    from cat.models.model import AsrModel
    from cat.rnnt.model import build_head

    problem = autocast_problem(ctx.device, MODES[mode], lstm=True)
    if problem:
        raise Skipped(problem)
    config = load_config(WENETSPEECH_RNNT / "config.json")
    hdim = config["encoder"]["kwargs"]["hdim"]
    batch, frames, labels = ctx.sizes.rnnt_shape
    torch.manual_seed(0)
    head, _ = build_head(config, hdim, vocab)
    model = AsrModel(GivenEncoderOutput(hdim), {"transducer": head}, {"transducer": 1.0})
    model.to(ctx.device).train()
    encoder_out = torch.randn(batch, frames, hdim, device=ctx.device, requires_grad=True)
    lengths = torch.full((batch,), frames, device=ctx.device)
    label_lens = torch.full((batch,), labels, device=ctx.device)
    targets = torch.randint(1, vocab, (batch, labels), device=ctx.device)
    dtype = MODES[mode]

    def run() -> None:
        with torch.autocast(ctx.device.type, dtype=dtype or torch.float32,
                            enabled=dtype is not None):
            loss, _ = model(encoder_out, lengths, targets, label_lens)
        loss.backward()

    joiner_hdim = config["joiner"]["kwargs"]["hdim"]
    estimate = batch * frames * (labels + 1) * (joiner_hdim + 2 * vocab) * 4 / 2**20
    reset_peak(ctx.device)
    try:
        seconds = best_time(lambda: (run(), ctx.sync()), ctx.sizes.repeats)
    except torch.cuda.OutOfMemoryError as error:  # a finding about memory, not a failure
        return {"mode": mode, "status": "out of memory", "reason": str(error).split("\n")[0],
                "estimate_mb": estimate}
    return {"mode": mode, "status": "ok", "seconds": seconds, "peak_mb": peak_mb(ctx.device),
            "estimate_mb": estimate}


def part_rnnt(ctx: Context) -> dict[str, Any]:
    """Part 3 (see the module docstring)."""
    batch, frames, labels = ctx.sizes.rnnt_shape
    vocab = ctx.args.rnnt_vocab
    print(f"batch {batch} x {frames} encoder frames x {labels} labels x {vocab} classes "
          f"({WENETSPEECH_RNNT.relative_to(REPO_ROOT)} predictor and joiner)")
    print(f"{'mode':<6} {'seconds':>8} {'peak MB':>9} {'estimate MB':>11} {'peak/estimate':>13}")
    rows = []
    for mode in ("fp32", "fp16"):
        try:
            row = rnnt_row(ctx, mode, vocab)
        except Skipped as reason:
            row = {"mode": mode, "status": "skipped", "reason": str(reason)}
        rows.append(row)
        if row["status"] != "ok":
            print(f"{mode:<6} {row['status']}: {row['reason']}")
            continue
        ratio = "n/a" if row["peak_mb"] is None else f"{row['peak_mb'] / row['estimate_mb']:.2f}"
        print(f"{mode:<6} {row['seconds']:>8.4f} {mb_text(row['peak_mb']):>9} "
              f"{row['estimate_mb']:>11,.0f} {ratio:>13}")
    print("estimate: B x T x (U+1) x (joiner hdim + 2V) x 4 bytes (cat/rnnt/model.py); "
          f"seconds: best of {ctx.sizes.repeats}")
    return {"batch": batch, "frames": frames, "labels": labels, "vocab": vocab, "rows": rows}


# --------------------------------------------------------------------------- 4. loader


def loader_workers(sizes: Sizes) -> int:
    """DataLoader workers: the sizes', else `exp/ctc-v1`'s `train.option`."""
    return sizes.workers or hyper_option(AISHELL / "ctc-v1")["workers"]


def step_seconds_per_frame(ctx: Context) -> tuple[float, str]:
    """The simulated step's seconds per input frame, and where they come from."""
    if ctx.args.step_ms is not None:
        return (ctx.args.step_ms / 1000 / ctx.args.step_frames,
                f"--step-ms {ctx.args.step_ms:g} per {ctx.args.step_frames:,} frames")
    train = ctx.results.get("train_step", {})
    rows = {row["mode"]: row for row in train.get("rows", []) if row["status"] == "ok"
            and row["attention"] == "sdpa" and not row["compiled"]}
    # What training runs: AMP on a GPU (bf16 where it has it), fp32 on the CPU
    # (cat.training.update).
    scale = ctx.sizes.step_scale
    for mode in (training_mode(ctx), "fp16", "bf16", "fp32") if ctx.cuda else ("fp32",):
        if mode in rows:
            seconds = rows[mode]["step_seconds"]
            return (scale * seconds / train["batch_frames"],
                    f"{'' if scale == 1 else f'{scale:g} x '}part 2's {mode} update: "
                    f"{seconds:.3f} s per {train['batch_frames']:,} frames")
    raise Skipped("no step time: part 2 (train_step) did not run and --step-ms is not set")


def device_fbank_difference(ctx: Context, corpus: Any) -> float:
    """Largest |difference| between the device's batched fbank of Opus utterances of the
    corpus and the workers' (`compute_fbank` on the CPU) of the same samples."""
    import tarfile

    from cat.audio.codec import decode, to_int16
    from cat.features.fbank import FbankOptions, batch_fbank, compute_fbank

    waves = []
    with tarfile.open(corpus.opus[0]) as tar:
        for member in tar:
            if member.name.endswith(".opus") and len(waves) < ctx.sizes.loader_batch:
                waves.append(to_int16(decode(tar.extractfile(member).read(), member.name,
                                             16000)[0]))
    lengths = [len(w) for w in waves]
    padded = torch.zeros(len(waves), max(lengths), dtype=torch.int16)
    for row, wave in enumerate(waves):
        padded[row, :len(wave)] = torch.from_numpy(wave)
    options = FbankOptions()
    features = batch_fbank(padded.to(ctx.device), torch.tensor(lengths), options,
                           batched=True).cpu().numpy()
    return max(float(np.abs(features[row, :len(ours)] - ours).max()) for row, ours in
               enumerate(compute_fbank(wave, 16000, options) for wave in waves))


def part_loader(ctx: Context) -> dict[str, Any]:
    """Part 4 (see the module docstring)."""
    import overlap

    seconds_per_frame, source = step_seconds_per_frame(ctx)
    sizes, workers = ctx.sizes, loader_workers(ctx.sizes)
    batch = (sizes.loader_batch, sizes.loader_frames)
    corpus = overlap.write_corpus(ctx.workdir / "loader", sizes.feature_utts, sizes.audio_utts,
                                  sizes.utts_per_shard)
    log_dir = ctx.workdir / "loader/log"
    difference = device_fbank_difference(ctx, corpus)
    ctx.check("loader device fbank vs workers' (max |diff|)", difference, 1e-4)
    print(f"device fbank of {sizes.loader_batch} Opus utterances against the workers': "
          f"max |difference| {difference:.2e}")
    per_worker = overlap.per_worker(corpus, ctx.device, log_dir, batch)
    print("one worker over Opus shards, no step: " + ", ".join(
        f"fbank on {row['features']} {row['utts_per_second']:.1f} utt/s" for row in per_worker))
    print(f"simulated step: {seconds_per_frame * 1e6:.2f} us per input frame ({source}); "
          f"{workers} workers; batches of {batch[0]} utterances"
          + (f" / {batch[1]:,} frames" if batch[1] else " (no frame budget)"))
    print(f"{'shards':<13} {'variant':<7} {'alone utt/s':>11} {'steps utt/s':>11} "
          f"{'utt/s':>7} {'wait share':>10} {'1st batch s':>11} {'padding':>8} {'workers':>7}")
    rows = []
    for kind, variant in overlap.ROWS:
        row = overlap.measure(corpus, kind, variant, workers, 1, seconds_per_frame, ctx.device,
                              log_dir, batch)
        rows.append(row)
        print(f"{kind:<13} {variant:<7} {row['alone_utts_per_second']:>11.1f} "
              f"{row['steps_utts_per_second']:>11.1f} {row['utts_per_second']:>7.1f} "
              f"{row['wait_share']:>10.3f} {row['first_batch_seconds']:>11.3f} "
              f"{row['padding_share']:>8.3f} {overlap.workers_needed(row):>7}", flush=True)
    print("alone: an epoch without steps; steps: the rate the simulated steps alone allow; "
          "wait share: seconds in next(loader) / wall seconds, over an epoch without its "
          "first batch (reported apart: the buffers filling); before: each batch taken, "
          "pinned, copied and featurized when the step asks; after: the prefetcher; "
          "workers: how many would keep up, when the loader is the bound")
    return {"seconds_per_frame": seconds_per_frame, "step_source": source,
            "workers": workers, "device_fbank_difference": difference,
            "per_worker": per_worker, "rows": rows}


# --------------------------------------------------------------------------- 5. DDP


@dataclasses.dataclass(frozen=True)
class DdpSpec:
    """What every rank trains: part 2's model and batch in one mode."""

    device: str
    mode: str
    sizes: Sizes
    threads: int


def ddp_update_times(spec: DdpSpec, device: torch.device, rank: int, distributed: bool
                     ) -> dict[str, Any]:
    """Median update seconds of part 2's model (under DDP when `distributed`) and a
    checksum of its parameters afterwards."""
    from cat.models.registry import build_model

    config = ctc_v1_config(spec.sizes)
    torch.manual_seed(0)
    module = build_model(config, AISHELL_CHARS).to(device)
    model = module
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None)
    update = update_function(model, module, config, device, MODES[spec.mode],
                             hyper_option(AISHELL / "ctc-v1")["grad_norm"])
    batch = [t.to(device) for t in step_batch(spec.sizes, seed=rank)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = median_times(lambda: update(batch), sync, spec.sizes.warmup_steps,
                         spec.sizes.timed_steps)
    checksum = float(sum(p.detach().double().sum() for p in module.parameters()))
    return {"step_seconds": statistics.median(times), "step_times": times,
            "checksum": checksum}


def ddp_rank(rank: int, world_size: int, spec: DdpSpec, out_dir: str) -> None:
    """One DDP process (`torch.multiprocessing.spawn`): its times into `rank<r>.json`."""
    import torch.distributed as dist

    if spec.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(spec.threads)
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo",
                            init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    try:
        result = ddp_update_times(spec, device, rank, distributed=True)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")


def ddp_world(ctx: Context) -> tuple[int, str, int]:
    """(processes, mode, torch threads per process) of the DDP part; Skipped if none."""
    if ctx.cuda:
        count = torch.cuda.device_count()
        if count < 2:
            raise Skipped(f"one GPU visible (torch.cuda.device_count() = {count}); DDP over "
                          "NCCL needs two or more")
        return count, "fp16", 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return 2, "fp32", max(1, cpus // 2)


def part_ddp(ctx: Context) -> dict[str, Any]:
    """Part 5 (see the module docstring)."""
    import torch.multiprocessing as mp

    world_size, mode, threads = ddp_world(ctx)
    spec = DdpSpec(ctx.device.type, mode, ctx.sizes, threads)
    backend = "nccl" if ctx.cuda else "gloo"
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)  # the single process gets what each rank gets
    try:
        single = ddp_update_times(spec, ctx.device, 0, distributed=False)
    finally:
        torch.set_num_threads(previous)
    out_dir = tempfile.mkdtemp(prefix="ddp-", dir=ctx.workdir)
    mp.spawn(ddp_rank, args=(world_size, spec, out_dir), nprocs=world_size, join=True)
    ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text(encoding="utf-8"))
             for r in range(world_size)]
    distributed = max(r["step_seconds"] for r in ranks)
    spread = max(r["checksum"] for r in ranks) - min(r["checksum"] for r in ranks)
    ctx.check("ddp parameters agree across ranks (checksum spread)", spread,
              1e-9 * max(1.0, abs(ranks[0]["checksum"])))
    result = {"world_size": world_size, "backend": backend, "mode": mode,
              "threads_per_process": threads or None,
              "single_step_seconds": single["step_seconds"],
              "ddp_step_seconds": distributed, "ratio": distributed / single["step_seconds"],
              "scaling_efficiency": single["step_seconds"] / distributed,
              "checksum_spread": spread, "ranks": ranks}
    print(f"{world_size} processes over {backend}, {mode}, the same batch per process"
          + (f", {threads} torch threads each" if threads else ""))
    print(f"{'one process s':>13} {'DDP s (slowest rank)':>20} {'DDP / one':>9} "
          f"{'throughput x':>12} {'checksum spread':>15}")
    print(f"{single['step_seconds']:>13.4f} {distributed:>20.4f} {result['ratio']:>9.2f} "
          f"{world_size * result['scaling_efficiency']:>12.2f} {spread:>15.3g}")
    return result


# --------------------------------------------------------------------------- driver


PART_FUNCTIONS: dict[str, tuple[str, Callable[[Context], dict[str, Any]]]] = {
    "crf": ("1. CTC-CRF loss: device against CPU, and against ctc_loss", part_crf),
    "train_step": ("2. exp/ctc-v1 update: fp32, fp16 + GradScaler, bf16; FLOPs, MFU, audio-hours; "
                   "attention, compile, host waits", part_train_step),
    "rnnt": ("3. RNN-T loss at a WenetSpeech batch: time and peak memory", part_rnnt),
    "loader": ("4. streaming loader: data-wait share at the measured step time", part_loader),
    "ddp": ("5. DDP: every GPU against one (on the CPU: two gloo processes)", part_ddp),
}


def run_part(ctx: Context, name: str) -> dict[str, Any]:
    """Run one part: its result with `status` ok, skipped (and why) or failed."""
    title, function = PART_FUNCTIONS[name]
    print(f"\n== {title} ==", flush=True)
    if name not in ctx.args.parts:
        print("skipped: not selected (--parts)")
        return {"status": "skipped", "reason": "not selected (--parts)"}
    start = time.perf_counter()
    try:
        result = {"status": "ok", **function(ctx)}
    except Skipped as reason:
        print(f"skipped: {reason}")
        result = {"status": "skipped", "reason": str(reason)}
    except Exception as error:  # reported, and the exit status says so
        traceback.print_exc()
        print(f"FAILED: {type(error).__name__}: {error}")
        result = {"status": "failed", "reason": f"{type(error).__name__}: {error}"}
    result["seconds"] = time.perf_counter() - start
    print(f"({result['seconds']:.1f} s)", flush=True)
    return result


def device_text(device: torch.device) -> str:
    if device.type == "cuda":
        return (f"{torch.cuda.get_device_name(device)} x {torch.cuda.device_count()}, "
                f"CUDA {torch.version.cuda}")
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write `report` to `path` through a temporary name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1), encoding="utf-8")
    tmp.replace(path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda: full sizes on the first GPU; cpu: every part at tiny sizes")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run (of {','.join(PARTS)})")
    parser.add_argument("--step-ms", type=float,
                        help="loader part: milliseconds of compute per --step-frames input "
                             "frames (default: part 2's measured update, AMP on CUDA and "
                             "fp32 on the CPU)")
    parser.add_argument("--step-frames", type=int, default=60000,
                        help="input frames the --step-ms step computes (exp/ctc-v1's "
                             "max_frames)")
    parser.add_argument("--compile", action="store_true",
                        help="train_step part: also the compiled row on the CPU (on CUDA "
                             "always; compiling takes minutes on a CPU)")
    parser.add_argument("--rnnt-vocab", type=int, default=5537,
                        help="RNN-T part: output classes (WenetSpeech characters)")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; run with --device cpu for the tiny sizes")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    sizes = FULL if device.type == "cuda" else TINY
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    print(f"device: {device_text(device)}; torch {torch.__version__}; sizes: {sizes.name}")
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as workdir:
        ctx = Context(device, sizes, args, Path(workdir))
        for name in PARTS:
            ctx.results[name] = run_part(ctx, name)
    failed = [name for name, result in ctx.results.items() if result["status"] == "failed"]
    failed_checks = [check["name"] for check in ctx.checks if not check["ok"]]
    wall = time.perf_counter() - start
    print("\nparts: " + ", ".join(f"{name} {result['status']}"
                                   for name, result in ctx.results.items()))
    print(f"checks: {len(ctx.checks) - len(failed_checks)} of {len(ctx.checks)} passed"
          + (f"; failed: {', '.join(failed_checks)}" if failed_checks else ""))
    print(f"wall time: {wall:.1f} s")
    if args.json:
        write_json(args.json, {
            "device": device_text(device), "device_type": device.type,
            "torch": torch.__version__, "sizes": sizes.name, "wall_seconds": wall,
            "parts": ctx.results, "checks": ctx.checks,
            "ok": not failed and not failed_checks})
    return 1 if failed or failed_checks else 0


if __name__ == "__main__":
    sys.exit(main())
