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
mean absolute difference of 80-dim log-mel features). Anything else the direct path does
not take (more channels, chained streams, no libopus) goes to libsndfile.

Damaged and hostile data is refused before it costs memory (`AudioDecodeError`, naming
the data): every Ogg page is checked (complete, its CRC, packets continued in order, each
stream from its first page to its last, so a cut stream is `truncated`, not decoded in
part); the length a header claims (WAV/FLAC headers, an Ogg stream's last granule
position) is checked, before anything is allocated, against what so many bytes of the
format can hold (`MAX_FRAMES_PER_BYTE`: Opus at most 2880 samples at 48 kHz per byte,
since every packet is at least one byte plus its lacing byte and at most 120 ms), and
against `max_samples`, the longest audio the caller wants (`AudioTooLongError`, which
carries the claimed length, so a loader drops it by its length filter undecoded); audio
that decodes to fewer samples than its header claims is `truncated`; files read in pieces
(`check_file_complete`) must end with their Ogg stream's last page, and an MP3 must hold
the bytes its Xing header records. Any other failure
of the decoders, of whatever type (a `MemoryError` included), becomes an
`AudioDecodeError` naming the data, so one bad member never ends a training run.
`MAX_BYTES_PER_SECOND` bounds the bytes per second of audio of each format, for readers
that refuse members too large for the length they accept before reading them.

Resampling uses libsoxr (`soxr`, quality "HQ": a linear-phase low-pass with its stopband
from the lower Nyquist frequency on), the library sox's `rate` effect comes from. It was
chosen over torchaudio's default band-limited sinc (`torchaudio.functional.resample`: 6
zero crossings, rolloff 0.99) by measurement (`bench/audio_bytes.py`, one core):
torchaudio leaves a tone above the new Nyquist frequency only 11 dB down (aliasing into
the top mel bins) and loses 1.8 dB at 7 kHz, where soxr removes it by 136 dB or more and
keeps 7 kHz within 0.01 dB; soxr was 3 to 4 times faster from 48, 44.1 and 8 kHz, 0.7
times as fast from 22.05 kHz, and runs at about 5 000 times real time at the 9:10
and 11:10 ratios of speed perturbation (0.7 to 0.8 times torchaudio's speed there).

Usage:
    data = encode(waveform, 16000, "opus")
    waveform, rate = decode(data, name="shard-00001.tar:A/B/utt.1.opus", sample_rate=16000,
                            max_samples=16000 * 20)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import io
import logging
import math
import re
import zlib
from typing import BinaryIO, NamedTuple

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


#: The most frames (samples per channel) one byte of each container can hold, however
#: well it compresses: a claim above `len(data) x` this is a damaged or hostile header.
#: Ogg: an Opus packet gives at most 120 ms (5760 samples at 48 kHz) and takes at least
#: one byte and one lacing byte (a Vorbis packet at most 4096 samples, likewise);
#: FLAC: a frame of at most 65535 samples takes at least about 8 bytes (a constant
#: subframe); MPEG: 1152 samples a frame of at least 24 bytes; WAV: 16 for codecs such
#: as GSM 6.10 (10 samples a byte), PCM is 1 to 8 bytes a sample.
MAX_FRAMES_PER_BYTE = {"OGG": 2880, "FLAC": 8192, "MPEG": 64, "WAV": 16}
#: For a container not listed above.
DEFAULT_MAX_FRAMES_PER_BYTE = 8192
#: The most bytes one second of audio takes in each format (the shard member extension):
#: PCM of 8 channels of 32-bit samples at 48 kHz for `wav` and `flac` (FLAC never
#: exceeds its PCM by more than its frame headers); 8 channels at Opus's 510 kbit/s
#: top for `opus` and Vorbis's for `ogg`, with their Ogg pages; 640 kbit/s (free
#: format) for `mp3`. Generous, as a bound must be: audio of more channels or higher
#: rates would need more.
MAX_BYTES_PER_SECOND = {"wav": 1_536_000, "flac": 1_600_000, "opus": 540_000,
                        "ogg": 540_000, "mp3": 80_000}


class AudioDecodeError(ValueError):
    """Bytes that are not decodable audio; the message names where they came from."""


class AudioTooLongError(AudioDecodeError):
    """Audio whose header claims more samples than the caller's `max_samples`; nothing was
    decoded. `num_samples` is the claimed length at the rate `decode` would return."""

    def __init__(self, message: str, num_samples: int) -> None:
        super().__init__(message)
        self.num_samples = num_samples


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
           sample_rate: int | None = None, source: dict[str, int] | None = None,
           max_samples: int | None = None) -> tuple[np.ndarray, int]:
    """Decode WAV, FLAC or Ogg Opus bytes -> `(float32 mono samples in [-1, 1), rate)`.

    `name` says where the bytes came from (`shard.tar:key.opus`, an S3 URL, a file) and
    is part of every error message. With `sample_rate`, the samples are resampled to it
    and that rate is returned. Channel 0 of multi-channel audio is used; `source`, when
    given, receives the data's own `rate` and `channels` (see `conversion_notes`).
    `max_samples` (at the returned rate): audio whose header claims more raises
    `AudioTooLongError` before anything is decoded (MP3, whose length libsndfile may
    only estimate, is decoded and left to the caller).
    Raises `AudioDecodeError` for empty, undecodable, damaged or truncated data (fewer
    samples than its header or last Ogg page claims, an Ogg stream cut short), for a
    claimed length no data of its size can hold (`MAX_FRAMES_PER_BYTE`), and for any
    other failure of the decoders, whatever its type.
    """
    if len(data) == 0:
        raise AudioDecodeError(f"cannot decode audio {name}: no bytes")
    try:
        waveform, rate = _decode(data, name, sample_rate, source, max_samples)
        if sample_rate is not None and sample_rate != rate:
            return resample(waveform, rate, sample_rate), sample_rate
        return waveform, rate
    except AudioDecodeError:
        raise
    except Exception as error:  # any failure on these bytes is theirs, not the run's
        raise AudioDecodeError(f"cannot decode audio {name}: {type(error).__name__}: "
                               f"{error}") from None


