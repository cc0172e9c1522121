"""Endpoint rules (`cat.serving.endpoint`): sherpa-onnx's three rules and their options."""

from __future__ import annotations

import argparse

import pytest

from cat.serving.endpoint import EndpointRule, EndpointRules, add_arguments


@pytest.mark.parametrize(("silence", "length", "tokens", "expected"), [
    (2.4, 3.0, False, True),    # rule 1: a long pause, nothing said
    (2.3, 3.0, False, False),
    (1.2, 3.0, True, True),     # rule 2: a pause after a token
    (1.19, 3.0, True, False),
    (1.5, 3.0, False, False),   # rule 2 needs a token
    (0.0, 20.0, True, True),    # rule 3: the longest utterance
    (0.0, 19.9, False, False),
])
def test_sherpa_onnx_default_rules(silence, length, tokens, expected):
    assert EndpointRules().detect(silence, length, tokens) is expected


def test_rules_from_the_command_line():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rules = EndpointRules.from_args(parser.parse_args(
        ["--rule1-min-trailing-silence", "5", "--rule2-min-trailing-silence", "0.5",
         "--rule3-min-utterance-length", "8"]))
    assert rules == EndpointRules(EndpointRule(False, 5.0, 0.0), EndpointRule(True, 0.5, 0.0),
                                  EndpointRule(False, 0.0, 8.0))
    assert rules.max_utterance_seconds == 8.0
    assert EndpointRules.from_args(parser.parse_args([])) == EndpointRules()
    with pytest.raises(ValueError, match="rule 3's minimum utterance length must be positive"):
        EndpointRules.from_args(parser.parse_args(["--rule3-min-utterance-length", "0"]))
