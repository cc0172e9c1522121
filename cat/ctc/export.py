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
from cat.ctc.search import ctc_greedy_search
from cat.ctc.stream import CtcChunkSearch
from cat.models.onnx_export import (
    STREAMING_NAME,
    TOKENS_NAME,
    ExportError,
    experiment_feature_metadata,
    export_onnx,
    export_streaming,
    load_export_metadata,
    onnx_session,
    sherpa_feature_config,
    sherpa_wrap,
    streaming_metadata,
    streaming_step,
    write_export,
    write_tokens,
)
from cat.models.streaming import export_strategy

MODEL_NAME = "model.onnx"
#: The streaming model in sherpa-onnx's online `wenet_ctc` layout.
WENET_CTC_NAME = "streaming_wenet_ctc.onnx"
#: `num_left_chunks` for a model trained with all left context: 16 chunks of 16 frames at
#: 8x subsampling hold 20 s.
DEFAULT_NUM_LEFT_CHUNKS = 16
#: export.json's key of the settings a runtime of `streaming_wenet_ctc.onnx` must use.
RUNTIME_KEY = "wenet_ctc_runtime"


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


def wenet_ctc_runtime(model: nn.Module, chunk_size: int) -> dict[str, Any]:
    """The settings a runtime of `streaming_wenet_ctc.onnx` must use (sherpa-onnx's
    `OnlineWenetCtcModelConfig`; its factory `from_wenet_ctc` defaults to chunk_size 16 and
    num_left_chunks 4 and reads neither from the model), as the model's streaming strategy
    gives them (`wenet_runtime` of its step): the export's chunk size, and
    `num_left_chunks` exactly a U2 model's `left_chunks`, or at least what holds a CUSIDE
    model's left context; a model trained with all left context at least 16 (20 s of left
    context at chunks of 16 and 8x subsampling; more keeps more of the utterance)."""
    return streaming_step(model, chunk_size).wenet_runtime(DEFAULT_NUM_LEFT_CHUNKS)


def export_wenet_ctc(model: nn.Module, chunk_size: int, path: Path,
                     metadata: dict[str, Any]) -> None:
    """`streaming_wenet_ctc.onnx`: the chunk step in sherpa-onnx's online `wenet_ctc` layout
    (`x`, `offset`, `required_cache_size`, `attn_cache`, `conv_cache`, `attn_mask` ->
    `log_probs`, `next_att_cache`, `next_conv_cache`), as the model's streaming strategy
    lays out its state (`wenet_graph` of its step), with the metadata it reads (`head`,
    `num_blocks`, `output_size`, `cnn_module_kernel`, `right_context`,
    `subsampling_factor`, `vocab_size`)."""
    settings = wenet_ctc_runtime(model, chunk_size)
    metadata = {**metadata, "num_left_chunks": settings["num_left_chunks"]}
    graph, layout = streaming_step(model, chunk_size).wenet_graph(
        _LogSoftmaxHead(model.first_head), "log_probs", settings, int(metadata["feature_dim"]))
    export_onnx(graph.module, graph.example, path, graph.input_names, graph.output_names,
                graph.dynamic_axes, {**metadata, **layout, "vocab_size": int(model.num_classes)},
                torchscript=False)