def _decode(data: bytes | bytearray | memoryview, name: str, sample_rate: int | None,
            source: dict[str, int] | None, max_samples: int | None
            ) -> tuple[np.ndarray, int]:
    if bytes(data[:4]) == b"OggS":
        pages = ogg_pages(data, name)
        decoded = decode_ogg_opus(data, sample_rate, source, max_samples, name, pages)
        if decoded is not None:
            return decoded
    else:
        check_file_complete(io.BytesIO(data), name)  # an MP3 cut short
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as audio:
            _check_not_truncated(audio, name)
            _check_claim(audio.frames, audio.samplerate, len(data), audio.format, name,
                         sample_rate, None if audio.format == "MPEG" else max_samples)
            samples = audio.read(dtype="float32", always_2d=True)
            rate = audio.samplerate
            if len(samples) < audio.frames and audio.format != "MPEG":
                raise AudioDecodeError(f"truncated audio {name}: its header claims "
                                       f"{audio.frames} samples, {len(samples)} decoded")
    except (soundfile.LibsndfileError, RuntimeError, EOFError) as error:
        raise AudioDecodeError(f"cannot decode audio {name}: {error}") from None
    if source is not None:
        source.update(rate=rate, channels=samples.shape[1])
    return np.ascontiguousarray(samples[:, 0]), rate


def resampled_length(num_samples: int, orig_rate: float, new_rate: float) -> int:
    """Length of `resample`'s output for `num_samples` input samples."""
    if orig_rate == new_rate:
        return num_samples
    return math.floor(num_samples * new_rate / orig_rate + 0.5)


