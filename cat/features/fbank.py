"""Kaldi-compatible log-mel filterbank features of a waveform, and the audio they come from.

* `read_audio`: a `wav.scp` entry (a file soundfile reads: WAV, FLAC, Ogg Opus...; or a
  Kaldi pipe command ending in `|`) as float samples and their rate; a WAV whose header
  promises more data than the file holds is an error (`AudioError`), as is a command
  that fails; a command the shell cannot run at all (status 126 or 127: the program is
  missing on this machine) is a `PipeCommandError`, which stops a job instead of skipping
  its utterances;
* `open_audio` / `read_channel`: the same entry opened, and channel 0 of any span of it
  read a block at a time (what transcription reads long recordings with);
* commands (`run_command`): run by `/bin/sh` in a process group of their own, their
  output written to a temporary file as it comes (not held in memory). A command gets
  `$CAT_WAV_SCP_TIMEOUT` seconds (default 600; 0: no limit) to write its audio and
  exit; after that its whole process group is killed and the entry is an `AudioError`
  (`command '<command>' did not finish within 600 s: killed (...)`), skipped and counted
  as a failing command is. The variable reaches every stage that reads `wav.scp`
  (stage 1, audio shards, transcription) and their worker processes and array tasks;
* `compute_fbank`: 80-dim log-mel fbank, the computation of
  `torchaudio.compliance.kaldi.fbank` (`FbankOptions`: 25 ms window, 10 ms shift, dither
  0 unless asked, other options at their Kaldi defaults; `high_freq`, `snip_edges` and
  `normalize_samples` as the front end asks) on audio scaled to the int16 range as Kaldi
  reads it; `num_frames` the frame count it gives for a number of samples;
* front ends (`FRONT_ENDS`, an experiment's `hyper-p.json: data.front_end`): Kaldi's
  defaults, and sherpa-onnx's (mel banks to 400 Hz below Nyquist, no snipped edges), so
  that a model trained on it runs in sherpa-onnx's recognizers as they come; stage 1
  records a feature dir's in its `fbank.json` (`write_front_end`, `read_front_end`,
  `check_front_end`);
  It takes the same steps in the same float32 order as torchaudio (DC offset, pre-emphasis,
  Povey window, 512-point real FFT, mel banks, log), but builds the window and mel banks
  once per `FbankOptions` (`fbank_tables`) and takes the power spectrum as re^2 + im^2
  instead of squaring complex magnitudes: 2.2 times as fast on one core (bench/README.md),
  within 1e-5 of torchaudio's (`tests/features/test_extract.py` holds it to 1e-5). Frames
  are computed `FBANK_WINDOW_FRAMES` (10 s) at a time, each window of N frames from its
  N * 160 + 240 samples, so a recording of hours takes about 10 MB besides its samples and
  features (before: about 9 KB per frame at once, 8 GB for 3 hours); the frames are those
  of the whole waveform (with dither, the noise is drawn window by window: reproducible
  with a seed, but not the noise of one draw).

Resampling (`cat.audio.codec.resample`) and speed perturbation (`cat.audio.speed`) are
libsoxr's, as sox does them: nothing the new rate cannot hold is left in the top bins.

Stage 1 (`cat.features.extract`) runs these over data directories; the streaming
loader can run them on audio shards.

Usage:
    samples, rate = read_audio("corpus/BAC009S0002W0122.wav")
    features = compute_fbank(samples, rate)  # [frames, 80] float32
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import soundfile
import torch
from torchaudio.compliance.kaldi import get_mel_banks

from cat.audio.codec import AudioDecodeError, check_file_complete, resample

logger = logging.getLogger(__name__)

# Kaldi reads 16-bit audio as integers; soundfile gives floats in [-1, 1).
INT16_SCALE = 32768.0
# WAV headers written to a pipe carry a placeholder data length at or above this.
_STREAMED_WAV_LENGTH = 0x7FFF0000
_WAV_DATA_MISMATCH = re.compile(r"^data\s*:\s*(\d+)\s*\(should be (\d+)\)", re.MULTILINE)


class AudioError(RuntimeError):
    """Audio could not be read, or is unusable (e.g. too short); the message says why."""


@dataclass(frozen=True)
class FbankOptions:
    """Options of the Kaldi fbank computation; the rest are Kaldi's defaults.

    `high_freq`: the top of the mel banks in Hz, <= 0 meaning the Nyquist frequency plus
    it (Kaldi's rule); `snip_edges`: whole windows only (Kaldi's default), else frame `m`
    centred on sample `m * shift + shift / 2` with the samples beyond either end
    reflected, `(n + shift / 2) // shift` frames; `normalize_samples`: the samples as they
    are read, in [-1, 1), instead of scaled to the int16 range as Kaldi reads audio (it
    shifts every log-mel bin by about 20.8)."""

    num_mel_bins: int = 80
    sample_rate: int = 16000
    dither: float = 0.0
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    high_freq: float = 0.0
    snip_edges: bool = True
    normalize_samples: bool = False

    @property
    def window_size(self) -> int:
        """Samples per frame."""
        return int(self.sample_rate * self.frame_length_ms / 1000)

    @property
    def window_shift(self) -> int:
        """Samples between frame starts."""
        return int(self.sample_rate * self.frame_shift_ms / 1000)

    @property
    def first_sample(self) -> int:
        """Where frame 0 starts (before sample 0 without `snip_edges`)."""
        return 0 if self.snip_edges else (self.window_shift - self.window_size) // 2


#: The front ends features are computed with (`hyper-p.json: data.front_end`): Kaldi's
#: defaults (stage 1's features until now), and sherpa-onnx's, what its recognizers compute
#: unless told otherwise: mel banks up to 400 Hz below the Nyquist frequency and no snipped
#: edges (`FeatureExtractorConfig`'s defaults, which its factory methods, command-line
#: tools and apps keep), on int16-range samples, which it feeds `wenet_ctc` models
#: whatever its `normalize_samples` says (`online-recognizer-ctc-impl.h`); its transducer
#: factory takes `normalize_samples=False` for them.
FRONT_ENDS: dict[str, FbankOptions] = {
    "kaldi": FbankOptions(),
    "sherpa-onnx": FbankOptions(high_freq=-400.0, snip_edges=False),
}
FRONT_END_FILE = "fbank.json"


def front_end(name: str) -> FbankOptions:
    """The `FbankOptions` of a front end's name (`FRONT_ENDS`); ValueError naming them."""
    if name not in FRONT_ENDS:
        raise ValueError(f"front end {name!r}: unknown; known: {', '.join(FRONT_ENDS)}")
    return FRONT_ENDS[name]


