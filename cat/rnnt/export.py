"""Export an RNN-T experiment to ONNX (encoder, decoder, joiner), and decode with the
export in onnxruntime.

The three models follow sherpa-onnx's transducer type (`sherpa_onnx.
OfflineTransducerModelConfig`), the layout icefall exports:

  * `encoder.onnx`: `x` [N, T, 80], `x_lens` [N] int64 -> `encoder_out` [N, T', J] (the
    encoder output already through the joiner's encoder projection), `encoder_out_lens`;
  * `decoder.onnx`: `y` [N, context_size] int64, the last tokens of each history (-1,
    sherpa-onnx's padding, reads as blank) -> `decoder_out` [N, J] (through the joiner's
    predictor projection); metadata `context_size`, `vocab_size`;
  * `joiner.onnx`: `encoder_out` [N, J], `decoder_out` [N, J] -> `logit` [N, V].

sherpa-onnx's transducer type feeds the decoder the last `context_size` tokens and keeps
no decoder state, so it runs models with a `StatelessPredictor`. A model with an
`LSTMPredictor` is exported with a stateful decoder instead (`y` [N, 1], `h`, `c` [N,
layers, hidden] -> `decoder_out`, `h_out`, `c_out`; metadata `predictor` "lstm"), which
`OnnxRnntDecoder` runs in onnxruntime and sherpa-onnx cannot.

Usage:
    python -m cat.rnnt.export exp/synth-rnnt-stateless    # -> exp/.../export/
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cat.core.io import PathLike
from cat.models.heads import TokenChunkSearch
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
from cat.models.streaming import StreamingStep
from cat.rnnt.model import BLANK, LSTMPredictor, StatelessPredictor

MAX_SYMBOLS_PER_FRAME = 3
# (tokens so far, decoder state, decoder output) of a greedy search
Hypothesis = tuple[list[int], dict[str, np.ndarray], np.ndarray]


class _Encoder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.encoder, self.joiner = model.encoder, model.transducer.joiner

    def forward(self, x: torch.Tensor, x_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lengths = self.encoder(x, x_lens)
        return self.joiner.project_encoder(out), lengths.to(torch.int64)


class _StatelessDecoder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.predictor, self.joiner = model.transducer.predictor, model.transducer.joiner

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        embedded = self.predictor.embedding(y.clamp(min=BLANK))
        return self.joiner.project_predictor(self.predictor._mix(embedded)[:, -1])


class _LSTMDecoder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.predictor, self.joiner = model.transducer.predictor, model.transducer.joiner

    def forward(self, y: torch.Tensor, h: torch.Tensor,
                c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, (h, c) = self.predictor.step(y[:, -1].clamp(min=BLANK), (h, c))
        return self.joiner.project_predictor(out), h, c


class _Joiner(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.joiner = model.transducer.joiner

    def forward(self, encoder_out: torch.Tensor, decoder_out: torch.Tensor) -> torch.Tensor:
        return self.joiner.joint(encoder_out, decoder_out)


def _export_decoder(model: nn.Module, path: Path, metadata: dict[str, Any]) -> None:
    predictor = model.transducer.predictor
    if isinstance(predictor, StatelessPredictor):
        context = predictor.context_size
        export_onnx(_StatelessDecoder(model), (torch.zeros(2, context, dtype=torch.int64),),
                    path, ["y"], ["decoder_out"], {"y": {0: "N"}, "decoder_out": {0: "N"}},
                    metadata)
        return
    if not isinstance(predictor, LSTMPredictor):
        raise TypeError(f"cannot export a {type(predictor).__name__}")
    state = predictor.initial_state(2, torch.device("cpu"))
    axes = {name: {0: "N"} for name in ("y", "h", "c", "decoder_out", "h_out", "c_out")}
    export_onnx(_LSTMDecoder(model), (torch.zeros(2, 1, dtype=torch.int64), *state), path,
                ["y", "h", "c"], ["decoder_out", "h_out", "c_out"], axes, metadata)


#: The streaming encoder in the layout of sherpa-onnx's online `lstm` transducer type.
LSTM_LAYOUT_NAME = "streaming_encoder_lstm.onnx"
#: Left context, in chunks, that the `lstm`-layout export of a U2 model with all left
#: context (`left_chunks` -1) caches: its hypotheses are `cat.rnnt.stream`'s while an
#: utterance's earlier chunks fit (16 chunks of 16 frames: 20 s at 8x).
LSTM_LAYOUT_LEFT_CHUNKS = 16


def _packed(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([part.reshape(-1) for part in parts])[None, None]


class _LstmLayoutStep(nn.Module):
    """A streaming encoder's chunk in the layout of sherpa-onnx's online `lstm` transducer
    type: `x` [1, T, 80], `h` [1, 1, 1] and `c` [1, 1, S] -> `encoder_out` [1, T', J] (through
    the joiner's encoder projection), `next_h`, `next_c`. The runtime hands the two states
    back unread, zeros at the start; `c` holds the step's own state flattened, what its
    streaming strategy keeps (`packed_state`: a CUSIDE model's left context, how many of
    its frames exist and the simulation's GRU states; a U2 model's cache of projected keys
    and values, its convolution frames and how many cached frames exist)."""

    def __init__(self, model: nn.Module, streaming: StreamingStep) -> None:
        super().__init__()
        self.joiner = model.transducer.joiner
        packed = streaming.packed_state(LSTM_LAYOUT_LEFT_CHUNKS)
        self.step, self.run, self.shapes = packed.module, packed.run, packed.shapes
        self.frames, self.stride = packed.frames, packed.stride
        self.size = sum(int(np.prod(shape)) for shape in self.shapes)

    def _unpack(self, c: torch.Tensor) -> list[torch.Tensor]:
        flat, parts, start = c.reshape(-1), [], 0
        for shape in self.shapes:
            count = int(np.prod(shape))
            parts.append(flat[start:start + count].reshape(shape))
            start += count
        return parts

    def forward(self, x: torch.Tensor, h: torch.Tensor,
                c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, packed = self.run(x, self._unpack(c))
        return self.joiner.project_encoder(out), h, _packed(packed)


def export_lstm_layout(model: nn.Module, streaming: StreamingStep, path: Path,
                       metadata: dict[str, Any]) -> None:
    """`streaming_encoder_lstm.onnx`: the streaming encoder in sherpa-onnx's online `lstm`
    transducer layout (`_LstmLayoutStep`) with the metadata it reads (`model_type` lstm,
    `num_encoder_layers`, `d_model`, `rnn_hidden_size`: the states' shapes; `T`, the frames
    a chunk reads; `decode_chunk_len`, its stride); the export's `decoder.onnx` and
    `joiner.onnx` go with it. Batch 1: streams are decoded one at a time."""
    step = _LstmLayoutStep(model, streaming)
    frames = step.frames
    layout = {"model_type": "lstm", "num_encoder_layers": 1, "d_model": 1,
              "rnn_hidden_size": step.size, "T": frames, "decode_chunk_len": streaming.stride}
    example = (torch.randn(1, frames, int(metadata["feature_dim"])), torch.zeros(1, 1, 1),
               torch.zeros(1, 1, step.size))
    export_onnx(step, example, path, ["x", "h", "c"], ["encoder_out", "next_h", "next_c"], {},
                {**metadata, **layout}, torchscript=False)


def export_model(model: nn.Module, tokenizer: Any, checkpoint: Path, exp_dir: PathLike,
                 out_dir: PathLike, chunk_size: int | None = None) -> Path:
    """Write `encoder.onnx`, `decoder.onnx`, `joiner.onnx`, `tokens.txt` and
    `export.json` of an RNN-T experiment; with `chunk_size`, also `streaming.onnx` (the
    encoder chunk by chunk, projected for the joiner, state in and out)."""
    predictor = model.transducer.predictor
    stateless = isinstance(predictor, StatelessPredictor)
    metadata: dict[str, Any] = {
        "family": "rnnt", "model_type": "transducer", "framework": "cat",
        "vocab_size": int(model.num_classes), "blank_id": BLANK, "checkpoint": checkpoint.name,
        "predictor": "stateless" if stateless else "lstm",
        "context_size": predictor.context_size if stateless else 1,
        "joiner_dim": int(model.transducer.joiner.enc_proj.out_features),
        **experiment_feature_metadata(exp_dir, model.encoder)}
    if not stateless:
        metadata.update(lstm_layers=predictor.lstm.num_layers,
                        lstm_hidden=predictor.lstm.hidden_size)
    dim, joiner_dim = metadata["feature_dim"], metadata["joiner_dim"]
    streaming = streaming_step(model, chunk_size) if chunk_size else None
    if streaming is not None:
        metadata.update(streaming_metadata(streaming))

    def write(directory: Path) -> dict[str, Any]:
        example = (torch.randn(2, 100, dim), torch.tensor([100, 80], dtype=torch.int64))
        export_onnx(_Encoder(model), example, directory / "encoder.onnx", ["x", "x_lens"],
                    ["encoder_out", "encoder_out_lens"],
                    {"x": {0: "N", 1: "T"}, "x_lens": {0: "N"},
                     "encoder_out": {0: "N", 1: "T_out"}, "encoder_out_lens": {0: "N"}},
                    metadata)
        _export_decoder(model, directory / "decoder.onnx", metadata)
        export_onnx(_Joiner(model), (torch.randn(2, joiner_dim), torch.randn(2, joiner_dim)),
                    directory / "joiner.onnx", ["encoder_out", "decoder_out"], ["logit"],
                    {"encoder_out": {0: "N"}, "decoder_out": {0: "N"}, "logit": {0: "N"}},
                    metadata)
        if streaming is not None:
            export_streaming(model.transducer.joiner.enc_proj, streaming,
                             directory / STREAMING_NAME, "encoder_out", metadata)
            if stateless:
                export_lstm_layout(model, streaming, directory / LSTM_LAYOUT_NAME, metadata)
        write_tokens(tokenizer, directory / TOKENS_NAME)
        return metadata

    return write_export(out_dir, write)


def sherpa_model_config(export_dir: Path, meta: dict[str, Any], common: dict[str, Any]) -> Any:
    """The family's hook for `cat.decoding.export.sherpa_recognizer`: sherpa-onnx's offline
    `transducer` model of the export's encoder, decoder and joiner; `common` holds the
    tokens, threads and provider. An LSTM predictor is an `ExportError`: sherpa-onnx's
    transducer type needs a stateless one."""
    import sherpa_onnx

    if meta.get("predictor") == "lstm":
        raise ExportError(f"{export_dir}: sherpa-onnx's transducer type needs a stateless "
                          "predictor (decoder.type StatelessPredictor); this model's LSTM "
                          "predictor runs in onnxruntime only (cat.rnnt.export.OnnxRnntDecoder)")
    return sherpa_onnx.OfflineModelConfig(
        transducer=sherpa_onnx.OfflineTransducerModelConfig(
            encoder_filename=str(export_dir / "encoder.onnx"),
            decoder_filename=str(export_dir / "decoder.onnx"),
            joiner_filename=str(export_dir / "joiner.onnx")),
        model_type="transducer", **common)


def sherpa_online_recognizer(export_dir: PathLike, num_threads: int = 1) -> Any:
    """A `sherpa_onnx.OnlineRecognizer` (transducer, model type `lstm`, greedy search)
    running `streaming_encoder_lstm.onnx` with the export's `decoder.onnx` and
    `joiner.onnx` and the fbank settings of `export.json`; decode one stream at a time."""
    import sherpa_onnx
    from sherpa_onnx.lib import _sherpa_onnx as native

    export_dir = Path(export_dir)
    meta = load_export_metadata(export_dir)
    if not (export_dir / LSTM_LAYOUT_NAME).is_file():
        raise ExportError(f"{export_dir}: no {LSTM_LAYOUT_NAME} (export a model with a "
                          "stateless predictor with --chunk-size)")
    model = native.OnlineModelConfig(
        transducer=native.OnlineTransducerModelConfig(
            encoder=str(export_dir / LSTM_LAYOUT_NAME), decoder=str(export_dir / "decoder.onnx"),
            joiner=str(export_dir / "joiner.onnx")),
        tokens=str(export_dir / TOKENS_NAME), num_threads=num_threads, debug=False,
        model_type="lstm")
    config = native.OnlineRecognizerConfig(feat_config=sherpa_feature_config(meta),
                                           model_config=model, enable_endpoint=False,
                                           decoding_method="greedy_search")
    return sherpa_wrap(sherpa_onnx.OnlineRecognizer, native.OnlineRecognizer, config)


class OnnxRnntDecoder:
    """Greedy RNN-T decoding of features with an export in onnxruntime: the search of
    `cat.rnnt.search.rnnt_greedy_search` (at most `MAX_SYMBOLS_PER_FRAME` per frame)."""

    def __init__(self, export_dir: PathLike, num_threads: int = 1) -> None:
        export_dir = Path(export_dir)
        self.meta = load_export_metadata(export_dir)
        self.encoder = onnx_session(export_dir / "encoder.onnx", num_threads)
        self.decoder = onnx_session(export_dir / "decoder.onnx", num_threads)
        self.joiner = onnx_session(export_dir / "joiner.onnx", num_threads)
        self.stateless = self.meta["predictor"] == "stateless"
        self.context_size = int(self.meta["context_size"])

    def _initial(self) -> tuple[list[int], dict[str, np.ndarray]]:
        if self.stateless:
            return [-1] * (self.context_size - 1) + [BLANK], {}
        shape = (1, int(self.meta["lstm_layers"]), int(self.meta["lstm_hidden"]))
        zeros = np.zeros(shape, np.float32)
        return [BLANK], {"h": zeros, "c": zeros}

    def _step(self, context: list[int], state: dict[str, np.ndarray]
              ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        y = np.array([context[-self.context_size:]], dtype=np.int64)
        outputs = self.decoder.run(None, {"y": y, **state})
        if self.stateless:
            return outputs[0], state
        return outputs[0], {"h": outputs[1], "c": outputs[2]}

    def start(self) -> Hypothesis:
        """The empty history: its tokens, decoder state and decoder output."""
        context, state = self._initial()
        decoder_out, state = self._step(context, state)
        return context, state, decoder_out

    def decode_encoded(self, encoder_out: np.ndarray, hyp: Hypothesis | None = None
                       ) -> tuple[list[int], Hypothesis]:
        """Search encoder frames [T', J] after `hyp` (default: the empty history):
        (new tokens, the hypothesis after them)."""
        context, state, decoder_out = hyp if hyp is not None else self.start()
        tokens: list[int] = []
        for frame in encoder_out:
            for _ in range(MAX_SYMBOLS_PER_FRAME):
                logit = self.joiner.run(None, {"encoder_out": frame[None],
                                               "decoder_out": decoder_out})[0]
                best = int(logit[0].argmax())
                if best == BLANK:
                    break
                tokens.append(best)
                context = [*context, best]
                decoder_out, state = self._step(context, state)
        return tokens, (context, state, decoder_out)

    def decode(self, feats: np.ndarray) -> list[int]:
        """Token ids of one utterance's features [T, D]."""
        encoder_out, lengths = self.encoder.run(
            None, {"x": feats[None].astype(np.float32), "x_lens": np.array([len(feats)])})
        return self.decode_encoded(encoder_out[0, :int(lengths[0])])[0]


class OnnxRnntChunkSearch(TokenChunkSearch):
    """Greedy search of `streaming.onnx`'s chunks with the export's decoder and joiner,
    carried over chunks."""

    def __init__(self, decoder: OnnxRnntDecoder) -> None:
        self.decoder = decoder
        self.tokens: list[int] = []
        self.hyp = decoder.start()

    def step(self, encoder_out: torch.Tensor) -> None:
        new, self.hyp = self.decoder.decode_encoded(encoder_out.numpy(), self.hyp)
        self.tokens.extend(new)


if __name__ == "__main__":
    from cat.core.commands import run_verb

    sys.exit(run_verb("cat.rnnt.export"))
