"""One optimizer update over every rank: take the batches, agree on the step, back-propagate.

Epoch end under DDP: before each update every rank takes `grad_accum` batches from its
loader (`Updater.take`), then ONE all-reduce (`Updater.sync`) carries [loss normaliser,
utterances, "ran out of data", "out of time", "asked to stop" (a signal,
`cat.training.preemption`)]. If any rank ran out, every rank ends the epoch at that same
update, so no rank waits in a collective that others never join; if any rank was asked to
stop, every rank stops after that same update.

Loss normalisation: the model returns `loss = batch sum / normalizer` (utterances or
tokens). The same all-reduce gives `step_normalizer`, the normaliser summed over the
update's micro-batches on all ranks, and each micro-batch back-propagates
`loss * normalizer * world_size / step_normalizer`. DDP averages gradients over ranks
(divides by world_size), so the update's gradient is the exact mean over every
utterance (or token) of the update on every rank, whatever the batch sizes.
Non-final micro-batches run under `no_sync`. Gradients are clipped to `grad_norm`, an
update with a non-finite gradient norm is skipped (counted; its utterances count as
skipped, not trained, and too many stop training: `Manager`), the utterances the loss
found infeasible (the model's `num_infeasible`: no alignment, loss 0 and no gradient) are
counted per update for the epoch's record, the model is handed the training progress
(`step`: the scheduler's count of updates done, which checkpoints keep, for the heads' losses
that warm up), AMP (autocast to `amp_dtype`: bfloat16 where the
GPU supports it, else float16 with a GradScaler) is used on GPU only, evaluation autocasts
alike, and the learning rate follows the scheduler per update.

The host waits for the device once per update: the model reads the batch's lengths and
labels on the CPU (its checks, its counts) and keeps its statistics on the device, and
the update's loss sums, infeasible counts and gradient norm come to the host in one copy,
before the optimizer step that the norm decides on (`cat.models.stats`; the heads' own
reads aside: a transducer's lengths, CTC-CRF's labels, one copy a micro-batch).
`tests/training/test_update.py` counts them with `cat.testing.device_reads`.

Usage:
    updater = Updater(model, config["scheduler"], options, context)
    batches, exhausted, wait = updater.take(iterator, note)
    totals = updater.sync(batches, exhausted, out_of_time=False)
    stats = updater.update(batches, totals.normalizer)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from cat.core import config as config_module
from cat.loading.batch import Batch
from cat.models.stats import host_values
from cat.training.distributed import DistributedContext
from cat.training.scheduler import build_scheduler

logger = logging.getLogger(__name__)


def amp_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype of `train.option.amp_dtype` on `device`: "auto" is bfloat16 on a
    CUDA device that supports it, else float16. ValueError for bfloat16 where the device
    has none."""
    bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if name == "auto":
        return torch.bfloat16 if bf16 else torch.float16
    if name == "bfloat16" and not bf16:
        raise ValueError(f"train.option.amp_dtype bfloat16: "
                         f"{torch.cuda.get_device_name(device)} does not support it "
                         "(torch.cuda.is_bf16_supported()); use float16 or auto")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """The name of `dtype` (torch.bfloat16: "bfloat16"), or None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def batch_normalizer(batch: Batch, loss_normalization: str) -> float:
    """The model's loss normaliser of a batch: utterances, or label tokens (at least 1)."""
    if loss_normalization == "token":
        return float(max(int(batch.label_lens.sum()), 1))
    return float(len(batch))


@dataclasses.dataclass
class StepTotals:
    """What the ranks agreed on before an update (sums over ranks, flags of any rank)."""

    normalizer: float
    utterances: float
    exhausted: bool
    out_of_time: bool
    #: a rank was asked to stop (`cat.training.preemption`): all stop after this update
    stop_requested: bool = False


