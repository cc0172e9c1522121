"""The training manager: data loaders from `hyper-p.json`, the training loop, checkpoints.

`train(exp_dir, command, resume)` runs stage 3 for one experiment, in one process or
under torchrun (one process per rank; nccl on GPU, gloo on CPU):

1. Load and validate `hyper-p.json` + `config.json` (`cat.core.config`), export `env`,
   set the CPU threads, save `exp/<name>/resolved.json` (resolved options + git commit).
2. Build the model for the tokenizer's vocabulary, and a `LengthFilter` from the
   encoder's subsampling (`cat.training.setup`).
3. Build the data (`cat.training.train_data.build_train_data`): `large_dataset: false`
   -> `MapTrainData` (map pack, bucketing batch sampler, equal batch counts per rank);
   `true` -> `StreamTrainData` (tar shards, `cat.loading.stream`). The Manager uses only
   their interface, `TrainData`. Dev data is a map pack unless `dev_large_dataset`.
4. Loop over epochs and optimizer updates; evaluate and checkpoint every `check_freq`
   updates or at the end of every epoch; stop at `epochs`, `max_steps`, the scheduler's
   `stop_step` or the time budget (always with a checkpoint). SIGTERM, SIGUSR1 or SIGINT
   (preemption, a time limit ahead, Ctrl-C) stop every rank after the update in flight
   with a checkpoint of every rank's position and `TrainingStopped`
   (`cat.training.preemption`): the run is then resumed, not finished.

Each update (`cat.training.update.Updater`) agrees across ranks on whether any rank ran
out of data, so every rank ends the epoch at the same update; the utterances that cut
leaves untrained are counted per epoch in `exp/<name>/log/epoch-<EEE>.json`. The loss is
the exact mean over every utterance (or token) of the update on every rank.

Logging: tqdm on rank 0; TensorBoard scalars in `exp/<name>/log/tensorboard/` and the same
scalars in `exp/<name>/log/scalars.jsonl` (train/dev loss, lr, grad norm, utterances/s,
data-wait fraction = time blocked on the loader / wall time, audio-hours trained per
device-hour and, on a GPU of known peak, the model FLOPs utilisation: rank 0's input
frames and FLOPs over the wall time; the FLOPs are counted with FlopCounterMode on a copy
of the model on the run's first batches and scaled to each later batch's shape,
`cat.training.throughput`);
`exp/<name>/monitor.png` plots them after training. Utterances left out are listed per epoch in
`exp/<name>/log/drops/` (`<utt> <reason> [detail]`), and with `log_utterances` the trained
utterance ids in `exp/<name>/log/utts/` (one line per batch); both stay true across a
resume (`cat.training.train_data.EpochLog`).

Resume (`--resume`): the latest checkpoint restores model, optimizer, scheduler, scaler,
RNG states and data position. Map-style epochs continue at the next batch (the batch
order is a function of (seed, epoch)); streaming epochs continue exactly where each
DataLoader worker of each rank stood (`cat.loading.stream`: buffers, reading position
and random state), so the epoch trains the same utterances, each once, and a resumed run
ends with the same model as an uninterrupted one (with up to one worker per rank; with
more, the same utterances in another order). The checkpoint records what decides the
data (`identity()`: shards with their CRC-32, world size, workers, batching, tokenizer,
filter, seed); when any of it changed, `--resume` stops with an error naming the change,
and `--resume-restart-epoch` starts the interrupted epoch again from its beginning
instead (its utterances trained so far are counted as retrained).

Resume also compares what decides an update (config.json, and `grad_accum`, `grad_norm`,
`amp`, and the dtype AMP trains in: `amp_dtype` as resolved on the device; float16 for
checkpoints written before it was recorded) with what the checkpoint recorded, and stops
naming the changed keys unless `--resume-allow-config-change` is given (then the changes
are logged).

No success without training: an update skipped for a non-finite gradient norm counts
its utterances as skipped, not trained; more than `max_skipped_updates` of an epoch's
updates skipped (checked at the epoch's end, or where training stops within it), or a
non-finite dev loss, stops training with `NonFiniteTrainingError` before a checkpoint
is written (`cat.training.report`). With `threads` 0 a `ThreadGovernor`
(`cat.core.threads`) lowers the torch threads while other processes keep the CPUs busy.

Coverage: at the end of every epoch, `exp/<name>/log/coverage.jsonl` gets a line with
the utterances trained (and of those, `infeasible`: the loss found no alignment, so they
got loss 0 and no gradient; logged with a warning), dropped per reason, lost in corrupt
shards, cut by the epoch's end (and the share of the epoch this is), retrained, skipped
(with their updates), and the lengths of the cut ones
(histogram and mean against the corpus mean), so any epoch can be audited afterwards.

Usage:
    python -m cat.ctc.train exp/ctc-v1 [--resume | --resume-restart-epoch]
    torchrun --nproc-per-node 2 -m cat.ctc.train exp/ctc-v1
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cat.core import config as config_module
from cat.core.config import Experiment
from cat.core.io import atomic_write
from cat.core.threads import ThreadGovernor
from cat.features.fbank import experiment_front_end
from cat.loading.batch import Batch
from cat.text.tokenizer import load as load_tokenizer
from cat.training import setup
from cat.training.checkpoint import (
    INTERFACE,
    CheckpointManager,
    flatten,
    interface_changes,
    load_checkpoint,
    load_model_state,
    model_interface,
    upgrade_training_checkpoint,
)
from cat.training.distributed import DistributedContext, set_threads
from cat.training.monitor import Monitor, plot_scalars
from cat.training.preemption import NoStopRequest, StopRequest, TrainingStopped
from cat.training.report import (
    DataChangedError,
    check_dev_loss,
    check_skipped,
    epoch_record,
    write_coverage,
)
from cat.training.throughput import (
    UpdateFlops,
    audio_hours_per_device_hour,
    count_model_flops,
    device_peak,
    mfu,
)
from cat.training.update import Updater, dtype_name
from cat.training.watchdog import NoWatchdog, Watchdog, start_watchdog

logger = logging.getLogger(__name__)


# train.option keys that change what an update computes (the others either decide the
# data, checked by the data's identity, or only when to stop, log and checkpoint).
UPDATE_OPTIONS = ("grad_accum", "grad_norm", "amp")


class ConfigChangedError(RuntimeError):
    """`--resume` found the training settings changed since the checkpoint."""


def training_settings(experiment: Experiment, amp_dtype: str | None = None,
                      interface: dict[str, Any] | None = None) -> dict[str, Any]:
    """What decides an update and what defines the model's input and output, recorded in
    checkpoints: config.json, the train.option keys of UPDATE_OPTIONS, the dtype AMP trains
    in (`train.option.amp_dtype` resolved on the device; None without AMP), and the front
    end and tokenizer (`interface`, default `model_interface` of the experiment's)."""
    if interface is None:
        interface = model_interface(experiment_front_end(experiment.hyper),
                                    load_tokenizer(experiment.options.tokenizer))
    return {"config.json": experiment.config,
            "hyper-p.json": {**{f"train.option.{key}": getattr(experiment.options, key)
                                for key in UPDATE_OPTIONS},
                             "train.option.amp_dtype": amp_dtype},
            **interface}


def setting_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'file: key: old -> new' for each setting that differs (the front end and the
    tokenizer when the checkpoint records them, `interface_changes`)."""
    changes = []
    for name in sorted(set(recorded) | set(current)):
        if name in INTERFACE:
            continue
        old = flatten(recorded.get(name, {}))
        new = flatten(current.get(name, {}))
        for key in sorted(set(old) | set(new)):
            if old.get(key, "(absent)") != new.get(key, "(absent)"):
                changes.append(f"{name}: {key}: {old.get(key, '(absent)')!r} -> "
                               f"{new.get(key, '(absent)')!r}")
    return changes + interface_changes(recorded, current)


class Manager:
    """Owns one training run (see the module docstring)."""

    def __init__(self, experiment: Experiment, context: DistributedContext,
                 resume: bool = False, restart_epoch: bool = False,
                 allow_config_change: bool = False,
                 stop_request: StopRequest | NoStopRequest | None = None) -> None:
        self.experiment = experiment
        self.stop_request = stop_request or NoStopRequest()
        self.stopped_by: str | None = None
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
        self.allow_config_change = allow_config_change
        self.in_epoch = False
        self.epoch_start_step = 0
        self.retrained = 0
        self.last_checkpoint_step = -1
        # This rank's updates skipped for a non-finite gradient in the epoch, and their
        # utterances (taken, not trained).
        self.skipped = {"updates": 0, "utterances": 0}
        # This rank's trained utterances of the epoch the loss found infeasible.
        self.infeasible = 0
        self.watchdog: Watchdog | NoWatchdog = NoWatchdog()

        self.threads = set_threads(self.options.threads, context)
        self.thread_governor = ThreadGovernor(self.options.threads, context.local_world_size)
        self.model, self.num_classes = setup.build_model(experiment, context)
        # What defines the model's input and output, recorded in every checkpoint.
        self.interface = model_interface(experiment_front_end(experiment.hyper),
                                         load_tokenizer(self.options.tokenizer))
        self.feat_dim = int(experiment.config["encoder"]["kwargs"]["idim"])
        self.train_data, self.dev_data = setup.build_data(self.options, self.model,
                                                          self.feat_dim, context, self.log_dir)
        if not resume:
            setup.init_feature_stats(self.model, self.train_data, self.feat_dim)
        self.updater = Updater(self.model, experiment.config["scheduler"], self.options,
                               context)
        self.checkpoints = CheckpointManager(self.exp_dir / "check", self.options.keep_checkpoints)
        if resume:
            self._resume()
        elif self.checkpoints.latest() is not None:
            raise FileExistsError(f"{self.checkpoints.directory} already holds checkpoints; "
                                  "pass --resume to continue, or remove them")
        self.monitor = Monitor(self.log_dir, context.is_main)
        # The FLOPs of an update, counted on the run's first one (throughput.UpdateFlops).
        self.update_flops: UpdateFlops | None = None
        self.peak_flops, peak = device_peak(context.device, self.updater.amp_dtype)
        if self.peak_flops:
            logger.info("throughput: MFU against %s", peak)
        else:
            logger.info("throughput: MFU not logged (%s)", peak)

    # ------------------------------------------------------------------ checkpoints

    def evaluate(self) -> float:
        """Mean dev loss over all ranks (see `Updater.evaluate`)."""
        return self.updater.evaluate(self.dev_data.loader)

    def _data_record(self) -> dict[str, Any]:
        ranks = self.context.gather(self.train_data.state()) if self.in_epoch else None
        return {"kind": self.train_data.kind, "seed": self.options.seed, "epoch": self.epoch,
                "epoch_seed": [self.options.seed, self.epoch],
                "world_size": self.context.world_size, "identity": self.train_data.identity(),
                "epoch_start_step": self.epoch_start_step, "ranks": ranks,
                "skipped": self.context.gather(dict(self.skipped)) if self.in_epoch else None,
                "infeasible": self.context.gather(self.infeasible) if self.in_epoch else None}

    def _rng_state(self) -> dict[str, Any]:
        device = self.context.device
        return {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}

    def save_checkpoint(self, evaluate: bool = True) -> Path | None:
        """Evaluate on dev (unless not `evaluate`: the checkpoint then has no dev loss),
        then write a checkpoint of the current position (all ranks); its path on rank 0."""
        self.watchdog.pause()  # evaluation and writing may take long
        dev_loss = self.evaluate() if evaluate else None
        if dev_loss is not None:
            # on every rank alike; between epochs, self.epoch is already the next one
            check_dev_loss(dev_loss, self.epoch if self.in_epoch else self.epoch - 1,
                           self.step)
        data = self._data_record()
        rng = self.context.gather(self._rng_state())
        if self.context.is_main:
            state = {
                "format": "cat-checkpoint", "version": 1, "model": self.model.state_dict(),
                **self.updater.state(), "epoch": self.epoch, "step": self.step,
                "dev_loss": dev_loss, "data": data, "rng": rng,
                "meta": {"num_classes": self.num_classes,
                         "train_bin": self.experiment.train_bin,
                         "settings": self._settings(),
                         "elapsed_seconds": self.elapsed()},
            }
            path = self.checkpoints.save(state, self.epoch, self.step, dev_loss)
            logger.info("epoch %d, step %d: dev loss %s; saved %s", self.epoch, self.step,
                        "not evaluated" if dev_loss is None else f"{dev_loss:.4f}", path)
        else:
            path = None
        if dev_loss is not None:
            self.monitor.add(self.step, loss__dev=dev_loss)
        self.last_checkpoint_step = self.step
        self.context.barrier()
        self.watchdog.resume()
        return path

    def _resume(self) -> None:
        path = self.checkpoints.latest()
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.checkpoints.directory}")
        state = load_checkpoint(path)
        upgrade_training_checkpoint(state, self.model)
        load_model_state(self.model, state["model"], path,
                         self.exp_dir / config_module.CONFIG_NAME)
        self._check_settings(state["meta"].get("settings"), path)
        self.updater.load(state)
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.last_checkpoint_step = self.step
        self.elapsed_before = float(state["meta"].get("elapsed_seconds", 0.0))
        self.resume_state = self._resume_data(state["data"], path)
        rng, device = state.get("rng"), self.context.device
        if rng and len(rng) == self.context.world_size:
            torch.set_rng_state(rng[self.context.rank]["torch"])
            if device.type == "cuda" and rng[self.context.rank]["cuda"] is not None:
                torch.cuda.set_rng_state(rng[self.context.rank]["cuda"], device)
        logger.info("resumed from %s: epoch %d, step %d", path, self.epoch, self.step)

    def _settings(self) -> dict[str, Any]:
        return training_settings(self.experiment, dtype_name(self.updater.amp_dtype),
                                 self.interface)

    def _check_settings(self, recorded: dict[str, Any] | None, path: Path) -> None:
        """Stop (or, with --resume-allow-config-change, log) when the training settings
        differ from those the checkpoint was trained with."""
        if recorded is None:
            return  # a checkpoint written before settings were recorded
        hyper = recorded.get("hyper-p.json", {})
        if "train.option.amp_dtype" not in hyper:
            # written before amp_dtype: AMP trained in float16 (on a GPU)
            recorded = {**recorded, "hyper-p.json": {**hyper, "train.option.amp_dtype": (
                "float16" if hyper.get("train.option.amp") and self.updater.amp else None)}}
        changes = setting_changes(recorded, self._settings())
        if not changes:
            return
        listed = "; ".join(changes)
        if not self.allow_config_change:
            raise ConfigChangedError(
                f"{path}: the training settings changed since this checkpoint was written: "
                f"{listed}. Restore them, or resume with --resume-allow-config-change to "
                "continue with the new settings")
        logger.warning("%s: resuming with changed training settings "
                       "(--resume-allow-config-change): %s", path, listed)

    def _resume_data(self, data: dict[str, Any], path: Path) -> dict[str, Any] | None:
        """This rank's state to continue the checkpoint's epoch (None: from its start)."""
        ranks = data.get("ranks")
        self.epoch_start_step = int(data.get("epoch_start_step", self.step))
        if ranks is None:
            return None
        changes = self.train_data.identity_changes(data.get("identity"))
        if not changes:
            skipped, infeasible = data.get("skipped"), data.get("infeasible")
            if skipped and len(skipped) == self.context.world_size:
                self.skipped = dict(skipped[self.context.rank])
            if infeasible and len(infeasible) == self.context.world_size:
                self.infeasible = int(infeasible[self.context.rank])
            return ranks[self.context.rank]
        trained = sum(self.train_data.trained_in(r) for r in ranks)
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
        if self.updater.scheduler.should_stop():
            return f"the scheduler's stop_step ({self.updater.scheduler.stop_step}) reached"
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
        if self.stopped_by is not None:
            self.monitor.close()
            raise TrainingStopped(self.stopped_by, self.step,
                                  str(self.checkpoints.latest()) if self.context.is_main
                                  else None)
        if self.last_checkpoint_step != self.step:
            self.save_checkpoint()
        logger.info("training finished after %d updates (%s)", self.step,
                    stopped or f"{self.options.epochs} epochs")
        if self.updater.skipped:
            logger.warning("%d updates were skipped for a non-finite gradient norm",
                           self.updater.skipped)
        self.monitor.close()
        if self.context.is_main and (self.log_dir / "scalars.jsonl").is_file():
            plot_scalars(self.log_dir / "scalars.jsonl", self.exp_dir / "monitor.png")

    def close(self) -> None:
        """Release files: scalar writers, ark handles, epoch logs; stop the watchdog."""
        self.watchdog.stop()
        self.monitor.close()
        self.train_data.close()
        self.dev_data.close()

    def train_epoch(self) -> str | None:
        """Train one epoch (or its rest); returns why training stops, or None."""
        epoch, data = self.epoch, self.train_data
        data.start_epoch(epoch, self.resume_state)
        if self.resume_state is None and not self.retrained:
            self.epoch_start_step = self.step
        if self.resume_state is None:
            self.skipped = {"updates": 0, "utterances": 0}
            self.infeasible = 0
        self.resume_state = None
        self.in_epoch = True
        self.model.train()
        interval = {"time": time.perf_counter(), "wait": 0.0, "utts": 0.0, "steps": 0,
                    "frames": 0.0, "flops": 0.0}
        progress = tqdm(total=data.steps_hint(), desc=f"epoch {epoch}", unit="step",
                        disable=None if self.context.is_main else True, leave=False)
        iterator = iter(data)
        stopped = None
        while True:
            batches, exhausted, wait = self.updater.take(
                iterator, lambda batch: data.note(batch, trained=False))
            out_of_time = (self.options.time_budget_minutes > 0
                           and self.elapsed() > self.options.time_budget_minutes * 60)
            totals = self.updater.sync(batches, exhausted, out_of_time,
                                       self.stop_request.signal is not None)
            if totals.exhausted:
                for batch in batches:
                    data.note(batch, trained=False)
                break
            stats = self._update(batches, totals.normalizer, interval)
            for batch in batches:
                data.note(batch, trained=True)  # taken: the epoch's position moves on
            if stats["skipped"]:
                self.skipped["updates"] += 1
                self.skipped["utterances"] += sum(len(batch) for batch in batches)
            else:
                self.infeasible += stats["infeasible"]
            self.step += 1
            self.watchdog.beat(self.step)
            threads = self.thread_governor.check()
            if threads is not None:
                logger.info("step %d: %d torch thread(s) now (load average %.1f on %d usable "
                            "CPUs; train.option.threads 0)", self.step, threads,
                            os.getloadavg()[0], self.thread_governor.usable)
            progress.update()
            interval["wait"] += wait
            interval["utts"] += totals.utterances
            interval["steps"] += 1
            if self.step % self.options.log_interval == 0:
                self._log_interval(interval, stats)
            stopped = self._stop_reason() or ("time budget reached" if totals.out_of_time
                                              else None)
            if stopped:  # within the epoch: its updates so far
                check_skipped(epoch, self.step - self.epoch_start_step,
                              self.skipped["updates"], self.options.max_skipped_updates)
            if totals.stop_requested and not stopped:
                # A signal (preemption, time limit, Ctrl-C): save without the dev pass,
                # which the grace time may not cover, and stop to be requeued.
                self.stopped_by = self.stop_request.signal or "a signal to another rank"
                self.save_checkpoint(evaluate=False)
                break
            if stopped or (self.options.check_freq and self.step % self.options.check_freq == 0):
                began = time.perf_counter()
                self.save_checkpoint()
                interval["time"] += time.perf_counter() - began  # throughput excludes it
            if stopped:
                break
        del iterator
        progress.close()
        updates = None
        if self.stopped_by is not None:
            stopped = f"stopped by {self.stopped_by}"
        elif stopped is None:
            updates = self.step - self.epoch_start_step
            self._finish_epoch(epoch, updates)
        data.end_epoch(updates)
        return stopped

    def _update(self, batches: list[Batch], normalizer: float, interval: dict[str, float]
                ) -> dict[str, float]:
        """The update, its input frames and FLOPs added to `interval`; the run's first
        batches have their FLOPs counted (`cat.training.throughput`: counted once, on a
        copy of the model, and scaled to the later batches' shapes)."""
        shapes = [(len(batch), batch.feats.size(1)) for batch in batches]
        if self.update_flops is None:
            device = self.context.device
            count = count_model_flops(self.model, [
                (b.feats.to(device), b.feat_lens, b.labels, b.label_lens) for b in batches])
            self.update_flops = UpdateFlops.from_count(count, shapes)
            logger.info("throughput: %.4g GFLOP counted in the update of %s (utterances x "
                        "padded frames), in %.2f s", count.total / 1e9,
                        " + ".join(f"{u} x {t}" for u, t in shapes), count.seconds)
        stats = self.updater.update(batches, normalizer)
        interval["frames"] += sum(float(batch.feat_lens.sum()) for batch in batches)
        interval["flops"] += self.update_flops.scaled(shapes)
        return stats

    def _log_interval(self, interval: dict[str, float], stats: dict[str, float]) -> None:
        now = time.perf_counter()
        seconds = max(now - interval["time"], 1e-9)
        self.monitor.add(self.step, loss__train=stats["loss"], lr=stats["lr"],
                         grad_norm=stats["grad_norm"],
                         throughput__utts_per_second=interval["utts"] / seconds,
                         data__wait_fraction=min(1.0, interval["wait"] / seconds))
        # this rank's: its batches' audio and FLOPs over the wall time, per device
        self.monitor.add(self.step, throughput__audio_hours_per_hour=(
            audio_hours_per_device_hour(interval["frames"], seconds)))
        if self.peak_flops:
            self.monitor.add(self.step,
                             throughput__mfu=mfu(interval["flops"], seconds, self.peak_flops))
        interval.update(time=now, wait=0.0, utts=0.0, steps=0, frames=0.0, flops=0.0)

    def _finish_epoch(self, epoch: int, steps: int) -> None:
        summary = {**self.train_data.summary(), **self.train_data.padding(), "updates": steps,
                   "cut_lengths": self.train_data.cut_profile(),
                   "skipped": self.skipped["utterances"],
                   "skipped_updates": self.skipped["updates"], "infeasible": self.infeasible}
        summaries = self.context.gather(summary)
        self.epoch = epoch + 1
        self.in_epoch = False
        record = epoch_record(epoch, steps, summaries, self.retrained)
        if self.context.is_main:
            self._report_epoch(record)
        check_skipped(epoch, steps, record["skipped_updates"],
                      self.options.max_skipped_updates)  # on every rank alike
        self.train_data.check_epoch(record)  # on every rank alike
        self.retrained = 0
        if not self.options.check_freq:
            self.save_checkpoint()

    def _report_epoch(self, record: dict[str, Any]) -> None:
        epoch = record["epoch"]
        with atomic_write(self.log_dir / f"epoch-{epoch:03d}.json") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        coverage = {key: value for key, value in record.items() if key != "ranks"}
        coverage["corpus_mean_frames"] = self.train_data.corpus_mean_frames()
        write_coverage(self.log_dir / "coverage.jsonl", coverage)
        dropped, cut = record["dropped"], record["not_trained"]
        details = ", ".join(f"{r}={n}" for r, n in sorted(dropped.items())) or "none"
        padding = record["padding_share"]
        logger.info("epoch %d: %d updates, %d utterances trained (%d of them infeasible for "
                    "the loss; padding %s of the input frames); skipped (%d updates with a "
                    "non-finite gradient): %d; dropped: %s; lost in corrupt shards: %d, in "
                    "unavailable shards: %d; not trained (epoch cut at the first rank out of "
                    "data): %s; retrained: %d", epoch,
                    record["steps"], record["trained"], record["infeasible"],
                    "unknown" if padding is None else f"{padding:.1%}",
                    record["skipped_updates"], record["skipped"], details,
                    record["corrupt_missing"], record["unavailable_missing"],
                    "unknown" if cut is None else f"{cut} ({record['cut_fraction']:.2%})",
                    record["retrained"])
        if record["infeasible"]:
            logger.warning("epoch %d: %d trained utterance(s) were infeasible for the loss (no "
                           "alignment of the transcript fits the frames, or none passes the "
                           "CTC-CRF graphs): they got loss 0 and no gradient", epoch,
                           record["infeasible"])
        if cut is not None and cut < 0:
            logger.error("epoch %d: %d more utterances were trained or dropped than the "
                         "indexes list: the shards hold utterances their index.jsonl does not "
                         "list (repacked without a new index?)", epoch, -cut)
