"""Hotwords (`cat.decoding.context_graph`): the bonus of a phrase is given token by token,
taken back when a partial match fails or a hypothesis ends in one, and kept for a full
match; overlapping phrases follow the failure arcs; an empty graph changes no search;
a listed phrase that is nearly the best hypothesis becomes the best; hotwords files are
read with errors naming their line; the decode command takes `--hotwords`."""

from __future__ import annotations

import itertools
import json
import logging
import random

import numpy as np
import pytest
import soundfile
import torch

from cat import train as cat_train
from cat.ctc.search import ctc_prefix_beam_search
from cat.decoding.context_graph import ContextGraph, HotwordsError, read_hotwords
from cat.decoding.inference import FusionSpec, decode_passes
from cat.decoding.inference import main as decode_main
from cat.decoding.searcher import DecodeOptions
from cat.lm.ngram import estimate, write_arpa
from cat.lm.rescore import NBEST_NAME, read_nbest
from cat.lm.scorer import CombinedFusion
from cat.rnnt.search import rnnt_modified_beam_search
from cat.testing.training import write_tiny_experiment
from cat.text.tokenizer import UNK_ID
from tests.ctc.test_search import BigramFusion, brute_force_labelings, random_log_probs
from tests.rnnt.test_search import brute_force_sequences, components

A, B, C, X = 1, 2, 3, 9
NAME = "exp/tiny"


def deltas(graph, tokens: list[int]) -> tuple[list[float], float]:
    """The score of each step through `tokens`, and the final score after them."""
    state, scores = graph.initial_state(), []
    for token in tokens:
        score, state = graph.step(state, token)
        scores.append(score)
    return scores, graph.final(state)


def total(graph, tokens: list[int]) -> float:
    steps, final = deltas(graph, tokens)
    return sum(steps) + final


# ----------------------------------------------------------------------------- the graph


def test_a_phrase_gives_its_score_per_token_and_keeps_it():
    graph = ContextGraph([([A, B, C], 2.0)])
    assert deltas(graph, [A, B, C]) == ([2.0, 2.0, 2.0], 0.0)
    # A full match restarts: the phrase again earns again.
    assert deltas(graph, [A, B, C, A, B, C]) == ([2.0] * 6, 0.0)
    assert total(graph, [X, A, B, C, X]) == 6.0


def test_a_failed_partial_match_takes_back_what_it_gave():
    graph = ContextGraph([([A, B, C], 2.0)])
    assert deltas(graph, [A, B, X]) == ([2.0, 2.0, -4.0], 0.0)
    assert total(graph, [A, B, X, X]) == 0.0
    # The failing token starts the phrase again: only the first 'a' is taken back.
    assert deltas(graph, [A, A, B, C]) == ([2.0, 0.0, 2.0, 2.0], 0.0)
    assert deltas(graph, [A, B, A, B, C]) == ([2.0, 2.0, -2.0, 2.0, 2.0], 0.0)


def test_final_takes_back_a_pending_partial_match():
    graph = ContextGraph([([A, B, C], 1.5)])
    assert deltas(graph, [A, B]) == ([1.5, 1.5], -3.0)
    assert total(graph, [A, B, C, A]) == 4.5


def test_overlapping_phrases_both_count_through_the_failure_arc():
    graph = ContextGraph([([A, B], 1.0), ([B, C], 1.0)])
    # 'b' completes "ab" (kept) and begins "bc" (pending) through the failure arc.
    assert deltas(graph, [A, B, C]) == ([1.0, 2.0, 1.0], 0.0)
    assert deltas(graph, [A, B, X]) == ([1.0, 2.0, -1.0], 0.0)


def test_a_phrase_that_is_a_suffix_of_another_counts_in_it():
    graph = ContextGraph([([A, B, C], 1.0), ([B, C], 1.0)])
    assert deltas(graph, [A, B, C]) == ([1.0, 1.0, 3.0], 0.0)  # "abc" 3 + "bc" 2
    assert deltas(graph, [A, B, X]) == ([1.0, 1.0, -2.0], 0.0)
    assert total(graph, [X, B, C]) == 2.0


