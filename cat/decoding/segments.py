"""Long recordings cut at their pauses: voice-activity segments, merged to a target length.

A recording longer than `--max-segment` is not decoded whole (full-context attention
grows with the square of the length) but as segments of at most that length, each
decoded alone and their results joined with times (`cat.decoding.results.join_parts`).
With `--vad silero` (the default) the cuts fall in pauses, where no word is cut:

1. Silero VAD gives the speech probability of every 32 ms (`cat.audio.vad`).
2. Speech regions (`speech_regions`): speech starts at a frame of probability at least
   `threshold` and ends after `min_silence` seconds below `threshold - RELEASE`
   (hysteresis, so a flicker around the threshold is no pause); regions shorter than
   `MIN_SPEECH_SECONDS` are dropped.
3. Segments (`plan_cuts`): regions in a row are merged while the segment stays within
   `target` seconds, cut at the widest pause of its second half; each segment keeps up
   to `PAD_SECONDS` of the pause on either side (a short pause is cut at its middle), so
   long silences, music without speech included, are not decoded.
4. A region longer than `--max-segment` (speech without a pause of `min_silence`) is cut
   at its quietest point, the middle of the `QUIET_SECONDS` of lowest mean speech
   probability in the second half of the allowed length, when that mean is below
   `threshold - RELEASE` (a pause too short to end a region); where there is none, the
   rest of the region is decoded in overlapping windows of `--max-segment` joined where
   they overlap, as `--vad none` decodes everything (`Cut.windowed`).

Recordings without speech give no segment (an empty transcript). Times are in samples
at `cat.audio.vad.SAMPLE_RATE`; the settings are `cat.decoding.audio.Segmenting`'s.

Usage:
    cuts = plan_cuts(probabilities, num_samples, max_segment=30.0, threshold=0.5,
                     min_silence=0.2, target=5.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from cat.audio.vad import FRAME_SAMPLES, FRAME_SECONDS

#: The VADs `--vad` chooses from: Silero's, or none (windows of `--max-segment`).
VADS = ("silero", "none")
#: How far below `threshold` the probability must fall before frames count as pause.
RELEASE = 0.15
#: Speech regions shorter than this are clicks or breaths, not speech (seconds).
MIN_SPEECH_SECONDS = 0.1
#: Seconds of pause a segment keeps on either side of its speech.
PAD_SECONDS = 0.3
#: The quietest point of speech longer than `--max-segment` is the middle of the stretch
#: of this length (seconds) of lowest mean probability; it is a pause to cut at when that
#: mean is below `threshold - RELEASE` (a dip of a frame or two is no pause: cutting
#: there cuts a word).
QUIET_SECONDS = 0.1


@dataclasses.dataclass(frozen=True)
class Cut:
    """A stretch of a recording decoded alone: samples `first` to `end`, its speech from
    `speech_first` to `speech_end`; `windowed`: speech without a pause, longer than
    `--max-segment`, decoded in overlapping windows."""

    first: int
    end: int
    speech_first: int
    speech_end: int
    windowed: bool = False


def _frames(seconds: float) -> int:
    return max(1, math.ceil(seconds / FRAME_SECONDS - 1e-9))


def speech_regions(probabilities: np.ndarray, threshold: float, min_silence: float
                   ) -> list[tuple[int, int]]:
    """(first, end) frames of each speech region of `probabilities` (see the module doc)."""
    release = threshold - RELEASE
    quiet_frames = _frames(min_silence)
    regions: list[tuple[int, int]] = []
    start: int | None = None
    quiet: int | None = None  # the first frame of the pause that may end the region
    for frame, probability in enumerate(np.asarray(probabilities, np.float32).tolist()):
        if probability >= threshold:
            if start is None:
                start = frame
            quiet = None
        elif start is not None and probability < release:
            quiet = frame if quiet is None else quiet
            if frame + 1 - quiet >= quiet_frames:
                regions.append((start, quiet))
                start = quiet = None
    if start is not None:
        regions.append((start, quiet if quiet is not None else len(probabilities)))
    shortest = _frames(MIN_SPEECH_SECONDS)
    return [(first, end) for first, end in regions if end - first >= shortest]


def _split_long(first: int, end: int, probabilities: np.ndarray, threshold: float,
                max_frames: int) -> list[tuple[int, int, bool]]:
    """A region longer than `max_frames` cut at its quietest points: (first, end,
    windowed) pieces."""
    width = _frames(QUIET_SECONDS)
    # The mean probability of the `width` frames from each frame on.
    sums = np.concatenate([[0.0], np.cumsum(probabilities, dtype=np.float64)])
    means = (sums[width:] - sums[:-width]) / width if len(probabilities) >= width else \
        np.zeros(0)
    pieces = []
    while end - first > max_frames:
        low, high = first + max_frames // 2, min(first + max_frames, len(means))
        if high <= low:
            break
        quietest = low + int(np.argmin(means[low:high]))
        if means[quietest] >= threshold - RELEASE:
            break
        cut = quietest + width // 2
        pieces.append((first, cut, False))
        first = cut
    pieces.append((first, end, end - first > max_frames))
    return pieces


def _group(units: Sequence[tuple[int, int, bool]], target_frames: int
           ) -> list[list[tuple[int, int, bool]]]:
    """Speech units in a row merged into segments of at most `target_frames`, each
    ended at the widest pause of its second half."""
    groups: list[list[tuple[int, int, bool]]] = []
    index = 0
    while index < len(units):
        first = units[index][0]
        last = index  # the last unit that fits
        while (last + 1 < len(units) and not units[last][2] and not units[last + 1][2]
               and units[last + 1][1] - first <= target_frames):
            last += 1
        if last + 1 < len(units) and last > index:
            half = first + target_frames // 2
            candidates = [k for k in range(index, last + 1) if units[k][1] >= half] or [last]
            last = max(candidates, key=lambda k: (units[k + 1][0] - units[k][1], k))
        groups.append(list(units[index:last + 1]))
        index = last + 1
    return groups


def plan_cuts(probabilities: np.ndarray, num_samples: int, max_segment: float,
              threshold: float, min_silence: float, target: float) -> list[Cut]:
    """The segments of a recording of `num_samples` samples whose VAD frames have
    `probabilities` (see the module doc; the settings are `Segmenting`'s), in order."""
    probabilities = np.asarray(probabilities, np.float32)
    pad = _frames(PAD_SECONDS)
    # Speech frames a segment may hold, leaving room for its pauses on either side.
    max_frames = max(1, int(max_segment / FRAME_SECONDS) - 2 * pad)
    units = [piece for first, end in speech_regions(probabilities, threshold, min_silence)
             for piece in _split_long(first, end, probabilities, threshold, max_frames)]
    groups = _group(units, min(max_frames, _frames(target) - 2 * pad))
    cuts = []
    for index, group in enumerate(groups):
        speech_first, speech_end = group[0][0], group[-1][1]
        before = groups[index - 1][-1][1] if index else None
        after = groups[index + 1][0][0] if index + 1 < len(groups) else None
        # Up to `pad` of the pause on either side, never past its middle.
        first = speech_first - pad if before is None else \
            max(speech_first - pad, (before + speech_first + 1) // 2)
        end = speech_end + pad if after is None else min(speech_end + pad,
                                                         (speech_end + after + 1) // 2)
        cuts.append(Cut(*(min(num_samples, max(0, frame * FRAME_SAMPLES))
                          for frame in (first, end, speech_first, speech_end)),
                        any(unit[2] for unit in group)))
    return [cut for cut in cuts if cut.end > cut.first]
