"""Token and word times of a hypothesis: where on the encoder frames each token was spoken.

A model whose first head can align hypotheses to the encoder frames (a `TokenAligner`)
gives each token's frame span and log-probability on the best alignment of that hypothesis;
the spans and the `TokenAligner` protocol are `cat.models.spans`' (below the model
families, which give them), re-exported here.

Aligning the chosen hypothesis after the search, rather than tracking frames inside each
search, gives every method the same definition (greedy, beam, hotwords, attention and
joint rescoring, whose best hypothesis may come from another head's list).

`token_times` turns spans into seconds: encoder frame `t` starts at
`t * frame_rate_factor * FRAME_SHIFT_SECONDS` (10 ms feature frames, `frame_rate_factor`
the encoder's subsampling); a token lasts from the start of its first frame to the end of
its last and on until the next token starts, `TOKEN_TAIL_SECONDS` at most (and never
past the utterance's end); tokens emitted on the same frame share it in equal parts, so
that times never decrease and tokens never overlap. `group_words` joins SentencePiece
pieces into the words they spell (a piece starting with `▁` starts a word) and keeps each
CJK character a word of its own (the unit of a character error rate), with the time span
of its tokens.

Usage:
    spans = model.first_head.token_frames(*model.search_inputs(feats, feat_lens), hyps)
    times = token_times(spans[0], model.encoder.frame_rate_factor, pieces)
    words = group_words(times)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import unicodedata
from collections.abc import Sequence

from cat.models.spans import Span as Span
from cat.models.spans import TokenAligner as TokenAligner

#: Seconds per feature frame (stage 1's 10 ms shift).
FRAME_SHIFT_SECONDS = 0.01
#: How long a token lasts past its last frame, unless the next token starts sooner: a CTC
#: spike or a transducer's emission frame marks where a token is recognised, not how long
#: it is spoken. 160 ms gave the smallest word boundary error on the synthetic AISHELL-1
#: dev alignment set (`cat.data.alignment`), for the CTC and the transducer models alike.
TOKEN_TAIL_SECONDS = 0.16
#: SentencePiece's word-start mark.
WORD_START = "\u2581"


@dataclasses.dataclass(frozen=True)
class TimedUnit:
    """A token or a word with its time span in seconds (from the utterance's start) and
    its confidence (the probability of its best frame, in [0, 1])."""

    text: str
    start: float
    end: float
    confidence: float


def token_times(spans: Sequence[Span], frame_rate_factor: int,
                pieces: Sequence[str] | None = None,
                duration: float | None = None) -> list[TimedUnit]:
    """`spans` in seconds (see the module doc); `pieces`: the tokens' text (default '');
    `duration`: the utterance's seconds, which no token passes."""
    frame = frame_rate_factor * FRAME_SHIFT_SECONDS
    pieces = pieces if pieces is not None else [""] * len(spans)
    units: list[TimedUnit] = []
    for (first, last), group in itertools.groupby(
            zip(spans, pieces, strict=True), key=lambda item: item[0][:2]):
        shared = list(group)
        # Tokens a transducer emits on one frame share it, in order.
        step = (last + 1 - first) * frame / len(shared)
        for index, ((_, _, score), piece) in enumerate(shared):
            units.append(TimedUnit(piece, round(first * frame + index * step, 3),
                                   round(first * frame + (index + 1) * step, 3),
                                   math.exp(min(score, 0.0))))
    limit = math.inf if duration is None else duration
    for index, unit in enumerate(units):
        following = units[index + 1].start if index + 1 < len(units) else limit
        end = min(max(unit.end, min(following, unit.end + TOKEN_TAIL_SECONDS)), limit)
        units[index] = dataclasses.replace(unit, start=min(unit.start, end),
                                           end=round(end, 3))
    return units


def _is_cjk(text: str) -> bool:
    return bool(text) and all(unicodedata.name(char, "").startswith(("CJK", "HANGUL",
                                                                     "HIRAGANA", "KATAKANA"))
                              for char in text)


def group_words(tokens: Sequence[TimedUnit]) -> list[TimedUnit]:
    """Words of timed pieces (see the module doc): each word spans its pieces, its
    confidence is the lowest of theirs. A piece that spells nothing (a lone `▁`) ends the
    word before it."""
    words: list[TimedUnit] = []
    pending: TimedUnit | None = None  # the word being built
    joinable = False  # the next piece may join `pending`
    for token in tokens:
        starts = token.text.startswith(WORD_START)
        text = token.text.replace(WORD_START, "")
        if not text:
            if pending is not None:
                words.append(pending)
            pending, joinable = None, False
            continue
        cjk = _is_cjk(text)
        if pending is not None and joinable and not starts and not cjk:
            pending = TimedUnit(pending.text + text, pending.start, token.end,
                                min(pending.confidence, token.confidence))
            continue
        if pending is not None:
            words.append(pending)
        pending, joinable = TimedUnit(text, token.start, token.end, token.confidence), not cjk
    if pending is not None:
        words.append(pending)
    return words
