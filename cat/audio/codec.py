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
input rate recorded in its header, rounded up to a rate Opus decodes at, as libsndfile
does), channel 0 of multi-channel audio, like the stage-1 features
(`cat.features.extract.read_audio`). `decode(..., sample_rate=16000)` also resamples.

Ogg Opus with one or two channels is decoded by libopus directly (`ctypes`, the system's
`libopus.so.0`), not through libsndfile: the same samples, bit for bit, at about 1.5
times the speed (libsndfile's reads and seeks cost more than the codec). libopus decodes
at 8, 12, 16, 24 or 48 kHz whatever rate was encoded, so `decode(..., sample_rate=16000)`
of 48 kHz Opus decodes at 16 kHz (the codec's own band limit) instead of decoding at 48
kHz and resampling: 3 times less to decode and nothing to resample. The two differ by
what the codec itself loses (`tests/audio/test_codec.py`: `OPUS_DIRECT_RATE_TOLERANCE`,
mean absolute difference of 80-dim log-mel features). Anything the direct path does not
take (more channels, chained streams, a page that fails its CRC, a truncated stream, no
libopus) goes to libsndfile, which decodes it or names the error.

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

import ctypes
import ctypes.util
import functools
import io
import logging
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
logger = logging.getLogger(__name__)


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
    if bytes(data[:4]) == b"OggS":
        decoded = decode_ogg_opus(data, sample_rate, source)
        if decoded is not None:
            waveform, rate = decoded
            if sample_rate is not None and sample_rate != rate:
                return resample(waveform, rate, sample_rate), sample_rate
            return waveform, rate
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


# ------------------------------------------------------------------- Ogg Opus with libopus

_OPUS_HEAD, _OPUS_TAGS = b"OpusHead", b"OpusTags"
_OPUS_SET_GAIN = 4034  # OPUS_SET_GAIN_REQUEST of opus_defines.h
_OPUS_MAX_FRAME = 5760  # 120 ms at 48 kHz, the longest packet
_OGG_CONTINUED, _OGG_FIRST, _OGG_LAST = 1, 2, 4


@functools.lru_cache(maxsize=1)
def _libopus() -> ctypes.CDLL | None:
    """libopus's decoder functions, or None (and libsndfile decodes) where it is missing."""
    path = ctypes.util.find_library("opus") or "libopus.so.0"
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        logger.info("libopus not found (%s): Opus is decoded through libsndfile", path)
        return None
    lib.opus_decoder_create.restype = ctypes.c_void_p
    lib.opus_decoder_create.argtypes = [ctypes.c_int32, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_int)]
    lib.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
    lib.opus_decode_float.restype = ctypes.c_int
    lib.opus_decode_float.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def opus_output_rate(input_rate: int) -> int:
    """The rate libsndfile decodes Opus at: the input rate of its header rounded up to one
    of `OPUS_SAMPLE_RATES` (48 kHz above them)."""
    return next((rate for rate in OPUS_SAMPLE_RATES if rate >= input_rate), 48000)


def ogg_packets(data: bytes | bytearray | memoryview) -> tuple[list[bytes], int] | None:
    """The packets of a single-stream Ogg file and the granule position of its last page;
    None if it is not one, or a page is truncated or fails its CRC."""
    data = bytes(data)
    packets: list[bytes] = []
    pending = b""
    position, serial, granule = 0, None, -1
    while position < len(data):
        if data[position:position + 4] != b"OggS" or position + 27 > len(data):
            return None
        header_type = data[position + 5]
        page_serial = int.from_bytes(data[position + 14:position + 18], "little")
        if serial is None:
            serial = page_serial
        elif page_serial != serial or header_type & _OGG_FIRST:
            return None  # chained or multiplexed streams
        num_segments = data[position + 26]
        lacing = data[position + 27:position + 27 + num_segments]
        start = position + 27 + num_segments
        end = start + sum(lacing)
        if len(lacing) < num_segments or end > len(data):
            return None
        crc = int.from_bytes(data[position + 22:position + 26], "little")
        page = bytearray(data[position:end])
        page[22:26] = bytes(4)
        if ogg_crc(page) != crc:
            return None
        if bool(header_type & _OGG_CONTINUED) != bool(pending):
            return None
        granule = int.from_bytes(data[position + 6:position + 14], "little", signed=True)
        cut = start
        for size in lacing:
            start += size
            if size < 255:
                packets.append(pending + data[cut:start])
                pending, cut = b"", start
        if cut < start:
            pending += data[cut:start]
        position = end
    if pending or not packets or granule < 0:
        return None
    return packets, granule


def decode_ogg_opus(data: bytes | bytearray | memoryview, sample_rate: int | None = None,
                    source: dict[str, int] | None = None) -> tuple[np.ndarray, int] | None:
    """Ogg Opus (one or two channels) -> `(float32 samples of channel 0, rate)` by libopus,
    at `sample_rate` if Opus decodes at it, else at libsndfile's rate
    (`opus_output_rate`); None for anything else, which `decode` leaves to libsndfile.
    `source` receives what libsndfile would report: the rate of the encoder's input
    (`opus_output_rate`) and the channels."""
    lib = _libopus()
    first = 27 + data[26] if len(data) > 27 else 0
    if lib is None or bytes(data[first:first + 8]) != _OPUS_HEAD:
        return None  # Vorbis, FLAC in Ogg, or no libopus
    parsed = ogg_packets(data)
    if parsed is None:
        return None
    packets, granule = parsed
    head = packets[0]
    if len(packets) < 2 or len(head) < 19 or head[:8] != _OPUS_HEAD or \
            packets[1][:8] != _OPUS_TAGS:
        return None
    channels, pre_skip = head[9], int.from_bytes(head[10:12], "little")
    input_rate = int.from_bytes(head[12:16], "little")
    gain = int.from_bytes(head[16:18], "little", signed=True)
    if head[8] != 1 or head[18] != 0 or channels not in (1, 2) or input_rate == 0:
        return None
    rate = sample_rate if sample_rate in OPUS_SAMPLE_RATES else opus_output_rate(input_rate)
    if source is not None:
        source.update(rate=opus_output_rate(input_rate), channels=channels)
    factor = 48000 // rate
    error = ctypes.c_int()
    decoder = lib.opus_decoder_create(rate, channels, ctypes.byref(error))
    if not decoder or error.value != 0:
        return None
    try:
        if gain and lib.opus_decoder_ctl(ctypes.c_void_p(decoder), _OPUS_SET_GAIN,
                                         ctypes.c_int(gain)) != 0:
            return None
        max_frame = _OPUS_MAX_FRAME // factor
        out = np.empty((max(granule, 0) // factor + max_frame) * channels, np.float32)
        filled, address = 0, out.ctypes.data
        for packet in packets[2:]:
            if (filled + max_frame) * channels > out.size:
                out = np.concatenate([out, np.empty_like(out)])
                address = out.ctypes.data
            count = lib.opus_decode_float(decoder, packet, len(packet),
                                          address + 4 * filled * channels, max_frame, 0)
            if count < 0:
                return None
            filled += count
    finally:
        lib.opus_decoder_destroy(decoder)
    # Ogg Opus: the first pre_skip samples (at 48 kHz) are the codec's delay; the last
    # page's granule position (at 48 kHz, pre-skip included) is where the audio ends.
    start = pre_skip // factor
    stop = min(filled, max(granule - pre_skip, 0) // factor + start)
    return np.ascontiguousarray(out[start * channels:stop * channels:channels]), rate


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
