"""CR-CTC: consistency-regularised CTC (Yao et al. 2024, icefall's Zipformer CR-CTC).

A CTC head that trains on two views of every utterance: the model stacks two independently
SpecAugmented copies of the batch into one encoder call (the head's `views` = 2:
`cat.models.heads.ProgressHead`), the head gives each view's CTC loss and, per view, a
consistency loss: the KL divergence from the other view's frame posteriors, detached (a
target, no gradient through it), to its own, summed over its frames and classes::

    loss of an utterance = mean over views of (CTC + scale(step) x KL(other || this))
    scale(step) = cr_loss_scale x min(step / warmup_steps, 1)   (cr_loss_scale alone when
                                                                  warmup_steps is 0)

`step` is the optimizer updates done before the batch (the trainer hands it to the model).
In evaluation the model runs one view and the loss is CTC's. Decoding, streaming and export
are the CTC head's: the class is a `CTCHead` with the same parameters (a CR-CTC checkpoint
is a CTC model's).

config.json: the `ctc` section's `cr_ctc` (keys and defaults:
`cat/core/schemas/config.schema.json`, `$defs.ctc`), e.g.::

    "ctc": {"cr_ctc": {"cr_loss_scale": 0.2, "warmup_steps": 2000}}

icefall's defaults: `cr_loss_scale` 0.2, a linear warm-up over 2,000 batches, and more time
masking than without CR-CTC (its `time_mask_ratio` 2.5: 2.5 times the masks and 2.5 times
the largest masked fraction), which here is the `specaug` section's `num_time_masks` and
`max_time_mask_ratio` (each mask is still at most `max_time_mask_width` frames).
"""

from __future__ import annotations

from typing import Any

import torch

from cat.ctc.head import CTCHead, ctc_losses
from cat.models.heads import Progress


def consistency_losses(log_probs: torch.Tensor, lengths: torch.Tensor,
                       views: int) -> torch.Tensor:
    """Per-row consistency losses [views x B] of frame log-probabilities [views x B, T', V]
    stacked view-major: row r's KL divergence from the detached posteriors of the same
    utterance's next view (the other one of two) to its own, summed over its `lengths[r]`
    frames and the classes."""
    rows = log_probs.size(0)
    if views < 2 or rows % views:
        raise ValueError(f"consistency needs >= 2 views stacked in the batch; got {views} "
                         f"views of {rows} rows")
    target = torch.roll(log_probs.detach(), shifts=rows // views, dims=0)
    divergence = torch.nn.functional.kl_div(log_probs, target, reduction="none",
                                            log_target=True)
    padding = (torch.arange(log_probs.size(1), device=log_probs.device)[None, :]
               >= lengths.to(log_probs.device)[:, None])
    return divergence.masked_fill(padding[:, :, None], 0.0).sum(dim=(1, 2))


class CRCTCHead(CTCHead):
    """A CTC head with CR-CTC's consistency loss (see the module docstring): a
    `ProgressHead` of two views."""

    views = 2

    def __init__(self, input_dim: int, num_classes: int, dropout: float = 0.0,
                 blank_init_prob: float = 0.5, cr_loss_scale: float = 0.2,
                 warmup_steps: int = 0) -> None:
        if cr_loss_scale < 0 or warmup_steps < 0:
            raise ValueError(f"ctc.cr_ctc: cr_loss_scale and warmup_steps must be >= 0, got "
                             f"{cr_loss_scale} and {warmup_steps}")
        super().__init__(input_dim, num_classes, dropout, blank_init_prob)
        self.cr_loss_scale = cr_loss_scale
        self.warmup_steps = warmup_steps

    def scale_at(self, step: int) -> float:
        """The consistency loss's scale after `step` updates (the linear warm-up)."""
        if self.warmup_steps == 0:
            return self.cr_loss_scale
        return self.cr_loss_scale * min(step / self.warmup_steps, 1.0)

    def progress_losses(self, hidden: torch.Tensor, lengths: torch.Tensor,
                        labels: torch.Tensor, label_lens: torch.Tensor, progress: Progress
                        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Per-row CTC plus scaled consistency losses of the stacked views, which rows are
        infeasible, and `cr_loss_sum` (the unscaled consistency summed per utterance,
        averaged over views); one view (evaluation): CTC alone."""
        log_probs = self.log_probs(hidden)
        losses, infeasible = ctc_losses(log_probs, lengths, labels, label_lens)
        if progress.views == 1:
            return losses, infeasible, {}
        consistency = consistency_losses(log_probs, lengths, progress.views)
        stats = {"cr_loss_sum": consistency.detach().sum() / progress.views}
        return losses + self.scale_at(progress.step) * consistency, infeasible, stats


def build_head(config: dict[str, Any], encoder_dim: int, num_classes: int,
               source: str = "config.json") -> tuple[CRCTCHead, float | None]:
    """The CR-CTC head of `config`'s `ctc` section (with its `cr_ctc`) and its loss weight,
    as `cat.ctc.head.build_head` gives a CTC head's."""
    section = dict(config["ctc"])
    weight = section.pop("weight", None)
    return CRCTCHead(encoder_dim, num_classes, **section.pop("cr_ctc"), **section), weight