def front_end_name(options: FbankOptions) -> str | None:
    """The name of `options` among `FRONT_ENDS` (None: options of their own)."""
    return next((name for name, known in FRONT_ENDS.items() if known == options), None)


def experiment_front_end(hyper: dict[str, Any]) -> FbankOptions:
    """The front end of an experiment's `hyper-p.json` (`data.front_end`, default kaldi)."""
    return front_end(hyper.get("data", {}).get("front_end", "kaldi"))


def write_front_end(feat_dir: str | os.PathLike, options: FbankOptions) -> None:
    """Record in a feature dir the options its features were computed with (`fbank.json`)."""
    path = os.path.join(feat_dir, FRONT_END_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(options), f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def read_front_end(feat_dir: str | os.PathLike) -> FbankOptions:
    """The options a feature dir's features were computed with (`fbank.json`; a dir
    without it holds Kaldi's defaults, as stage 1 wrote before it recorded them)."""
    path = os.path.join(feat_dir, FRONT_END_FILE)
    if not os.path.isfile(path):
        return FbankOptions()
    with open(path, encoding="utf-8") as f:
        try:
            return FbankOptions(**json.load(f))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: not fbank options: {error}") from None


def check_front_end(feat_dir: str | os.PathLike, options: FbankOptions, source: str) -> None:
    """ValueError when the features of `feat_dir` were not computed with `options` (the
    front end `source`, an experiment's hyper-p.json, declares)."""
    found = read_front_end(feat_dir)
    if found != options:
        have, want = front_end_name(found) or str(found), front_end_name(options) or str(options)
        raise ValueError(f"{feat_dir}: its features were computed with the {have} front end "
                         f"({FRONT_END_FILE}), but {source} declares data.front_end {want}; "
                         f"extract them with that one (run.sh --front_end {want})")


# ----------------------------------------------------------------------------------------------
# Audio and features of one waveform


def read_audio(spec: str) -> tuple[np.ndarray, int]:
    """Read a `wav.scp` value: a file path, or a shell command ending in `|` writing audio.

    Returns `(waveform, sample_rate)`: float32 mono samples in [-1, 1] (channel 0 of
    multi-channel audio). Raises `AudioError` naming the source for missing, corrupt or
    truncated audio and for failing commands or ones that outlive their time limit
    (`command_timeout`).
    """
    waveform, sample_rate, _ = read_audio_with_channels(spec)
    return waveform, sample_rate


def read_audio_with_channels(spec: str) -> tuple[np.ndarray, int, int]:
    """`read_audio`, plus the number of channels the audio had."""
    with open_audio(spec) as (audio, name):
        return read_channel(audio, name), audio.samplerate, audio.channels


@contextlib.contextmanager
def open_audio(spec: str) -> Iterator[tuple[soundfile.SoundFile, str]]:
    """A `wav.scp` value opened for reading in pieces: `(audio, its name in messages)`.

    A command's output is written to a temporary file as it comes (see `run_command`),
    so neither it nor the samples are held in memory; the file is removed on leaving.
    Raises `AudioError` (or `PipeCommandError`) as `read_audio` does.
    """
    spec = spec.strip()
    with contextlib.ExitStack() as stack:
        if spec.endswith("|"):
            command = spec[:-1].strip()
            source: str | BinaryIO = stack.enter_context(run_command(command))
            name = f"command '{command}'"
        else:
            if not os.path.isfile(spec):
                raise AudioError(f"no such file: {spec}")
            source, name = spec, spec
        try:
            # libsndfile reads a cut Ogg or MP3 stream as shorter audio, without a word.
            with contextlib.ExitStack() as opened:
                file = source if not isinstance(source, str) else \
                    opened.enter_context(open(source, "rb"))
                check_file_complete(file, name)
        except AudioDecodeError as error:
            raise AudioError(str(error)) from None
        try:
            audio = stack.enter_context(soundfile.SoundFile(source))
        except soundfile.SoundFileError as error:
            # Of a file object (a command's output) libsndfile gives its repr: say only why.
            detail = error if isinstance(source, str) else \
                getattr(error, "error_string", None) or error
            raise AudioError(f"cannot decode {name}: {detail}") from error
        _check_not_truncated(audio, name)
        yield audio, name


#: Bytes of decoded samples `read_channel` reads at once.
READ_BLOCK_BYTES = 1 << 22


def read_channel(audio: soundfile.SoundFile, name: str, start: int = 0,
                 stop: int | None = None) -> np.ndarray:
    """Float32 samples `start` to `stop` (default: the end) of channel 0 of `audio`,
    read a block at a time (channels other than 0 are never held whole). Raises
    `AudioError` naming `name` when the data cannot be decoded."""
    stop = audio.frames if stop is None else min(stop, audio.frames)
    out = np.empty(max(0, stop - start), np.float32)
    block = max(1, READ_BLOCK_BYTES // (4 * audio.channels))
    filled = 0
    try:
        if start != audio.tell():  # a recording read again from its start: seek back
            audio.seek(start)
        while filled < len(out):
            data = audio.read(min(block, len(out) - filled), dtype="float32", always_2d=True)
            if not len(data):
                break
            out[filled:filled + len(data)] = data[:, 0]
            filled += len(data)
    except soundfile.SoundFileError as error:
        raise AudioError(f"cannot decode {name}: {error}") from error
    return out[:filled]


#: The shell's statuses of a command it could not run: not executable, not found.
COMMAND_NOT_RUN_STATUSES = {126: "not executable", 127: "not found"}
#: The environment variable holding the seconds a `wav.scp` command may run (0: no limit).
COMMAND_TIMEOUT_VARIABLE = "CAT_WAV_SCP_TIMEOUT"
#: Its default: a command converting a recording is done within seconds; one waiting on
#: a hung mount or a prompt would hold its job forever.
DEFAULT_COMMAND_TIMEOUT = 600.0
_READ_BYTES = 1 << 20


class PipeCommandError(RuntimeError):
    """A `wav.scp` command the shell could not run (status 126 or 127): the program is
    missing or not executable on this machine. A problem of the machine (a cluster node
    without sox, say), not of the recording, so it stops the job instead of skipping
    the utterance as an `AudioError` does; once the program is there, a re-run redoes
    only the jobs that stopped."""


def command_timeout() -> float | None:
    """Seconds a `wav.scp` command may run: `$CAT_WAV_SCP_TIMEOUT`, else 600; None
    when it is 0 (no limit)."""
    text = os.environ.get(COMMAND_TIMEOUT_VARIABLE, "").strip()
    try:
        seconds = float(text) if text else DEFAULT_COMMAND_TIMEOUT
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{COMMAND_TIMEOUT_VARIABLE}={text!r}: expected seconds (a "
                         "non-negative number; 0 for no limit)")
    return seconds or None


@contextlib.contextmanager
def run_command(command: str) -> Iterator[BinaryIO]:
    """Run a `wav.scp` command with the shell, as Kaldi does (popen): its standard output
    in a temporary file, positioned at its start.

    The command runs in a process group of its own; when it has not finished within
    `command_timeout()` seconds (reading its output included), or the caller stops
    waiting, the whole group is killed. Raises `AudioError` for a command that failed,
    wrote nothing or ran out of time, `PipeCommandError` for one the shell could not run.
    """
    limit = command_timeout()
    with tempfile.TemporaryFile() as output, tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=errors,
                                   start_new_session=True)
        try:
            with process.stdout:
                _copy_output(process, output, limit, command)
        finally:
            if process.poll() is None:
                _kill_group(process.pid)
            process.wait()
        _check_status(command, process.returncode, _last_line(errors))
        if not output.tell():
            raise AudioError(f"command '{command}' wrote no audio")
        output.seek(0)
        yield output


def _copy_output(process: subprocess.Popen, output: BinaryIO, limit: float | None,
                 command: str) -> None:
    """Copy the command's standard output into `output` until it ends and the command
    exits, within `limit` seconds; else kill its process group."""
    deadline = None if limit is None else time.monotonic() + limit

    def remaining() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    descriptor = process.stdout.fileno()
    finished = False
    while select.select([descriptor], [], [], remaining())[0]:
        data = os.read(descriptor, _READ_BYTES)
        if not data:
            finished = True
            break
        output.write(data)
    if finished:
        # Its output ended; a command may still run (`cat a.wav; sleep 1000`).
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(remaining())
    if not finished or process.poll() is None:
        _kill_group(process.pid)
        raise AudioError(f"command '{command}' did not finish within {limit:g} s: killed "
                         f"(the limit is ${COMMAND_TIMEOUT_VARIABLE}, in seconds)")


def _kill_group(pid: int) -> None:
    """Kill the command's process group: the shell and all it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _last_line(errors: BinaryIO) -> str:
    """The last line of a command's standard error (its last 64 KB read)."""
    size = errors.seek(0, os.SEEK_END)
    errors.seek(max(0, size - (1 << 16)))
    lines = errors.read().decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else ""


def _check_status(command: str, status: int, message: str) -> None:
    detail = f": {message}" if message else ""
    if status in COMMAND_NOT_RUN_STATUSES:
        raise PipeCommandError(
            f"command '{command}' could not run on {os.uname().nodename} (status "
            f"{status}: {COMMAND_NOT_RUN_STATUSES[status]}{detail})")
    if status != 0:
        raise AudioError(f"command '{command}' exited with status {status}{detail}")


def _check_not_truncated(audio: soundfile.SoundFile, name: str) -> None:
    """Reject a WAV file whose data chunk is shorter than its header declares.

    libsndfile silently reads what is there; its header log reports the mismatch.
    Headers written to a pipe declare a placeholder length and are accepted.
    """
    match = _WAV_DATA_MISMATCH.search(audio.extra_info)
    if match is None:
        return
    declared, present = int(match.group(1)), int(match.group(2))
    # One byte of slack: a missing pad byte after odd-sized data is harmless.
    if declared < _STREAMED_WAV_LENGTH and declared > present + 1:
        raise AudioError(f"truncated audio {name}: header declares {declared} data bytes, "
                         f"file holds {present}")


def num_frames(num_samples: int, options: FbankOptions | None = None) -> int:
    """Kaldi's frame count: whole windows only with `snip_edges`, else
    `(num_samples + shift / 2) // shift` (none for fewer samples than a window)."""
    options = options or FbankOptions()
    if num_samples < options.window_size:
        return 0
    if not options.snip_edges:
        return (num_samples + options.window_shift // 2) // options.window_shift
    return 1 + (num_samples - options.window_size) // options.window_shift


def compute_fbank(waveform: np.ndarray | torch.Tensor, sample_rate: int,
                  options: FbankOptions | None = None, seed: int | None = None,
                  window_frames: int | None = None) -> np.ndarray:
    """Log-mel fbank of one waveform -> float32 array `[frames, bins]`.

    The waveform is floats in [-1, 1], or int16 samples (as the streaming loader keeps
    them; the same features as their floats / 32768). It is resampled to
    `options.sample_rate` (`cat.audio.codec.resample`) if `sample_rate` differs, and
    scaled to the int16 range as Kaldi reads audio. The frames are computed
    `window_frames` at a time (default `FBANK_WINDOW_FRAMES`), so the memory it takes
    beyond its input and output does not grow with the waveform; every frame is the one
    the whole waveform gives. `seed` makes dithering (only used when `options.dither >
    0`) reproducible without touching the global RNG. Raises `AudioError` if the
    waveform is shorter than one frame.
    """
    options = options or FbankOptions()
    samples = _int16_range(np.asarray(waveform), sample_rate, options)
    count = num_frames(len(samples), options)
    if count == 0:
        raise AudioError(f"too short for one frame: {len(samples)} samples at "
                         f"{options.sample_rate} Hz, need {options.window_size}")
    window_frames = window_frames or FBANK_WINDOW_FRAMES
    if window_frames < 1:
        raise ValueError(f"window_frames must be at least 1, got {window_frames}")
    features = np.empty((count, options.num_mel_bins), np.float32)
    output = torch.from_numpy(features)
    rng = torch.random.fork_rng(devices=[]) if options.dither > 0 and seed is not None \
        else contextlib.nullcontext()
    with rng:
        if options.dither > 0 and seed is not None:
            torch.manual_seed(seed)
        for first in range(0, count, window_frames):
            last = min(first + window_frames, count)
            output[first:last] = _fbank(samples.window(first, last), options)
    return features


#: Frames `compute_fbank` computes at once (10 s of audio): a window of them takes about
#: 9 KB of intermediate tensors per frame (9 MB), however long the waveform. Windows that
#: fit the CPU's caches were also faster than the whole waveform at once, in a one-thread
#: measurement on 2 minutes of audio.
FBANK_WINDOW_FRAMES = 1000


@dataclass(frozen=True)
class _Samples:
    """A waveform at the fbank rate, turned into int16-range float32 one window at a
    time: int16 samples are converted, float samples scaled by 32768, as the whole
    waveform would be."""

    data: np.ndarray
    options: FbankOptions

    def __len__(self) -> int:
        return len(self.data)

    def window(self, first: int, last: int) -> torch.Tensor:
        """The samples of frames `first` to `last` (exclusive): consecutive windows
        overlap by the frame length less one shift; without `snip_edges` samples before
        the start and past the end are reflected (Kaldi's rule)."""
        options = self.options
        start = first * options.window_shift + options.first_sample
        end = (last - 1) * options.window_shift + options.first_sample + options.window_size
        if start >= 0 and end <= len(self.data):
            piece = torch.from_numpy(self.data[start:end])
        else:
            index = np.arange(start, end)
            index = np.where(index < 0, -index - 1, index)
            index = np.where(index >= len(self.data), 2 * len(self.data) - 1 - index, index)
            piece = torch.from_numpy(self.data[index])
        if self.data.dtype == np.int16:
            # int16 / 32768 * 32768 is the int16 value exactly: skip both passes.
            piece = piece.to(torch.float32)
            return piece / INT16_SCALE if options.normalize_samples else piece
        return piece.to(torch.float32) if options.normalize_samples else piece * INT16_SCALE


def _int16_range(waveform: np.ndarray, sample_rate: int, options: FbankOptions) -> _Samples:
    if waveform.dtype == np.int16 and sample_rate == options.sample_rate:
        return _Samples(waveform, options)
    return _Samples(resample(waveform, sample_rate, options.sample_rate), options)


# Kaldi's defaults, as torchaudio.compliance.kaldi.fbank has them.
_PREEMPHASIS = 0.97
_LOW_FREQ = 20.0
_VTLN_LOW, _VTLN_HIGH, _VTLN_WARP = 100.0, -500.0, 1.0
_EPSILON = torch.finfo(torch.float32).eps


@functools.lru_cache(maxsize=16)
def fbank_tables(options: FbankOptions) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The Povey window `[window]`, the mel banks `[fft bins, mel bins]` (a zero row for
    the Nyquist bin) and the FFT size of `options`, built once per options."""
    window = torch.hann_window(options.window_size, periodic=False,
                               dtype=torch.float32).pow(0.85)
    fft_size = 1 << (options.window_size - 1).bit_length()
    banks, _ = get_mel_banks(options.num_mel_bins, fft_size, float(options.sample_rate),
                             _LOW_FREQ, float(options.high_freq), _VTLN_LOW, _VTLN_HIGH,
                             _VTLN_WARP)
    banks = torch.nn.functional.pad(banks.to(torch.float32), (0, 1))
    return window, banks.T.contiguous(), fft_size


def _fbank(samples: torch.Tensor, options: FbankOptions) -> torch.Tensor:
    """`torchaudio.compliance.kaldi.fbank` of int16-range float32 samples, with the
    options `FbankOptions` sets (snip_edges, no energy, power spectrum, log)."""
    frames = samples.unfold(0, options.window_size, options.window_shift)
    if options.dither != 0.0:
        frames = frames + torch.randn(frames.shape, dtype=frames.dtype) * options.dither
    return _frames_fbank(frames, options)


def _frames_fbank(frames: torch.Tensor, options: FbankOptions) -> torch.Tensor:
    """Log-mel of windows `[..., window]` of int16-range float32 samples (the steps of
    `_fbank` after framing and dither) -> `[..., mel bins]`, on the frames' device."""
    window, banks, fft_size = fbank_tables(options)
    if frames.device != window.device:
        window, banks = _device_tables(options, frames.device)
    frames = frames - frames.mean(dim=-1, keepdim=True)
    # Pre-emphasis x[j] - 0.97 x[max(0, j - 1)], a product then a difference as
    # torchaudio rounds it (a fused multiply-add moves quiet bins by up to 3e-3).
    emphasized = torch.empty_like(frames)
    torch.mul(frames[..., :-1], _PREEMPHASIS, out=emphasized[..., 1:])
    torch.mul(frames[..., :1], _PREEMPHASIS, out=emphasized[..., :1])
    torch.sub(frames, emphasized, out=emphasized)
    emphasized *= window
    # re^2 + im^2 as two halves of one squared view: a sum over the last axis of size 2
    # costs 6 times as much, |z|^2 (torchaudio's) 5 times.
    squared = torch.view_as_real(torch.fft.rfft(emphasized, n=fft_size)).square_()
    power = squared[..., 0] + squared[..., 1]
    return torch.matmul(power, banks).clamp_(min=_EPSILON).log_()


@functools.lru_cache(maxsize=16)
def _device_tables(options: FbankOptions, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`fbank_tables`' window and mel banks copied to `device` once."""
    window, banks, _ = fbank_tables(options)
    return window.to(device), banks.to(device)


def batch_num_frames(lengths: torch.Tensor, options: FbankOptions) -> torch.Tensor:
    """`num_frames` of each sample count in `lengths` (a tensor, on its device)."""
    if options.snip_edges:
        frames = 1 + torch.div(lengths - options.window_size, options.window_shift,
                               rounding_mode="floor")
    else:
        frames = torch.div(lengths + options.window_shift // 2, options.window_shift,
                           rounding_mode="floor")
    return torch.where(lengths < options.window_size, 0, frames)


def batch_fbank(waves: torch.Tensor, lengths: torch.Tensor, options: FbankOptions,
                num_frames_max: int | None = None, batched: bool | None = None
                ) -> torch.Tensor:
    """`compute_fbank` of a padded batch on its device: `waves` [B, S] (int16 samples, or
    floats in [-1, 1)) whose row b holds `lengths[b]` samples at `options.sample_rate`
    -> features [B, T, bins] float32, the frames past each row's count zero (as the
    collate pads them).

    Each frame takes the steps of `compute_fbank` in the same float32 order, so the
    features equal its features of each row (`tests/features/test_fbank.py`); on a GPU
    the whole batch at once, nothing copied to the host and nothing waiting for the
    device (`num_frames_max`, the padded frame count, default `num_frames` of the padded
    width, is a host number); on the CPU a row at a time (`compute_fbank`; `batched`
    chooses otherwise). Dither draws from the device's generator, not `compute_fbank`'s,
    so it is refused.
    """
    if options.dither != 0.0:
        raise ValueError("batch_fbank computes features without dither; "
                         f"the options ask for dither {options.dither}")
    if waves.dim() != 2:
        raise ValueError(f"expected padded waveforms [batch, samples], got {tuple(waves.shape)}")
    count = num_frames(waves.size(1), options) if num_frames_max is None else num_frames_max
    lengths = lengths.to(waves.device)
    if count == 0:
        return torch.zeros(waves.size(0), 0, options.num_mel_bins, device=waves.device)
    if not (waves.device.type != "cpu" if batched is None else batched):
        # A row at a time in cache-sized windows, its frames only: 6 times as fast on one
        # core as the whole padded batch at once (a batch of 128 utterances of 2-6 s).
        features = torch.zeros(waves.size(0), count, options.num_mel_bins)
        for row, (samples, length) in enumerate(zip(waves, lengths.tolist(), strict=True)):
            if num_frames(length, options):
                rows = compute_fbank(samples[:length].numpy(), options.sample_rate, options)
                features[row, :len(rows)] = torch.from_numpy(rows)
        return features
    samples = _int16_range_batch(waves, options)
    if not options.snip_edges:
        samples = _reflect_edges(samples, lengths, options)
    frames = samples.unfold(1, options.window_size, options.window_shift)[:, :count]
    # Rows in groups of BATCH_FBANK_FRAMES padded frames: the steps take about 8 KB a
    # frame, so a group peaks near 0.5 GB whatever the batch.
    rows = max(1, BATCH_FBANK_FRAMES // count)
    features = torch.cat([_frames_fbank(frames[first:first + rows], options)
                          for first in range(0, len(frames), rows)])
    valid = torch.arange(count, device=waves.device) < batch_num_frames(lengths, options)[:, None]
    return features.masked_fill_(~valid[..., None], 0.0)


#: Padded frames `batch_fbank` computes at once on a GPU.
BATCH_FBANK_FRAMES = 1 << 16


def _int16_range_batch(waves: torch.Tensor, options: FbankOptions) -> torch.Tensor:
    """`_Samples.window` for a whole batch: int16 values (or floats x 32768) as float32."""
    if waves.dtype == torch.int16:
        samples = waves.to(torch.float32)
        return samples / INT16_SCALE if options.normalize_samples else samples
    samples = waves.to(torch.float32)
    return samples if options.normalize_samples else samples * INT16_SCALE


def _reflect_edges(samples: torch.Tensor, lengths: torch.Tensor, options: FbankOptions
                   ) -> torch.Tensor:
    """Each row with the samples Kaldi reflects around its own ends (`_Samples.window`
    without snipped edges): `[B, left + S + right]`, row b's sample i at `left + i`,
    `left = -first_sample`; sample -1 - i is sample i, and past the end of row b sample
    n_b + i is sample n_b - 1 - i. (A row shorter than a window has no frame, so its
    reflections, clamped to the row, are never read.)"""
    left, right = -options.first_sample, options.window_size
    batch, width = samples.shape
    out = samples.new_zeros(batch, left + width + right)
    out[:, left:left + width] = samples
    out[:, :left] = samples[:, :left].flip(1)
    steps = torch.arange(right, device=samples.device)
    source = (lengths[:, None] - 1 - steps).clamp(0, width - 1)
    out.scatter_(1, left + lengths[:, None] + steps, samples.gather(1, source))
    return out