def test_a_phrase_that_is_a_prefix_of_another_is_kept_when_the_longer_one_fails():
    graph = ContextGraph([([A, B], 1.0), ([A, B, C], 1.0)])
    assert deltas(graph, [A, B]) == ([1.0, 3.0], -2.0)  # "ab" kept, "abc" pending
    assert total(graph, [A, B, X]) == 2.0
    assert total(graph, [A, B, C]) == 5.0


def test_each_phrase_keeps_its_own_score():
    graph = ContextGraph([([A, B], 1.0), ([A, C], 3.0), ([A, B], 0.5)])
    assert graph.num_phrases == 2  # "ab" listed twice keeps its larger score
    # 'a' begins both: it is given the larger score until the match decides.
    assert deltas(graph, [A, B]) == ([3.0, -1.0], 0.0)
    assert total(graph, [A, C]) == 6.0
    assert deltas(graph, [A]) == ([3.0], -3.0)


def occurrence_bonus(phrases: list[tuple[list[int], float]], tokens: list[int]) -> float:
    """The bonus of every occurrence of every phrase in `tokens`, by brute force."""
    best: dict[tuple[int, ...], float] = {}
    for phrase, score in phrases:
        best[tuple(phrase)] = max(best.get(tuple(phrase), -np.inf), len(phrase) * score)
    return sum(bonus for phrase, bonus in best.items()
               for start in range(len(tokens) - len(phrase) + 1)
               if tuple(tokens[start:start + len(phrase)]) == phrase)


def pending_bonus(phrases: list[list[int]], tokens: list[int], score: float) -> float:
    """The pending bonus after `tokens` (one score for all phrases), by brute force: of the
    longest suffix that a phrase continues (the empty one, at worst)."""
    for start in range(len(tokens) + 1):
        suffix = tokens[start:]
        if any(len(p) > len(suffix) and p[:len(suffix)] == suffix for p in phrases):
            return score * len(suffix)
    return 0.0


@pytest.mark.parametrize("seed", range(6))
def test_the_steps_add_up_to_every_occurrence_plus_the_pending_match(seed):
    rng = random.Random(seed)
    phrases = [[rng.randint(1, 3) for _ in range(rng.randint(1, 4))] for _ in range(4)]
    graph = ContextGraph([(phrase, 0.5) for phrase in phrases])
    for length in range(9):
        for tokens in itertools.islice(itertools.product(range(1, 4), repeat=length), 40):
            tokens = list(tokens)
            steps, final = deltas(graph, tokens)
            occurrences = occurrence_bonus([(p, 0.5) for p in phrases], tokens)
            assert sum(steps) == pytest.approx(
                occurrences + pending_bonus(phrases, tokens, 0.5)), (phrases, tokens)
            assert sum(steps) + final == pytest.approx(occurrences), (phrases, tokens)
    scored = [(phrase, rng.choice([0.5, 1.0, 2.0])) for phrase in phrases]
    mixed = ContextGraph(scored)
    for _ in range(200):
        tokens = [rng.randint(1, 3) for _ in range(rng.randint(0, 10))]
        assert total(mixed, tokens) == pytest.approx(occurrence_bonus(scored, tokens))


def test_states_are_node_ids_and_the_graph_is_deterministic():
    phrases = [([A, B, C], 1.0), ([B, C], 1.0), ([C, A], 2.0)]
    first, second = ContextGraph(phrases), ContextGraph(phrases)
    tokens = [A, B, C, A, B, X, C, A]
    state_a, state_b = first.initial_state(), second.initial_state()
    for token in tokens:
        (score_a, state_a), (score_b, state_b) = first.step(state_a, token), \
            second.step(state_b, token)
        assert isinstance(state_a, int) and 0 <= state_a < first.num_nodes
        assert (score_a, state_a) == (score_b, state_b)


@pytest.mark.parametrize(("phrases", "message"), [
    ([([], 1.0)], "at least one token"),
    ([([A], float("nan"))], "finite"),
])
def test_a_bad_phrase_is_refused(phrases, message):
    with pytest.raises(ValueError, match=message):
        ContextGraph(phrases)


