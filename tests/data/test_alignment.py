"""The synthetic alignment set: word boundaries the generator knows, and the boundary error
of timed hypotheses against them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
import torch

from cat.ctc.align import ctc_token_frames
from cat.data import alignment, synth
from cat.data.alignment import Word, boundary_errors, make_alignment_set, read_ctm
from cat.decoding.results import Result, format_lines
from cat.decoding.timestamps import token_times


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    root = tmp_path_factory.mktemp("alignment")
    synth.make_aishell(root / "corpus", num_utts=40, seed=3, num_chars=300,
                       utts_per_speaker=10, nj=2)
    make_alignment_set(root / "corpus", root / "set", "test", num_utts=2)
    return root


@pytest.mark.slow
def test_words_are_where_the_speech_is(aligned):
    reference = read_ctm(aligned / "set/words.ctm")
    texts = dict(line.split(" ", 1) for line in
                 (aligned / "set/text").read_text(encoding="utf-8").splitlines())
    wavs = dict(line.split(" ", 1) for line in
                (aligned / "set/wav.scp").read_text(encoding="utf-8").splitlines())
    assert len(reference) == 2 and set(reference) == set(texts) == set(wavs)
    for utt, words in reference.items():
        assert "".join(word.text for word in words) == texts[utt]
        samples, rate = sf.read(wavs[utt])
        assert words[0].start > 0 and words[-1].end < len(samples) / rate
        loudness = []
        for word, following in zip(words, [*words[1:], None], strict=True):
            inside = samples[int(word.start * rate):int(word.end * rate)]
            # The pause after the word holds the speaker's noise alone.
            gap = samples[int(word.end * rate) + 80:int((following.start if following
                                                         else word.end + 0.1) * rate) - 80]
            assert word.start < word.end and (following is None or word.end < following.start)
            loudness.append((np.abs(inside).max(), np.abs(gap).max() if gap.size else 0.0))
        assert all(speech > 10 * noise for speech, noise in loudness), loudness
    # Made again with the same parameters: nothing to do; the corpus is left as it was.
    meta = json.loads((aligned / "set/alignment.json").read_text())
    assert meta["num_utts"] == 2 and meta["set"] == "test"
    before = (aligned / "set/words.ctm").stat().st_mtime_ns
    make_alignment_set(aligned / "corpus", aligned / "set", "test", num_utts=2)
    assert (aligned / "set/words.ctm").stat().st_mtime_ns == before


def spiking_at(words: list[Word], frame_seconds: float, vocab: dict[str, int]
               ) -> tuple[torch.Tensor, list[int]]:
    """Log-probabilities whose CTC spikes sit where each character of `words` starts (the
    characters of a word sharing it evenly), and the token ids."""
    frames = int(words[-1].end / frame_seconds) + 4
    probs = np.full((frames, len(vocab) + 1), 0.01)
    probs[:, 0] = 1.0
    tokens = []
    for word in words:
        step = (word.end - word.start) / len(word.text)
        for index, char in enumerate(word.text):
            frame = int((word.start + index * step) / frame_seconds + 0.5)
            probs[frame] = 0.01
            probs[frame, vocab[char]] = 1.0
            tokens.append(vocab[char])
    probs /= probs.sum(axis=1, keepdims=True)
    return torch.tensor(np.log(probs), dtype=torch.float32)[None], tokens


def test_ctc_times_of_known_spikes_meet_the_reference_boundaries():
    """A CTC head spiking where each word starts: the words of its CTM start within an
    encoder frame of the reference, and the boundary error counts them."""
    reference = {"utt": [Word("半经", 0.31, 0.9), Word("参", 1.02, 1.31),
                         Word("建强来", 1.5, 2.45)]}
    vocab = {char: index for index, char in enumerate("半经参建强来", 1)}
    frame_seconds = 0.04
    log_probs, tokens = spiking_at(reference["utt"], frame_seconds, vocab)
    (spans,) = ctc_token_frames(log_probs, torch.tensor([log_probs.size(1)]), [tokens])
    times = token_times(spans, 4, list("半经参建强来"), duration=3.0)
    result = Result("utt", "半经参建强来", tuple("半经参建强来"), tuple(times))
    lines = list(format_lines([result], "ctm"))
    hypothesis = {"utt": [Word(fields[4], float(fields[2]), float(fields[2]) + float(fields[3]))
                          for fields in map(str.split, lines)]}
    errors = boundary_errors(reference, hypothesis)
    assert errors.num_words == 3 and len(errors.starts) == 3
    assert max(errors.starts) <= frame_seconds / 2 + 1e-6
    starts = [word.start for word in hypothesis["utt"]]
    assert starts == sorted(starts) and hypothesis["utt"][-1].end <= 3.0


def test_boundary_errors_match_characters_and_skip_misrecognised_words(tmp_path):
    reference = {"a": [Word("半经", 0.1, 0.5), Word("参", 0.6, 0.8)],
                 "b": [Word("强", 0.2, 0.4)]}
    hypothesis = {"a": [Word("半", 0.12, 0.3), Word("经", 0.3, 0.45), Word("x", 0.5, 0.55),
                        Word("参", 0.65, 0.8)]}
    errors = boundary_errors(reference, hypothesis)
    assert errors.num_words == 3
    assert errors.starts == pytest.approx([0.02, 0.05]) and errors.ends == pytest.approx(
        [0.05, 0.0])
    assert errors.mean_ms == pytest.approx(30.0)
    assert errors.start_shifts == pytest.approx([0.02, 0.05])  # late: positive
    assert errors.end_shifts == pytest.approx([-0.05, 0.0])  # early: negative
    # A word with a wrong character is not compared.
    wrong = boundary_errors(reference, {"a": [Word("半", 0.1, 0.3), Word("x", 0.3, 0.5)]})
    assert (wrong.starts, wrong.ends) == ([], [])

    ctm = tmp_path / "x.ctm"
    ctm.write_text("a 1 0.600 0.200 参\na 1 0.100 0.400 半经 0.9\n", encoding="utf-8")
    assert read_ctm(ctm) == {"a": [Word("半经", 0.1, 0.5), Word("参", 0.6, 0.8)]}
    ctm.write_text("a 1 zero 0.2 参\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"x.ctm:1: not a CTM line"):
        read_ctm(ctm)


def test_trimming_keeps_the_speech():
    samples = np.zeros(1000, np.float32)
    samples[100:400] = 0.5
    samples[250] = 0.0
    trimmed = alignment._trimmed(samples)
    assert len(trimmed) == 300 and trimmed[0] == 0.5 and trimmed[-1] == 0.5
