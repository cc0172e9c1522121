"""Hotwords (contextual biasing): phrases the beam searches favour, as a `Fusion`.

`ContextGraph(phrases)` takes `(tokens, score)` pairs: a phrase's token ids and its score
per token; its bonus is `len(tokens) * score`. It is an Aho-Corasick automaton over the
phrases (the ContextGraph of WeNet, icefall and sherpa-onnx) and a
`cat.lm.scorer.Fusion`, so `ctc_prefix_beam_search` and `rnnt_modified_beam_search` take
it as they take a language model, alone or with one (`cat.lm.scorer.CombinedFusion`).

States are node ids of a trie of the phrases; node 0 (the root) is the empty match. The
state after a token sequence is the node of its longest suffix that begins a phrase,
except that a node where a phrase ends and which no phrase continues gives way to its
failure node (the longest proper suffix that begins a phrase): a full match restarts
matching. Each node holds:

* `pending`: the provisional bonus of the partial match it stands for, the score of each
  of its tokens summed (a token shared by phrases with different scores has the largest);
* `output`: the bonus of every phrase ending with its last token: its own, and those of
  the nodes on its failure arcs.

`step(state, token)` moves along the child arc for `token`, else along failure arcs
until a node has one (else to the root), to a node `n`, and scores
`output[n] + pending[after(n)] - pending[state]`; `final(state)` is `-pending[state]`.
So, over a token sequence, the steps add up to the bonus of every occurrence of a phrase
in it (overlapping ones included) plus the pending bonus of the partial match at its end,
and `final` takes that back:

* each token that continues a match gives its score (a lone phrase: `score` per token);
* a partial match that fails gives back what it gave, down to the pending bonus of the
  suffix the failure arc leads to (its node's minus the fail node's);
* a hypothesis that ends in a partial match gives its bonus back;
* a complete match keeps its bonus.

An empty graph (no phrase) scores 0 everywhere.

`read_hotwords(path, tokenizer, default_score)` reads a hotwords file (sherpa-onnx's
format, the phrases as text): one phrase per line, blank lines ignored, an optional
trailing ` :<score>` (per token) overriding `default_score`. A score that is not a
number, or that gives its phrase a bonus (score times tokens) beyond `MAX_PHRASE_BONUS`,
is a `HotwordsError` naming the file and line; a phrase the tokenizer cannot spell (its
ids contain `<unk>`) is skipped, counted and named in a warning; a phrase listed twice
keeps its larger score.

Usage:
    graph, report = read_hotwords("hotwords.txt", tokenizer, default_score=1.5)
    nbest = ctc_prefix_beam_search(log_probs, lengths, beam_size=10, fusion=graph)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from cat.core.io import PathLike
from cat.text.tokenizer import UNK_ID, Tokenizer

logger = logging.getLogger(__name__)

ROOT = 0
#: Skipped phrases a warning names (the rest are counted).
NAMED_SKIPPED = 20
#: The largest bonus (or penalty) of one phrase, its score per token times its tokens, in
#: log probability: far beyond any useful one (sherpa-onnx's default is 1.5 per token),
#: and small enough that the bonuses a hypothesis gathers stay finite numbers. A larger
#: one would outweigh every acoustic score (or, past 1.8e308, overflow to infinity and
#: turn every hypothesis into garbage).
MAX_PHRASE_BONUS = 1000.0


class HotwordsError(ValueError):
    """A hotwords file is malformed; the message names the file and line."""


class ContextGraph:
    """Aho-Corasick automaton of hotword phrases scored as a `Fusion` (see the module doc)."""

    def __init__(self, phrases: Sequence[tuple[Sequence[int], float]]) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.parent = [ROOT]
        self.token_score = [0.0]
        bonus: dict[int, float] = {}
        for tokens, score in phrases:
            _check_phrase(tokens, score)
            node = ROOT
            for token in tokens:
                node = self._child(node, int(token), float(score))
            bonus[node] = max(bonus.get(node, -math.inf), len(tokens) * float(score))
        self.num_phrases = len(bonus)
        self.fail = [ROOT] * self.num_nodes
        self.pending = [0.0] * self.num_nodes
        self.output = [0.0] * self.num_nodes
        self.after = list(range(self.num_nodes))
        for node in self._breadth_first():  # a failure arc leads to an earlier node
            self.pending[node] = self.pending[self.parent[node]] + self.token_score[node]
            self.output[node] = bonus.get(node, 0.0) + self.output[self.fail[node]]
            if not self.children[node]:
                self.after[node] = self.after[self.fail[node]]

    def _child(self, node: int, token: int, score: float) -> int:
        """The child of `node` for `token`, made if missing; its token score is the largest
        of the phrases through it."""
        child = self.children[node].get(token)
        if child is None:
            child = len(self.children)
            self.children[node][token] = child
            self.children.append({})
            self.parent.append(node)
            self.token_score.append(score)
        else:
            self.token_score[child] = max(self.token_score[child], score)
        return child

    def _breadth_first(self) -> list[int]:
        """The nodes but the root, breadth first, setting each one's failure arc."""
        order: list[int] = []
        queue = collections.deque(self.children[ROOT].values())
        while queue:
            node = queue.popleft()
            order.append(node)
            for token, child in self.children[node].items():
                self.fail[child] = ROOT if node == ROOT else self._goto(self.fail[node], token)
                queue.append(child)
        return order

    def _goto(self, node: int, token: int) -> int:
        """The node reached from `node` by `token`: its child, else its failure node's, and
        so on; the root when no suffix matches."""
        while True:
            child = self.children[node].get(token)
            if child is not None:
                return child
            if node == ROOT:
                return ROOT
            node = self.fail[node]

    @property
    def num_nodes(self) -> int:
        return len(self.children)

    def initial_state(self) -> int:
        return ROOT

    def step(self, state: int, token: int) -> tuple[float, int]:
        """(bonus of emitting `token` after `state`, next state); see the module doc."""
        reached = self._goto(state, token)
        new_state = self.after[reached]
        return self.output[reached] + self.pending[new_state] - self.pending[state], new_state

    def final(self, state: int) -> float:
        """The pending bonus of the partial match at the end of a hypothesis, taken back."""
        return -self.pending[state]