def test_combined_fusion_sums_its_parts_and_keeps_their_states():
    lm, graph = BigramFusion(4, seed=0), ContextGraph([([A, B], 1.0)])
    combined = CombinedFusion([lm, graph])
    tokens = [A, B, C, A]
    state = combined.initial_state()
    assert state == (lm.initial_state(), graph.initial_state())
    summed = 0.0
    for token in tokens:
        score, state = combined.step(state, token)
        summed += score
    summed += combined.final(state)
    assert summed == pytest.approx(lm.total(tuple(tokens)) + total(graph, tokens))
    graph_state = graph.initial_state()
    for token in tokens:
        graph_state = graph.step(graph_state, token)[1]
    assert state == (A, graph_state)  # the bigram's state is the last token


# ----------------------------------------------------------------------------- the searches


def test_an_empty_graph_changes_no_ctc_hypothesis_or_score():
    log_probs = random_log_probs(3, 12, 6, seed=20, sharpness=1.5)
    lengths = torch.tensor([12, 8, 3])
    plain = ctc_prefix_beam_search(log_probs, lengths, beam_size=5)
    empty = ctc_prefix_beam_search(log_probs, lengths, beam_size=5, fusion=ContextGraph([]))
    assert empty == plain
    lm = BigramFusion(6, seed=21)
    assert ctc_prefix_beam_search(log_probs, lengths, beam_size=5,
                                  fusion=CombinedFusion([lm, ContextGraph([])])) == \
        ctc_prefix_beam_search(log_probs, lengths, beam_size=5, fusion=lm)


@pytest.mark.parametrize("kind", ["lstm", "stateless"])
def test_an_empty_graph_changes_no_rnnt_hypothesis_or_score(kind):
    predictor, joiner = components(kind, num_classes=6, seed=22, blank_bias=-0.5)
    encoder_out = 2 * torch.randn(3, 8, 6, generator=torch.Generator().manual_seed(23))
    lengths = torch.tensor([8, 5, 2])
    plain = rnnt_modified_beam_search(predictor, joiner, encoder_out, lengths, beam_size=4)
    empty = rnnt_modified_beam_search(predictor, joiner, encoder_out, lengths, beam_size=4,
                                      fusion=ContextGraph([]))
    assert empty == plain


def near_miss_log_probs() -> torch.Tensor:
    """Three frames: 'a', then 'b' a little likelier than 'c', then blank; "ab" beats
    "ac" by log(0.45 / 0.40), about 0.118."""
    probs = torch.tensor([[0.10, 0.80, 0.05, 0.05],
                          [0.10, 0.05, 0.45, 0.40],
                          [0.90, 0.04, 0.03, 0.03]], dtype=torch.float64)
    return torch.log(probs)[None]


def test_a_listed_near_miss_becomes_the_best_ctc_hypothesis():
    log_probs = near_miss_log_probs()
    exact = brute_force_labelings(log_probs[0])
    ranked = sorted(exact, key=exact.get, reverse=True)
    assert ranked[:2] == [(A, B), (A, C)]
    margin = exact[A, B] - exact[A, C]
    assert 0 < margin < 0.2
    graph = ContextGraph([([A, C], 0.1)])  # a bonus of 0.2
    lengths = torch.tensor([3])
    plain = ctc_prefix_beam_search(log_probs, lengths, beam_size=4)[0]
    biased = ctc_prefix_beam_search(log_probs, lengths, beam_size=4, fusion=graph)[0]
    assert plain[0][0] == [A, B]
    assert biased[0][0] == [A, C]
    assert biased[0][1] == pytest.approx(exact[A, C] + 0.2, abs=1e-5)
    # The failed partial match "a" of "ab" is taken back: it keeps its acoustic score.
    assert dict((tuple(t), s) for t, s in biased)[A, B] == pytest.approx(exact[A, B], abs=1e-5)


