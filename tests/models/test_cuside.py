"""CUSIDE (`cat.models.cuside`): the simulation network, the chunked forward, unified
training of CTC, CTC-CRF and RNN-T heads, streaming equal to the chunked forward, the ONNX
step, and the settings' errors."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch

from cat.core import config as core_config
from cat.core.config import ConfigError, cuside_keys, load_config_schema, model_kind
from cat.decoding.export import (
    METADATA_NAME,
    STREAMING_NAME,
    export_streaming,
    feature_metadata,
    onnx_chunk_encoder,
    streaming_metadata,
)
from cat.decoding.online import StreamingError, streaming_encoder
from cat.models import cuside
from cat.models.cuside import ContextChunking, SimulationNet, build_chunking
from cat.models.cuside_streaming import CusideStep, CusideStreamingEncoder
from cat.models.registry import build_model, count_parameters
from cat.testing.training import tiny_model_config

FEATS = 8


def cuside_config(kind: str = "ctc", time_reduction: int = 1, **trainer) -> dict:
    config = tiny_model_config(kind, FEATS)
    config["encoder"]["kwargs"].update(time_reduction_factor=time_reduction, global_cmvn=True,
                                       num_cells=2)
    rate = 4 * time_reduction
    config["trainer"] = {"chunk_size": 3 * rate, "context_size_left": 3 * rate,
                         "context_size_right": 5, "jitter_range": 1, "simu": True,
                         "simu_hdim": 8, "simu_layers": 2, **trainer}
    return config


def cuside_model(kind: str = "ctc", time_reduction: int = 1, **trainer):
    torch.manual_seed(0)
    model = build_model(cuside_config(kind, time_reduction, **trainer), num_classes=7)
    model.encoder.normalizer.set_stats(torch.randn(FEATS), torch.rand(FEATS) + 0.5)
    return model


def _batch(lengths=(70, 45, 13)):
    generator = torch.Generator().manual_seed(1)
    feats = torch.randn(len(lengths), max(lengths), FEATS, generator=generator) * 2 + 1
    labels = torch.tensor([[1, 2, 3], [2, 4, 0], [5, 0, 0]])[:len(lengths)]
    label_lens = torch.tensor([3, 2, 1])[:len(lengths)]
    return feats, torch.tensor(lengths), labels, label_lens


def test_the_simulation_network_has_cats_parameter_count():
    # CAT's simu_net.py: GRUs of 256 (80 -> 256, then 256 -> 256 twice) and a linear layer
    # to 40 frames of 80 bins; a GRU has 3 gates of input and hidden weights and 2 biases.
    def gru(inputs, hidden):
        return 3 * (hidden * inputs + hidden * hidden + 2 * hidden)

    expected = gru(80, 256) + 2 * gru(256, 256) + 256 * 40 * 80 + 40 * 80
    assert count_parameters(SimulationNet(80, 40, 256, 3)) == expected == 1_871_488


def test_a_chunk_is_encoded_in_its_own_window_of_context():
    """Each chunk's output is the encoder's output of [left context, chunk, right context]
    (the real frames after it), pad frames standing for what does not exist."""
    model = cuside_model(simu=False).eval()
    chunking, encoder = model.chunking, model.encoder
    feats, lengths, _, _ = _batch()
    with torch.no_grad():
        hidden, out_lens, losses = chunking.encode_chunks(encoder, feats, lengths, 12, "real")
    assert losses is None
    assert out_lens.tolist() == [math.ceil(n / 4) for n in lengths.tolist()]
    pad = encoder.normalizer.mean
    utterance = feats[0]
    for chunk in range(math.ceil(70 / 12)):
        start = chunk * 12
        frames = [utterance[t] if 0 <= t < 70 else pad for t in range(start - 12, start + 17)]
        with torch.no_grad():
            out, _ = encoder(torch.stack(frames)[None], torch.tensor([29]))
        got = hidden[0, 3 * chunk:3 * chunk + 3]
        want = out[0, 3:3 + got.size(0)]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Frames past an utterance's length are zero, and padding does not change the others.
    assert hidden[2, out_lens[2]:].abs().max() == 0
    with torch.no_grad():
        alone, _, _ = chunking.encode_chunks(encoder, feats[1:2, :45], lengths[1:2], 12, "real")
    torch.testing.assert_close(alone[0], hidden[1, :out_lens[1]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("time_reduction", "right_context", "chunk_size"),
                         [(1, "simulated", 3), (1, "real", 2), (1, "none", 4),
                          (2, "simulated", 2), (2, "real", 4)])
def test_streaming_equals_the_chunked_forward(time_reduction, right_context, chunk_size):
    """Chunk by chunk, with the left context and the simulation's state carried, the outputs
    are those of the chunked forward of the whole utterance with the same simulated frames,
    also for the last, partial chunk."""
    model = cuside_model(time_reduction=time_reduction).eval()
    model.set_decode_chunk_size(chunk_size, right_context)
    feats, lengths, _, _ = _batch((83, 61, 7))
    with torch.no_grad():
        hidden, out_lens = model.encode(feats, lengths)
        for row, length in enumerate(lengths.tolist()):
            streaming = streaming_encoder(model, chunk_size, right_context)
            assert isinstance(streaming, CusideStreamingEncoder)
            x, start, outputs = feats[row:row + 1, :length], 0, []
            while length - start >= streaming.stride + streaming.lookahead:
                outputs.append(streaming(x[:, start:start + streaming.stride
                                           + streaming.lookahead]))
                start += streaming.stride
            outputs.append(streaming.finish(x[:, start:]))
            streamed = torch.cat(outputs, dim=1)
            assert streamed.size(1) == out_lens[row]
            torch.testing.assert_close(streamed[0], hidden[row, :length and out_lens[row]],
                                       atol=1e-5, rtol=1e-5)
        model.set_decode_chunk_size(0)
        full, _ = model.encode(feats, lengths)
    # The chunks matter: full context gives other outputs.
    assert (full[0, :10] - hidden[0, :10]).abs().max() > 1e-3


def test_simulated_context_is_not_the_real_one():
    """The three right contexts give three encodings (the simulated frames are used)."""
    model = cuside_model().eval()
    feats, lengths, _, _ = _batch()
    with torch.no_grad():
        outs = [model.chunking.encode_chunks(model.encoder, feats, lengths, 12, right)[0]
                for right in ("simulated", "real", "none")]
    assert (outs[0] - outs[1]).abs().max() > 1e-3
    assert (outs[0] - outs[2]).abs().max() > 1e-3


def test_the_simulation_loss_is_the_l1_distance_to_the_real_future():
    model = cuside_model().train()
    chunking, encoder = model.chunking, model.encoder
    chunking.simulation.dropout.p = 0.0
    feats, lengths, _, _ = _batch()
    _, _, losses = chunking.encode_chunks(encoder, feats, lengths, 12, "none", feats)
    # By hand for utterance 1 (45 frames: chunks at 0, 12, 24, 36), normalised features.
    normalized = encoder.normalizer(feats[1, :45])
    pad = encoder.normalizer(encoder.normalizer.mean)
    padded = torch.cat([normalized, pad.expand(48 - 45 + 5, FEATS)])
    states, _ = chunking.simulation(torch.cat([normalized, pad.expand(3, FEATS)])[None])
    distances = []
    for chunk in range(4):
        predicted = chunking.simulation.predict(states[0, 12 * chunk + 11])
        real = padded[12 * (chunk + 1):12 * (chunk + 1) + 5]
        distances.append((predicted - real).abs().mean().detach())
    expected = float(torch.stack(distances).mean())
    assert float(losses[1].detach()) == pytest.approx(expected, rel=1e-5)
    losses.sum().backward()
    assert chunking.simulation.postnet.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["ctc", "rnnt"])
def test_unified_training_adds_the_chunked_losses_and_the_simulation(kind, monkeypatch):
    """loss = the heads' loss on the full-context forward + on the chunked forward +
    simu_loss_weight x the simulation's L1 (the draw fixed: jitter 0, simulated)."""
    model = cuside_model(kind, simu_loss_weight=3.0).train()
    model.chunking.simulation.dropout.p = 0.0
    monkeypatch.setattr(model.chunking, "_draw_chunk", lambda: 12)
    monkeypatch.setattr(model.chunking, "_draw_right_context", lambda: "simulated")
    feats, lengths, labels, label_lens = _batch()
    torch.manual_seed(5)
    loss, stats = model(feats, lengths, labels, label_lens)
    loss.backward()
    head = model.first_head
    with torch.no_grad():
        hidden, out_lens = model.encoder(feats, lengths)
        full = head.losses(hidden, out_lens, labels, label_lens)[0].sum()
        chunked, chunk_lens, simulation = model.chunking.encode_chunks(
            model.encoder, feats, lengths, 12, "simulated", feats)
        chunk = head.losses(chunked, chunk_lens, labels, label_lens)[0].sum()
    assert stats["chunk_loss_sum"] == pytest.approx(float(chunk), rel=1e-4)
    assert stats["simu_loss_sum"] == pytest.approx(3.0 * float(simulation.sum()), rel=1e-4)
    assert stats["loss_sum"] == pytest.approx(float(full + chunk + 3.0 * simulation.sum()),
                                              rel=1e-4)
    assert stats["num_frames"] == float(out_lens.sum())
    for module in (model.encoder, model.chunking.simulation):
        assert sum(float(p.grad.abs().sum()) for p in module.parameters()
                   if p.grad is not None) > 0


