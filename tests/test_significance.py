"""Tests of the paired-bootstrap comparison of two systems."""

from __future__ import annotations

import pytest

from cat.scoring import score
from cat.significance import compare, main, utterance_errors

REFS = {f"u{i:03d}": "今天天气很好我们去公园" for i in range(200)}


def with_errors(every: int) -> dict[str, str]:
    """Hypotheses with one substitution in every `every`-th utterance."""
    return {utt: ("昨" + ref[1:]) if i % every == 0 else ref
            for i, (utt, ref) in enumerate(sorted(REFS.items()))}


def test_whole_set_rates_are_the_scorer_s():
    hyps_a, hyps_b = with_errors(2), with_errors(5)
    result = compare(REFS, hyps_a, hyps_b, samples=200)
    assert result.a.value == pytest.approx(score(REFS, hyps_a).error_rate)
    assert result.b.value == pytest.approx(score(REFS, hyps_b).error_rate)
    assert result.delta.value == pytest.approx(result.b.value - result.a.value)
    for interval in (result.a, result.b, result.delta):
        assert interval.low <= interval.value <= interval.high


def test_a_clearly_better_system_wins_every_resample_and_identical_ones_tie():
    clear = compare(REFS, with_errors(2), with_errors(20), samples=300)
    assert clear.b_better == 1.0 and clear.delta.high < 0
    same = compare(REFS, with_errors(4), with_errors(4), samples=300)
    assert same.b_better == 0.0
    assert (same.delta.low, same.delta.high) == (0.0, 0.0)


def test_resampling_is_paired_and_seeded():
    # B is A with one more error: resampled together, the difference varies far less than
    # either system's rate (unpaired resamples would give it the width of both).
    hyps_a = with_errors(3)
    hyps_b = dict(hyps_a, u001="昨天天气很好我们去公园")
    first = compare(REFS, hyps_a, hyps_b, samples=400, seed=3)
    assert first.delta.high - first.delta.low < (first.a.high - first.a.low) / 5
    assert 0 < first.delta.value < first.a.high - first.a.low
    assert first == compare(REFS, hyps_a, hyps_b, samples=400, seed=3)
    assert first != compare(REFS, hyps_a, hyps_b, samples=400, seed=4)


def test_missing_hypotheses_count_as_deletions():
    errors, units = utterance_errors({"a": "你好", "b": "我们"}, {"a": "你好"})
    assert errors.tolist() == [0, 2] and units.tolist() == [2, 2]


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="no reference"):
        compare({}, {}, {})
    with pytest.raises(ValueError, match="samples"):
        compare(REFS, REFS, REFS, samples=0)


def test_command_line(tmp_path, capsys):
    ref, hyp_a, hyp_b = (tmp_path / name for name in ("ref", "a", "b"))
    for path, table in ((ref, REFS), (hyp_a, with_errors(2)), (hyp_b, with_errors(20))):
        path.write_text("".join(f"{utt} {text}\n" for utt, text in sorted(table.items())),
                        encoding="utf-8")
    assert main(["--cer", "--samples", "100", str(ref), str(hyp_a), str(hyp_b)]) == 0
    out = capsys.readouterr().out
    assert "%CER with 95 % paired-bootstrap intervals (100 resamples of 200 utterances" in out
    assert f"P({hyp_b} better): 1.000" in out


def test_command_line_takes_empty_hypotheses(tmp_path, capsys):
    """An empty result is a key alone on its line (the text format's), as scoring reads it."""
    ref, hyp_a, hyp_b = (tmp_path / name for name in ("ref", "a", "b"))
    ref.write_text("u1 你好\nu2 我们\n", encoding="utf-8")
    hyp_a.write_text("u1 你好\nu2\n", encoding="utf-8")
    hyp_b.write_text("u1 你好\nu2 我们\n", encoding="utf-8")
    assert main(["--cer", "--samples", "50", str(ref), str(hyp_a), str(hyp_b)]) == 0
    assert f"{hyp_a}: 50.00" in capsys.readouterr().out