def test_a_listed_near_miss_becomes_the_best_rnnt_hypothesis():
    predictor, joiner = components("lstm", num_classes=4, seed=5, blank_bias=-0.5)
    encoder_out = 2 * torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(6))
    exact = brute_force_sequences(predictor, joiner, encoder_out[0])
    best, second = sorted(exact, key=exact.get, reverse=True)[:2]
    assert len(second) > 0
    margin = exact[best] - exact[second]
    assert 0 < margin < 0.1
    score = (margin + 0.05) / len(second)
    graph = ContextGraph([(list(second), score)])
    biased_exact = {sequence: value + total(graph, list(sequence))
                    for sequence, value in exact.items()}
    assert max(biased_exact, key=biased_exact.get) == second
    lengths, beam = torch.tensor([4]), len(exact)  # a full beam: exact scores
    plain = rnnt_modified_beam_search(predictor, joiner, encoder_out, lengths, beam)[0]
    biased = rnnt_modified_beam_search(predictor, joiner, encoder_out, lengths, beam,
                                       fusion=graph, token_topk=3)[0]
    assert tuple(plain[0][0]) == best
    assert tuple(biased[0][0]) == second
    assert biased[0][1] == pytest.approx(biased_exact[second], abs=1e-4)


# ----------------------------------------------------------------------------- the file


class Letters:
    """A tokenizer of the letters a to z (ids 2 to 27); anything else is `<unk>`."""

    def encode(self, text: str) -> list[int]:
        return [ord(char) - ord("a") + 2 if "a" <= char <= "z" else UNK_ID
                for char in text.replace(" ", "")]


def test_a_hotwords_file_gives_phrases_with_their_scores(tmp_path):
    path = tmp_path / "hotwords.txt"
    path.write_text("ab\n\n  bc :3\ncab :0.5 \n", encoding="utf-8")
    graph, report = read_hotwords(path, Letters(), default_score=1.5)
    assert (report.num_used, report.num_skipped) == (3, 0)
    a, b, c = 2, 3, 4
    assert total(graph, [a, b]) == 3.0
    assert total(graph, [b, c]) == 6.0
    assert total(graph, [c, a, b]) == 1.5 + 3.0  # "cab" and the "ab" in it


@pytest.mark.parametrize(("line", "shown"), [("ab :x", "'x'"), ("ab :", "''"),
                                             ("ab :inf", "'inf'")])
def test_a_score_that_is_not_a_number_names_the_file_and_line(tmp_path, line, shown):
    path = tmp_path / "hotwords.txt"
    path.write_text(f"ab\n\n{line}\n", encoding="utf-8")
    with pytest.raises(HotwordsError, match=rf"hotwords\.txt:3: the score after ':' must be "
                                            rf"a number, got {shown}"):
        read_hotwords(path, Letters(), 1.5)


def test_a_bonus_past_the_bound_after_multiplication_names_the_file_and_line(tmp_path):
    """A score finite per token can overflow once multiplied by the phrase's tokens (1e308
    times 3 is infinite), and a large finite one outweighs every acoustic score: both are
    refused by name, whether the line or the default gives the score."""
    path = tmp_path / "hotwords.txt"
    path.write_text("ab :2\nabc :1e308\n", encoding="utf-8")
    with pytest.raises(HotwordsError, match=r"hotwords\.txt:2: 'abc': a phrase of 3 token\(s\) "
                                            r"at 1e\+308 per token gets a bonus of inf, beyond "
                                            r"±1000 \(log probability\); give it a score per "
                                            r"token of at most 333\.333 in absolute value"):
        read_hotwords(path, Letters(), 1.5)
    path.write_text("abcd :-300\n", encoding="utf-8")  # finite, but 4 x -300 = -1200
    with pytest.raises(HotwordsError, match=r"hotwords\.txt:1: 'abcd': .* bonus of -1200"):
        read_hotwords(path, Letters(), 1.5)
    path.write_text("ab :2\nabcde\n", encoding="utf-8")
    with pytest.raises(HotwordsError, match=r"hotwords\.txt:2: 'abcde' \(the default score\): "
                                            r"a phrase of 5 token\(s\) at 250 per token"):
        read_hotwords(path, Letters(), 250)
    graph, _ = read_hotwords(path, Letters(), 200)  # 5 x 200 = 1000: the bound itself
    assert total(graph, [2, 3, 4, 5, 6]) == 1000.0 + 2 * 2  # abcde, and ab in it
    with pytest.raises(ValueError, match="gets a bonus of inf"):
        ContextGraph([([A, B], 1e308)])
    with pytest.raises(ValueError, match=r"hotwords_score: 1e\+308 is greater than the maximum"):
        DecodeOptions.from_dict({"hotwords": "h.txt", "hotwords_score": 1e308}, "x")


