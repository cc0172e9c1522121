"""Encode mono waveforms to WAV, FLAC or Ogg Opus bytes, decode them back, resample.

Formats (the extension of an audio shard member; soundfile/libsndfile does the work):

    wav    16-bit PCM, RIFF/WAVE: lossless, 32 000 bytes per second at 16 kHz
    flac   16-bit FLAC, libsndfile's default compression: lossless
    opus   Ogg Opus (libopus through libsndfile >= 1.0.29; the bundled 1.2.2 has it),
           sample rate 8, 12, 16, 24 or 48 kHz, variable bitrate around
           `DEFAULT_OPUS_BITRATE` (32 kbit/s), encoder complexity 10, 20 ms frames

Opus is lossy. At 32 kbit/s on 16 kHz speech with a 30 dB noise floor, the 80-dim
log-mel features of the decoded audio differ from those of the original by 0.36 on
average (natural log), mostly because Opus drops part of the noise above about 3 kHz
(bins 54 to 79 lose 0.3 to 0.85 of mean log energy); at 64 kbit/s the mean difference
is 0.12 and the per-bin means agree within 0.15. Choose the bitrate with that in mind
(`bench/audio_bytes.py` prints the bytes per hour of each). libsndfile takes the Opus
bitrate as a "compression level" in [0, 1], mapped linearly onto 256 down to 6 kbit/s per
channel; `encode` converts. libsndfile also picks a random Ogg stream serial number;
`encode` rewrites it to a fixed one, so the same samples always give the same bytes.

Decoding gives float32 samples in [-1, 1) at the rate stored in the data (Opus: the
input rate recorded in its header), channel 0 of multi-channel audio, like the stage-1
features (`cat.features.extract.read_audio`). `decode(..., sample_rate=16000)` also
resamples.

Resampling uses libsoxr (`soxr`, quality "HQ": a linear-phase low-pass with its stopband
from the lower Nyquist frequency on), the library sox's `rate` effect comes from. It was
chosen over torchaudio's default band-limited sinc (`torchaudio.functional.resample`: 6
zero crossings, rolloff 0.99) by measurement (`bench/audio_bytes.py`, one core):
torchaudio leaves a tone above the new Nyquist frequency only 11 dB down (aliasing into
the top mel bins) and loses 1.8 dB at 7 kHz, where soxr removes it by 136 dB or more and
keeps 7 kHz within 0.01 dB; soxr was 3 to 4 times faster from 48, 44.1 and 8 kHz, 0.7
to 1.0 times as fast from 22.05 kHz, and runs at about 5 000 times real time at the 9:10
and 11:10 ratios of speed perturbation (0.7 to 0.9 times torchaudio's speed there).

Usage:
    data = encode(waveform, 16000, "opus")
    waveform, rate = decode(data, name="shard-00001.tar:A/B/utt.1.opus", sample_rate=16000)
"""

from __future__ import annotations

import io
import re
import zlib

import numpy as np
import soundfile
import soxr

FORMATS = ("wav", "flac", "opus")
#: Extensions of the audio `decode` reads in shards and lists: what the packers write,
#: and Ogg Vorbis and MP3 as other tools' shards may hold them.
READ_EXTENSIONS = (*FORMATS, "ogg", "mp3")
# soundfile (major format, subtype) of each format.
_SOUNDFILE_FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"),
                      "opus": ("OGG", "OPUS")}
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
DEFAULT_OPUS_BITRATE = 32000
# libsndfile's Opus "compression level" q means (1 - q) * 250 000 + 6 000 bit/s per channel.
_OPUS_MIN_BITRATE, _OPUS_MAX_BITRATE = 6000, 256000
# Any fixed value: every member is a stream of its own, so serial numbers never meet.
OGG_SERIAL = 1
INT16_SCALE = 32768.0
RESAMPLE_QUALITY = "HQ"
_WAV_DATA_MISMATCH = re.compile(r"^data\s*:\s*(\d+)\s*\(should be (\d+)\)", re.MULTILINE)
# WAV headers written to a pipe carry a placeholder data length at or above this.
_STREAMED_WAV_LENGTH = 0x7FFF0000


