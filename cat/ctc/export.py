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
from cat.models.chunked import KeyValueStreamingEncoder
from cat.models.cuside import CusideStep
from cat.models.onnx_export import (
    METADATA_NAME,
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


class _Refusal(nn.Module):
    """Zero when `ok`; else a lookup out of range, which stops onnxruntime with an error
    naming the node, whose scope is the name this module is given (what a runtime must
    set): sherpa-onnx's factories do not read the settings from the metadata, and other
    settings give wrong text, not an error."""

    def forward(self, ok: torch.Tensor) -> torch.Tensor:
        index = (1 - ok.to(torch.int64)).reshape(1)
        return torch.index_select(torch.zeros(1), 0, index).sum()


def _runtime_sizes(attn_cache: torch.Tensor, attn_mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's cache frames `chunk_size x num_left_chunks` and its `chunk_size`, as
    tensors the graph computes from its inputs' sizes (not constants of the trace)."""
    cached = torch.ones_like(attn_cache[0, 0, :, 0]).sum()
    return cached, torch.ones_like(attn_mask[0, 0], dtype=attn_cache.dtype).sum() - cached


def refusal_name(settings: dict[str, Any]) -> str:
    """The name of the graph's `_Refusal`: the runtime settings (`wenet_ctc_runtime`) it
    refuses others than, as onnxruntime's error will show it."""
    least = "_at_least" if settings["num_left_chunks_is"] == "minimum" else ""
    return (f"run_with_chunk_size_{settings['chunk_size']}_and_num_left_chunks{least}_"
            f"{settings['num_left_chunks']}")


class _WenetCtcStep(nn.Module):
    """One chunk in the state layout of sherpa-onnx's online `wenet_ctc` model type (inputs
    and outputs matched by position; see `export_wenet_ctc`). A runtime of another chunk
    size than the export's, or whose cache holds other than `wenet_ctc_runtime`'s
    `num_left_chunks` (the model's `left_chunks` exactly; at least 16 for a model trained
    with all left context), is refused (`_Refusal`): sherpa-onnx's factory defaults (chunk
    16, 4 left chunks) fit neither unless the export was made for them."""

    def __init__(self, streaming: KeyValueStreamingEncoder, head: nn.Module,
                 settings: dict[str, Any]) -> None:
        super().__init__()
        self.streaming, self.head = streaming, _LogSoftmaxHead(head)
        self.chunk_size, self.left_chunks = settings["chunk_size"], settings["num_left_chunks"]
        self.exact = settings["num_left_chunks_is"] == "exact"
        self.refusal_name = refusal_name(settings)
        self.add_module(self.refusal_name, _Refusal())

    def forward(self, x: torch.Tensor, offset: torch.Tensor, required_cache_size: torch.Tensor,
                attn_cache: torch.Tensor, conv_cache: torch.Tensor, attn_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Relative positions need no absolute offset, and the cache's size is its own; both
        # inputs stay in the graph (a runtime feeds them by position), contributing zero.
        unused = (offset.sum() + required_cache_size.sum()).to(x.dtype) * 0.0
        cached, chunk = _runtime_sizes(attn_cache, attn_mask)
        least = chunk * self.left_chunks
        left_ok = cached == least if self.exact else cached >= least
        unused = unused + getattr(self, self.refusal_name)((chunk == self.chunk_size) & left_ok)
        out, attn_cache, conv_cache = self.streaming(x + unused, attn_cache, conv_cache,
                                                     attn_mask)
        return self.head(out), attn_cache, conv_cache


class _CusideWenetCtcStep(nn.Module):
    """A CUSIDE model's chunk (`CusideStep`) in sherpa-onnx's online `wenet_ctc` layout: the
    runtime's two caches hold its state, which it hands back unread. `attn_cache` [1, 1, R,
    D] holds the last R >= left feature frames (its `attn_mask` says how many exist: while
    fewer than `num_left_chunks` chunks have been decoded, `chunks x chunk_size` rows);
    `conv_cache` [1, 1, D / 2, K - 1] the simulation network's GRU states, flattened."""

    def __init__(self, step: CusideStep, head: nn.Module, settings: dict[str, Any]) -> None:
        super().__init__()
        self.step, self.head = step, _LogSoftmaxHead(head)
        simulation = step.chunking.simulation
        self.state_shape = ((len(simulation.rnns), 1, simulation.hidden)
                            if step.right_context == "simulated" else None)
        # The chunk's frames are fixed (its stride), and the cache must hold the left
        # context: a runtime of another chunk size, or too few left chunks, is refused.
        self.refusal_name = refusal_name(settings)
        self.add_module(self.refusal_name, _Refusal())

    def forward(self, x: torch.Tensor, offset: torch.Tensor, required_cache_size: torch.Tensor,
                attn_cache: torch.Tensor, conv_cache: torch.Tensor, attn_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        step = self.step
        unused = (offset.sum() + required_cache_size.sum()).to(x.dtype) * 0.0
        runtime_cache, runtime_chunk = _runtime_sizes(attn_cache, attn_mask)
        unused = unused + getattr(self, self.refusal_name)(
            (runtime_chunk == step.chunk_size) & (runtime_cache >= step.left))
        rows = attn_cache[0, 0]  # [R, D]
        cached = rows.size(0)
        valid_rows = attn_mask[0, 0, :cached].to(torch.int64).sum()
        history_valid = torch.clamp(valid_rows * step.chunking.frame_rate, max=step.left)
        state = None
        if self.state_shape is not None:
            size = self.state_shape[0] * self.state_shape[2]
            state = conv_cache.flatten()[:size].reshape(self.state_shape)
        chunk = x[:, :step.stride] + unused
        right = x[:, step.stride:]
        out, _, state = step(chunk, torch.full((1,), step.stride, dtype=torch.int64),
                             rows[cached - step.left:][None], history_valid.reshape(1), state,
                             right, torch.full((1,), right.size(1), dtype=torch.int64))
        next_rows = torch.cat([rows, chunk[0]], dim=0)[chunk.size(1):]
        next_conv = conv_cache
        if state is not None:
            flat = state.flatten()
            next_conv = torch.cat([flat, conv_cache.flatten()[flat.numel():]]).reshape(
                conv_cache.shape)
        return self.head(out), next_rows[None, None], next_conv


def cuside_wenet_layout(step: CusideStep) -> dict[str, int]:
    """The `wenet_ctc` metadata of a CUSIDE step's state layout (`_CusideWenetCtcStep`):
    one block of one head whose rows are feature frames, a convolution cache large enough
    for the GRU states, and the frames a chunk reads beyond its stride as right context."""
    dim = step.chunking.feature_dim
    if dim % 2:
        raise ExportError(f"{dim}-dim features do not fit sherpa-onnx's wenet_ctc cache rows "
                          "(2 x output_size)")
    simulation = step.chunking.simulation
    state = (len(simulation.rnns) * simulation.hidden
             if step.right_context == "simulated" else 0)
    rate = step.chunking.frame_rate
    lookahead = step.chunking.context_size_right if step.right_context == "real" else 0
    return {"head": 1, "num_blocks": 1, "output_size": dim // 2,
            "cnn_module_kernel": 1 + max(1, -(-state // (dim // 2))),
            "subsampling_factor": rate, "right_context": rate - 1 + lookahead}


def wenet_ctc_runtime(model: nn.Module, chunk_size: int) -> dict[str, Any]:
    """The settings a runtime of `streaming_wenet_ctc.onnx` must use (sherpa-onnx's
    `OnlineWenetCtcModelConfig`; its factory `from_wenet_ctc` defaults to chunk_size 16 and
    num_left_chunks 4 and reads neither from the model): the export's chunk size, and
    `num_left_chunks` exactly the model's `left_chunks`, or at least what holds a CUSIDE
    model's left context; a model trained with all left context at least 16 (20 s of left
    context at chunks of 16 and 8x subsampling; more keeps more of the utterance)."""
    if model.chunking is not None:
        left = CusideStep(model.encoder, model.chunking, chunk_size).left
        return {"chunk_size": chunk_size, "num_left_chunks": max(1, -(-left // chunk_size)),
                "num_left_chunks_is": "minimum"}
    left_chunks = model.encoder.left_chunks
    if left_chunks > 0:
        return {"chunk_size": chunk_size, "num_left_chunks": left_chunks,
                "num_left_chunks_is": "exact"}
    return {"chunk_size": chunk_size, "num_left_chunks": DEFAULT_NUM_LEFT_CHUNKS,
            "num_left_chunks_is": "minimum"}


def export_wenet_ctc(model: nn.Module, chunk_size: int, path: Path,
                     metadata: dict[str, Any]) -> None:
    """`streaming_wenet_ctc.onnx`: the chunk step in sherpa-onnx's online `wenet_ctc` layout
    (`x`, `offset`, `required_cache_size`, `attn_cache`, `conv_cache`, `attn_mask` ->
    `log_probs`, `next_att_cache`, `next_conv_cache`; `KeyValueStreamingEncoder`) with the
    metadata it reads (`head`, `num_blocks`, `output_size`, `cnn_module_kernel`,
    `right_context`, `subsampling_factor`, `vocab_size`)."""
    settings = wenet_ctc_runtime(model, chunk_size)
    metadata = {**metadata, "num_left_chunks": settings["num_left_chunks"]}
    if model.chunking is not None:
        _export_cuside_wenet_ctc(model, chunk_size, path, metadata, settings)
        return
    streaming = KeyValueStreamingEncoder(model.encoder, chunk_size)
    encoder = model.encoder
    cell = encoder.cells[0]
    stride = streaming.streaming.stride
    wenet = {"head": cell.attn.num_heads, "num_blocks": len(encoder.cells),
             "output_size": encoder.output_dim,
             "cnn_module_kernel": cell.conv.depthwise.kernel_size[0],
             "subsampling_factor": stride // chunk_size,
             # A chunk's frames: (chunk - 1) x subsampling + right_context + 1.
             "right_context": streaming.streaming.frames_per_chunk - stride + stride // chunk_size
             - 1, "vocab_size": int(model.num_classes)}
    cache = chunk_size * settings["num_left_chunks"]
    attn_cache, conv_cache = streaming.initial_state(cache)
    mask = torch.ones(1, 1, cache + chunk_size, dtype=torch.bool)
    mask[:, :, :chunk_size] = False
    example = (torch.randn(1, streaming.streaming.frames_per_chunk, metadata["feature_dim"]),
               torch.tensor([cache], dtype=torch.int64), torch.tensor([cache], dtype=torch.int64),
               attn_cache, conv_cache, mask)
    export_onnx(_WenetCtcStep(streaming, model.first_head, settings), example, path,
                ["x", "offset", "required_cache_size", "attn_cache", "conv_cache", "attn_mask"],
                ["log_probs", "next_att_cache", "next_conv_cache"],
                {"x": {1: "T"}, "attn_cache": {2: "R"}, "attn_mask": {2: "M"},
                 "log_probs": {1: "T_out"}, "next_att_cache": {2: "R_out"}},
                {**metadata, **wenet}, torchscript=False)


def _export_cuside_wenet_ctc(model: nn.Module, chunk_size: int, path: Path,
                             metadata: dict[str, Any], settings: dict[str, Any]) -> None:
    step = CusideStep(model.encoder, model.chunking, chunk_size)
    layout = cuside_wenet_layout(step)
    dim = int(metadata["feature_dim"])
    cache = -(-step.left // chunk_size) * chunk_size
    mask = torch.ones(1, 1, cache + chunk_size, dtype=torch.bool)
    mask[:, :, :cache] = False
    frames = (chunk_size - 1) * layout["subsampling_factor"] + layout["right_context"] + 1
    example = (torch.randn(1, frames, dim), torch.tensor([cache], dtype=torch.int64),
               torch.tensor([cache], dtype=torch.int64), torch.zeros(1, 1, cache, dim),
               torch.zeros(1, 1, layout["output_size"], layout["cnn_module_kernel"] - 1), mask)
    export_onnx(_CusideWenetCtcStep(step, model.first_head, settings), example, path,
                ["x", "offset", "required_cache_size", "attn_cache", "conv_cache", "attn_mask"],
                ["log_probs", "next_att_cache", "next_conv_cache"],
                {"attn_cache": {2: "R"}, "attn_mask": {2: "M"}, "next_att_cache": {2: "R_out"}},
                {**metadata, **layout, "vocab_size": int(model.num_classes)}, torchscript=False)


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
    if meta.get("streaming") == "cuside":
        needed = -(-int(meta["left_frames"]) // int(meta["chunk_size"]))
        if num_left_chunks < needed:
            raise ExportError(f"{export_dir}: the CUSIDE model keeps {meta['left_frames']} "
                              f"frames of left context in the runtime's cache: "
                              f"num_left_chunks must be at least {needed}")
    elif int(meta["left_chunks"]) > 0 and num_left_chunks != int(meta["left_chunks"]):
        raise ExportError(f"{export_dir}: the model attends to {meta['left_chunks']} earlier "
                          f"chunks (encoder.kwargs.left_chunks); num_left_chunks must be that, "
                          f"not {num_left_chunks}")
    elif int(meta["left_chunks"]) <= 0:
        least = int(meta.get(RUNTIME_KEY, {}).get("num_left_chunks", 1))
        if num_left_chunks < least:
            raise ExportError(f"{export_dir}: the model was trained with all left context "
                              f"(encoder.kwargs.left_chunks {meta['left_chunks']}); "
                              f"num_left_chunks must be at least {least} ({METADATA_NAME} "
                              f"{RUNTIME_KEY}), not {num_left_chunks}")
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
    from cat.decoding.export import export_main

    sys.exit(export_main("cat.ctc.export"))
