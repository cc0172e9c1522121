"""What a training run is built from: the model, its length filter, the data, global CMVN.

`build_model` builds the model of `config.json` for the tokenizer's vocabulary (seeded
alike on every rank, then each rank reseeded for its own dropout and SpecAugment);
`build_data` the training data (`cat.training.train_data.build_train_data`: a map pack
or tar shards, behind one interface, `TrainData`) with a `LengthFilter` from the
encoder's own subsampling, and the dev data; `init_feature_stats` the encoder's global
CMVN from training utterances as the loader reads them.

Usage:
    model, num_classes = build_model(experiment, context)
    train_data, dev_data = build_data(experiment.options, model, feat_dim, context, log_dir)
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from cat.core import config as config_module
from cat.core.config import Experiment
from cat.formats.tables import FrameRange
from cat.loading.batch import LengthFilter
from cat.models import registry
from cat.text.tokenizer import load as load_tokenizer
from cat.training.distributed import DistributedContext
from cat.training.train_data import DevData, TrainData, build_train_data

logger = logging.getLogger(__name__)


def build_model(experiment: Experiment, context: DistributedContext
                ) -> tuple[torch.nn.Module, int]:
    """The model of `config.json` on the rank's device, and its number of classes."""
    options = experiment.options
    tokenizer = load_tokenizer(options.tokenizer)
    num_classes = tokenizer.vocab_size
    torch.manual_seed(options.seed)
    model = registry.build_model(experiment.config, num_classes,
                                 str(experiment.directory / config_module.CONFIG_NAME),
                                 experiment.kind)
    if hasattr(model, "prepare_training"):  # e.g. CTC-CRF reads its denominator graph
        model.prepare_training([tokenizer.id_to_piece(i) for i in range(num_classes)])
    # Training randomness (dropout, SpecAugment) differs per rank, reproducibly.
    torch.manual_seed(int(np.random.SeedSequence([options.seed, context.rank])
                          .generate_state(1)[0]))
    logger.info("model %s: %d parameters, %d classes", experiment.kind,
                sum(p.numel() for p in model.parameters()), num_classes)
    return model.to(context.device), num_classes


def build_length_filter(model: torch.nn.Module, frame_range: FrameRange | None,
                        longest: int) -> LengthFilter:
    """`LengthFilter` with the encoder's own output lengths (its subsampling)."""
    encoder = model.encoder
    limit = max(frame_range.high if frame_range and frame_range.high else 0, longest, 4096)
    with torch.no_grad():
        table = encoder.output_lengths(torch.arange(limit + 1)).numpy().astype(np.int64)
    return LengthFilter(frame_range, table, int(getattr(encoder, "frame_rate_factor", 1)),
                        ctc=getattr(model, "ctc_alignment", False))


def build_data(options: config_module.TrainOptions, model: torch.nn.Module, feat_dim: int,
               context: DistributedContext, log_dir: Path) -> tuple[TrainData, DevData]:
    """The training data of `trset` (`build_train_data`: map pack or tar shards), with the
    encoder's length filter, and the dev data."""
    frame_range = FrameRange.parse(options.filter) if options.filter else None
    train_data = build_train_data(
        options, lambda longest: build_length_filter(model, frame_range, longest), feat_dim,
        context, log_dir)
    longest = train_data.longest
    if frame_range is not None and frame_range.high is not None:
        longest = min(longest, frame_range.high - 1)
    if options.max_frames and longest > options.max_frames:
        logger.warning("utterances of up to %d frames exceed max_frames=%d; each of them "
                       "forms a batch of its own", longest, options.max_frames)
    return train_data, DevData(options, feat_dim, context)


def init_feature_stats(model: torch.nn.Module, train_data: TrainData, feat_dim: int,
                       max_utts: int = 2000) -> None:
    """Set the encoder's global CMVN (when configured) from training utterances, read
    through the loader's own stages (`TrainData.feature_samples`).

    Every rank computes the same statistics from the same utterances, so the models stay
    identical; a resumed run takes them from the checkpoint instead.
    """
    normalizer = getattr(getattr(model, "encoder", None), "normalizer", None)
    if normalizer is None or bool(normalizer.initialized):
        return
    total = np.zeros(feat_dim)
    squares = np.zeros(feat_dim)
    frames = 0
    culprits = []  # utterances whose values make the sums non-finite
    for name, feats in train_data.feature_samples(max_utts):
        feats = np.asarray(feats, dtype=np.float64)
        sums, sum_squares = feats.sum(axis=0), np.square(feats).sum(axis=0)
        if not (np.isfinite(sums).all() and np.isfinite(sum_squares).all()):
            culprits.append(f"{name} ({_non_finite_text(feats)})")
        total += sums
        squares += sum_squares
        frames += feats.shape[0]
    if frames == 0:
        raise ValueError(f"trset {train_data.options.trset}: no features to compute the "
                         "global CMVN statistics from")
    mean = total / frames
    std = np.sqrt(np.maximum(squares / frames - np.square(mean), 0.0))
    if culprits or not (np.isfinite(mean).all() and np.isfinite(std).all()):
        raise ValueError(
            f"trset {train_data.options.trset}: the global CMVN statistics are not finite, "
            f"caused by {len(culprits)} utterance(s): {'; '.join(culprits[:5]) or 'unknown'}"
            f"{'; ...' if len(culprits) > 5 else ''}. Remove or repack them (stage 2 drops "
            "non-finite features as 'non_finite')")
    normalizer.set_stats(torch.as_tensor(mean, dtype=torch.float32),
                         torch.as_tensor(std, dtype=torch.float32))
    logger.info("global CMVN from %d frames of training data", frames)


def _non_finite_text(feats: np.ndarray) -> str:
    """'3 NaN, 1 inf values' (or 'values too large to square') of a feature matrix."""
    nan, inf = int(np.isnan(feats).sum()), int(np.isinf(feats).sum())
    if not nan and not inf:
        return "values too large to sum"
    return ", ".join(part for part in (f"{nan} NaN" if nan else "",
                                       f"{inf} infinite" if inf else "") if part) + " values"
