"""Tests of the Conformer encoder and its building blocks."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from cat.models.encoder import ConformerNet
from cat.models.layer import (
    Conv2dSubsampling,
    RelPositionalEncoding,
    RelPositionMultiHeadAttention,
    TimeReduction,
    VGG2LSubsampling,
    lengths_to_padding_mask,
)


def tiny_encoder(**overrides) -> ConformerNet:
    kwargs = {"idim": 20, "hdim": 16, "num_cells": 2, "num_heads": 2, "kernel_size": 5,
              "dropout": 0.1}
    kwargs.update(overrides)
    torch.manual_seed(0)
    return ConformerNet(**kwargs)


def test_padding_mask_marks_positions_beyond_length():
    mask = lengths_to_padding_mask(torch.tensor([3, 1]), 4)
    assert mask.tolist() == [[False, False, False, True], [False, True, True, True]]


@pytest.mark.parametrize("length", [7, 8, 9, 10, 11, 50, 101])
def test_subsampling_lengths_match_convolution_output(length):
    layer = Conv2dSubsampling(20, 8)
    out, out_lens = layer(torch.randn(1, length, 20), torch.tensor([length]))
    assert out.shape == (1, int(out_lens[0]), 8)
    assert int(out_lens[0]) == ((length - 1) // 2 - 1) // 2


def test_subsampling_of_too_short_input_gives_no_frames():
    out, out_lens = Conv2dSubsampling(20, 8)(torch.randn(2, 6, 20), torch.tensor([6, 3]))
    assert out.shape == (2, 0, 8)
    assert out_lens.tolist() == [0, 0]


@pytest.mark.parametrize("length", [4, 5, 7, 8, 50, 101])
def test_padded_subsampling_keeps_a_quarter_of_frames_and_bins(length):
    layer = Conv2dSubsampling(20, 8, pad_end=True)
    assert layer.out.in_features == 8 * (20 // 4)
    out, out_lens = layer(torch.randn(1, length, 20), torch.tensor([length]))
    assert out.shape == (1, length // 4, 8) and int(out_lens[0]) == length // 4


@pytest.mark.parametrize("length", [1, 2, 3, 5, 8, 50, 101])
def test_vgg2l_subsampling_rounds_up_twice(length):
    layer = VGG2LSubsampling(20, 8)
    assert layer.out.in_features == 128 * 5
    out, out_lens = layer(torch.randn(1, length, 20), torch.tensor([length]))
    expected = math.ceil(math.ceil(length / 2) / 2)
    assert out.shape == (1, expected, 8) and int(out_lens[0]) == expected


def test_subsampling_time_reduction_keeps_every_factor_th_frame():
    layer = TimeReduction(4, 2, mode="subsample")
    x = torch.randn(2, 5, 4)
    out, out_lens = layer(x, torch.tensor([5, 3]))
    assert torch.equal(out, x[:, ::2]) and out_lens.tolist() == [3, 2]
    assert not list(layer.parameters())


def test_time_reduction_stacks_frames_and_rounds_up():
    layer = TimeReduction(4, 2)
    out, out_lens = layer(torch.randn(2, 5, 4), torch.tensor([5, 3]))
    assert out.shape == (2, 3, 4)
    assert out_lens.tolist() == [3, 2]


@pytest.mark.parametrize("overrides", [
    {},
    {"conv_norm": "layernorm"},
    {"time_reduction_factor": 2},
    {"time_reduction_factor": 3, "time_reduction_position": 1},
])
def test_output_shapes_and_lengths(overrides):
    encoder = tiny_encoder(**overrides).eval()
    feat_lens = torch.tensor([64, 40, 23])
    out, out_lens = encoder(torch.randn(3, 64, 20), feat_lens)
    assert out_lens.tolist() == encoder.output_lengths(feat_lens).tolist()
    assert out.shape == (3, int(out_lens.max()), 16)
    factor = encoder.frame_rate_factor
    assert factor == 4 * overrides.get("time_reduction_factor", 1)
    assert out_lens.tolist() == [math.ceil((((n - 1) // 2 - 1) // 2) / (factor // 4))
                                 for n in feat_lens.tolist()]
    padded = lengths_to_padding_mask(out_lens, out.size(1))
    assert torch.all(out[padded] == 0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("overrides", [
    {},
    {"conv_norm": "layernorm"},
    {"time_reduction_factor": 2},
    {"time_reduction_factor": 2, "time_reduction_position": 1},
    {"subsampling": "conv2d_padded"},
    {"subsampling": "vgg2l", "time_reduction_factor": 2, "time_reduction_position": 2,
     "time_reduction_mode": "subsample"},
    {"subsampling": "vgg2l", "global_cmvn": True},
])
def test_padding_does_not_change_valid_outputs(overrides):
    encoder = tiny_encoder(**overrides).eval()
    if encoder.normalizer is not None:
        # Statistics that map zero padding to values far from zero.
        encoder.normalizer.set_stats(torch.full((20,), 3.0), torch.full((20,), 0.5))
    feat_lens = torch.tensor([70, 45, 29])
    feats = torch.randn(3, 70, 20)
    for index, length in enumerate(feat_lens.tolist()):
        feats[index, length:] = 0.0
    batch_out, batch_lens = encoder(feats, feat_lens)
    for index, length in enumerate(feat_lens.tolist()):
        alone, alone_lens = encoder(feats[index:index + 1, :length], feat_lens[index:index + 1])
        assert int(alone_lens[0]) == int(batch_lens[index])
        torch.testing.assert_close(batch_out[index, :int(alone_lens[0])], alone[0],
                                   rtol=1e-4, atol=1e-5)


def test_padding_garbage_does_not_leak_into_valid_outputs():
    encoder = tiny_encoder().eval()
    feat_lens = torch.tensor([40, 25])
    feats = torch.randn(2, 40, 20)
    noisy = feats.clone()
    noisy[1, 25:] = 1000.0
    out, _ = encoder(feats, feat_lens)
    out_noisy, out_lens = encoder(noisy, feat_lens)
    valid = int(out_lens[1])
    torch.testing.assert_close(out[1, :valid], out_noisy[1, :valid], rtol=1e-4, atol=1e-5)


def test_relative_attention_scores_match_the_definition():
    torch.manual_seed(1)
    dim, heads, time = 8, 2, 5
    attention = RelPositionMultiHeadAttention(dim, heads, dropout=0.0)
    x = torch.randn(1, time, dim)
    pos_emb = RelPositionalEncoding(dim, 0.0).position_embeddings(time, x.device, x.dtype)
    scores, _ = attention.scores(x, pos_emb)
    head_dim = dim // heads
    query = attention.linear_q(x).view(time, heads, head_dim)
    key = attention.linear_k(x).view(time, heads, head_dim)
    position = attention.linear_pos(pos_emb[0]).view(2 * time - 1, heads, head_dim)
    for h in range(heads):
        for i in range(time):
            for j in range(time):
                relative = i - j  # embedding row of relative position r is time - 1 - r
                expected = ((query[i, h] + attention.pos_bias_u[h]) @ key[j, h]
                            + (query[i, h] + attention.pos_bias_v[h])
                            @ position[time - 1 - relative, h]) / math.sqrt(head_dim)
                torch.testing.assert_close(scores[0, h, i, j], expected, rtol=1e-5, atol=1e-5)


def explicit_attention(attention: RelPositionMultiHeadAttention, x: torch.Tensor,
                       pos_emb: torch.Tensor, padding_mask: torch.Tensor,
                       attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The attention as it was computed before scaled_dot_product_attention: scores,
    masked keys at the finite minimum, softmax, masked weights set to 0, dropout."""
    scores, value = attention.scores(x, pos_emb)
    key_mask = padding_mask[:, None, None, :]
    if attn_mask is not None:
        key_mask = key_mask | attn_mask[None, None]
    scores = scores.masked_fill(key_mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).masked_fill(key_mask, 0.0)
    context = torch.matmul(attention.dropout(weights), value)
    batch, _, time, _ = context.shape
    return attention.linear_out(context.transpose(1, 2).reshape(batch, time, -1))