class AudioDecodeError(ValueError):
    """Bytes that are not decodable audio; the message names where they came from."""


def to_int16(waveform: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1) (clipped) or int16 samples -> int16, as Kaldi reads audio."""
    waveform = np.asarray(waveform)
    if waveform.dtype == np.int16:
        return waveform
    if not np.issubdtype(waveform.dtype, np.floating):
        raise TypeError(f"expected int16 or float samples, got {waveform.dtype}")
    return np.clip(np.round(waveform * INT16_SCALE), -32768, 32767).astype(np.int16)


def to_float32(waveform: np.ndarray) -> np.ndarray:
    """int16 samples (scaled by 1/32768) or float samples -> float32."""
    waveform = np.asarray(waveform)
    if waveform.dtype == np.int16:
        return waveform.astype(np.float32) / np.float32(INT16_SCALE)
    if not np.issubdtype(waveform.dtype, np.floating):
        raise TypeError(f"expected int16 or float samples, got {waveform.dtype}")
    return waveform.astype(np.float32, copy=False)


def _check_mono(waveform: np.ndarray) -> np.ndarray:
    waveform = np.asarray(waveform)
    if waveform.ndim != 1:
        raise ValueError(f"expected a mono (1-D) waveform, got shape {waveform.shape}")
    return waveform


def opus_compression_level(bitrate: int) -> float:
    """libsndfile's Opus compression level for a target bitrate (bit/s) of one channel."""
    if not _OPUS_MIN_BITRATE <= bitrate <= _OPUS_MAX_BITRATE:
        raise ValueError(f"Opus bitrate must be in [{_OPUS_MIN_BITRATE}, {_OPUS_MAX_BITRATE}] "
                         f"bit/s, got {bitrate}")
    return 1.0 - (bitrate - _OPUS_MIN_BITRATE) / (_OPUS_MAX_BITRATE - _OPUS_MIN_BITRATE)


def encode(waveform: np.ndarray, sample_rate: int, audio_format: str,
           opus_bitrate: int = DEFAULT_OPUS_BITRATE) -> bytes:
    """Encode a mono waveform (int16, or float in [-1, 1)) as `wav`, `flac` or `opus` bytes.

    WAV and FLAC store 16-bit samples: float input is rounded as `to_int16` does, so
    `decode(encode(x))` gives back `to_int16(x) / 32768` exactly. Opus needs one of
    `OPUS_SAMPLE_RATES` (resample first); `opus_bitrate` is its target in bit/s.
    """
    if audio_format not in _SOUNDFILE_FORMATS:
        raise ValueError(f"unknown audio format {audio_format!r}; expected one of {FORMATS}")
    waveform = _check_mono(waveform)
    major, subtype = _SOUNDFILE_FORMATS[audio_format]
    buffer = io.BytesIO()
    if audio_format == "opus":
        if sample_rate not in OPUS_SAMPLE_RATES:
            raise ValueError(f"Opus cannot store {sample_rate} Hz audio; resample to one of "
                             f"{OPUS_SAMPLE_RATES} first")
        level = opus_compression_level(opus_bitrate)
        soundfile.write(buffer, to_float32(waveform), sample_rate, format=major,
                        subtype=subtype, compression_level=level)
        return set_ogg_serial(buffer.getvalue(), OGG_SERIAL)
    soundfile.write(buffer, to_int16(waveform), sample_rate, format=major, subtype=subtype)
    return buffer.getvalue()


