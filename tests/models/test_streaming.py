"""The encoder's streaming strategies (`cat.models.streaming`): each strategy, U2's caches
and CUSIDE's windows, passes one contract: the model picks it by its config, its chunk
encoder over an utterance gives its step's outputs, chunks of several streams batch as
each alone, and its `streaming.onnx` runs back in onnxruntime, found by the name
`export.json` holds."""

from __future__ import annotations

import json

import pytest
import torch

from cat.models import streaming
from cat.models.chunked import CachedChunkEncoder, OnnxChunkEncoder, U2Streaming
from cat.models.cuside_streaming import (
    CusideStreaming,
    CusideStreamingEncoder,
    OnnxCusideEncoder,
)
from cat.models.onnx_export import (
    METADATA_NAME,
    STREAMING_NAME,
    ExportError,
    export_streaming,
    feature_metadata,
    onnx_chunk_encoder,
    streaming_metadata,
    streaming_step,
)
from cat.models.registry import build_model
from cat.testing.training import tiny_model_config

FEATS = 8
CHUNK = 3


def _u2_model():
    torch.manual_seed(0)
    config = tiny_model_config("ctc", FEATS)
    config["encoder"]["kwargs"].update(causal_conv=True, max_chunk_size=8,
                                       time_reduction_factor=2)
    return build_model(config, num_classes=7).eval()


def _cuside_model():
    torch.manual_seed(0)
    config = tiny_model_config("ctc", FEATS)
    config["encoder"]["kwargs"].update(time_reduction_factor=2, global_cmvn=True, num_cells=2)
    config["trainer"] = {"chunk_size": 24, "context_size_left": 24, "context_size_right": 5,
                         "jitter_range": 1, "simu": True, "simu_hdim": 8, "simu_layers": 2}
    model = build_model(config, num_classes=7)
    model.encoder.normalizer.set_stats(torch.randn(FEATS), torch.rand(FEATS) + 0.5)
    return model.eval()


# strategy name -> (model factory, strategy class, PyTorch and onnxruntime chunk encoders)
CASES = {"u2": (_u2_model, U2Streaming, CachedChunkEncoder, OnnxChunkEncoder),
         "cuside": (_cuside_model, CusideStreaming, CusideStreamingEncoder, OnnxCusideEncoder)}


def _feats(frames: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(1, frames, FEATS, generator=torch.Generator().manual_seed(seed))


def _encode(encoder, feats: torch.Tensor) -> torch.Tensor:
    """An utterance through a chunk encoder as `StreamingRecognizer` feeds it."""
    outputs, start, frames = [], 0, feats.size(1)
    with torch.no_grad():
        while frames - start >= encoder.stride + encoder.lookahead:
            outputs.append(encoder(feats[:, start:start + encoder.stride + encoder.lookahead]))
            start += encoder.stride
        outputs.append(encoder.finish(feats[:, start:]))
    return torch.cat([out for out in outputs if out.size(1)], dim=1)


def test_the_registry_names_every_strategy_by_its_export_name():
    assert [streaming.strategy_class(name) for name in streaming.STRATEGIES] == [
        U2Streaming, CusideStreaming]
    assert all(streaming.strategy_class(name).name == name for name in streaming.STRATEGIES)
    assert streaming.right_context_choices() == ("simulated", "real", "none")
    # an export written before exports named their strategy streams as U2's
    assert streaming.export_strategy({"chunk_size": 4}) is U2Streaming
    assert streaming.export_strategy({"streaming": "cuside"}) is CusideStreaming
    with pytest.raises(ValueError, match="streaming strategy 'u3': not one of u2, cuside"):
        streaming.strategy_class("u3")


@pytest.mark.parametrize("name", CASES)
def test_the_model_picks_its_strategy_by_its_config(name):
    make, strategy_class, torch_class, _ = CASES[name]
    model = make()
    strategy = model.streaming
    assert type(strategy) is strategy_class
    encoder = strategy.chunk_encoder(CHUNK)
    assert type(encoder) is torch_class
    step = strategy.step(CHUNK)
    metadata = step.metadata()
    assert next(iter(metadata.items())) == ("streaming", name)
    assert (metadata["chunk_size"], metadata["stride"]) == (CHUNK, encoder.stride) == (
        CHUNK, 8 * CHUNK)
    assert encoder.right_context == step.right_context == (
        None if name == "u2" else "simulated")


@pytest.mark.parametrize("name", CASES)
def test_streams_batch_as_each_alone(name):
    """`encode_batch` of streams at different points gives each stream's own output."""
    model = CASES[name][0]()
    strategy = model.streaming
    feats = _feats(200)
    alone, together = strategy.chunk_encoder(CHUNK), strategy.chunk_encoder(CHUNK)
    ahead, behind = strategy.chunk_encoder(CHUNK), strategy.chunk_encoder(CHUNK)
    size, stride = alone.stride + alone.lookahead, alone.stride
    with torch.no_grad():
        ahead(feats[:, :size])  # one chunk ahead of the others
        for index in range(3):
            chunk = feats[:, index * stride:index * stride + size]
            later = feats[:, (index + 1) * stride:(index + 1) * stride + size]
            want = [alone(chunk)[0]]
            got = type(together).encode_batch([together, ahead, behind],
                                              torch.cat([chunk, later, chunk]))
            torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got[2], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_encode(together, feats[:, 3 * stride:]),
                                   _encode(alone, feats[:, 3 * stride:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_the_export_of_a_strategy_streams_back_in_onnxruntime(name, tmp_path):
    pytest.importorskip("onnxruntime")
    make, _, _, onnx_class = CASES[name]
    model = make()
    step = streaming_step(model, CHUNK)
    metadata = {**feature_metadata(model.encoder), **streaming_metadata(step),
                "feature_dim": FEATS}
    export_streaming(torch.nn.Identity(), step, tmp_path / STREAMING_NAME, "encoder_out",
                     metadata)
    (tmp_path / METADATA_NAME).write_text(json.dumps(metadata), encoding="utf-8")
    onnx = onnx_chunk_encoder(tmp_path)
    assert type(onnx) is onnx_class
    feats = _feats(131)
    torch.testing.assert_close(_encode(onnx, feats),
                               _encode(model.streaming.chunk_encoder(CHUNK), feats),
                               atol=1e-4, rtol=1e-4)
    metadata["streaming"] = "u3"
    (tmp_path / METADATA_NAME).write_text(json.dumps(metadata), encoding="utf-8")
    with pytest.raises(ExportError, match="streaming strategy 'u3'"):
        onnx_chunk_encoder(tmp_path)


@pytest.mark.parametrize("name", CASES)
def test_the_packed_state_step_gives_the_chunk_encoders_outputs(name):
    """`packed_state` (sherpa-onnx's `lstm` layout: one state the runtime hands back) over
    an utterance's whole chunks: the chunk encoder's outputs."""
    model = CASES[name][0]()
    step = model.streaming.step(CHUNK)
    packed = step.packed_state(16)
    encoder = model.streaming.chunk_encoder(CHUNK)
    assert (packed.frames, packed.stride) == (encoder.stride + encoder.lookahead, encoder.stride)
    feats, state = _feats(200), [torch.zeros(shape) for shape in packed.shapes]
    with torch.no_grad():
        for start in range(0, 200 - packed.frames + 1, packed.stride):
            chunk = feats[:, start:start + packed.frames]
            out, state = packed.run(chunk, state)
            assert [tuple(part.shape) for part in state] == packed.shapes
            torch.testing.assert_close(out, encoder(chunk), atol=1e-5, rtol=1e-5)