def _check_claim(frames: int, rate: int, num_bytes: int, container: str, name: str,
                 sample_rate: int | None, max_samples: int | None) -> None:
    """Refuse a claimed length (`frames` at `rate`) that `num_bytes` of `container` cannot
    hold, or (`AudioTooLongError`) one above `max_samples` at the output rate."""
    bound = MAX_FRAMES_PER_BYTE.get(container, DEFAULT_MAX_FRAMES_PER_BYTE) * num_bytes
    if frames > bound:
        raise AudioDecodeError(f"corrupt audio {name}: its header claims {frames} samples, "
                               f"more than {num_bytes} bytes of {container} can hold (at "
                               f"most {bound})")
    claimed = resampled_length(frames, rate, sample_rate or rate)
    if max_samples is not None and claimed > max_samples:
        raise AudioTooLongError(f"audio {name}: its header claims {claimed} samples at "
                                f"{sample_rate or rate} Hz, more than the {max_samples} "
                                "wanted; not decoded", claimed)


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


#: The largest Ogg page: its header, 255 lacing values and 255 segments of 255 bytes.
_OGG_MAX_PAGE = 27 + 255 + 255 * 255


def check_file_complete(file: BinaryIO, name: str) -> None:
    """Raise `AudioDecodeError` (`truncated audio <name>: ...`) when an Ogg file (Opus,
    Vorbis, FLAC in Ogg) or an MP3 file with a Xing/Info header is cut short, which
    libsndfile reads without a word as shorter audio. Reads only the file's first bytes
    and its last page (at most 64 KB), whatever its length; leaves `file` at its start.

    An Ogg file must end with a complete page (its CRC right) that ends its stream (the
    EOS flag), as every Ogg writer closes one; an MP3's Xing or Info header (LAME and
    libsndfile write one) records the bytes of the whole stream. (WAV: see
    `_check_not_truncated`; FLAC cut short fails to decode, `lost sync`.)"""
    size = file.seek(0, io.SEEK_END)
    file.seek(0)
    head = file.read(10)
    try:
        if head[:4] == b"OggS":
            file.seek(max(0, size - _OGG_MAX_PAGE))
            reason = _ogg_tail_problem(file.read(), name)
        else:
            reason = _mp3_size_problem(file, head, size)
    finally:
        file.seek(0)
    if reason:
        raise AudioDecodeError(f"truncated audio {name}: {reason}")


def _ogg_tail_problem(tail: bytes, name: str) -> str | None:
    """Why the `tail` of an Ogg file does not end its last stream, or None."""
    position = tail.find(b"OggS")
    while position >= 0:
        if position + 27 <= len(tail):
            lacing = tail[position + 27:position + 27 + tail[position + 26]]
            if position + 27 + len(lacing) + sum(lacing) == len(tail):
                with contextlib.suppress(AudioDecodeError):
                    page = _ogg_page(tail, position, name)
                    if page.header_type & _OGG_LAST:
                        return None
                    return (f"its last Ogg page (stream {page.serial}) does not end the "
                            "stream: the file is cut short after it")
        position = tail.find(b"OggS", position + 1)
    return "its last Ogg page is cut short (the file ends inside it)"


def _mp3_size_problem(file: BinaryIO, head: bytes, size: int) -> str | None:
    """Why an MP3 file is shorter than its Xing/Info header records, or None (also for
    an MP3 without one, whose length nothing records)."""
    start = 0
    if head[:3] == b"ID3" and len(head) == 10:  # ID3v2: a synchsafe size after the header
        start = 10 + sum((byte & 0x7F) << (7 * (3 - i)) for i, byte in enumerate(head[6:10]))
        if head[5] & 0x10:
            start += 10  # its footer
    file.seek(start)
    frame = file.read(200)
    if len(frame) < 4 or frame[0] != 0xFF or frame[1] & 0xE0 != 0xE0:
        return None  # not an MPEG frame here: left to libsndfile
    tag = max(frame.find(b"Xing"), frame.find(b"Info"))
    if tag < 0 or len(frame) < tag + 16:
        return None
    flags = int.from_bytes(frame[tag + 4:tag + 8], "big")
    if not flags & 0x2:
        return None  # no byte count recorded
    field = tag + 8 + (4 if flags & 0x1 else 0)
    declared = int.from_bytes(frame[field:field + 4], "big")
    present = size - start
    if declared > present:
        return f"its Xing header declares {declared} bytes of MPEG audio, the file holds {present}"
    return None


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


