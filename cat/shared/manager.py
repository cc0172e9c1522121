"""The training manager: data loaders from `hyper-p.json`, the training loop, checkpoints.

`train(exp_dir, expected_bin, resume)` runs stage 3 for one experiment, in one process or
under torchrun (one process per rank; nccl on GPU, gloo on CPU):

1. Load and validate `hyper-p.json` + `config.json` (`cat.shared.config`), export `env`,
   set the CPU threads, save `exp/<name>/resolved.json` (resolved options + git commit).
2. Build the model (`cat.shared.model.build_model`) for the tokenizer's vocabulary, and a
   `LengthFilter` from the encoder's subsampling.
3. Build the data: `large_dataset: false` -> `MapTrainData` (map pack, bucketing batch
   sampler, equal batch counts per rank); `true` -> `StreamTrainData` (tar shards,
   `cat.shared.pipeline`). Dev data is a map pack unless `dev_large_dataset`.
4. Loop over epochs and optimizer updates; evaluate and checkpoint every `check_freq`
   updates or at the end of every epoch; stop at `epochs`, `max_steps`, the scheduler's
   `stop_step` or the time budget (always with a checkpoint).

Epoch end under DDP: before each update every rank takes `grad_accum` batches from its
loader, then ONE all-reduce carries [loss normaliser, utterances, "ran out of data",
"out of time"]. If any rank ran out, every rank ends the epoch at that same update, so no
rank waits in a collective that others never join. The utterances not trained because of
this cut are counted per epoch in `exp/<name>/log/epoch-<EEE>.json` (the shard order
changes every epoch, so the cut shards differ).

Loss normalisation: the model returns `loss = batch sum / normalizer` (utterances or
tokens). The same all-reduce gives `step_normalizer`, the normaliser summed over the
update's micro-batches on all ranks, and each micro-batch back-propagates
`loss * normalizer * world_size / step_normalizer`. DDP averages gradients over ranks
(divides by world_size), so the update's gradient is the exact mean over every
utterance (or token) of the update on every rank, whatever the batch sizes.
Non-final micro-batches run under `no_sync`. Gradients are clipped to `grad_norm`, an
update with a non-finite gradient norm is skipped (and counted), AMP (float16 autocast +
GradScaler) is used on GPU only, and the learning rate follows the scheduler per update.

Logging: tqdm on rank 0; TensorBoard scalars in `exp/<name>/log/tensorboard/` and the same
scalars in `exp/<name>/log/scalars.jsonl` (train/dev loss, lr, grad norm, utterances/s,
data-wait fraction = time blocked on the loader / wall time); `exp/<name>/monitor.png`
plots them after training. Utterances left out are listed per epoch in
`exp/<name>/log/drops/` (`<utt> <reason> [detail]`), and with `log_utterances` the trained
utterance ids in `exp/<name>/log/utts/` (one line per batch); both stay true across a
resume (`cat.shared.train_data.EpochLog`).

Resume (`--resume`): the latest checkpoint restores model, optimizer, scheduler, scaler,
RNG states and data position. Map-style epochs continue at the next batch (the batch
order is a function of (seed, epoch)); streaming epochs continue exactly where each
DataLoader worker of each rank stood (`cat.shared.pipeline`: buffers, reading position
and random state), so the epoch trains the same utterances, each once, and a resumed run
ends with the same model as an uninterrupted one (with up to one worker per rank; with
more, the same utterances in another order). The checkpoint records what decides the
data (`identity()`: shards with their CRC-32, world size, workers, batching, tokenizer,
filter, seed); when any of it changed, `--resume` stops with an error naming the change,
and `--resume-restart-epoch` starts the interrupted epoch again from its beginning
instead (its utterances trained so far are counted as retrained).

Coverage: at the end of every epoch, `exp/<name>/log/coverage.jsonl` gets a line with
the utterances trained, dropped per reason, lost in corrupt shards, cut by the epoch's
end (and the share of the epoch this is), retrained, and the lengths of the cut ones
(histogram and mean against the corpus mean), so any epoch can be audited afterwards.

Usage:
    python -m cat.ctc.train exp/ctc-v1 [--resume | --resume-restart-epoch]
    torchrun --nproc-per-node 2 -m cat.ctc.train exp/ctc-v1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from cat.ctc.model import CTCModel
from cat.data.pack import FrameRange, MapPack
from cat.shared import config as config_module
from cat.shared.checkpoint import CheckpointManager, load_checkpoint, load_model_state
from cat.shared.config import Experiment
from cat.shared.data import Batch, LengthFilter
from cat.shared.model import build_model, model_kind
from cat.shared.pipeline import DataUnavailableError, storage_of
from cat.shared.scheduler import build_scheduler
from cat.shared.shardlist import load_shard_list
from cat.shared.tokenizer import load as load_tokenizer
from cat.shared.train_data import DevData, MapTrainData, StreamTrainData
from cat.shared.watchdog import NoWatchdog, Watchdog, start_watchdog
from cat.utils.io import atomic_write, setup_logging
from cat.utils.process import die_with_parent

logger = logging.getLogger(__name__)

DEFAULT_DIST_TIMEOUT = datetime.timedelta(minutes=5)  # train.option.dist_timeout_seconds


# --------------------------------------------------------------------------- distribution


@dataclasses.dataclass
class DistributedContext:
    """Where this process stands: rank, world size and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the one that writes files)."""
        return self.rank == 0

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        """`value` of every rank, on every rank."""
        if not self.distributed:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.distributed:
            dist.barrier()


def init_distributed(timeout: datetime.timedelta = DEFAULT_DIST_TIMEOUT) -> DistributedContext:
    """Join the process group set up by torchrun (env RANK, WORLD_SIZE...), if any."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return DistributedContext(
        rank=int(os.environ.get("RANK", "0")), world_size=world_size, local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        device=device)


