"""Chunk-by-chunk encoding (`cat.models.chunked.StreamingEncoder`) equals the full
forward of the chunk-masked encoder; chunk training options and their errors."""

from __future__ import annotations

import pytest
import torch

from cat.models.chunked import StreamingEncoder
from cat.models.encoder import ConformerNet, chunk_attention_mask


def _encoder(time_reduction: int, left_chunks: int, conv_norm: str = "batchnorm"
             ) -> ConformerNet:
    torch.manual_seed(0)
    encoder = ConformerNet(80, 16, 2, 2, kernel_size=5, dropout=0.0, subsampling_channels=4,
                           time_reduction_factor=time_reduction, global_cmvn=True,
                           conv_norm=conv_norm, causal_conv=True, max_chunk_size=8,
                           left_chunks=left_chunks)
    encoder.normalizer.set_stats(torch.randn(80), torch.rand(80) + 0.5)
    if conv_norm == "batchnorm":
        for cell in encoder.cells:  # running statistics that are not the identity
            cell.conv.norm.running_mean.normal_()
            cell.conv.norm.running_var.uniform_(0.5, 2.0)
    return encoder.eval()


def _stream(encoder: ConformerNet, chunk_size: int, feats: torch.Tensor) -> torch.Tensor:
    streaming = StreamingEncoder(encoder, chunk_size)
    attn_cache, conv_cache = streaming.initial_state()
    outputs, start = [], 0
    while feats.size(1) - start >= 7:
        out, attn_cache, conv_cache = streaming(
            feats[:, start:start + streaming.frames_per_chunk], attn_cache, conv_cache)
        outputs.append(out)
        start += streaming.stride
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize(("time_reduction", "left_chunks", "conv_norm"),
                         [(1, -1, "batchnorm"), (2, -1, "layernorm"), (2, 2, "batchnorm"),
                          (1, 4, "batchnorm")])
@pytest.mark.parametrize("chunk_size", [1, 3, 8])
def test_chunks_equal_the_chunk_masked_forward(time_reduction, left_chunks, conv_norm,
                                               chunk_size):
    encoder = _encoder(time_reduction, left_chunks, conv_norm)
    feats = torch.randn(1, 173, 80)
    encoder.set_decode_chunk_size(chunk_size)
    with torch.no_grad():
        masked, lengths = encoder(feats, torch.tensor([173]))
        streamed = _stream(encoder, chunk_size, feats)
        encoder.set_decode_chunk_size(0)
        full, _ = encoder(feats, torch.tensor([173]))
    assert streamed.shape == masked.shape == (1, int(lengths[0]), 16)
    torch.testing.assert_close(streamed, masked, atol=1e-5, rtol=1e-5)
    # The chunk mask matters: full context gives other outputs.
    assert (full - masked).abs().max() > 1e-3


@pytest.mark.parametrize("left_chunks", [-1, 2])
def test_streams_at_different_points_batch_as_each_alone(left_chunks):
    """A batch of streams whose caches differ in length (`cache_valid`: each stream's
    frames right-aligned, padding before them) gives each stream its own output and
    cache."""
    encoder = _encoder(2, left_chunks)
    streaming = StreamingEncoder(encoder, 3)
    feats = torch.randn(2, 200, 80)
    states, chunks = [], []
    with torch.no_grad():
        for index, seen in enumerate((4, 1)):  # chunks each stream has been through
            attn, conv = streaming.initial_state()
            for chunk in range(seen):
                start = chunk * streaming.stride
                _, attn, conv = streaming(feats[index:index + 1, start:start +
                                                streaming.frames_per_chunk], attn, conv)
            states.append((attn, conv))
            start = seen * streaming.stride
            chunks.append(feats[index:index + 1, start:start + streaming.frames_per_chunk])
        alone = [streaming(chunk, *state) for chunk, state in zip(chunks, states, strict=True)]
        lengths = [state[0].size(2) for state in states]
        assert lengths[0] > lengths[1]
        longest = max(lengths)
        attn = torch.zeros(states[0][0].size(0), 2, longest, states[0][0].size(3))
        valid = torch.zeros(2, longest, dtype=torch.bool)
        for index, ((cache, _), length) in enumerate(zip(states, lengths, strict=True)):
            attn[:, index, longest - length:] = cache[:, 0]
            valid[index, longest - length:] = True
        out, attn_out, conv_out = streaming(torch.cat(chunks), attn,
                                            torch.cat([state[1] for state in states], dim=1),
                                            valid)
    for index, (expected, expected_attn, expected_conv) in enumerate(alone):
        torch.testing.assert_close(out[index:index + 1], expected, atol=1e-5, rtol=1e-5)
        kept = expected_attn.size(2)
        torch.testing.assert_close(attn_out[:, index:index + 1, attn_out.size(2) - kept:],
                                   expected_attn, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_out[:, index:index + 1], expected_conv)
    # Without the mask the shorter stream attends to the padding: another output.
    with torch.no_grad():
        unmasked, _, _ = streaming(torch.cat(chunks), attn,
                                   torch.cat([state[1] for state in states], dim=1))
    assert (unmasked[1] - alone[1][0][0]).abs().max() > 1e-3