def test_a_ctc_crf_head_trains_on_chunks(tmp_path):
    from cat.crf.model import CRFHead
    from cat.graph.denominator import build_den_graph, save_den_graph

    units = ["<blk>", "<unk>", "a", "b", "c", "d", "e"]
    save_den_graph(build_den_graph([[2, 3, 4], [3, 6], [2, 2, 6], [5]], 7, order=2,
                                   units=units), tmp_path / "den_lm.npz")
    model = cuside_model(use_crf=True, den_lm=str(tmp_path / "den_lm.npz")).train()
    assert isinstance(model.first_head, CRFHead)
    model.prepare_training(units)
    loss, stats = model(*_batch())
    loss.backward()
    assert torch.isfinite(loss) and stats["chunk_loss_sum"] > 0 and stats["simu_loss_sum"] > 0
    assert model.chunking.simulation.postnet.weight.grad.abs().sum() > 0


def test_jitter_and_right_context_draws():
    chunking = ContextChunking(FEATS, 4, chunk_size=16, context_size_left=32,
                               context_size_right=8, jitter_range=2, simu=True)
    assert list(chunking.chunk_sizes) == [2, 3, 4, 5, 6]
    # The left context grows with the chunk, by context_size_left // chunk_size per frame.
    assert [chunking.left_frames(4 * n) for n in chunking.chunk_sizes] == [16, 24, 32, 40, 48]
    draws = {chunking._draw_right_context() for _ in range(200)}
    assert draws == {"simulated", "none", "real"}
    assert {chunking._draw_chunk() for _ in range(200)} == {8, 12, 16, 20, 24}
    plain = ContextChunking(FEATS, 4, chunk_size=16, context_size_right=8)
    assert {plain._draw_right_context() for _ in range(100)} == {"none", "real"}
    assert plain.default_right_context == "real"