def _attention_case(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x [3, 12, 16], padding mask, attention mask) of a masking case."""
    from cat.models.encoder import chunk_attention_mask

    time = 12
    lengths = {"full": [12, 12, 12], "padding": [12, 7, 3], "chunks": [12, 7, 3],
               "empty rows": [12, 5, 0]}[case]
    padding = lengths_to_padding_mask(torch.tensor(lengths), time)
    attn_mask = None
    if case in ("chunks", "empty rows"):
        # left_chunks 0: a padded query whose chunk starts past its utterance's end sees
        # no valid key at all
        attn_mask = chunk_attention_mask(time, 4, 0 if case == "empty rows" else -1,
                                         torch.device("cpu"))
    return torch.randn(3, time, 16), padding, attn_mask


@pytest.mark.parametrize("backend", ["default", "math"])
@pytest.mark.parametrize("case", ["full", "padding", "chunks", "empty rows"])
def test_attention_equals_the_explicit_softmax_with_gradients(case, backend):
    """Equal outputs and gradients, with the kernel torch picks here and with its reference
    (math) kernel, which other devices fall back to."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(3)
    attention = RelPositionMultiHeadAttention(16, 4, dropout=0.0)
    x, padding, attn_mask = _attention_case(case)
    pos_emb = RelPositionalEncoding(16, 0.0).position_embeddings(12, x.device, x.dtype)
    if case == "empty rows":
        key_mask = padding[:, None, :] | attn_mask[None]
        assert key_mask.all(dim=-1).any()  # the case has rows without a valid key
    outputs, gradients = [], []
    for function in (attention, lambda *a: explicit_attention(attention, *a)):
        attention.zero_grad()
        x_grad = x.clone().requires_grad_(True)
        with (sdpa_kernel(SDPBackend.MATH) if backend == "math" else contextlib.nullcontext()):
            out = function(x_grad, pos_emb, padding, attn_mask)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append(out)
        gradients.append([x_grad.grad] + [p.grad.clone() for p in attention.parameters()])
    assert torch.isfinite(outputs[0]).all()
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    for new, old in zip(*gradients, strict=True):
        assert torch.isfinite(new).all()
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["padding", "empty rows"])
def test_attention_equals_the_explicit_softmax_in_eval_mode(case):
    torch.manual_seed(4)
    attention = RelPositionMultiHeadAttention(16, 4, dropout=0.5).eval()
    x, padding, attn_mask = _attention_case(case)
    pos_emb = RelPositionalEncoding(16, 0.0).position_embeddings(12, x.device, x.dtype)
    with torch.no_grad():
        torch.testing.assert_close(attention(x, pos_emb, padding, attn_mask),
                                   explicit_attention(attention, x, pos_emb, padding,
                                                      attn_mask), rtol=1e-5, atol=1e-5)


