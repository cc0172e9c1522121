"""CTC-CRF acoustic model: the CTC model's encoder and head, trained with the CRF loss.

config.json (as CAT names the keys)::

    "ctc":     {"dropout": 0.0},
    "trainer": {"use_crf": true, "den_lm": "exp/crf-v1/den_lm.npz"}   # lamb: 0.01 (schema)

`den_lm` (relative to the recipe directory) is the denominator graph stage 2 builds
(`cat.graph.den_graph`). It is read when training starts (`prepare_training`, which checks it
belongs to the run's tokenizer) or on the first loss; decoding does not need it. The loss
runs in float32 even under autocast. An utterance without a path through its numerator
graph or the denominator (`CtcCrfLoss`'s `infeasible`) gets loss 0 and no gradient; the
trainer counts them per epoch (`infeasible` in `log/epoch-<EEE>.json` and
`log/coverage.jsonl`, and a warning). Decoding (greedy, prefix beam, LM fusion) is the CTC
model's; WFST decoding with TLG is `cat.decoding.wfst`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from cat.core.config import ConfigError
from cat.crf.loss import CtcCrfLoss
from cat.ctc.model import CTCModel
from cat.graph.denominator import load_den_graph
from cat.models.heads import batch_loss, encode_batch
from cat.models.specaug import SpecAugment


class CRFModel(CTCModel):
    """`CTCModel` with the CTC-CRF loss (see the module docstring)."""

    def __init__(self, encoder: nn.Module, num_classes: int, specaug: SpecAugment | None = None,
                 dropout: float = 0.0, loss_normalization: str = "utterance",
                 blank_init_prob: float = 0.5, den_lm: str = "", lamb: float = 0.01) -> None:
        super().__init__(encoder, num_classes, specaug, dropout, loss_normalization,
                         blank_init_prob)
        if not den_lm:
            raise ValueError("trainer.den_lm: a CTC-CRF model needs its denominator graph")
        if lamb < 0:
            raise ValueError(f"trainer.lamb must be >= 0, got {lamb}")
        self.den_lm = den_lm
        self.lamb = float(lamb)
        self._loss: CtcCrfLoss | None = None

    def prepare_training(self, units: Sequence[str] | None = None) -> None:
        """Read the denominator graph, checked against the vocabulary (and the tokenizer's
        pieces when given); raises DenGraphError naming the file."""
        graph = load_den_graph(self.den_lm, self.num_classes, units)
        self._loss = CtcCrfLoss(graph, self.lamb)

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (normalised loss, stats) as `CTCModel.forward` does."""
        if self._loss is None:
            self.prepare_training()
        hidden, lengths, labels, label_lens = encode_batch(self, feats, feat_lens, labels,
                                                           label_lens)
        log_probs = self.ctc_log_probs(hidden)
        with torch.autocast(device_type=log_probs.device.type, enabled=False):
            losses, infeasible = self._loss(log_probs.float(), lengths, labels, label_lens)
        return batch_loss(losses, labels, label_lens, lengths, infeasible,
                          self.loss_normalization)


def build_model(config: dict[str, Any], encoder: nn.Module, num_classes: int,
                specaug: SpecAugment | None, source: str = "config.json") -> CRFModel:
    """The CTC-CRF model of `config` (`ctc` and `trainer` sections) around `encoder`."""
    trainer = {k: v for k, v in config.get("trainer", {}).items()
               if k not in ("use_crf", "den_lm_order", "den_lm_extra_states",
                            "den_lm_estimator")}  # stage 2's
    if "attention" in config:
        raise ConfigError(f"{source}: attention: an attention decoder is trained with CTC "
                          f"(U2), not with the CTC-CRF loss; remove it or trainer.use_crf")
    try:
        return CRFModel(encoder, num_classes, specaug, **{**config["ctc"], **trainer})
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None