def test_the_draws_follow_torchs_seed_alone():
    """Chunk sizes and right contexts come from torch's generator, which training seeds:
    the same seed gives the same draws whatever Python's own generator holds."""
    import random

    chunking = ContextChunking(FEATS, 4, chunk_size=16, context_size_left=32,
                               context_size_right=8, jitter_range=2, simu=True)

    def draws(python_seed: int) -> list:
        random.seed(python_seed)
        torch.manual_seed(7)
        return [(chunking._draw_chunk(), chunking._draw_right_context()) for _ in range(50)]

    assert draws(1) == draws(2)


@pytest.mark.parametrize(("trainer", "message"), [
    ({"chunk_size": 10}, r"chunk_size \(10\) and context_size_left \(40\) must be multiples "
                         r"of the encoder's frame rate reduction \(4\)"),
    ({"chunk_size": 12, "context_size_left": 12, "jitter_range": 3},
     r"jitter_range \(3 encoder frames\) must be below the chunk's 3"),
    ({"chunk_size": 12, "context_size_left": 12, "context_size_right": 0, "simu": True},
     "simu needs context_size_right > 0"),
    ({"chunk_size": 12, "context_size_left": 12, "downsampling_ratio": 8},
     "trainer.downsampling_ratio 8: the encoder reduces the frame rate 4x"),
    ({"chunk_size": 12, "context_size_left": 12, "mel_dim": 80},
     "trainer.mel_dim 80: the encoder takes 8-dim features"),
    ({"simu": True}, r"trainer\.simu: a CUSIDE setting, used only with trainer\.chunk_size"),
])
def test_settings_that_do_not_fit_are_errors_naming_the_key(trainer, message):
    config = tiny_model_config("ctc", FEATS)
    config["trainer"] = trainer
    with pytest.raises(ConfigError, match=message):
        build_model(config, num_classes=7)


def test_the_schema_is_the_one_list_of_the_keys_and_their_defaults():
    """The chunking settings the schema marks are `ContextChunking`'s keyword arguments,
    with the schema's defaults; CAT's checked keys are the two it compares."""
    chunking = cuside_keys("chunking")
    parameters = inspect.signature(ContextChunking).parameters
    assert list(chunking) == list(parameters)[2:]
    assert {key: parameters[key].default for key in list(chunking)[1:]} == {
        "context_size_left": 40, "context_size_right": 40, "jitter_range": 2, "simu": False,
        "simu_loss_weight": 1.0, "simu_hdim": 256, "simu_layers": 3} == {
        key: chunking[key] for key in list(chunking)[1:]}
    assert list(cuside_keys("check")) == ["downsampling_ratio", "mel_dim"]
    assert list(cuside_keys()) == [*chunking, "downsampling_ratio", "mel_dim"]