def shutdown_distributed() -> None:
    """Leave the process group, if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- helpers


def set_threads(threads: int, context: DistributedContext) -> int:
    """Torch CPU threads: `threads`, or the usable cores shared by the local ranks."""
    if threads <= 0:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        threads = max(1, cores // context.local_world_size)
    torch.set_num_threads(threads)
    return threads


def build_length_filter(model: torch.nn.Module, frame_range: FrameRange | None,
                        longest: int) -> LengthFilter:
    """`LengthFilter` with the encoder's own output lengths (its subsampling)."""
    encoder = model.encoder
    limit = max(frame_range.high if frame_range and frame_range.high else 0, longest, 4096)
    with torch.no_grad():
        table = encoder.output_lengths(torch.arange(limit + 1)).numpy().astype(np.int64)
    return LengthFilter(frame_range, table, int(getattr(encoder, "frame_rate_factor", 1)),
                        ctc=isinstance(model, CTCModel))


def batch_normalizer(batch: Batch, loss_normalization: str) -> float:
    """The model's loss normaliser of a batch: utterances, or label tokens (at least 1)."""
    if loss_normalization == "token":
        return float(max(int(batch.label_lens.sum()), 1))
    return float(len(batch))


# --------------------------------------------------------------------------- monitoring


class Monitor:
    """Scalars to TensorBoard and `scalars.jsonl` (rank 0 only), and `monitor.png`."""

    def __init__(self, log_dir: Path, enabled: bool) -> None:
        self.log_dir = log_dir
        self.enabled = enabled
        self.writer = None
        self.file = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            log_dir.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(log_dir / "tensorboard"))
            self.file = open(log_dir / "scalars.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def add(self, step: int, **scalars: float) -> None:
        """Record scalars (tag names such as `loss/train`, given with `/` as `__`)."""
        if not self.enabled:
            return
        for name, value in scalars.items():
            tag = name.replace("__", "/")
            self.writer.add_scalar(tag, value, step)
            self.file.write(json.dumps({"step": step, "tag": tag, "value": value}) + "\n")
        self.file.flush()

    def close(self) -> None:
        """Flush and close the writers."""
        if self.writer is not None:
            self.writer.close()
            self.file.close()
            self.writer = self.file = None


def plot_scalars(scalars_path: Path, out: Path) -> None:
    """Plot every tag of a `scalars.jsonl` against the step into `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, float]] = {}
    with open(scalars_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            # A resumed run rewrites steps after its checkpoint: the last value wins.
            series.setdefault(record["tag"], {})[record["step"]] = record["value"]
    if not series:
        return
    tags = sorted(series)
    columns = min(3, len(tags))
    rows = math.ceil(len(tags) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False)
    for axis, tag in zip(axes.flat, tags, strict=False):
        steps = sorted(series[tag])
        axis.plot(steps, [series[tag][s] for s in steps], marker="." if len(steps) < 50 else "")
        axis.set_title(tag)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(tags):]:
        axis.axis("off")
    figure.tight_layout()
    with atomic_write(out, "wb") as f:
        figure.savefig(f, format="png", dpi=100)
    plt.close(figure)


# --------------------------------------------------------------------------- epoch reports


class DataChangedError(RuntimeError):
    """`--resume` found that what decides the interrupted epoch's data changed."""


def epoch_record(epoch: int, steps: int, summaries: list[dict[str, Any]],
                 retrained: int = 0) -> dict[str, Any]:
    """The epoch's totals over ranks (`log/epoch-<EEE>.json`), per-rank summaries kept."""
    dropped: dict[str, int] = {}
    for summary in summaries:
        for reason, count in summary["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + count
    not_trained = [s["not_trained"] for s in summaries]
    cut = None if None in not_trained else int(sum(not_trained))
    expected = [s["expected"] for s in summaries]
    total = None if None in expected else int(sum(expected)) + dropped.get("epoch_remainder", 0)
    profiles = [s.get("cut_lengths") for s in summaries]
    cut_lengths = None
    if profiles and None not in profiles:
        count = sum(p["count"] for p in profiles)
        frames = sum(p["count"] * (p["mean_frames"] or 0.0) for p in profiles)
        cut_lengths = {"count": count, "mean_frames": frames / count if count else None,
                       "histogram": {name: sum(p["histogram"][name] for p in profiles)
                                     for name in profiles[0]["histogram"]}}
    return {"epoch": epoch, "steps": steps, "expected": total,
            "trained": sum(s["trained"] for s in summaries), "dropped": dropped,
            "corrupt_missing": sum(s.get("corrupt_missing", 0) for s in summaries),
            "unavailable_missing": sum(s.get("unavailable_missing", 0) for s in summaries),
            "not_trained": cut,
            "cut_fraction": cut / total if cut is not None and total else None,
            "retrained": retrained + sum(s.get("retrained", 0) for s in summaries),
            "cut_lengths": cut_lengths,
            "corrupt_shards": [url for s in summaries for url in s.get("corrupt_shards", [])],
            "unavailable_shards": [url for s in summaries
                                   for url in s.get("unavailable_shards", [])],
            "shards": sum(s.get("shards", 0) for s in summaries),
            "ranks": summaries}


def check_epoch(record: dict[str, Any], bad_shard_limit: float) -> None:
    """Raise DataUnavailableError for an epoch that trained nothing, or whose unavailable
    and corrupt shards exceed `bad_shard_limit` of its shards (the record names them)."""
    failed = record["unavailable_shards"] + record["corrupt_shards"]
    epoch = record["epoch"]
    if record["trained"] and len(failed) <= bad_shard_limit * record["shards"]:
        return
    why = (f"epoch {epoch} trained no utterance" if not record["trained"] else
           f"{len(failed)} of the {record['shards']} shards of epoch {epoch} could not be "
           f"read, more than train.option.bad_shard_limit={bad_shard_limit:g}")
    details = []
    for kind in ("unavailable", "corrupt"):
        urls = record[f"{kind}_shards"]
        if urls:
            details.append(f"{len(urls)} {kind} ({', '.join(urls[:3])}"
                           f"{', ...' if len(urls) > 3 else ''}; storage: {storage_of(urls)})")
    raise DataUnavailableError(f"{why}: {'; '.join(details) or 'no shard failed'} (see "
                               f"log/epoch-{epoch:03d}.json)")


def write_coverage(path: Path, record: dict[str, Any]) -> None:
    """Add (or replace) the line of `record["epoch"]` in `coverage.jsonl`, atomically."""
    lines = []
    if path.is_file():
        lines = [line for line in path.read_text(encoding="utf-8").splitlines()
                 if line.strip() and json.loads(line).get("epoch") < record["epoch"]]
    lines.append(json.dumps(record))
    with atomic_write(path) as f:
        f.write("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- manager


@dataclasses.dataclass
class _StepTotals:
    normalizer: float
    utterances: float
    exhausted: bool
    out_of_time: bool


class Manager:
    """Owns one training run (see the module docstring)."""

    def __init__(self, experiment: Experiment, context: DistributedContext,
                 resume: bool = False, restart_epoch: bool = False) -> None:
        self.experiment = experiment
        self.options = experiment.options
        self.context = context
        self.exp_dir = experiment.directory
        self.log_dir = self.exp_dir / "log"
        self.start_time = time.monotonic()
        self.elapsed_before = 0.0
        self.step = 0
        self.epoch = 1
        # This rank's data state to continue the first epoch after a resume.
        self.resume_state: dict[str, Any] | None = None
        self.restart_epoch = restart_epoch
        self.in_epoch = False
        self.epoch_start_step = 0
        self.retrained = 0
        self.last_checkpoint_step = -1
        self.skipped_updates = 0
        self.device = context.device
        self.watchdog: Watchdog | NoWatchdog = NoWatchdog()

        self.threads = set_threads(self.options.threads, context)
        self._build_model()
        self._build_data()
        if not resume:
            self._init_feature_stats()
        self._build_optimizer()
        self.checkpoints = CheckpointManager(self.exp_dir / "check", self.options.keep_checkpoints)
        if resume:
            self._resume()
        elif self.checkpoints.latest() is not None:
            raise FileExistsError(f"{self.checkpoints.directory} already holds checkpoints; "
                                  "pass --resume to continue, or remove them")
        self.monitor = Monitor(self.log_dir, context.is_main)

    # ------------------------------------------------------------------ construction

    def _build_model(self) -> None:
        options, experiment = self.options, self.experiment
        tokenizer = load_tokenizer(options.tokenizer)
        self.num_classes = tokenizer.vocab_size
        torch.manual_seed(options.seed)
        self.model = build_model(experiment.config, self.num_classes,
                                 str(self.exp_dir / config_module.CONFIG_NAME)).to(self.device)
        # Training randomness (dropout, SpecAugment) differs per rank, reproducibly.
        torch.manual_seed(int(np.random.SeedSequence([options.seed, self.context.rank])
                              .generate_state(1)[0]))
        self.kind = model_kind(experiment.config)
        self.feat_dim = int(experiment.config["encoder"]["kwargs"]["idim"])
        self.loss_normalization = self.model.loss_normalization
        logger.info("model %s: %d parameters, %d classes", self.kind,
                    sum(p.numel() for p in self.model.parameters()), self.num_classes)

    def _build_data(self) -> None:
        options = self.options
        frame_range = FrameRange.parse(options.filter) if options.filter else None
        if options.large_dataset:
            shards = load_shard_list(options.trset, options.utts_per_shard_estimate,
                                     options.read_timeout)
            longest = shards.longest
            length_filter = build_length_filter(self.model, frame_range, longest)
            self.train_data: MapTrainData | StreamTrainData = StreamTrainData(
                options, length_filter, self.feat_dim, self.context, self.log_dir, shards)
            logger.info("training on %d shards (%d utterances) from %s", len(shards),
                        int(shards.num_utts.sum()), options.trset)
        else:
            pack = self._open_pack(options.trset[0])
            longest = int(pack.num_frames.max(initial=0))
            length_filter = build_length_filter(self.model, frame_range, longest)
            self.train_data = MapTrainData(options, length_filter, self.feat_dim,
                                           self.context, self.log_dir, pack)
        if frame_range is not None and frame_range.high is not None:
            longest = min(longest, frame_range.high - 1)
        if options.max_frames and longest > options.max_frames:
            logger.warning("utterances of up to %d frames exceed max_frames=%d; each of them "
                           "forms a batch of its own", longest, options.max_frames)
        dev_pack = None if options.dev_large_dataset else self._open_pack(options.devset[0])
        self.dev_data = DevData(options, self.feat_dim, self.context, dev_pack)

    def _init_feature_stats(self, max_utts: int = 2000) -> None:
        """Set the encoder's global CMVN (when configured) from training utterances.

        Every rank computes the same statistics from the same utterances, so the models
        stay identical; a resumed run takes them from the checkpoint instead.
        """
        normalizer = getattr(getattr(self.model, "encoder", None), "normalizer", None)
        if normalizer is None or bool(normalizer.initialized):
            return
        total = np.zeros(self.feat_dim)
        squares = np.zeros(self.feat_dim)
        frames = 0
        for feats in self.train_data.feature_samples(max_utts):
            feats = np.asarray(feats, dtype=np.float64)
            total += feats.sum(axis=0)
            squares += np.square(feats).sum(axis=0)
            frames += feats.shape[0]
        if frames == 0:
            raise ValueError(f"trset {self.options.trset}: no features to compute the "
                             "global CMVN statistics from")
        mean = total / frames
        std = np.sqrt(np.maximum(squares / frames - np.square(mean), 0.0))
        normalizer.set_stats(torch.as_tensor(mean, dtype=torch.float32),
                             torch.as_tensor(std, dtype=torch.float32))
        logger.info("global CMVN from %d frames of training data", frames)

    def _open_pack(self, path: str) -> MapPack:
        """The pack at `path`, checked to be encoded with this run's tokenizer."""
        pack = MapPack(path)
        meta = pack.meta.get("tokenizer", {})
        digest = hashlib.sha256(Path(self.options.tokenizer).read_bytes()).hexdigest()
        if meta.get("sha256") not in (None, digest):
            raise ValueError(f"{path} was encoded with the tokenizer {meta.get('file')}, "
                             f"which differs from train.option.tokenizer "
                             f"{self.options.tokenizer}; repack or fix the tokenizer path")
        return pack

    def _build_optimizer(self) -> None:
        self.scheduler = build_scheduler(self.experiment.config["scheduler"],
                                         self.model.parameters())
        self.optimizer = self.scheduler.optimizer
        self.amp = self.options.amp and self.device.type == "cuda"
        if self.options.amp and not self.amp:
            logger.warning("train.option.amp is ignored on CPU")
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp)
        self.ddp = None
        if self.context.distributed:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    # ------------------------------------------------------------------ checkpoints

    def _data_record(self) -> dict[str, Any]:
        ranks = self.context.gather(self.train_data.state()) if self.in_epoch else None
        return {"kind": self.train_data.kind, "seed": self.options.seed, "epoch": self.epoch,
                "epoch_seed": [self.options.seed, self.epoch],
                "world_size": self.context.world_size, "identity": self.train_data.identity(),
                "epoch_start_step": self.epoch_start_step, "ranks": ranks}

    def _rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(self.device)
                if self.device.type == "cuda" else None}

    def save_checkpoint(self) -> None:
        """Evaluate on dev, then write a checkpoint of the current position (all ranks)."""
        self.watchdog.pause()  # evaluation and writing may take long
        dev_loss = self.evaluate()
        data = self._data_record()
        rng = self.context.gather(self._rng_state())
        if self.context.is_main:
            state = {
                "format": "cat-checkpoint", "version": 1,
                "model": self.model.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "epoch": self.epoch, "step": self.step,
                "dev_loss": dev_loss, "data": data, "rng": rng,
                "meta": {"num_classes": self.num_classes,
                         "train_bin": self.experiment.train_bin,
                         "elapsed_seconds": self.elapsed()},
            }
            path = self.checkpoints.save(state, self.epoch, self.step, dev_loss)
            logger.info("epoch %d, step %d: dev loss %.4f; saved %s", self.epoch, self.step,
                        dev_loss, path)
        self.monitor.add(self.step, loss__dev=dev_loss)
        self.last_checkpoint_step = self.step
        self.context.barrier()
        self.watchdog.resume()

    def _resume(self) -> None:
        path = self.checkpoints.latest()
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.checkpoints.directory}")
        state = load_checkpoint(path)
        load_model_state(self.model, state["model"], path,
                         self.exp_dir / config_module.CONFIG_NAME)
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.last_checkpoint_step = self.step
        self.elapsed_before = float(state["meta"].get("elapsed_seconds", 0.0))
        self.resume_state = self._resume_data(state["data"], path)
        rng = state.get("rng")
        if rng and len(rng) == self.context.world_size:
            torch.set_rng_state(rng[self.context.rank]["torch"])
            if self.device.type == "cuda" and rng[self.context.rank]["cuda"] is not None:
                torch.cuda.set_rng_state(rng[self.context.rank]["cuda"], self.device)
        logger.info("resumed from %s: epoch %d, step %d", path, self.epoch, self.step)

    def _resume_data(self, data: dict[str, Any], path: Path) -> dict[str, Any] | None:
        """This rank's state to continue the checkpoint's epoch (None: from its start)."""
        ranks = data.get("ranks")
        self.epoch_start_step = int(data.get("epoch_start_step", self.step))
        if ranks is None:
            return None
        changes = self.train_data.identity_changes(data.get("identity"))
        if not changes:
            return ranks[self.context.rank]
        trained = sum(int(r["trained"] if "trained" in r else r["progress"]["trained"])
                      for r in ranks)
        problem = (f"{path}: epoch {self.epoch} cannot continue where it stopped, because "
                   f"what decides its data changed: {'; '.join(changes)}")
        if not self.restart_epoch:
            raise DataChangedError(
                f"{problem}. Restore the previous data and settings, or resume with "
                f"--resume-restart-epoch to train epoch {self.epoch} again from its beginning "
                f"(its {trained} utterances trained so far are then trained again)")
        logger.warning("%s; epoch %d starts again from its beginning "
                       "(--resume-restart-epoch): %d utterances are trained again",
                       problem, self.epoch, trained)
        self.retrained = trained
        self.epoch_start_step = self.step
        return None

    # ------------------------------------------------------------------ loop

    def elapsed(self) -> float:
        """Training seconds, including those before a resume."""
        return self.elapsed_before + time.monotonic() - self.start_time

    def _stop_reason(self) -> str | None:
        if self.options.max_steps and self.step >= self.options.max_steps:
            return f"max_steps={self.options.max_steps} reached"
        if self.scheduler.should_stop():
            return f"the scheduler's stop_step ({self.scheduler.stop_step}) reached"
        return None

    def run(self) -> None:
        """Train until the epochs, steps or time run out; checkpoint; plot the scalars."""
        if self.context.is_main:
            config_module.save_resolved(self.experiment, {
                "world_size": self.context.world_size, "threads_per_rank": self.threads,
                "num_classes": self.num_classes})
        self.watchdog = start_watchdog(self.context.rank, self.context.world_size,
                                       self.options.stall_seconds)
        stopped = self._stop_reason()
        while stopped is None and self.epoch <= self.options.epochs:
            stopped = self.train_epoch()
        self.watchdog.stop()
        if self.last_checkpoint_step != self.step:
            self.save_checkpoint()
        logger.info("training finished after %d updates (%s)", self.step,
                    stopped or f"{self.options.epochs} epochs")
        if self.skipped_updates:
            logger.warning("%d updates were skipped for a non-finite gradient norm",
                           self.skipped_updates)
        self.monitor.close()
        if self.context.is_main and (self.log_dir / "scalars.jsonl").is_file():
            plot_scalars(self.log_dir / "scalars.jsonl", self.exp_dir / "monitor.png")

    def close(self) -> None:
        """Release files: scalar writers, ark handles, epoch logs; stop the watchdog."""
        self.watchdog.stop()
        self.monitor.close()
        self.train_data.close()
        self.dev_data.close()

    def _take(self, iterator: Iterator[Batch]) -> tuple[list[Batch], bool, float]:
        """Up to `grad_accum` non-empty batches; also says whether the loader ran dry."""
        batches: list[Batch] = []
        wait = 0.0
        while len(batches) < self.options.grad_accum:
            begin = time.perf_counter()
            batch = next(iterator, None)
            wait += time.perf_counter() - begin
            if batch is None:
                return batches, True, wait
            if len(batch) == 0:
                self.train_data.note(batch, trained=False)
                continue
            batches.append(batch)
        return batches, False, wait

    def _sync(self, batches: list[Batch], exhausted: bool) -> _StepTotals:
        out_of_time = (self.options.time_budget_minutes > 0
                       and self.elapsed() > self.options.time_budget_minutes * 60)
        local = [sum(batch_normalizer(b, self.loss_normalization) for b in batches),
                 float(sum(len(b) for b in batches)), float(exhausted), float(out_of_time)]
        total = self.context.all_reduce_sum(local)
        return _StepTotals(total[0], total[1], total[2] > 0, total[3] > 0)

    def _update(self, batches: list[Batch], step_normalizer: float) -> dict[str, float]:
        """Forward/backward every micro-batch, clip, step; returns logging stats."""
        model = self.ddp or self.model
        loss_sum = normalizer_sum = 0.0
        for position, batch in enumerate(batches):
            batch = batch.to(self.device, non_blocking=True)
            sync = position == len(batches) - 1 or self.ddp is None
            with (contextlib.nullcontext() if sync else self.ddp.no_sync()), \
                    torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp):
                loss, stats = model(batch.feats, batch.feat_lens, batch.labels, batch.label_lens)
                normalizer = batch_normalizer(batch, self.loss_normalization)
                if stats["normalizer"] != normalizer:
                    raise RuntimeError(f"the model normalised by {stats['normalizer']}, the "
                                       f"trainer expected {normalizer}")
                scale = normalizer * self.context.world_size / step_normalizer
                self.scaler.scale(loss * scale).backward()
            loss_sum += stats["loss_sum"]
            normalizer_sum += normalizer
        self.scaler.unscale_(self.optimizer)
        max_norm = self.options.grad_norm if self.options.grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if math.isfinite(grad_norm) or self.amp:
            # With AMP the scaler skips non-finite updates itself and lowers its scale.
            self.scaler.step(self.optimizer)
        else:
            self.skipped_updates += 1
            logger.warning("step %d: non-finite gradient norm; update skipped", self.step + 1)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.lr
        self.scheduler.step()
        return {"loss": loss_sum / max(normalizer_sum, 1e-12), "grad_norm": grad_norm, "lr": lr}

    def train_epoch(self) -> str | None:
        """Train one epoch (or its rest); returns why training stops, or None."""
        epoch, data = self.epoch, self.train_data
        data.start_epoch(epoch, self.resume_state)
        if self.resume_state is None and not self.retrained:
            self.epoch_start_step = self.step
        self.resume_state = None
        self.in_epoch = True
        self.model.train()
        interval = {"time": time.perf_counter(), "wait": 0.0, "utts": 0.0, "steps": 0}
        progress = tqdm(total=data.steps_hint(), desc=f"epoch {epoch}", unit="step",
                        disable=None if self.context.is_main else True, leave=False)
        iterator = iter(data)
        stopped = None
        while True:
            batches, exhausted, wait = self._take(iterator)
            totals = self._sync(batches, exhausted)
            if totals.exhausted:
                for batch in batches:
                    data.note(batch, trained=False)
                break
            stats = self._update(batches, totals.normalizer)
            for batch in batches:
                data.note(batch, trained=True)
            self.step += 1
            self.watchdog.beat(self.step)
            progress.update()
            interval["wait"] += wait
            interval["utts"] += totals.utterances
            interval["steps"] += 1
            if self.step % self.options.log_interval == 0:
                self._log_interval(interval, stats)
            stopped = self._stop_reason() or ("time budget reached" if totals.out_of_time
                                              else None)
            if stopped or (self.options.check_freq and self.step % self.options.check_freq == 0):
                began = time.perf_counter()
                self.save_checkpoint()
                interval["time"] += time.perf_counter() - began  # throughput excludes it
            if stopped:
                break
        del iterator
        progress.close()
        if stopped is None:
            self._finish_epoch(epoch, self.step - self.epoch_start_step)
        data.end_epoch()
        return stopped

    def _log_interval(self, interval: dict[str, float], stats: dict[str, float]) -> None:
        now = time.perf_counter()
        seconds = max(now - interval["time"], 1e-9)
        self.monitor.add(self.step, loss__train=stats["loss"], lr=stats["lr"],
                         grad_norm=stats["grad_norm"],
                         throughput__utts_per_second=interval["utts"] / seconds,
                         data__wait_fraction=min(1.0, interval["wait"] / seconds))
        interval.update(time=now, wait=0.0, utts=0.0, steps=0)

    def _finish_epoch(self, epoch: int, steps: int) -> None:
        summary = {**self.train_data.summary(), "updates": steps,
                   "cut_lengths": self.train_data.cut_profile()}
        summaries = self.context.gather(summary)
        if isinstance(self.train_data, StreamTrainData):
            self.train_data.last_steps = steps
        self.epoch = epoch + 1
        self.in_epoch = False
        record = epoch_record(epoch, steps, summaries, self.retrained)
        if self.context.is_main:
            self._report_epoch(record)
        if self.train_data.kind == "stream":
            check_epoch(record, self.options.bad_shard_limit)  # on every rank alike
        self.retrained = 0
        if not self.options.check_freq:
            self.save_checkpoint()

    def _report_epoch(self, record: dict[str, Any]) -> None:
        epoch = record["epoch"]
        with atomic_write(self.log_dir / f"epoch-{epoch:03d}.json") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        coverage = {key: value for key, value in record.items() if key != "ranks"}
        if isinstance(self.train_data, StreamTrainData):
            shards = self.train_data.shards
            coverage["corpus_mean_frames"] = (float(shards.num_frames.sum() / shards.num_utts.sum())
                                             if not shards.estimated.any() else None)
        write_coverage(self.log_dir / "coverage.jsonl", coverage)
        dropped, cut = record["dropped"], record["not_trained"]
        details = ", ".join(f"{r}={n}" for r, n in sorted(dropped.items())) or "none"
        logger.info("epoch %d: %d updates, %d utterances trained; dropped: %s; lost in "
                    "corrupt shards: %d, in unavailable shards: %d; not trained (epoch cut at "
                    "the first rank out of data): %s; retrained: %d", epoch, record["steps"],
                    record["trained"], details, record["corrupt_missing"],
                    record["unavailable_missing"],
                    "unknown" if cut is None else f"{cut} ({record['cut_fraction']:.2%})",
                    record["retrained"])
        if cut is not None and cut < 0:
            logger.error("epoch %d: %d more utterances were trained or dropped than the "
                         "indexes list: the shards hold utterances their index.jsonl does not "
                         "list (repacked without a new index?)", epoch, -cut)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean dev loss (per utterance or token, as the model normalises), over all ranks."""
        if self.context.distributed:
            # BatchNorm statistics drift apart per rank between DDP's broadcasts.
            for buffer in self.model.buffers():
                dist.broadcast(buffer, 0)
        self.model.eval()
        totals = [0.0, 0.0]
        for batch in self.dev_data.loader:
            if not len(batch):
                continue
            batch = batch.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp):
                _, stats = self.model(batch.feats, batch.feat_lens, batch.labels,
                                      batch.label_lens)
            totals[0] += stats["loss_sum"]
            totals[1] += stats["normalizer"]
        self.model.train()
        loss_sum, normalizer = self.context.all_reduce_sum(totals)
        return loss_sum / normalizer if normalizer else math.nan


# --------------------------------------------------------------------------- entry


MODEL_KINDS = {"cat.ctc.train": "ctc", "cat.rnnt.train": "rnnt"}
MODEL_NAMES = {"cat.ctc.train": "CTC", "cat.rnnt.train": "RNN-T"}


def train(exp_dir: str | os.PathLike, expected_bin: str, resume: bool = False,
          restart_epoch: bool = False) -> None:
    """Stage 3 for `exp_dir` (see the module docstring); call once per process."""
    experiment = config_module.load_experiment(exp_dir, expected_bin)
    kind = model_kind(experiment.config)
    if MODEL_KINDS.get(expected_bin, kind) != kind:
        raise config_module.ConfigError(
            f"{Path(exp_dir) / config_module.CONFIG_NAME}: describes a {kind} model, but "
            f"{expected_bin} trains {MODEL_KINDS[expected_bin]} models")
    config_module.apply_env(experiment.hyper)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank started by torchrun: end with it
        die_with_parent(os.getppid())
    context = init_distributed(
        datetime.timedelta(seconds=experiment.options.dist_timeout_seconds))
    if not context.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        manager = Manager(experiment, context, resume or restart_epoch, restart_epoch)
        try:
            manager.run()
        finally:
            manager.close()
    finally:
        shutdown_distributed()


def run_cli(train_bin: str, argv: list[str] | None = None) -> None:
    """Command line of the training entry points (`cat.ctc.train`, `cat.rnnt.train`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {train_bin}",
                                     description=f"Train a {MODEL_NAMES[train_bin]} model "
                                                 "from exp/<name>/hyper-p.json and config.json")
    parser.add_argument("exp_dir", help="experiment directory, e.g. exp/ctc-v1")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in exp_dir/check")
    parser.add_argument("--resume-restart-epoch", action="store_true",
                        help="continue from the latest checkpoint, but start its epoch again "
                             "from the beginning (when the data or its settings changed)")
    args = parser.parse_args(argv)
    setup_logging()
    train(args.exp_dir, train_bin, args.resume, args.resume_restart_epoch)
