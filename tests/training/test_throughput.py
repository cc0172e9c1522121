"""Counted FLOPs of an update, their scaling to other batches, the peaks by device name, and
the throughput arithmetic (`cat.training.throughput`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cat.models.layer import RelPositionMultiHeadAttention
from cat.models.registry import build_model
from cat.testing.training import tiny_model_config
from cat.training import throughput
from cat.training.throughput import (
    UpdateFlops,
    audio_hours_per_device_hour,
    count_flops,
    device_peak,
    gpu_peak,
    mfu,
)

FEAT_DIM, HDIM, CELLS, HEADS, CHANNELS, KERNEL, VOCAB = 80, 32, 2, 2, 4, 3, 40


def tiny_model() -> torch.nn.Module:
    config = tiny_model_config("ctc", FEAT_DIM)
    config["encoder"]["kwargs"].update(hdim=HDIM, num_cells=CELLS, num_heads=HEADS,
                                       subsampling_channels=CHANNELS, kernel_size=KERNEL)
    torch.manual_seed(0)
    return build_model(config, VOCAB)


def batch(utterances: int, frames: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(utterances * 1000 + frames)
    return (torch.randn(utterances, frames, FEAT_DIM, generator=generator),
            torch.full((utterances,), frames),
            torch.randint(1, VOCAB, (utterances, 4), generator=generator),
            torch.full((utterances,), 4))


def update_flops(model: torch.nn.Module, utterances: int, frames: int) -> throughput.FlopCount:
    def run() -> None:
        loss, _ = model(*batch(utterances, frames))
        loss.backward()

    return count_flops(run)


def forward_matmul_flops(utterances: int, frames: int) -> int:
    """The multiply-adds (x 2) of the tiny Conformer's convolutions and matrix products,
    counted by hand from its sizes."""
    b, d = utterances, HDIM
    t1, f1 = (frames - 3) // 2 + 1, (FEAT_DIM - 3) // 2 + 1  # first 3x3 stride-2 conv
    t, f2 = (t1 - 3) // 2 + 1, (f1 - 3) // 2 + 1  # second
    flops = 2 * b * CHANNELS * t1 * f1 * 9 + 2 * b * CHANNELS * t * f2 * 9 * CHANNELS
    flops += 2 * b * t * CHANNELS * f2 * d  # projection to the model dimension
    block = (2 * 2 * (2 * b * t * d * 4 * d)  # two feed-forward modules, d -> 4d -> d
             + 4 * 2 * b * t * d * d  # q, k, v, out
             + 2 * (2 * t - 1) * d * d  # the position embeddings' projection
             + 2 * b * t * t * d + 2 * b * t * (2 * t - 1) * d  # content, position terms
             + 2 * b * t * t * d  # weights x values
             + 2 * b * t * d * 2 * d + 2 * b * t * d * KERNEL + 2 * b * t * d * d)  # conv
    return flops + CELLS * block + 2 * b * t * d * VOCAB  # + the CTC head


def test_counted_update_flops_are_those_of_the_matrix_products():
    count = update_flops(tiny_model(), 4, 200)
    # backward: a gradient for the input and one for the weights of each product
    hand = 3 * forward_matmul_flops(4, 200)
    assert 0.8 < count.total / hand < 1.25, (count.total, hand)
    assert 0 < count.pairwise < count.total
    assert count.seconds > 0


def test_scaled_count_is_within_a_few_percent_of_a_fresh_count():
    model = tiny_model()
    counted = UpdateFlops.from_count(update_flops(model, 4, 400), [(4, 400)])
    assert counted.scaled([(4, 400)]) == pytest.approx(counted.total)
    for utterances, frames in ((8, 100), (2, 800), (16, 300)):
        fresh = update_flops(model, utterances, frames).total
        assert counted.scaled([(utterances, frames)]) == pytest.approx(fresh, rel=0.05)
    # two batches in one update (gradient accumulation)
    both = update_flops(model, 8, 100).total + update_flops(model, 2, 800).total
    assert counted.scaled([(8, 100), (2, 800)]) == pytest.approx(both, rel=0.05)
    # only frames: the attention grows with their square
    linear_only = dataclasses.replace(counted, pairwise=0.0)
    fresh = update_flops(model, 2, 800).total
    assert abs(linear_only.scaled([(2, 800)]) - fresh) > abs(counted.scaled([(2, 800)]) - fresh)


def test_fused_attention_on_the_cpu_is_counted_as_the_explicit_products():
    """Without the CPU kernel's formula, inference (where torch runs the fused kernel)
    would count no attention."""
    model = tiny_model().eval()
    inputs = batch(2, 120)
    with torch.no_grad():
        fused = count_flops(lambda: model.encoder(*inputs[:2]))

    def explicit(self, x, pos_emb, padding_mask, attn_mask=None):
        scores, value = self.scores(x, pos_emb)
        weights = torch.softmax(scores.masked_fill(padding_mask[:, None, None, :], -1e30), -1)
        context = torch.matmul(weights, value)
        return self.linear_out(context.transpose(1, 2).reshape(x.size(0), x.size(1), -1))

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(RelPositionMultiHeadAttention, "forward", explicit)
        products = count_flops(lambda: model.encoder(*inputs[:2]))
    assert fused.total == products.total
    assert fused.pairwise == products.pairwise > 0


@pytest.mark.parametrize(("name", "expected"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"), ("NVIDIA A10", "A10"), ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"), ("Tesla V100-SXM2-32GB", "V100 SXM2"),
    ("Tesla V100-PCIE-16GB", "V100 PCIe"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
])
def test_gpu_peaks_by_device_name(name, expected):
    assert gpu_peak(name).name == expected


def test_unknown_gpu_and_cpu_have_no_peak():
    assert gpu_peak("NVIDIA GeForce GTX 1080") is None
    peak, why = device_peak(torch.device("cpu"), torch.float32)
    assert peak is None and "cpu" in why
    assert mfu(1e12, 1.0, None) is None


def test_dense_peaks_are_below_the_sparse_datasheet_figures():
    h100 = gpu_peak("NVIDIA H100 80GB HBM3")
    assert (h100.bf16, h100.fp16, h100.tf32, h100.fp32) == (989.5, 989.5, 494.5, 67.0)
    assert gpu_peak("NVIDIA A100-SXM4-40GB").bf16 == 312.0
    assert gpu_peak("Tesla V100-SXM2-16GB").bf16 is None  # V100 has no bf16


def test_throughput_arithmetic():
    # an hour of 10 ms frames in an hour of one device, or in half an hour of two
    assert audio_hours_per_device_hour(360_000, 3600.0) == pytest.approx(1.0)
    assert audio_hours_per_device_hour(360_000, 1800.0, devices=2) == pytest.approx(1.0)
    # exp/ctc-v1's batch of 58,007 frames in 0.158 s: 580 s of audio
    assert audio_hours_per_device_hour(58_007, 0.158) == pytest.approx(3671.3, rel=1e-4)
    assert mfu(2e12, 0.5, 8e12) == pytest.approx(0.5)
    assert mfu(2e12, 0.0, 8e12) is None


def test_counting_on_a_copy_leaves_the_model_and_the_random_state_alone():
    model = tiny_model()
    model.encoder.cells[0].attn.dropout.p = 0.5  # draws random numbers in training mode
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = torch.get_rng_state()
    count = throughput.count_model_flops(model, [batch(2, 120), batch(3, 100)])
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None and torch.equal(p, before[name])
               for name, p in model.named_parameters())
    alone = update_flops(model, 2, 120).total + update_flops(model, 3, 100).total
    assert count.total == alone
