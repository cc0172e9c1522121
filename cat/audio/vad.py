"""Voice activity: the speech probability of every 32 ms of 16 kHz audio, by Silero VAD.

The model is the one the `silero-vad` package ships for whole sequences
(`silero_vad_16k_sequence.onnx`, MIT licence; the same network as its streaming model,
giving the same probabilities), run here with onnxruntime on one thread. Each frame is
`FRAME_SAMPLES` samples (32 ms) seen with the `CONTEXT_SAMPLES` before it; the network's
LSTM state goes from one call to the next, so audio given in blocks of any size
(`SileroVad.accept`) gets the probabilities it would get given whole, and memory holds
one block whatever the length. Only the model file is taken from the package, found
without importing it (importing `silero_vad` sets torch's thread count as a side effect).

Usage:
    vad = SileroVad()
    for block in blocks:                       # float32 samples at 16 kHz
        probabilities.append(vad.accept(block))
    probabilities.append(vad.finish())         # the last, partial frame
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

#: The rate the model takes, the samples of a frame (32 ms) and of the context before it.
SAMPLE_RATE = 16000
FRAME_SAMPLES = 512
CONTEXT_SAMPLES = 64
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE
#: Frames per call of the network (about 16 s): the GIL-free part of the work stays large.
BLOCK_FRAMES = 512
MODEL_FILE = "silero_vad_16k_sequence.onnx"
_STATE_SHAPE = (1, 1, 128)


class VadError(RuntimeError):
    """The voice activity detector cannot run (its package or model file is missing)."""


def model_path() -> Path:
    """The ONNX model of the installed `silero-vad` package (a VadError without it)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise VadError("voice activity detection needs the silero-vad package (pinned in "
                       "requirements.txt: pip install -r requirements.txt), or --vad none")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / MODEL_FILE
    if not path.is_file():
        raise VadError(f"{path}: missing; this silero-vad install has no sequence model "
                       "(install the version pinned in requirements.txt), or use --vad none")
    return path


class SileroVad:
    """Speech probabilities of one stream of 16 kHz audio, fed a block at a time."""

    def __init__(self, path: Path | None = None) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            str(path or model_path()), sess_options=options,
            providers=["CPUExecutionProvider"])
        self.reset()

    def reset(self) -> None:
        """Start a new stream."""
        self._hidden = np.zeros(_STATE_SHAPE, np.float32)
        self._cell = np.zeros(_STATE_SHAPE, np.float32)
        self._context = np.zeros(CONTEXT_SAMPLES, np.float32)
        self._pending = np.zeros(0, np.float32)

    def accept(self, samples: np.ndarray) -> np.ndarray:
        """The probabilities of the frames `samples` completes (float32 [-1, 1], 16 kHz);
        what is left of a frame waits for the next block."""
        samples = np.concatenate([self._pending, np.asarray(samples, np.float32)])
        whole = len(samples) // FRAME_SAMPLES * FRAME_SAMPLES
        self._pending = samples[whole:]
        return self._run(samples[:whole].reshape(-1, FRAME_SAMPLES))

    def finish(self) -> np.ndarray:
        """The probability of the last, partial frame (zero-padded), if there is one."""
        if not len(self._pending):
            return np.zeros(0, np.float32)
        frame = np.zeros((1, FRAME_SAMPLES), np.float32)
        frame[0, :len(self._pending)] = self._pending
        self._pending = np.zeros(0, np.float32)
        return self._run(frame)

    def probabilities(self, samples: np.ndarray) -> np.ndarray:
        """The probabilities of a whole stream (`ceil(len / FRAME_SAMPLES)` frames)."""
        self.reset()
        return np.concatenate([self.accept(samples), self.finish()])

    def _run(self, frames: np.ndarray) -> np.ndarray:
        results = []
        for first in range(0, len(frames), BLOCK_FRAMES):
            block = frames[first:first + BLOCK_FRAMES]
            contexts = np.concatenate([self._context[None], block[:-1, -CONTEXT_SAMPLES:]])
            self._context = block[-1, -CONTEXT_SAMPLES:].copy()
            probabilities, self._hidden, self._cell = self._session.run(
                ["speech_probs", "hn", "cn"],
                {"input": np.ascontiguousarray(np.concatenate([contexts, block], axis=1)),
                 "h": self._hidden, "c": self._cell})
            results.append(np.asarray(probabilities, np.float32).reshape(-1))
        return np.concatenate(results) if results else np.zeros(0, np.float32)
