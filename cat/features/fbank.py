"""Kaldi-compatible log-mel filterbank features of a waveform, and the audio they come from.

* `read_audio`: a `wav.scp` entry (a file soundfile reads: WAV, FLAC, Ogg Opus...; or a
  Kaldi pipe command ending in `|`) as float samples and their rate; a WAV whose header
  promises more data than the file holds is an error (`AudioError`);
* `compute_fbank`: 80-dim log-mel fbank with `torchaudio.compliance.kaldi.fbank`
  (`FbankOptions`: 25 ms window, 10 ms shift, dither 0 unless asked, other options at
  their Kaldi defaults) on audio scaled to the int16 range as Kaldi reads it;
  `num_frames` the frame count it gives for a number of samples.

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
import io
import logging
import os
import re
import subprocess
from dataclasses import dataclass

import numpy as np
import soundfile
import torch
import torchaudio.compliance.kaldi

from cat.audio.codec import resample

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
    """Options of the Kaldi fbank computation; the rest are Kaldi's defaults."""

    num_mel_bins: int = 80
    sample_rate: int = 16000
    dither: float = 0.0
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0

    @property
    def window_size(self) -> int:
        """Samples per frame."""
        return int(self.sample_rate * self.frame_length_ms / 1000)

    @property
    def window_shift(self) -> int:
        """Samples between frame starts."""
        return int(self.sample_rate * self.frame_shift_ms / 1000)


# ----------------------------------------------------------------------------------------------
# Audio and features of one waveform


def read_audio(spec: str) -> tuple[np.ndarray, int]:
    """Read a `wav.scp` value: a file path, or a shell command ending in `|` writing audio.

    Returns `(waveform, sample_rate)`: float32 mono samples in [-1, 1] (channel 0 of
    multi-channel audio). Raises `AudioError` naming the source for missing, corrupt or
    truncated audio and for failing commands.
    """
    waveform, sample_rate, _ = read_audio_with_channels(spec)
    return waveform, sample_rate


def read_audio_with_channels(spec: str) -> tuple[np.ndarray, int, int]:
    """`read_audio`, plus the number of channels the audio had."""
    spec = spec.strip()
    if spec.endswith("|"):
        command = spec[:-1].strip()
        source: str | io.BytesIO = io.BytesIO(_run_pipe(command))
        name = f"command '{command}'"
    else:
        if not os.path.isfile(spec):
            raise AudioError(f"no such file: {spec}")
        source, name = spec, spec
    try:
        with soundfile.SoundFile(source) as audio:
            _check_not_truncated(audio, name)
            data = audio.read(dtype="float32", always_2d=True)
            sample_rate = audio.samplerate
    except soundfile.SoundFileError as error:
        raise AudioError(f"cannot decode {name}: {error}") from error
    return np.ascontiguousarray(data[:, 0]), sample_rate, data.shape[1]


def _run_pipe(command: str) -> bytes:
    # Kaldi runs wav.scp commands with the shell too (popen).
    result = subprocess.run(command, shell=True, capture_output=True, check=False)
    if result.returncode != 0:
        message = result.stderr.decode("utf-8", "replace").strip().splitlines()
        detail = f": {message[-1]}" if message else ""
        raise AudioError(f"command '{command}' exited with status {result.returncode}{detail}")
    if not result.stdout:
        raise AudioError(f"command '{command}' wrote no audio")
    return result.stdout


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
    """Kaldi's frame count with `snip_edges=true`: whole windows only."""
    options = options or FbankOptions()
    if num_samples < options.window_size:
        return 0
    return 1 + (num_samples - options.window_size) // options.window_shift


def compute_fbank(waveform: np.ndarray | torch.Tensor, sample_rate: int,
                  options: FbankOptions | None = None, seed: int | None = None) -> np.ndarray:
    """Log-mel fbank of one waveform (floats in [-1, 1]) -> float32 array `[frames, bins]`.

    The waveform is resampled to `options.sample_rate` (`cat.audio.codec.resample`) if
    `sample_rate` differs, and scaled to the int16 range as Kaldi reads audio. `seed`
    makes dithering (only used when `options.dither > 0`) reproducible without touching
    the global RNG. Raises `AudioError` if the waveform is shorter than one frame.
    """
    options = options or FbankOptions()
    tensor = torch.from_numpy(resample(np.asarray(waveform), sample_rate, options.sample_rate))
    if tensor.numel() < options.window_size:
        raise AudioError(f"too short for one frame: {tensor.numel()} samples at "
                         f"{options.sample_rate} Hz, need {options.window_size}")
    rng = torch.random.fork_rng(devices=[]) if options.dither > 0 and seed is not None \
        else contextlib.nullcontext()
    with rng:
        if options.dither > 0 and seed is not None:
            torch.manual_seed(seed)
        features = torchaudio.compliance.kaldi.fbank(
            tensor.unsqueeze(0) * INT16_SCALE,
            num_mel_bins=options.num_mel_bins,
            frame_length=options.frame_length_ms,
            frame_shift=options.frame_shift_ms,
            dither=options.dither,
            sample_frequency=float(options.sample_rate),
        )
    return features.numpy().astype(np.float32, copy=False)