def _check_phrase(tokens: Sequence[int], score: float) -> None:
    if len(tokens) == 0:
        raise ValueError("a hotword phrase needs at least one token")
    if not math.isfinite(score):
        raise ValueError(f"a hotword score must be a finite number, got {score!r}")
    problem = bonus_problem(len(tokens), score)
    if problem:
        raise ValueError(problem)


def bonus_problem(num_tokens: int, score: float) -> str | None:
    """Why a phrase of `num_tokens` tokens cannot have `score` per token (its bonus past
    `MAX_PHRASE_BONUS`), or None."""
    bonus = num_tokens * score
    if math.isfinite(bonus) and abs(bonus) <= MAX_PHRASE_BONUS:
        return None
    return (f"a phrase of {num_tokens} token(s) at {score:g} per token gets a bonus of "
            f"{bonus:g}, beyond ±{MAX_PHRASE_BONUS:g} (log probability); give it a score "
            f"per token of at most {MAX_PHRASE_BONUS / num_tokens:g} in absolute value")


@dataclasses.dataclass(frozen=True)
class HotwordsReport:
    """What `read_hotwords` made of a file: phrases used, and those skipped as
    `(line number, phrase)`."""

    path: str
    num_used: int
    skipped: tuple[tuple[int, str], ...]

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)


def parse_hotword_line(line: str, default_score: float, where: str) -> tuple[str, float] | None:
    """(phrase, score per token) of a hotwords line, None for a blank one; `where` names the
    line in errors (`file:line`)."""
    fields = line.split()
    if not fields:
        return None
    score = default_score
    if fields[-1].startswith(":"):
        text = fields[-1][1:]
        try:
            score = float(text)
        except ValueError:
            score = math.nan
        if not math.isfinite(score):
            raise HotwordsError(f"{where}: the score after ':' must be a number, got {text!r}")
        fields = fields[:-1]
        if not fields:
            raise HotwordsError(f"{where}: a score without a phrase")
    return " ".join(fields), score


def read_hotwords(path: PathLike, tokenizer: Tokenizer, default_score: float
                  ) -> tuple[ContextGraph, HotwordsReport]:
    """The context graph of a hotwords file and what was used of it (see the module doc)."""
    phrases, report = read_hotword_phrases(path, tokenizer, default_score)
    return ContextGraph([(tokens, score) for _, tokens, score in phrases]), report


def read_hotword_phrases(path: PathLike, tokenizer: Tokenizer, default_score: float
                         ) -> tuple[list[tuple[str, list[int], float]], HotwordsReport]:
    """The phrases of a hotwords file as (text, token ids, score per token), and what was
    used of it (see the module doc; the warnings are logged here)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise HotwordsError(f"{path}: not UTF-8 text ({error.reason} at byte "
                            f"{error.start})") from None
    phrases: list[tuple[str, list[int], float]] = []
    skipped: list[tuple[int, str]] = []
    for number, line in enumerate(lines, start=1):
        parsed = parse_hotword_line(line, default_score, f"{path}:{number}")
        if parsed is None:
            continue
        text, score = parsed
        tokens = tokenizer.encode(text)
        if not tokens or UNK_ID in tokens:
            skipped.append((number, text))
            continue
        problem = bonus_problem(len(tokens), score)
        if problem:
            given = "" if line.split()[-1].startswith(":") else " (the default score)"
            raise HotwordsError(f"{path}:{number}: {text!r}{given}: {problem}")
        phrases.append((text, tokens, score))
    report = HotwordsReport(str(path), len(phrases), tuple(skipped))
    _log_report(report)
    return phrases, report


def _log_report(report: HotwordsReport) -> None:
    if report.skipped:
        named = ", ".join(f"line {number} {text!r}"
                          for number, text in report.skipped[:NAMED_SKIPPED])
        more = (f" and {report.num_skipped - NAMED_SKIPPED} more"
                if report.num_skipped > NAMED_SKIPPED else "")
        logger.warning("%s: skipped %d hotword phrase(s) the tokenizer cannot spell (<unk>): "
                       "%s%s", report.path, report.num_skipped, named, more)
    if report.num_used == 0:
        logger.warning("%s: no usable hotword phrase; decoding as without hotwords",
                       report.path)
    else:
        logger.info("%s: %d hotword phrase(s)", report.path, report.num_used)
