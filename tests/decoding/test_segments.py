"""Voice-activity segments of long recordings (`cat.decoding.segments`) and their settings."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cat.audio.vad import FRAME_SAMPLES, FRAME_SECONDS
from cat.decoding.audio import Segmenting
from cat.decoding.segments import PAD_SECONDS, Cut, plan_cuts, speech_regions

RATE = 16000


def probabilities(spans: list[tuple[float, float]], seconds: float, dips: tuple = ()
                  ) -> np.ndarray:
    """VAD frames of `seconds` of audio: 0.95 in the speech `spans` (seconds), 0.02
    elsewhere, and `dips` ((second, probability): one frame) inside speech."""
    frames = np.full(round(seconds / FRAME_SECONDS), 0.02, np.float32)
    for start, end in spans:
        frames[round(start / FRAME_SECONDS):round(end / FRAME_SECONDS)] = 0.95
    for second, probability in dips:
        frames[round(second / FRAME_SECONDS)] = probability
    return frames


def plan(frames: np.ndarray, max_segment: float = 30.0, target: float = 15.0,
         min_silence: float = 0.2) -> list[Cut]:
    return plan_cuts(frames, len(frames) * FRAME_SAMPLES, max_segment, 0.5, min_silence,
                     target)


def seconds(cut: Cut) -> tuple[float, float, float, float]:
    return tuple(round(value / RATE, 3) for value in (cut.first, cut.end, cut.speech_first,
                                                      cut.speech_end))


def test_speech_regions_need_a_pause_of_min_silence():
    frames = probabilities([(1.0, 2.0), (2.1, 3.0), (3.5, 4.0), (6.0, 6.05)], 8.0)
    # 0.1 s between the first two is no pause at 0.2 s; the 32 ms blip is no speech.
    assert speech_regions(frames, 0.5, 0.2) == [(31, 94), (109, 125)]
    assert speech_regions(frames, 0.5, 0.05) == [(31, 62), (66, 94), (109, 125)]
    # Between threshold - RELEASE and threshold the frame is neither: no pause starts.
    frames = probabilities([(1.0, 3.0)], 4.0, dips=[(2.0, 0.4), (2.04, 0.4), (2.08, 0.4)])
    assert speech_regions(frames, 0.5, 0.05) == [(31, 94)]
    assert speech_regions(np.zeros(100, np.float32), 0.5, 0.2) == []


def test_regions_are_merged_up_to_the_target_and_cut_at_the_widest_pause():
    # Utterances of 3 s with pauses of 0.5 s, one of 1.5 s.
    spans = [(1.0 + 3.5 * index, 4.0 + 3.5 * index) for index in range(8)]
    spans[4:] = [(start + 1.0, end + 1.0) for start, end in spans[4:]]
    cuts = plan(probabilities(spans, 32.0), target=15.0)
    assert [seconds(cut)[2:] for cut in cuts] == [(0.992, 14.496), (16.0, 29.504)]
    first, second = cuts
    # PAD_SECONDS of pause on either side (10 frames); the long pause is not decoded.
    pad = 10 * FRAME_SECONDS
    assert pad >= PAD_SECONDS > pad - FRAME_SECONDS
    assert seconds(first)[:2] == (round(0.992 - pad, 3), round(14.496 + pad, 3))
    assert seconds(second)[0] == round(16.0 - pad, 3)
    assert all(cut.end - cut.first <= 15.0 * RATE and not cut.windowed for cut in cuts)
    # A short pause is cut at its middle: neighbouring segments do not overlap.
    cuts = plan(probabilities(spans, 32.0), target=5.0)
    assert len(cuts) == 8
    assert all(left.end <= right.first for left, right in itertools.pairwise(cuts))
    assert seconds(cuts[0])[1] == seconds(cuts[1])[0]  # 0.5 s pause: its middle


def test_speech_longer_than_the_window_is_cut_at_its_quietest_point_or_in_windows():
    # 70 s without a pause of 0.2 s, but pauses of 0.13 s at 22 s and 45 s: cut there,
    # each piece at least half of --max-segment (less its pauses), at most all of it.
    frames = probabilities([(1.0, 22.0), (22.13, 45.0), (45.13, 71.0)], 72.0)
    assert speech_regions(frames, 0.5, 0.2) == [(31, 2219)]
    cuts = plan(frames, max_segment=30.0)
    assert [seconds(cut) for cut in cuts] == [(0.672, 22.08, 0.992, 22.08),  # in the pauses
                                              (22.08, 45.056, 22.08, 45.056),
                                              (45.056, 71.328, 45.056, 71.008)]
    assert not any(cut.windowed for cut in cuts)
    assert all(cut.end - cut.first <= 30 * RATE for cut in cuts)
    # A dip of a frame or two is no pause (it lies within a word): the rest is decoded
    # in windows.
    frames = probabilities([(1.0, 22.0), (22.064, 51.0)], 52.0, dips=[(35.0, 0.3)])
    cuts = plan(frames, max_segment=30.0)
    assert len(cuts) == 1 and cuts[0].windowed
    assert seconds(cuts[0])[2:] == (0.992, 51.008)


def test_no_speech_gives_no_segment():
    assert plan(np.full(2000, 0.01, np.float32)) == []
    assert plan(np.zeros(0, np.float32)) == []


def test_settings_out_of_range_are_errors_naming_their_flag():
    assert Segmenting().target == 5.0 and Segmenting(max_segment=3, overlap=1).target == 3
    for settings, message in [
        ({"vad": "webrtc"}, "--vad 'webrtc': expected one of silero, none"),
        ({"vad_threshold": 1.0}, "--vad-threshold 1: expected a speech probability above "
                                 "0.15 and below 1"),
        ({"vad_threshold": 0.1}, "--vad-threshold 0.1: expected"),
        ({"vad_min_silence": 0}, "--vad-min-silence 0: expected more than 0 and at most a "
                                 "quarter of --max-segment 30 seconds"),
        ({"vad_min_silence": 8}, "--vad-min-silence 8: expected"),
        ({"max_segment": 3, "overlap": 1, "vad_min_silence": 1},
         "--vad-min-silence 1: expected more than "
                                                     "0 and at most a quarter of --max-segment "
                                                     "3 seconds"),
        ({"segment_target": 0.5}, "--segment-target 0.5: expected at least 1 and at most "
                                  "--max-segment 30 seconds"),
        ({"segment_target": 31}, "--segment-target 31: expected"),
        ({"max_segment": -1}, "--max-segment -1: expected a positive number of seconds"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            Segmenting(**settings)
