"""What a CTC-CRF model needs before training, stage 2's hook for the family
(`cat.models.registry.before_training`): the denominator graph `trainer.den_lm` from the
training transcripts.

The token n-gram's settings are `trainer.den_lm_order`, `den_lm_extra_states` and
`den_lm_estimator`, with the defaults the config.json schema gives them
(`cat.core.config.schema_defaults`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cat.core.config import schema_defaults
from cat.core.io import PathLike
from cat.core.stages import is_done, mark_done, signature

logger = logging.getLogger(__name__)


def den_graph_options(trainer: dict[str, Any]) -> dict[str, Any]:
    """`build_for_tokenizer`'s order, extra_states and estimator from the `trainer` section,
    the schema's defaults for the keys it leaves out."""
    settings = {**schema_defaults("trainer"), **trainer}
    return {"order": int(settings["den_lm_order"]),
            "extra_states": int(settings["den_lm_extra_states"]),
            "estimator": settings["den_lm_estimator"]}


def prepare(config: dict[str, Any], train_texts: Sequence[PathLike],
            tokenizer: PathLike) -> None:
    """Build `trainer.den_lm` of `config` (a CTC-CRF config.json) from the transcripts
    `train_texts` with the tokenizer file `tokenizer`; skipped when it is up to date (the
    same settings, transcripts and tokenizer)."""
    from cat.graph.den_graph import build_for_tokenizer

    trainer = config.get("trainer", {})
    out = Path(trainer["den_lm"])
    texts = [Path(text) for text in train_texts]
    options = den_graph_options(trainer)
    sig = signature("den_lm", options["order"], options["extra_states"], options["estimator"],
                    files=[*texts, Path(tokenizer)])
    if is_done(out, sig):
        logger.info("%s is up to date", out)
        return
    build_for_tokenizer(tokenizer, texts, out, **options)
    mark_done(out, sig)