def test_chunk_mask():
    mask = chunk_attention_mask(5, 2, -1, torch.device("cpu"))
    assert (~mask).int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0],
                                      [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    limited = chunk_attention_mask(5, 1, 1, torch.device("cpu"))
    assert (~limited[4]).int().tolist() == [0, 0, 0, 1, 1]


def test_chunk_training_draws_chunk_sizes():
    encoder = _encoder(1, -1).train()
    torch.manual_seed(1)
    sizes = [encoder._chunk_size() for _ in range(400)]
    assert 0 in sizes and set(sizes) <= set(range(9)) and len(set(sizes)) == 9
    assert 150 < sizes.count(0) < 250  # full_context_prob 0.5
    assert encoder.eval()._chunk_size() == 0


def test_min_chunk_size_bounds_training_and_streaming_chunks():
    encoder = ConformerNet(80, 16, 1, 2, kernel_size=3, subsampling_channels=4,
                           causal_conv=True, max_chunk_size=8, min_chunk_size=3,
                           full_context_prob=0.0).train()
    torch.manual_seed(0)
    sizes = {encoder._chunk_size() for _ in range(300)}
    assert sizes == set(range(3, 9))
    encoder.set_decode_chunk_size(3)
    with pytest.raises(ValueError,
                       match=r"chunk size 2: this model was trained on chunks of 3 to 8 frames"):
        encoder.set_decode_chunk_size(2)
    with pytest.raises(ValueError,
                       match=r"min_chunk_size=9 must be within \[1, max_chunk_size=8\]"):
        ConformerNet(80, 16, 1, 2, kernel_size=3, causal_conv=True, max_chunk_size=8,
                     min_chunk_size=9)


def test_chunk_sizes_the_model_was_not_trained_for():
    encoder = _encoder(1, -1)
    with pytest.raises(ValueError, match=r"chunk size 9: this model was trained on chunks of 1 "
                                         r"to 8 frames \(encoder.kwargs.min_chunk_size, "
                                         r"max_chunk_size\)"):
        StreamingEncoder(encoder, 9)
    full_context = ConformerNet(80, 16, 1, 2, kernel_size=3, subsampling_channels=4)
    with pytest.raises(ValueError, match="trained with full context only"):
        full_context.set_decode_chunk_size(4)
    with pytest.raises(ValueError, match="needs causal_conv"):
        ConformerNet(80, 16, 1, 2, kernel_size=3, max_chunk_size=4)


@pytest.mark.parametrize("name", ["synth-ctc-stream", "synth-rnnt-stream", "ctc-stream",
                                  "rnnt-stream"])
def test_recipe_stream_configs(name):
    from pathlib import Path

    from cat.core.config import load_config

    config = load_config(Path(__file__).resolve().parents[2] / f"egs/aishell/exp/{name}"
                         / "config.json")
    kwargs = config["encoder"]["kwargs"]
    assert kwargs["causal_conv"] and kwargs["max_chunk_size"] == 25
    if "decoder" in config:  # sherpa-onnx's transducer type needs a stateless predictor
        assert config["decoder"]["type"] == "StatelessPredictor"


@pytest.mark.parametrize(("time_reduction", "left_chunks"), [(1, -1), (2, -1), (2, 2)])
def test_the_key_value_cache_layout_gives_the_streaming_output(time_reduction, left_chunks):
    """WeNet's layout (`KeyValueStreamingEncoder`, what sherpa-onnx's `wenet_ctc` feeds): a
    fixed cache of R frames whose invalid ones the mask leaves out, filled as sherpa-onnx
    fills it, gives `StreamingEncoder`'s chunks while the cache holds the left context."""
    from cat.models.chunked import KeyValueStreamingEncoder

    encoder = _encoder(time_reduction, left_chunks)
    chunk = 3
    feats = torch.randn(1, 8 * 4 * time_reduction * chunk + 2, 80)
    expected = _stream(encoder, chunk, feats)
    kv = KeyValueStreamingEncoder(encoder, chunk)
    left = left_chunks if left_chunks > 0 else 10
    cache_frames = chunk * left
    attn_cache, conv_cache = kv.initial_state(cache_frames)
    outputs, start, seen = [], 0, 0
    frames, stride = kv.streaming.frames_per_chunk, kv.streaming.stride
    while feats.size(1) - start >= frames:
        mask = torch.ones(1, 1, cache_frames + chunk, dtype=torch.bool)
        mask[:, :, :max(cache_frames - seen, 0)] = False
        with torch.no_grad():
            out, attn_cache, conv_cache = kv(feats[:, start:start + frames], attn_cache,
                                             conv_cache, mask)
        outputs.append(out)
        start, seen = start + stride, seen + chunk
    got = torch.cat(outputs, dim=1)
    assert attn_cache.shape == (2, 2, cache_frames, 16)
    assert torch.allclose(got, expected[:, :got.size(1)], atol=1e-5)