def test_attention_dropout_acts_in_training_only():
    torch.manual_seed(5)
    attention = RelPositionMultiHeadAttention(16, 4, dropout=0.5)
    x, padding, _ = _attention_case("padding")
    pos_emb = RelPositionalEncoding(16, 0.0).position_embeddings(12, x.device, x.dtype)
    with torch.no_grad():
        first, second = (attention(x, pos_emb, padding) for _ in range(2))
        assert not torch.allclose(first, second)  # fresh dropout masks
        attention.eval()
        torch.testing.assert_close(attention(x, pos_emb, padding),
                                   attention(x, pos_emb, padding))
        # without dropout, training mode gives the eval output
        attention.train()
        attention.dropout.p = 0.0
        torch.testing.assert_close(attention(x, pos_emb, padding),
                                   explicit_attention(attention.eval(), x, pos_emb, padding),
                                   rtol=1e-5, atol=1e-5)


def test_position_term_depends_only_on_relative_distance():
    torch.manual_seed(2)
    attention = RelPositionMultiHeadAttention(8, 2, dropout=0.0)
    with torch.no_grad():
        for layer in (attention.linear_q, attention.linear_k):
            layer.weight.zero_()
            layer.bias.zero_()
    time = 6
    x = torch.randn(1, time, 8)
    pos_emb = RelPositionalEncoding(8, 0.0).position_embeddings(time, x.device, x.dtype)
    scores, _ = attention.scores(x, pos_emb)
    for i in range(1, time):
        for j in range(1, time):
            torch.testing.assert_close(scores[0, :, i, j], scores[0, :, i - 1, j - 1])
    assert not torch.allclose(scores[0, :, 0, 1], scores[0, :, 1, 0])


def test_position_embeddings_are_sinusoids_of_relative_positions():
    embeddings = RelPositionalEncoding(4, 0.0).position_embeddings(3, torch.device("cpu"),
                                                                 torch.float32)
    assert embeddings.shape == (1, 5, 4)
    for row, position in enumerate([2, 1, 0, -1, -2]):
        expected = [math.sin(position), math.cos(position),
                    math.sin(position / 100.0), math.cos(position / 100.0)]
        torch.testing.assert_close(embeddings[0, row], torch.tensor(expected), rtol=1e-5,
                                   atol=1e-6)


def test_utterance_shorter_than_subsampling_window_gives_empty_finite_output():
    encoder = tiny_encoder().eval()
    out, out_lens = encoder(torch.randn(2, 30, 20), torch.tensor([30, 5]))
    assert out_lens.tolist() == [6, 0]
    assert torch.isfinite(out).all()
    assert torch.all(out[1] == 0)


def test_gradients_reach_every_parameter():
    encoder = tiny_encoder(time_reduction_factor=2).train()
    out, _ = encoder(torch.randn(2, 40, 20), torch.tensor([40, 33]))
    out.sum().backward()
    missing = [name for name, p in encoder.named_parameters() if p.grad is None]
    assert missing == []


@pytest.mark.parametrize(("overrides", "message"), [
    ({"kernel_size": 4}, "kernel_size must be odd"),
    ({"hdim": 18, "num_heads": 4}, "divisible by num_heads"),
    ({"conv_norm": "groupnorm"}, "conv norm"),
    ({"time_reduction_position": 3}, "time_reduction_position"),
    ({"idim": 4}, "too small"),
    ({"subsampling": "conv3d"}, "subsampling must be one of"),
    ({"subsampling": "vgg2l", "subsampling_channels": 8}, "subsampling_channels applies"),
    ({"time_reduction_factor": 2, "time_reduction_mode": "drop"}, "time_reduction_mode"),
])
def test_invalid_sizes_raise_with_the_option_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_encoder(**overrides)


@pytest.mark.parametrize("factor", [1, 2])
def test_batch_of_too_short_utterances_gives_empty_output(factor):
    encoder = tiny_encoder(time_reduction_factor=factor).eval()
    out, out_lens = encoder(torch.randn(2, 6, 20), torch.tensor([6, 4]))
    assert out.shape == (2, 0, 16)
    assert out_lens.tolist() == [0, 0]
