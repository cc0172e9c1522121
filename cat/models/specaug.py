"""SpecAugment (Park et al. 2019) on padded feature batches.

`SpecAugment(**config["specaug"])(feats, feat_lens, generator)` returns an
augmented copy of `feats` [B, T, D]:

  * time warp (optional): a centre frame `c` inside each utterance is moved by
    `w` in `[-max_time_warp, max_time_warp]` frames by linearly resampling the
    two sides; only the first `feat_lens[b]` frames take part;
  * `num_freq_masks` frequency masks of width `[0, W_f]` bins with
    `W_f = min(max_freq_mask_width, max_freq_mask_ratio * D)` (either bound may be None);
  * `num_time_masks` time masks of width `[0, W_t]` frames with
    `W_t = min(max_time_mask_width, max_time_mask_ratio * feat_lens[b])`,
    placed inside the valid frames of each utterance.

Masked cells take `mask_value`: "zero", or "mean" (the utterance's mean over
its valid frames, a neutral value for features without mean normalisation).

`start_batch` delays augmentation: the first `start_batch` calls (training
batches) pass through unchanged. Masks from the first step slow a model's
escape from the initial blank-only plateau; short training budgets start them
once the model has begun to tell tokens apart. The count is a buffer, so it
survives checkpoints and resumes.
Padded frames are never modified. All randomness comes from `generator` (or
the global torch RNG), so a seeded generator gives identical masks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MASK_VALUES = ("zero", "mean")


def _draw(shape: tuple[int, ...], generator: torch.Generator | None,
          device: torch.device) -> torch.Tensor:
    """Uniform [0, 1) numbers drawn on the generator's device, moved to `device`."""
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def _mask_bands(extent: torch.Tensor, max_width: torch.Tensor, num_masks: int, size: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """Random bands `[start, start + width)` inside `[0, extent)` -> bool mask [B, size].

    `extent` and `max_width` are float tensors [B]; widths are uniform integers in
    `[0, max_width]` (capped by `extent`) and starts uniform in `[0, extent - width]`.
    """
    batch = extent.size(0)
    device = extent.device
    max_width = torch.minimum(max_width, extent)
    width = torch.floor(_draw((batch, num_masks), generator, device) * (max_width[:, None] + 1))
    width = torch.minimum(width, max_width[:, None])
    start = torch.floor(_draw((batch, num_masks), generator, device)
                        * (extent[:, None] - width + 1))
    positions = torch.arange(size, device=device, dtype=extent.dtype)[None, None, :]
    inside = (positions >= start[..., None]) & (positions < (start + width)[..., None])
    return inside.any(dim=1)


class SpecAugment(nn.Module):
    """Frequency masks, time masks and optional time warp; see the module docstring.

    The module augments whenever it is called; models call it in training mode only.
    """

    def __init__(self, num_freq_masks: int = 2, max_freq_mask_width: int | None = None,
                 max_freq_mask_ratio: float | None = 0.15, num_time_masks: int = 2,
                 max_time_mask_width: int | None = None, max_time_mask_ratio: float | None = 0.1,
                 max_time_warp: int = 0, mask_value: str = "zero", start_batch: int = 0) -> None:
        super().__init__()
        if mask_value not in MASK_VALUES:
            raise ValueError(f"specaug mask_value must be one of {MASK_VALUES}, got {mask_value!r}")
        for name, value in (("max_freq_mask_ratio", max_freq_mask_ratio),
                            ("max_time_mask_ratio", max_time_mask_ratio)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"specaug {name} must be within [0, 1], got {value}")
        for name, value in (("num_freq_masks", num_freq_masks), ("num_time_masks", num_time_masks),
                            ("max_time_warp", max_time_warp),
                            ("max_freq_mask_width", max_freq_mask_width or 0),
                            ("max_time_mask_width", max_time_mask_width or 0),
                            ("start_batch", start_batch)):
            if value < 0:
                raise ValueError(f"specaug {name} must be >= 0, got {value}")
        self.num_freq_masks = num_freq_masks
        self.max_freq_mask_width = max_freq_mask_width
        self.max_freq_mask_ratio = max_freq_mask_ratio
        self.num_time_masks = num_time_masks
        self.max_time_mask_width = max_time_mask_width
        self.max_time_mask_ratio = max_time_mask_ratio
        self.max_time_warp = max_time_warp
        self.mask_value = mask_value
        self.start_batch = start_batch
        self.register_buffer("batches_seen", torch.zeros((), dtype=torch.long))
        # `batches_seen` as the host knows it: read from the (device) buffer once, then
        # counted here, so that the check of `start_batch` does not wait for the device.
        self._seen_on_host: int | None = None

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._seen_on_host = None  # the buffer is about to change: read it again
        super()._load_from_state_dict(*args, **kwargs)

    @staticmethod
    def _max_width(extent: torch.Tensor, width: int | None, ratio: float | None) -> torch.Tensor:
        bound = extent.clone()
        if width is not None:
            bound = torch.clamp(bound, max=float(width))
        if ratio is not None:
            bound = torch.minimum(bound, torch.floor(extent * ratio))
        return bound

    def time_warp(self, feats: torch.Tensor, feat_lens: torch.Tensor,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """Warp each utterance's valid frames around a random centre (no-op when disabled)."""
        window = self.max_time_warp
        if window == 0:
            return feats
        feats = feats.clone()
        draws = _draw((feats.size(0), 2), generator, torch.device("cpu"))
        for index, length in enumerate(feat_lens.tolist()):
            # The centre must leave `window` frames on each side to move within.
            if length <= 2 * window + 1:
                continue
            centre = window + int(draws[index, 0] * (length - 2 * window - 1)) + 1
            shift = int(draws[index, 1] * (2 * window + 1)) - window
            if shift == 0:
                continue
            valid = feats[index, :length].t().unsqueeze(0)  # [1, D, length]
            left = nn.functional.interpolate(valid[..., :centre], size=centre + shift,
                                             mode="linear", align_corners=False)
            right = nn.functional.interpolate(valid[..., centre:], size=length - centre - shift,
                                              mode="linear", align_corners=False)
            feats[index, :length] = torch.cat([left, right], dim=-1)[0].t()
        return feats

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor,
                generator: torch.Generator | None = None, views: int = 1) -> torch.Tensor:
        """Return an augmented copy of `feats` [B, T, D]; frames >= `feat_lens` are untouched.

        `views` > 1: [views x B, T, D], each utterance time-warped once and then `views`
        copies of it, each with masks of its own, stacked view-major (as icefall's CR-CTC
        warps before it duplicates the batch, so that the views' frames stay aligned); one
        batch for `start_batch`."""
        if views < 1:
            raise ValueError(f"specaug views must be >= 1, got {views}")
        self.batches_seen += 1
        if self.start_batch:
            self._seen_on_host = (int(self.batches_seen) if self._seen_on_host is None
                                  else self._seen_on_host + 1)
            if self._seen_on_host <= self.start_batch:
                return feats.repeat(views, 1, 1) if views > 1 else feats
        feats = self.time_warp(feats, feat_lens, generator)
        if views > 1:
            feats, feat_lens = feats.repeat(views, 1, 1), feat_lens.repeat(views)
        batch, time, dim = feats.shape
        lengths = feat_lens.to(device=feats.device, dtype=torch.float32, non_blocking=True)
        mask = torch.zeros(batch, time, dim, dtype=torch.bool, device=feats.device)
        if self.num_freq_masks > 0:
            extent = torch.full((batch,), float(dim), device=feats.device)
            max_width = self._max_width(extent, self.max_freq_mask_width, self.max_freq_mask_ratio)
            mask |= _mask_bands(extent, max_width, self.num_freq_masks, dim, generator)[:, None, :]
        if self.num_time_masks > 0:
            max_width = self._max_width(lengths, self.max_time_mask_width,
                                        self.max_time_mask_ratio)
            time_mask = _mask_bands(lengths, max_width, self.num_time_masks, time, generator)
            mask |= time_mask[:, :, None]
        valid = ~torch.arange(time, device=feats.device)[None, :].ge(lengths[:, None])
        mask &= valid[:, :, None]
        if self.mask_value == "zero":
            return feats.masked_fill(mask, 0.0)
        counts = lengths.clamp(min=1.0)[:, None, None]
        means = (feats * valid[:, :, None]).sum(dim=(1, 2), keepdim=True) / (counts * dim)
        return torch.where(mask, means.to(feats.dtype), feats)
