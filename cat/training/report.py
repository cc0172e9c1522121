"""Epoch reports: totals over ranks, the coverage report, and the checks that stop training.

`epoch_record` sums the ranks' summaries of an epoch (`log/epoch-<EEE>.json`);
`write_coverage` keeps one line per epoch in `log/coverage.jsonl` (trained and, of those,
infeasible for the loss: no alignment, loss 0 and no gradient; dropped per reason, lost,
cut by the epoch's end and its lengths, retrained, skipped with an update skipped for a
non-finite gradient, compressed shards a resume read again from their start, kept
utterances per note: audio resampled or down-mixed, transcripts with `<unk>` tokens; the
padding share of the trained batches' input frames); `check_epoch` stops training when
an epoch trained nothing or more of its shards failed than `bad_shard_limit` allows,
`check_skipped` when more of its updates were skipped than `max_skipped_updates` allows,
`check_dev_loss` at a non-finite dev loss.

Usage:
    record = epoch_record(epoch, steps, summaries)
    write_coverage(Path("exp/asr/log/coverage.jsonl"), record)
    check_epoch(record, bad_shard_limit=0.1)
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from cat.core.io import atomic_write
from cat.loading.reader import DataUnavailableError, storage_of

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- epoch reports


class DataChangedError(RuntimeError):
    """`--resume` found that what decides the interrupted epoch's data changed."""


class NonFiniteTrainingError(RuntimeError):
    """Training produced non-finite numbers: too many skipped updates, or a NaN dev loss."""


def epoch_record(epoch: int, steps: int, summaries: list[dict[str, Any]],
                 retrained: int = 0) -> dict[str, Any]:
    """The epoch's totals over ranks (`log/epoch-<EEE>.json`), per-rank summaries kept."""
    dropped: dict[str, int] = {}
    noted: dict[str, int] = {}
    for summary in summaries:
        for reason, count in summary["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + count
        for note, count in summary.get("noted", {}).items():
            noted[note] = noted.get(note, 0) + count
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
    # Utterances of updates skipped for a non-finite gradient were taken, not trained.
    skipped = sum(s.get("skipped", 0) for s in summaries)
    frames = sum(s.get("frames", 0) for s in summaries)
    padded = sum(s.get("padded_frames", 0) for s in summaries)
    return {"epoch": epoch, "steps": steps, "expected": total,
            "trained": sum(s["trained"] for s in summaries) - skipped,
            # Of the trained: the loss found no alignment (loss 0, no gradient).
            "infeasible": sum(s.get("infeasible", 0) for s in summaries), "dropped": dropped,
            "skipped": skipped,
            "skipped_updates": max((s.get("skipped_updates", 0) for s in summaries), default=0),
            "corrupt_missing": sum(s.get("corrupt_missing", 0) for s in summaries),
            "unavailable_missing": sum(s.get("unavailable_missing", 0) for s in summaries),
            "not_trained": cut,
            "cut_fraction": cut / total if cut is not None and total else None,
            "retrained": retrained + sum(s.get("retrained", 0) for s in summaries),
            "resume_reread_shards": sum(s.get("resume_reread_shards", 0) for s in summaries),
            "cut_lengths": cut_lengths,
            "corrupt_shards": [url for s in summaries for url in s.get("corrupt_shards", [])],
            "unavailable_shards": [url for s in summaries
                                   for url in s.get("unavailable_shards", [])],
            "shards": sum(s.get("shards", 0) for s in summaries),
            # Kept utterances per note: audio resampled or down-mixed, <unk> tokens.
            "noted": noted,
            # Of the input frames of the trained batches (padded: utterances x longest),
            # the share that is padding.
            "frames": frames, "padded_frames": padded,
            "padding_share": 1 - frames / padded if padded else None,
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


def check_skipped(epoch: int, steps: int, skipped_updates: int, limit: float) -> None:
    """Raise NonFiniteTrainingError when more than `limit` of an epoch's `steps` updates
    were skipped for a non-finite gradient norm."""
    if skipped_updates and skipped_updates > limit * steps:
        raise NonFiniteTrainingError(
            f"epoch {epoch}: {skipped_updates} of its {steps} updates were skipped for a "
            f"non-finite gradient norm, more than train.option.max_skipped_updates={limit:g}: "
            "the model is not training (non-finite features, CMVN statistics or learning "
            "rate?); see log/drops and the training log")


def check_dev_loss(dev_loss: float, epoch: int, step: int) -> None:
    """Raise NonFiniteTrainingError for a non-finite dev loss (no checkpoint is written)."""
    if not math.isfinite(dev_loss):
        raise NonFiniteTrainingError(
            f"epoch {epoch}, step {step}: the dev loss is {dev_loss}: the model diverged or "
            "was fed non-finite numbers; no checkpoint was written for this step")


def write_coverage(path: Path, record: dict[str, Any]) -> None:
    """Add (or replace) the line of `record["epoch"]` in `coverage.jsonl`, atomically."""
    lines = []
    if path.is_file():
        lines = [line for line in path.read_text(encoding="utf-8").splitlines()
                 if line.strip() and json.loads(line).get("epoch") < record["epoch"]]
    lines.append(json.dumps(record))
    with atomic_write(path) as f:
        f.write("\n".join(lines) + "\n")
