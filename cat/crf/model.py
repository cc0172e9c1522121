"""The CTC-CRF head: the CTC head trained with the CRF loss.

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
head's; WFST decoding with TLG is `cat.decoding.wfst`. The head's parameters are the CTC
head's (`ctc.*` in the state dict).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cat.core.config import ConfigError
from cat.crf.loss import CtcCrfLoss
from cat.ctc.head import CTCHead
from cat.graph.denominator import load_den_graph

#: `trainer` keys the head reads (the others: the loss normalisation, CUSIDE's, and those
#: of stage 2's denominator graph).
HEAD_KEYS = ("den_lm", "lamb")


class CRFHead(CTCHead):
    """`CTCHead` with the CTC-CRF loss (see the module docstring)."""

    stat_name = "crf"

    def __init__(self, input_dim: int, num_classes: int, dropout: float = 0.0,
                 blank_init_prob: float = 0.5, den_lm: str = "", lamb: float = 0.01) -> None:
        super().__init__(input_dim, num_classes, dropout, blank_init_prob)
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

    def losses(self, hidden: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
               label_lens: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Per-utterance CTC-CRF losses, which utterances are infeasible, no stats."""
        if self._loss is None:
            self.prepare_training()
        log_probs = self.log_probs(hidden)
        with torch.autocast(device_type=log_probs.device.type, enabled=False):
            losses, infeasible = self._loss(log_probs.float(), lengths, labels, label_lens)
        return losses, infeasible, {}


def build_head(config: dict[str, Any], encoder_dim: int, num_classes: int,
               source: str = "config.json") -> tuple[CRFHead, float | None]:
    """The CTC-CRF head of `config` (`ctc` and `trainer` sections), alone in its model."""
    if "attention" in config:
        raise ConfigError(f"{source}: attention: an attention decoder is trained with CTC "
                          f"(U2), not with the CTC-CRF loss; remove it or trainer.use_crf")
    trainer = {k: v for k, v in config.get("trainer", {}).items() if k in HEAD_KEYS}
    return CRFHead(encoder_dim, num_classes, **config["ctc"], **trainer), None
