"""Endpointing: when a pause (or the length) ends an utterance, sherpa-onnx's three rules.

Each rule holds when the trailing silence (the decoded frames after the last token, blank
on the best path; all of them before any token) lasts at least `min_trailing_silence`
seconds and the utterance at least `min_utterance_length`, and, with
`must_contain_nonsilence`, a token has been decoded. sherpa-onnx's defaults (its
`EndpointConfig`), also this server's:

1. 2.4 s of silence, tokens or not (a long pause: nothing was said, the state is freed);
2. 1.2 s of silence after a token (the end of a sentence);
3. 20 s of utterance, whatever its silence (no utterance grows without bound).

Usage:
    rules = EndpointRules()
    if rules.detect(trailing_silence=1.3, utterance_length=4.0, has_tokens=True): ...
"""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass(frozen=True)
class EndpointRule:
    """One rule (see the module docstring)."""

    must_contain_nonsilence: bool
    min_trailing_silence: float
    min_utterance_length: float

    def holds(self, trailing_silence: float, utterance_length: float, has_tokens: bool
              ) -> bool:
        return ((has_tokens or not self.must_contain_nonsilence)
                and trailing_silence >= self.min_trailing_silence
                and utterance_length >= self.min_utterance_length)


@dataclasses.dataclass(frozen=True)
class EndpointRules:
    """sherpa-onnx's three rules, with its defaults."""

    rule1: EndpointRule = EndpointRule(False, 2.4, 0.0)
    rule2: EndpointRule = EndpointRule(True, 1.2, 0.0)
    rule3: EndpointRule = EndpointRule(False, 0.0, 20.0)

    def __post_init__(self) -> None:
        if self.rule3.min_utterance_length <= 0:
            raise ValueError("rule 3's minimum utterance length must be positive: it bounds "
                             "the state of an utterance")

    def detect(self, trailing_silence: float, utterance_length: float,
               has_tokens: bool) -> bool:
        """Whether any rule holds."""
        return any(rule.holds(trailing_silence, utterance_length, has_tokens)
                   for rule in (self.rule1, self.rule2, self.rule3))

    @property
    def max_utterance_seconds(self) -> float:
        """The longest an utterance gets (rule 3)."""
        return self.rule3.min_utterance_length

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EndpointRules:
        """The rules of `add_arguments`' options."""
        return cls(EndpointRule(False, args.rule1_min_trailing_silence, 0.0),
                   EndpointRule(True, args.rule2_min_trailing_silence, 0.0),
                   EndpointRule(False, 0.0, args.rule3_min_utterance_length))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The rules' options, by sherpa-onnx's names."""
    defaults = EndpointRules()
    parser.add_argument("--rule1-min-trailing-silence", type=float,
                        default=defaults.rule1.min_trailing_silence,
                        help="endpoint after this much silence, tokens or not (seconds)")
    parser.add_argument("--rule2-min-trailing-silence", type=float,
                        default=defaults.rule2.min_trailing_silence,
                        help="endpoint after this much silence following a token (seconds)")
    parser.add_argument("--rule3-min-utterance-length", type=float,
                        default=defaults.rule3.min_utterance_length,
                        help="endpoint when an utterance is this long (seconds)")