class OggPage(NamedTuple):
    """One checked Ogg page: where it starts, its header fields, its lacing values, where
    its body starts and where the page ends."""

    position: int
    header_type: int
    serial: int
    granule: int
    lacing: bytes
    body: int
    end: int


def ogg_pages(data: bytes | bytearray | memoryview, name: str = "Ogg data") -> list[OggPage]:
    """The pages of Ogg data, every one checked: complete, with its CRC, its packets
    continuing those of the stream's previous page, and each logical stream running from
    a first page (BOS) to a last one (EOS). Raises `AudioDecodeError` naming `name`:
    `truncated audio` for data cut short (a stream without its last page included),
    `corrupt audio` for the rest."""
    data = bytes(data)
    pages: list[OggPage] = []
    open_packet: dict[int, bool] = {}  # serial -> a packet continues on the next page
    ended: set[int] = set()
    position = 0
    while position < len(data):
        page = _ogg_page(data, position, name)
        flags, serial = page.header_type, page.serial
        first = serial not in open_packet
        if first != bool(flags & _OGG_FIRST) or serial in ended:
            raise AudioDecodeError(f"corrupt audio {name}: the Ogg page at byte {position} "
                                   f"{'starts' if first else 'restarts'} stream {serial} "
                                   "out of order")
        if bool(flags & _OGG_CONTINUED) != open_packet.get(serial, False):
            raise AudioDecodeError(f"corrupt audio {name}: the Ogg page at byte {position} "
                                   "breaks its stream's packet sequence")
        if page.lacing:
            open_packet[serial] = page.lacing[-1] == 255
        else:
            open_packet.setdefault(serial, False)
        if flags & _OGG_LAST:
            ended.add(serial)
        pages.append(page)
        position = page.end
    unfinished = sorted(set(open_packet) - ended)
    if unfinished:
        raise AudioDecodeError(f"truncated audio {name}: Ogg stream {unfinished[0]} ends "
                               "without its last page (cut short)")
    return pages


def _ogg_page(data: bytes, position: int, name: str) -> OggPage:
    if data[position:position + 4] != b"OggS":
        raise AudioDecodeError(f"corrupt audio {name}: no Ogg page at byte {position}")
    num_segments = data[position + 26] if position + 27 <= len(data) else 256
    lacing = data[position + 27:position + 27 + num_segments]
    body = position + 27 + num_segments
    end = body + sum(lacing)
    if len(lacing) < num_segments or end > len(data):
        raise AudioDecodeError(f"truncated audio {name}: the Ogg page at byte {position} "
                               "is cut short")
    page = bytearray(data[position:end])
    crc = int.from_bytes(page[22:26], "little")
    page[22:26] = bytes(4)
    if ogg_crc(page) != crc:
        raise AudioDecodeError(f"corrupt audio {name}: the Ogg page at byte {position} "
                               "fails its CRC")
    return OggPage(position, data[position + 5],
                   int.from_bytes(data[position + 14:position + 18], "little"),
                   int.from_bytes(data[position + 6:position + 14], "little", signed=True),
                   lacing, body, end)


def ogg_packets(data: bytes | bytearray | memoryview, name: str = "Ogg data",
                pages: list[OggPage] | None = None) -> tuple[list[bytes], int] | None:
    """The packets of a single-stream Ogg file and the granule position of its last page;
    None for several streams (chained or multiplexed). `pages`: `ogg_pages(data, name)`,
    which raises `AudioDecodeError` for damaged or truncated data."""
    pages = ogg_pages(data, name) if pages is None else pages
    if len({page.serial for page in pages}) > 1:
        return None
    data = bytes(data)
    packets: list[bytes] = []
    pending = b""
    for page in pages:
        start = cut = page.body
        for size in page.lacing:
            start += size
            if size < 255:
                packets.append(pending + data[cut:start])
                pending, cut = b"", start
        if cut < start:
            pending += data[cut:start]
    return packets, pages[-1].granule