def export_model(model: nn.Module, tokenizer: Any, checkpoint: Path, exp_dir: PathLike,
                 out_dir: PathLike, chunk_size: int | None = None) -> Path:
    """Write `model.onnx`, `tokens.txt` and `export.json` of a CTC experiment; with
    `chunk_size`, also `streaming.onnx` (chunk log-probabilities, state in and out) and
    `streaming_wenet_ctc.onnx` (the same in sherpa-onnx's online `wenet_ctc` layout)."""
    metadata: dict[str, Any] = {
        "family": "ctc", "model_type": "zipformer2_ctc", "framework": "cat",
        "vocab_size": int(model.num_classes), "blank_id": 0, "checkpoint": checkpoint.name,
        **experiment_feature_metadata(exp_dir, model.encoder)}
    dim = metadata["feature_dim"]
    streaming = streaming_step(model, chunk_size) if chunk_size else None
    if streaming is not None:
        metadata.update(streaming_metadata(streaming))

    def write(directory: Path) -> dict[str, Any]:
        example = (torch.randn(2, 100, dim), torch.tensor([100, 80], dtype=torch.int64))
        export_onnx(_LogProbs(model), example, directory / MODEL_NAME, ["x", "x_lens"],
                    ["log_probs", "log_probs_len"],
                    {"x": {0: "N", 1: "T"}, "x_lens": {0: "N"},
                     "log_probs": {0: "N", 1: "T_out"}, "log_probs_len": {0: "N"}},
                    metadata)
        write_tokens(tokenizer, directory / TOKENS_NAME)
        if streaming is None:
            return metadata
        export_streaming(_LogSoftmaxHead(model.first_head), streaming,
                         directory / STREAMING_NAME, "log_probs", metadata)
        export_wenet_ctc(model, streaming.chunk_size, directory / WENET_CTC_NAME, metadata)
        return {**metadata, RUNTIME_KEY: wenet_ctc_runtime(model, streaming.chunk_size)}

    return write_export(out_dir, write)


def sherpa_model_config(export_dir: Path, meta: dict[str, Any], common: dict[str, Any]) -> Any:
    """The family's hook for `cat.decoding.export.sherpa_recognizer`: sherpa-onnx's offline
    model of the export's `model.onnx`, its generic CTC type `zipformer2_ctc`
    (`OfflineZipformerCtcModelConfig`); `common` holds the tokens, threads and provider."""
    import sherpa_onnx

    return sherpa_onnx.OfflineModelConfig(
        zipformer_ctc=sherpa_onnx.OfflineZipformerCtcModelConfig(
            model=str(export_dir / MODEL_NAME)), **common)


def sherpa_online_recognizer(export_dir: PathLike, num_left_chunks: int | None = None,
                             num_threads: int = 1) -> Any:
    """A `sherpa_onnx.OnlineRecognizer` running `streaming_wenet_ctc.onnx` (model type
    `wenet_ctc`, greedy search) with the export's chunk size and the fbank settings of
    `export.json`; `num_left_chunks` (default: export.json's `wenet_ctc_runtime`) x the
    chunk size is its attention cache: a model trained with all left context
    (`left_chunks` -1) gives `cat.ctc.stream`'s hypotheses while an utterance's earlier
    chunks fit in it."""
    import sherpa_onnx
    from sherpa_onnx.lib import _sherpa_onnx as native

    export_dir = Path(export_dir)
    meta = load_export_metadata(export_dir)
    if not (export_dir / WENET_CTC_NAME).is_file():
        raise ExportError(f"{export_dir}: no {WENET_CTC_NAME} (export with --chunk-size)")
    if num_left_chunks is None:
        num_left_chunks = int(meta.get(RUNTIME_KEY, {}).get("num_left_chunks",
                                                            DEFAULT_NUM_LEFT_CHUNKS))
    problem = export_strategy(meta).wenet_runtime_problem(meta, num_left_chunks, RUNTIME_KEY)
    if problem:
        raise ExportError(f"{export_dir}: {problem}")
    model = native.OnlineModelConfig(
        wenet_ctc=native.OnlineWenetCtcModelConfig(
            model=str(export_dir / WENET_CTC_NAME), chunk_size=int(meta["chunk_size"]),
            num_left_chunks=num_left_chunks),
        tokens=str(export_dir / TOKENS_NAME), num_threads=num_threads, debug=False)
    config = native.OnlineRecognizerConfig(feat_config=sherpa_feature_config(meta),
                                           model_config=model, enable_endpoint=False,
                                           decoding_method="greedy_search")
    return sherpa_wrap(sherpa_onnx.OnlineRecognizer, native.OnlineRecognizer, config)


class OnnxCtcDecoder:
    """Greedy CTC decoding of features with an export's `model.onnx` in onnxruntime."""

    def __init__(self, export_dir: PathLike, num_threads: int = 1) -> None:
        load_export_metadata(export_dir)  # its files checked
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
    from cat.core.commands import run_verb

    sys.exit(run_verb("cat.ctc.export"))