class Updater:
    """The model's optimizer, scheduler, AMP scaler and DDP wrapper, and one update."""

    def __init__(self, model: torch.nn.Module, scheduler_config: dict[str, Any],
                 options: config_module.TrainOptions, context: DistributedContext) -> None:
        self.model = model
        self.options = options
        self.context = context
        self.device = context.device
        self.loss_normalization = model.loss_normalization
        self.scheduler = build_scheduler(scheduler_config, model.parameters())
        self.optimizer = self.scheduler.optimizer
        self.amp = options.amp and self.device.type == "cuda"
        if options.amp and not self.amp:
            logger.warning("train.option.amp is ignored on CPU")
        self.amp_dtype = amp_dtype(options.amp_dtype, self.device) if self.amp else None
        if self.amp:
            logger.info("mixed precision: %s autocast%s (train.option.amp_dtype %s)",
                        dtype_name(self.amp_dtype),
                        " with gradient scaling" if self.amp_dtype == torch.float16 else "",
                        options.amp_dtype)
        # float16 needs its gradients scaled (its range is small); bfloat16 has float32's.
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=self.amp_dtype == torch.float16)
        if options.compile:
            model.encoder.compile_blocks()
            logger.info("train.option.compile: the encoder's blocks are compiled with "
                        "torch.compile (the first batch of each new length compiles them)")
        self.ddp = None
        if context.distributed:
            # No device_ids: DDP would copy every input to the device, the CPU lengths and
            # labels the model reads without waiting for the device too (`update`).
            self.ddp = torch.nn.parallel.DistributedDataParallel(model)
        self.skipped = 0

    def state(self) -> dict[str, Any]:
        """Scheduler (with the optimizer) and scaler states, for a checkpoint."""
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of a checkpoint."""
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])

    def take(self, iterator: Iterator[Batch], note_empty: Callable[[Batch], None]
             ) -> tuple[list[Batch], bool, float]:
        """Up to `grad_accum` non-empty batches, whether the loader ran dry, and the seconds
        spent waiting for it; batches without utterances (events only) go to `note_empty`."""
        batches: list[Batch] = []
        wait = 0.0
        while len(batches) < self.options.grad_accum:
            begin = time.perf_counter()
            batch = next(iterator, None)
            wait += time.perf_counter() - begin
            if batch is None:
                return batches, True, wait
            if len(batch) == 0:
                note_empty(batch)
                continue
            batches.append(batch)
        return batches, False, wait

    def sync(self, batches: Iterable[Batch], exhausted: bool, out_of_time: bool,
             stop_requested: bool = False) -> StepTotals:
        """The one all-reduce before an update (see the module docstring)."""
        batches = list(batches)
        local = [sum(batch_normalizer(b, self.loss_normalization) for b in batches),
                 float(sum(len(b) for b in batches)), float(exhausted), float(out_of_time),
                 float(stop_requested)]
        total = self.context.all_reduce_sum(local)
        return StepTotals(total[0], total[1], total[2] > 0, total[3] > 0, total[4] > 0)

    def update(self, batches: list[Batch], step_normalizer: float) -> dict[str, float]:
        """Forward/backward every micro-batch, clip, step; returns logging stats (`loss`,
        `grad_norm`, `lr`, `skipped`, and `infeasible`: the update's utterances without a
        loss).

        The host waits for the device once per update: the model gets each batch's CPU
        lengths and labels (its checks and counts read them there) and keeps its
        statistics on the device, and the loss sums, infeasible counts and gradient norm
        are copied to the host together, before the step that the norm decides on."""
        model = self.ddp or self.model
        pending: list[float | torch.Tensor] = []  # loss sum, infeasible count per micro-batch
        normalizer_sum = 0.0
        for position, batch in enumerate(batches):
            # The batch's speech goes to the device (its features computed there when
            # the device computes them); its lengths and labels stay on the host, where
            # the model reads them (`Batch.to`).
            batch = batch.to(self.device, non_blocking=True).featurize()
            sync = position == len(batches) - 1 or self.ddp is None
            with (contextlib.nullcontext() if sync else self.ddp.no_sync()), \
                    torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp):
                loss, stats = model(batch.feats, batch.feat_lens, batch.labels, batch.label_lens,
                                    step=self.scheduler.num_steps)
                normalizer = batch_normalizer(batch, self.loss_normalization)
                if stats["normalizer"] != normalizer:
                    raise RuntimeError(f"the model normalised by {stats['normalizer']}, the "
                                       f"trainer expected {normalizer}")
                scale = normalizer * self.context.world_size / step_normalizer
                self.scaler.scale(loss * scale).backward()
            pending += [stats.value("loss_sum"), stats.value("num_infeasible")]
            normalizer_sum += normalizer
        self.scaler.unscale_(self.optimizer)
        max_norm = self.options.grad_norm if self.options.grad_norm > 0 else math.inf
        grad_norm, *values = host_values(
            [torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm), *pending])
        loss_sum, infeasible = sum(values[0::2]), sum(values[1::2])
        skipped = not math.isfinite(grad_norm) and not self.scaler.is_enabled()
        if not skipped:
            # With float16 the scaler skips non-finite updates itself and lowers its scale.
            self.scaler.step(self.optimizer)
        else:
            self.skipped += 1
            logger.warning("non-finite gradient norm; update skipped (its utterances are "
                           "counted as skipped, not trained)")
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.lr
        self.scheduler.step()
        return {"loss": loss_sum / max(normalizer_sum, 1e-12), "grad_norm": grad_norm, "lr": lr,
                "skipped": skipped, "infeasible": int(infeasible)}

    @torch.no_grad()
    def evaluate(self, loader: Iterable[Batch]) -> float:
        """Mean loss over `loader` (per utterance or token, as the model normalises), over
        all ranks."""
        if self.context.distributed:
            # BatchNorm statistics drift apart per rank between DDP's broadcasts.
            for buffer in self.model.buffers():
                dist.broadcast(buffer, 0)
        self.model.eval()
        loss_sums: list[float | torch.Tensor] = []  # read once, at the end
        normalizer = 0.0
        for batch in loader:
            if not len(batch):
                continue
            batch = batch.to(self.device, non_blocking=True).featurize()
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp):
                _, stats = self.model(batch.feats, batch.feat_lens, batch.labels,
                                      batch.label_lens, step=self.scheduler.num_steps)
            loss_sums.append(stats.value("loss_sum"))
            normalizer += stats["normalizer"]
        self.model.train()
        totals = [sum(host_values(loss_sums)), normalizer]
        loss_sum, normalizer = self.context.all_reduce_sum(totals)
        return loss_sum / normalizer if normalizer else math.nan