class _Encoder:
    max_chunk_size = 0
    frame_rate_factor = 4


def test_a_key_added_to_the_schema_is_seen_by_the_config_check_and_the_model(monkeypatch):
    """A CUSIDE key (and a default) changed in the schema alone reaches both readers: the
    config check (`model_kind`) and the settings `build_chunking` gives the chunking."""
    schema = load_config_schema()
    properties = schema["$defs"]["trainer"]["properties"]
    properties["simu_dropout"] = {"x-cuside": "chunking", "type": "number", "default": 0.25}
    properties["context_size_left"]["default"] = 48
    monkeypatch.setattr(core_config, "load_config_schema", lambda: schema)
    with pytest.raises(ConfigError, match=r"trainer\.simu_dropout: a CUSIDE setting, used "
                                          r"only with trainer\.chunk_size"):
        model_kind({"ctc": {}, "trainer": {"simu_dropout": 0.5}})
    given: dict = {}
    monkeypatch.setattr(cuside, "ContextChunking",
                        lambda feature_dim, rate, **settings: given.update(settings))
    build_chunking({"chunk_size": 16, "simu_dropout": 0.5}, _Encoder(), FEATS)
    assert given["simu_dropout"] == 0.5 and given["context_size_left"] == 48
    build_chunking({"chunk_size": 16}, _Encoder(), FEATS)
    assert given["simu_dropout"] == 0.25


def test_cuside_and_u2_chunk_training_exclude_each_other():
    config = cuside_config()
    config["encoder"]["kwargs"].update(causal_conv=True, max_chunk_size=4)
    with pytest.raises(ConfigError, match=r"trainer.chunk_size \(CUSIDE\) and encoder.kwargs."
                                          r"max_chunk_size \(U2 chunk training\) exclude"):
        build_model(config, num_classes=7)


def test_chunk_sizes_and_right_contexts_it_was_not_trained_for_are_errors():
    model = cuside_model().eval()
    with pytest.raises(ValueError, match=r"chunk size 5: this CUSIDE model was trained on "
                                         r"chunks of 2 to 4 encoder frames"):
        model.set_decode_chunk_size(5)
    with pytest.raises(ValueError, match="chunk size 1"):
        streaming_encoder(model, 1)
    with pytest.raises(ValueError, match="right context must be one of"):
        model.set_decode_chunk_size(3, "future")
    plain = cuside_model(simu=False).eval()
    with pytest.raises(ValueError, match="right context 'simulated': this CUSIDE model has no "
                                         "simulation network"):
        CusideStep(plain.encoder, plain.chunking, 3, "simulated")
    u2 = build_model(tiny_model_config("ctc", FEATS), num_classes=7)
    with pytest.raises(ValueError, match="only CUSIDE models"):
        u2.set_decode_chunk_size(0, "real")
    with pytest.raises(StreamingError, match="only CUSIDE models"):
        streaming_encoder(u2, 3, "real")


@pytest.mark.parametrize("right_context", ["simulated", "real", "none"])
def test_the_onnx_step_gives_pytorch_streaming_outputs(right_context, tmp_path):
    pytest.importorskip("onnxruntime")
    model = cuside_model(time_reduction=2).eval()
    step = CusideStep(model.encoder, model.chunking, 3, right_context)
    metadata = {**feature_metadata(model.encoder), **streaming_metadata(step)}
    metadata["feature_dim"] = FEATS
    export_streaming(model.ctc, step, tmp_path / STREAMING_NAME, "log_probs", metadata)
    (tmp_path / METADATA_NAME).write_text(json.dumps(metadata), encoding="utf-8")
    onnx = onnx_chunk_encoder(tmp_path)
    feats = _batch((131,))[0]
    for encoder in (onnx, CusideStreamingEncoder(model.encoder, model.chunking, 3,
                                                 right_context)):
        assert (encoder.stride, encoder.lookahead) == (24, 5 if right_context == "real" else 0)
    torch_encoder = CusideStreamingEncoder(model.encoder, model.chunking, 3, right_context)
    start, got, want = 0, [], []
    with torch.no_grad():
        while 131 - start >= onnx.stride + onnx.lookahead:
            piece = feats[:, start:start + onnx.stride + onnx.lookahead]
            got.append(onnx(piece))
            want.append(model.ctc(torch_encoder(piece)))
            start += onnx.stride
        got.append(onnx.finish(feats[:, start:]))
        want.append(model.ctc(torch_encoder.finish(feats[:, start:])))
    got, want = torch.cat(got, dim=1), torch.cat(want, dim=1)
    assert got.size(1) == math.ceil(131 / 8)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