def decode(data: bytes | bytearray | memoryview, name: str,
           sample_rate: int | None = None, source: dict[str, int] | None = None
           ) -> tuple[np.ndarray, int]:
    """Decode WAV, FLAC or Ogg Opus bytes -> `(float32 mono samples in [-1, 1), rate)`.

    `name` says where the bytes came from (`shard.tar:key.opus`, an S3 URL, a file) and
    is part of every error message. With `sample_rate`, the samples are resampled to it
    and that rate is returned. Channel 0 of multi-channel audio is used; `source`, when
    given, receives the data's own `rate` and `channels` (see `conversion_notes`).
    Raises `AudioDecodeError` for empty, undecodable or truncated data (a WAV whose data
    chunk is shorter than its header declares).
    """
    if len(data) == 0:
        raise AudioDecodeError(f"cannot decode audio {name}: no bytes")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as audio:
            _check_not_truncated(audio, name)
            samples = audio.read(dtype="float32", always_2d=True)
            rate = audio.samplerate
    except (soundfile.LibsndfileError, RuntimeError, EOFError) as error:
        raise AudioDecodeError(f"cannot decode audio {name}: {error}") from None
    waveform = np.ascontiguousarray(samples[:, 0])
    if source is not None:
        source.update(rate=rate, channels=samples.shape[1])
    if sample_rate is not None and sample_rate != rate:
        return resample(waveform, rate, sample_rate), sample_rate
    return waveform, rate


def conversion_notes(rate: int, channels: int, sample_rate: int) -> list[str]:
    """What was done to audio of `rate` Hz and `channels` to make it `sample_rate` Hz mono,
    in the words stage 1 and the streaming loader count it with."""
    notes = []
    if rate != sample_rate:
        notes.append(f"resampled from {rate} Hz to {sample_rate} Hz")
    if channels > 1:
        notes.append(f"{channels} channels, channel 0 used")
    return notes


def _check_not_truncated(audio: soundfile.SoundFile, name: str) -> None:
    """libsndfile reads what is there of a short WAV data chunk; its header log says so."""
    match = _WAV_DATA_MISMATCH.search(audio.extra_info)
    if match is None:
        return
    declared, present = int(match.group(1)), int(match.group(2))
    # One byte of slack: a missing pad byte after odd-sized data is harmless.
    if declared < _STREAMED_WAV_LENGTH and declared > present + 1:
        raise AudioDecodeError(f"truncated audio {name}: header declares {declared} data "
                               f"bytes, {present} present")


def resample(waveform: np.ndarray, orig_rate: float, new_rate: float) -> np.ndarray:
    """Resample a mono waveform with libsoxr "HQ" (see the module docstring) -> float32.

    Rates may be fractional (a speed change). The output has
    `floor(len * new_rate / orig_rate + 0.5)` samples, as sox's `rate` effect gives.
    """
    waveform = to_float32(_check_mono(waveform))
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} -> {new_rate}")
    if orig_rate == new_rate or waveform.size == 0:
        return waveform
    return soxr.resample(waveform, orig_rate, new_rate, quality=RESAMPLE_QUALITY)


# ---------------------------------------------------------------------- Ogg serial numbers

# Bit order reversal of every byte value, for the CRC below.
_REVERSED_BITS = bytes(int(f"{value:08b}"[::-1], 2) for value in range(256))
_REVERSE_TABLE = bytes.maketrans(bytes(range(256)), _REVERSED_BITS)


def ogg_crc(data: bytes | bytearray | memoryview) -> int:
    """The CRC of an Ogg page: CRC-32, polynomial 0x04C11DB7, not reflected, init 0.

    zlib computes the reflected CRC with the same polynomial; reversing the bits of every
    input byte and of the result turns one into the other, at zlib's speed.
    """
    reflected = zlib.crc32(bytes(data).translate(_REVERSE_TABLE), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int(f"{reflected:032b}"[::-1], 2)


def set_ogg_serial(data: bytes, serial: int) -> bytes:
    """Rewrite the stream serial number of every Ogg page (and the page CRCs)."""
    out = bytearray(data)
    position = 0
    while position < len(out):
        if out[position:position + 4] != b"OggS" or position + 27 > len(out):
            raise ValueError(f"not an Ogg page at byte {position}")
        num_segments = out[position + 26]
        end = position + 27 + num_segments + sum(out[position + 27:position + 27 + num_segments])
        out[position + 14:position + 18] = serial.to_bytes(4, "little")
        out[position + 22:position + 26] = bytes(4)
        crc = ogg_crc(memoryview(out)[position:end])
        out[position + 22:position + 26] = crc.to_bytes(4, "little")
        position = end
    return bytes(out)
