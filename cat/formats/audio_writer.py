"""Writing one audio shard: each utterance's audio cut, encoded and stored with its text.

`write_audio_shard(job)` decodes each recording of the shard once (stage 1's reader,
`cat.features.fbank.read_audio_with_channels`: channel 0, pipes run by the shell),
resamples it to 16 kHz (`cat.audio.codec.resample`), cuts the shard's segments of it
in order (`cat.features.extract.segment_span`), encodes each
(`cat.audio.codec.encode`: `wav`, `flac` or `opus`) and writes the members
`<encode_key(utt)>.<format>` and `<encode_key(utt)>.txt`, with the fixed metadata and
the atomic rename of the feature shards (`cat.formats.shard_writer`). An utterance whose
audio turns out unreadable (`bad_audio`), whose segment lies outside the decoded
recording (`bad_segment`), that is shorter than a frame (`too_short`) or whose frame
count falls outside the folder's length group (`out_of_range`: a header that
misreported the length) is left out and returned with its reason.

Usage:
    result = write_audio_shard(AudioShardJob("data/wds_audio/train/data-00000.tar",
                                             entries, recordings, "opus"))
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import tarfile
from typing import Any

import numpy as np

from cat.audio import codec
from cat.core.io import atomic_write
from cat.features.extract import segment_span
from cat.features.fbank import AudioError, num_frames, read_audio_with_channels
from cat.features.plan import DEFAULT_MAX_OVERSHOOT
from cat.formats.audio_tables import SAMPLE_RATE
from cat.formats.shard_format import encode_key
from cat.formats.shard_writer import ChecksumWriter, add_member

# One utterance: (utt, recording number in `AudioShardJob.recordings`, start, end,
# transcript, frames planned from the audio header).
AudioEntry = tuple[str, int, float, float, str, int]


@dataclasses.dataclass
class AudioShardJob:
    """One audio shard to write; entries of a recording are consecutive, in time order.

    `frame_range` is the folder's length group `(low, high or None)`; `fingerprint`
    identifies the inputs so a re-run can keep a finished shard.
    """

    path: str
    entries: list[AudioEntry]
    recordings: list[str]
    audio_format: str
    opus_bitrate: int = codec.DEFAULT_OPUS_BITRATE
    max_overshoot: float = DEFAULT_MAX_OVERSHOOT
    frame_range: tuple[int, int | None] = (0, None)
    fingerprint: str = ""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def read_recording(spec: str, conversions: collections.Counter) -> np.ndarray:
    """A `wav.scp` value decoded, channel 0, at 16 kHz; conversions are counted."""
    waveform, rate, channels = read_audio_with_channels(spec)
    if rate != SAMPLE_RATE:
        conversions[f"recording(s) resampled from {rate} Hz to {SAMPLE_RATE} Hz"] += 1
        waveform = codec.resample(waveform, rate, SAMPLE_RATE)
    if channels > 1:
        conversions[f"recording(s) of {channels} channels: channel 0 used"] += 1
    return waveform


def _cut(job: AudioShardJob, entry: AudioEntry, waveform: np.ndarray,
         conversions: collections.Counter) -> tuple[np.ndarray, int] | tuple[str, str]:
    """An utterance's samples and frame count, or its drop reason and detail."""
    _, _, start, end, _, planned = entry
    span = segment_span(start, end, len(waveform), SAMPLE_RATE, job.max_overshoot)
    if isinstance(span, str):
        return "bad_segment", span
    count = num_frames(span[1] - span[0])
    if count != planned:
        conversions["utterance(s) whose frames differ from what the audio header said "
                    "(the index has the decoded ones)"] += 1
    low, high = job.frame_range
    if count == 0:
        return "too_short", f"{span[1] - span[0]} samples at {SAMPLE_RATE} Hz"
    if count < low or (high is not None and count >= high):
        return "out_of_range", f"num_frames={count} group={low}:{'' if high is None else high}"
    return waveform[span[0]:span[1]], count


def write_audio_shard(job: AudioShardJob) -> dict[str, Any]:
    """Write one audio shard atomically (see the module doc).

    Returns `num_bytes`, `crc32`, the `keys` and `frames` written in tar order, the
    `dropped` utterances (`[utt, "<reason> <detail>"]`) and `conversions` (counts).
    """
    keys: list[str] = []
    frames: list[int] = []
    dropped: list[list[str]] = []
    conversions: collections.Counter = collections.Counter()
    with atomic_write(job.path, "wb") as raw:
        sink = ChecksumWriter(raw)
        with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT,
                          copybufsize=1 << 20) as tar:
            for number, run in itertools.groupby(job.entries, key=lambda e: e[1]):
                run = list(run)
                try:
                    waveform = read_recording(job.recordings[number], conversions)
                except AudioError as error:
                    dropped += [[entry[0], f"bad_audio {_one_line(error)}"] for entry in run]
                    continue
                for entry in run:
                    cut = _cut(job, entry, waveform, conversions)
                    if isinstance(cut[0], str):
                        dropped.append([entry[0], f"{cut[0]} {_one_line(cut[1])}"])
                        continue
                    name = encode_key(entry[0])
                    data = codec.encode(cut[0], SAMPLE_RATE, job.audio_format,
                                        job.opus_bitrate)
                    add_member(tar, f"{name}.{job.audio_format}", data)
                    add_member(tar, f"{name}.txt", entry[4].encode("utf-8"))
                    keys.append(entry[0])
                    frames.append(cut[1])
    return {"num_bytes": sink.size, "crc32": f"{sink.crc32:08x}", "keys": keys,
            "frames": frames, "dropped": dropped, "conversions": dict(conversions)}