def decode_ogg_opus(data: bytes | bytearray | memoryview, sample_rate: int | None = None,
                    source: dict[str, int] | None = None, max_samples: int | None = None,
                    name: str = "Ogg Opus data", pages: list[OggPage] | None = None
                    ) -> tuple[np.ndarray, int] | None:
    """Ogg Opus (one or two channels) -> `(float32 samples of channel 0, rate)` by libopus,
    at `sample_rate` if Opus decodes at it, else at libsndfile's rate
    (`opus_output_rate`); None for anything else, which `decode` leaves to libsndfile.
    `source` receives what libsndfile would report: the rate of the encoder's input
    (`opus_output_rate`) and the channels. The length the last page claims is checked
    before anything is allocated (see `decode`: `max_samples`, `MAX_FRAMES_PER_BYTE`);
    damaged, truncated or hostile data raises `AudioDecodeError` naming `name`."""
    lib = _libopus()
    first = 27 + data[26] if len(data) > 27 else 0
    if lib is None or bytes(data[first:first + 8]) != _OPUS_HEAD:
        return None  # Vorbis, FLAC in Ogg, or no libopus
    parsed = ogg_packets(data, name, pages)
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
    # Ogg Opus: the first pre_skip samples (at 48 kHz) are the codec's delay; the last
    # page's granule position (at 48 kHz, pre-skip included) is where the audio ends.
    _check_claim(max(granule - pre_skip, 0), 48000, len(data), "OGG", name, None, None)
    length = max(granule - pre_skip, 0) // (48000 // rate)
    _check_claim(length, rate, len(data), "OGG", name, sample_rate, max_samples)
    if source is not None:
        source.update(rate=opus_output_rate(input_rate), channels=channels)
    return _decode_opus_packets(lib, packets[2:], rate, channels, gain,
                                (pre_skip // (48000 // rate), length), name)


def _decode_opus_packets(lib: ctypes.CDLL, packets: list[bytes], rate: int, channels: int,
                         gain: int, span: tuple[int, int], name: str
                         ) -> tuple[np.ndarray, int] | None:
    """Channel 0 of the `span` (`(start, length)`, at `rate`) of the decoded packets; None
    where libopus cannot start or rejects a packet (libsndfile then tries)."""
    start, length = span
    error = ctypes.c_int()
    decoder = lib.opus_decoder_create(rate, channels, ctypes.byref(error))
    if not decoder or error.value != 0:
        return None
    try:
        if gain and lib.opus_decoder_ctl(ctypes.c_void_p(decoder), _OPUS_SET_GAIN,
                                         ctypes.c_int(gain)) != 0:
            return None
        max_frame = _OPUS_MAX_FRAME // (48000 // rate)
        out = np.empty((start + length + max_frame) * channels, np.float32)
        filled, address = 0, out.ctypes.data
        for packet in packets:
            if filled >= start + length:
                break  # what follows is past the end the last page gives
            if not packet:
                raise AudioDecodeError(f"corrupt audio {name}: an empty Opus packet")
            count = lib.opus_decode_float(decoder, packet, len(packet),
                                          address + 4 * filled * channels, max_frame, 0)
            if count < 0:
                return None
            filled += count
    finally:
        lib.opus_decoder_destroy(decoder)
    if filled < start + length:
        raise AudioDecodeError(f"truncated audio {name}: its last Ogg page ends the audio at "
                               f"{length} samples ({rate} Hz), its packets hold "
                               f"{max(filled - start, 0)}")
    return np.ascontiguousarray(out[start * channels:(start + length) * channels:channels]), rate


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