def test_a_score_without_a_phrase_names_the_line(tmp_path):
    path = tmp_path / "hotwords.txt"
    path.write_text(":2\n", encoding="utf-8")
    with pytest.raises(HotwordsError, match=r"hotwords\.txt:1: a score without a phrase"):
        read_hotwords(path, Letters(), 1.5)


def test_unspellable_phrases_are_skipped_counted_and_named(tmp_path, caplog):
    path = tmp_path / "hotwords.txt"
    path.write_text("ab\nAB :2\nok\nx1\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        graph, report = read_hotwords(path, Letters(), 1.5)
    assert (report.num_used, report.num_skipped) == (2, 2)
    assert report.skipped == ((2, "AB"), (4, "x1"))
    assert graph.num_phrases == 2
    assert "skipped 2 hotword phrase(s) the tokenizer cannot spell" in caplog.text
    assert "line 2 'AB', line 4 'x1'" in caplog.text


def test_an_empty_hotwords_file_is_an_empty_graph(tmp_path, caplog):
    path = tmp_path / "hotwords.txt"
    path.write_text("\n  \n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        graph, report = read_hotwords(path, Letters(), 1.5)
    assert (report.num_used, report.num_skipped, graph.num_phrases) == (0, 0, 0)
    assert total(graph, [2, 3, 4]) == 0.0
    assert "no usable hotword phrase" in caplog.text


def test_hotwords_need_a_beam_search():
    with pytest.raises(ValueError, match="hotwords need a beam search"):
        DecodeOptions(method="greedy", hotwords="hotwords.txt")
    with pytest.raises(ValueError, match=r"hyper-p\.json: hotwords need a beam search"):
        DecodeOptions.from_dict({"method": "greedy", "hotwords": "h.txt"}, "hyper-p.json")
    options = DecodeOptions.from_dict({"hotwords": "h.txt", "hotwords_score": 2.5}, "x")
    assert (options.method, options.hotwords, options.hotwords_score) == ("beam", "h.txt", 2.5)


# ----------------------------------------------------------------------------- the command


@pytest.fixture(scope="module", params=["ctc", "rnnt"])
def trained(request, tmp_path_factory):
    """A tiny experiment (80-dim features) trained for one epoch, and its checkpoint."""
    root = tmp_path_factory.mktemp(request.param)
    experiment = write_tiny_experiment(root, kind=request.param, num_train=8, num_dev=4,
                                       feat_dim=80, options={"epochs": 1})
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        cat_train.main([NAME])
    checkpoint = sorted((experiment.exp_dir / "check").glob("ckpt-*.pt"))[-1]
    return experiment, checkpoint


def _count(hyp: str, char: str) -> int:
    return sum(line.split(" ", 1)[-1].count(char) for line in hyp.splitlines()
               if " " in line)


def test_the_decode_command_takes_hotwords(trained, monkeypatch, caplog):
    experiment, checkpoint = trained
    monkeypatch.chdir(experiment.root)
    dev_text = (experiment.root / "data/fbank/dev/text").read_text(encoding="utf-8")
    word = dev_text.split()[1][0]  # a character of the first dev transcript
    (experiment.root / "hotwords.txt").write_text(f"{word} :4\nxyz\n", encoding="utf-8")
    decode = [NAME, "--data", "data/fbank/dev", "--device", "cpu", "--beam-size", "30",
              "--checkpoint", str(checkpoint)]
    assert decode_main("cat.decode", [*decode, "--out", "plain"]) == 0
    with caplog.at_level(logging.WARNING):
        assert decode_main("cat.decode", [*decode, "--out", "biased", "--hotwords",
                                          "hotwords.txt", "--hotwords-score", "0.5"]) == 0
    assert "line 2 'xyz'" in caplog.text
    plain = (experiment.root / "plain/hyp").read_text(encoding="utf-8")
    biased = (experiment.root / "biased/hyp").read_text(encoding="utf-8")
    assert biased.count("\n") == 4
    assert _count(biased, word) > _count(plain, word)
    log = json.loads((experiment.root / "biased/decode.log").read_text())
    assert (log["hotwords"], log["hotwords_score"]) == ("hotwords.txt", 0.5)
    # Audio goes through the same searcher, hotwords included.
    path = experiment.root / "utt.wav"
    samples = np.random.default_rng(0).normal(scale=0.1, size=16000).astype(np.float32)
    soundfile.write(path, samples, 16000)
    audio = [NAME, "--audio", str(path), "--device", "cpu", "--beam-size", "30",
             "--checkpoint", str(checkpoint)]
    assert decode_main("cat.decode", [*audio, "--out", "audio-plain"]) == 0
    assert decode_main("cat.decode", [*audio, "--out", "audio-biased", "--hotwords",
                                      "hotwords.txt"]) == 0
    assert _count((experiment.root / "audio-biased/hyp").read_text(encoding="utf-8"), word) > \
        _count((experiment.root / "audio-plain/hyp").read_text(encoding="utf-8"), word)


def test_the_decode_command_refuses_bad_hotwords(trained, monkeypatch, caplog):
    experiment, checkpoint = trained
    monkeypatch.chdir(experiment.root)
    (experiment.root / "bad.txt").write_text("ok\nfoo :bar\n", encoding="utf-8")
    decode = [NAME, "--data", "data/fbank/dev", "--device", "cpu", "--checkpoint",
              str(checkpoint), "--out", "refused"]
    assert decode_main("cat.decode", [*decode, "--hotwords", "bad.txt"]) == 1
    assert "bad.txt:2: the score after ':' must be a number, got 'bar'" in caplog.text
    assert decode_main("cat.decode", [*decode, "--hotwords", "bad.txt", "--method",
                                      "greedy"]) == 1
    assert "hotwords need a beam search" in caplog.text
    dev_text = (experiment.root / "data/fbank/dev/text").read_text(encoding="utf-8")
    (experiment.root / "huge.txt").write_text(f"{dev_text.split()[1][:2]} :1e308\n",
                                              encoding="utf-8")
    assert decode_main("cat.decode", [*decode, "--hotwords", "huge.txt"]) == 1
    assert "huge.txt:1: " in caplog.text and "gets a bonus of inf, beyond ±1000" in caplog.text
    assert not (experiment.root / "refused").exists()


def test_hotwords_join_the_language_model_of_each_pass(trained, monkeypatch):
    """With an LM that weighs nothing, a pass with hotwords gives the N-best lists of the
    pass without an LM, both unlike those of a decode without hotwords."""
    pytest.importorskip("kenlm")
    experiment, checkpoint = trained
    monkeypatch.chdir(experiment.root)
    texts = [list(line.split(" ", 1)[1]) for line in
             (experiment.root / "data/fbank/train/text").read_text(encoding="utf-8").splitlines()]
    write_arpa(estimate(texts, 2, (0.5, 1.0)), "lm.arpa")
    word = texts[0][0]
    (experiment.root / "hotwords.txt").write_text(f"{word} :2\n", encoding="utf-8")
    data = "data/fbank/dev"
    plain = DecodeOptions(beam_size=6, device="cpu")
    decode_passes(NAME, data, checkpoint, plain, [(None, "nohot")])
    biased = DecodeOptions(beam_size=6, device="cpu", hotwords="hotwords.txt")
    decode_passes(NAME, data, checkpoint, biased,
                  [(None, "hot"), (FusionSpec("lm.arpa", 0.0), "hot-lm")])
    lists = {name: read_nbest(f"{name}/{NBEST_NAME}") for name in ("nohot", "hot", "hot-lm")}
    assert lists["hot-lm"] == lists["hot"] != lists["nohot"]
