"""Export a CTC experiment to ONNX, and decode with the export in onnxruntime.

`model.onnx` maps features `x` [N, T, 80] float and `x_lens` [N] int64 to `log_probs`
[N, T', V] and `log_probs_len` [N] int64: the inputs and outputs of sherpa-onnx's
"zipformer2_ctc" model type (`sherpa_onnx.OfflineZipformerCtcModelConfig`), its generic
CTC interface, which leaves the fbank settings to the caller (see `cat.decoding.export`).

Usage:
    python -m cat.ctc.export exp/synth-ctc            # -> exp/synth-ctc/export/
    python -m cat.ctc.export exp/synth-ctc --checkpoint exp/synth-ctc/check/ckpt-e003.pt \
        --out /tmp/ctc-export
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cat.core.io import PathLike
from cat.ctc.stream import CtcChunkSearch
from cat.decoding.export import (
    EXPORT_NAME,
    STREAMING_NAME,
    TOKENS_NAME,
    export_main,
    export_onnx,
    export_streaming,
    feature_metadata,
    load_experiment_model,
    onnx_session,
    streaming_metadata,
    write_export,
    write_tokens,
)
from cat.models.chunked import StreamingEncoder
from cat.models.ctc_search import ctc_greedy_search

MODEL_NAME = "model.onnx"


class _LogProbs(nn.Module):
    """`AsrModel.log_probs` with int64 lengths, as the graph's outputs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, x_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, lengths = self.model.log_probs(x, x_lens)
        return log_probs, lengths.to(torch.int64)


class _LogSoftmaxHead(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head(x), dim=-1)


def export(exp_dir: PathLike, out_dir: PathLike | None = None,
           checkpoint: PathLike | None = None, chunk_size: int | None = None,
           allow_config_change: bool | None = None) -> Path:
    """Write `model.onnx`, `tokens.txt` and `export.json` of a CTC experiment; with
    `chunk_size`, also `streaming.onnx` (chunk log-probabilities, state in and out)."""
    model, tokenizer, path = load_experiment_model(exp_dir, "ctc", checkpoint,
                                                   allow_config_change)
    metadata: dict[str, Any] = {
        "family": "ctc", "model_type": "zipformer2_ctc", "framework": "cat",
        "vocab_size": int(model.num_classes), "blank_id": 0, "checkpoint": path.name,
        **feature_metadata(model.encoder)}
    dim = metadata["feature_dim"]
    streaming = StreamingEncoder(model.encoder, chunk_size) if chunk_size else None
    if streaming is not None:
        metadata.update(streaming_metadata(streaming))

    def write(directory: Path) -> dict[str, Any]:
        example = (torch.randn(2, 100, dim), torch.tensor([100, 80], dtype=torch.int64))
        export_onnx(_LogProbs(model), example, directory / MODEL_NAME, ["x", "x_lens"],
                    ["log_probs", "log_probs_len"],
                    {"x": {0: "N", 1: "T"}, "x_lens": {0: "N"},
                     "log_probs": {0: "N", 1: "T_out"}, "log_probs_len": {0: "N"}},
                    metadata)
        if streaming is not None:
            export_streaming(_LogSoftmaxHead(model.first_head), streaming,
                             directory / STREAMING_NAME, "log_probs", metadata)
        write_tokens(tokenizer, directory / TOKENS_NAME)
        return metadata

    return write_export(out_dir or Path(exp_dir) / EXPORT_NAME, write)


class OnnxCtcDecoder:
    """Greedy CTC decoding of features with an export's `model.onnx` in onnxruntime."""

    def __init__(self, export_dir: PathLike, num_threads: int = 1) -> None:
        self.session = onnx_session(Path(export_dir) / MODEL_NAME, num_threads)

    def decode(self, feats: np.ndarray) -> list[int]:
        """Token ids of one utterance's features [T, D]."""
        log_probs, lengths = self.session.run(
            None, {"x": feats[None].astype(np.float32), "x_lens": np.array([len(feats)])})
        return ctc_greedy_search(torch.from_numpy(log_probs), torch.from_numpy(lengths))[0]


class OnnxCtcChunkSearch(CtcChunkSearch):
    """The chunk search of `streaming.onnx`'s log-probabilities."""

    def __init__(self) -> None:
        self.tokens = []
        self.last = 0

    def step(self, encoder_out: torch.Tensor) -> None:
        self.step_log_probs(encoder_out)


if __name__ == "__main__":
    sys.exit(export_main("cat.ctc.export"))
