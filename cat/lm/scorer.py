"""kenlm-backed scorers: token-level shallow fusion (with LODR) and word-level rescoring.

Scores are natural logarithms (kenlm returns log10; they are converted), so they add to
the acoustic log-probabilities of the searches.

* `ShallowFusion` scores a hypothesis token by token during beam search:
  `alpha * log p_LM(token | history) - lodr_weight * log p_LODR(token | history) + beta`,
  and `alpha * log p_LM(</s> | history) - lodr_weight * log p_LODR(</s> | history)` at the
  end. The LODR model (Zheng et al., 2022: low-order density ratio) is a low-order n-gram
  of the training transcripts standing for the acoustic model's internal LM, which is
  subtracted. States are opaque; the searches cache them per prefix.
* `WordRescorer` scores whole hypotheses with a word (or any unit) n-gram:
  `alpha * log p_LM(words </s>) + beta * len(words)`.
* `CombinedFusion` scores with several `Fusion`s at once (e.g. an LM and the hotwords of
  `cat.decoding.context_graph`): its scores are the sums of theirs, its states the
  tuples of theirs.

Usage:
    lm = TokenLM("exp/lm-char-5gram/lm.arpa", [tokenizer.id_to_piece(i) for i in ...])
    fusion = ShallowFusion(lm, alpha=0.3, beta=0.5)
    state = fusion.initial_state()
    score, state = fusion.step(state, token_id)
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any, Protocol

from cat.core.io import PathLike
from cat.lm.text import Splitter

LN10 = math.log(10.0)


def load_kenlm(path: PathLike) -> Any:
    """A `kenlm.Model` from an ARPA or kenlm binary file, with a clear error when missing."""
    import kenlm

    if not os.path.isfile(path):
        raise FileNotFoundError(f"language model {path} does not exist (train it first: "
                                "python -m cat.stages.driver lm <exp>, or run.sh stage 5)")
    return kenlm.Model(str(path))


class Fusion(Protocol):
    """What the beam searches need from a language model (`ShallowFusion` is one)."""

    def initial_state(self) -> Any: ...

    def step(self, state: Any, token: int) -> tuple[float, Any]: ...

    def final(self, state: Any) -> float: ...


def sequence_score(fusion: Fusion, tokens: Sequence[int]) -> float:
    """The score `fusion` gives a whole token sequence, its end included (what a beam
    search adds up step by step, for a hypothesis ranked again after the search)."""
    state, total = fusion.initial_state(), 0.0
    for token in tokens:
        delta, state = fusion.step(state, token)
        total += delta
    return total + fusion.final(state)


class CombinedFusion:
    """Several fusions as one: each score is the sum of theirs, each state the tuple of
    theirs (in the order of `parts`)."""

    def __init__(self, parts: Sequence[Fusion]) -> None:
        self.parts = tuple(parts)

    def initial_state(self) -> tuple[Any, ...]:
        return tuple(part.initial_state() for part in self.parts)

    def step(self, state: tuple[Any, ...], token: int) -> tuple[float, tuple[Any, ...]]:
        """(summed score of emitting `token`, the parts' next states)."""
        total = 0.0
        states = []
        for part, part_state in zip(self.parts, state, strict=True):
            score, next_state = part.step(part_state, token)
            total += score
            states.append(next_state)
        return total, tuple(states)

    def final(self, state: tuple[Any, ...]) -> float:
        """Summed score of ending the sentence after `state`."""
        return sum(part.final(part_state)
                   for part, part_state in zip(self.parts, state, strict=True))


class TokenLM:
    """A kenlm model over the ASR tokenizer's pieces; `pieces[i]` is the string of id i."""

    def __init__(self, path: PathLike, pieces: Sequence[str]) -> None:
        import kenlm

        self.path = str(path)
        self.model = load_kenlm(path)
        self.order = self.model.order
        self._kenlm = kenlm
        self.pieces = list(pieces)

    def initial_state(self) -> Any:
        state = self._kenlm.State()
        self.model.BeginSentenceWrite(state)
        return state

    def step(self, state: Any, token: int) -> tuple[float, Any]:
        """(ln p(token | state), next state)."""
        out = self._kenlm.State()
        log10 = self.model.BaseScore(state, self.pieces[token], out)
        return log10 * LN10, out

    def final(self, state: Any) -> float:
        """ln p(</s> | state)."""
        return self.model.BaseScore(state, "</s>", self._kenlm.State()) * LN10


@dataclasses.dataclass
class ShallowFusion:
    """Weighted token LM (and LODR) scores for the beam searches; see the module doc."""

    lm: TokenLM
    alpha: float
    beta: float = 0.0
    lodr: TokenLM | None = None
    lodr_weight: float = 0.0

    def initial_state(self) -> tuple[Any, Any]:
        return (self.lm.initial_state(),
                self.lodr.initial_state() if self.lodr is not None else None)

    def step(self, state: tuple[Any, Any], token: int) -> tuple[float, tuple[Any, Any]]:
        """(weighted score of emitting `token`, next state)."""
        lm_score, lm_state = self.lm.step(state[0], token)
        score = self.alpha * lm_score + self.beta
        lodr_state = None
        if self.lodr is not None:
            lodr_score, lodr_state = self.lodr.step(state[1], token)
            score -= self.lodr_weight * lodr_score
        return score, (lm_state, lodr_state)

    def final(self, state: tuple[Any, Any]) -> float:
        """Weighted score of ending the sentence after `state`."""
        score = self.alpha * self.lm.final(state[0])
        if self.lodr is not None:
            score -= self.lodr_weight * self.lodr.final(state[1])
        return score


class WordRescorer:
    """Whole-hypothesis scores of an n-gram over `split(text)` units (jieba words)."""

    def __init__(self, path: PathLike, split: Splitter) -> None:
        self.model = load_kenlm(path)
        self.split = split

    def score(self, text: str) -> tuple[float, int]:
        """(ln p(units </s>), number of units) of a hypothesis."""
        units = self.split(text)
        return self.model.score(" ".join(units), bos=True, eos=True) * LN10, len(units)
