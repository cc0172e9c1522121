"""What the device does per update: counted FLOPs, model FLOPs utilisation (MFU), and
audio-hours trained per device-hour.

FLOPs are counted, not estimated from the model's sizes: `count_flops` runs a forward and
backward under `torch.utils.flop_counter.FlopCounterMode`, which adds up the FLOPs of every
matrix product, convolution and attention kernel the update dispatches (element-wise work,
the loss and the optimizer step are not counted; they are not what the device's peak
measures). The count is of the padded shapes the device computes.

Counting costs Python work per operation, so training counts once, on the first batches of
a run (a forward and backward of a copy of the model, `count_model_flops`, so that the
training goes on as it would have), and scales the count to later batches
(`UpdateFlops.scaled`): the FLOPs of
operations over pairs of frames (attention: `bmm`, scaled dot-product attention) grow
with the utterances x the padded frames squared, the rest with the utterances x the
padded frames. That is exact for the counted shape and for shapes with the same ratio of
the two terms, and within a few per cent of a fresh count for other shapes of a Conformer
(`tests/training/test_throughput.py`).

MFU = counted FLOPs / step seconds / the device's dense peak in the update's dtype
(`device_peak`), from `GPU_PEAKS`, a table of the vendors' datasheets by device name. An
unknown GPU or a CPU has no peak: MFU is then "n/a", and `device_peak` says why. A CPU's
matrix-product rate can be measured instead (`measured_matmul_peak`), which must then be
labelled as measured.

Audio-hours per device-hour = input frames (10 ms each, `FRAME_SECONDS`) trained / the
device seconds they took.

Usage:
    flops = count_flops(lambda: model(*batch)[0].backward())
    update = UpdateFlops.from_count(flops, [(8, 600)])   # 8 utterances of 600 frames
    update.scaled([(16, 420)])                     # FLOPs of another batch's update
    peak, why = device_peak(torch.device("cuda"), torch.bfloat16)
    mfu(update.total, 0.158, peak)                 # None when peak is None
    audio_hours_per_device_hour(58007, 0.158)
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import flop_counter

#: Seconds of audio per input frame (a 10 ms frame shift).
FRAME_SECONDS = 0.01

#: Operations whose FLOPs grow with the square of the time axis (attention over pairs of
#: frames); every other counted operation grows with it linearly.
PAIRWISE_OPS = frozenset({
    "aten.bmm", "aten.baddbmm",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_efficient_attention_backward",
    "aten._scaled_dot_product_flash_attention_backward",
    "aten._scaled_dot_product_cudnn_attention_backward",
    "aten._flash_attention_forward", "aten._flash_attention_backward",
    "aten._efficient_attention_forward", "aten._efficient_attention_backward",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
})


def _cpu_sdpa_flops(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                    **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any,
                             out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


def _cpu_attention_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas of the CPU's fused attention kernels, which torch's counter lacks
    (without them a CPU count would leave attention out)."""
    ops = torch.ops.aten
    formulas: dict[Any, Callable[..., int]] = {}
    if hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu"):
        formulas[ops._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flops
    if hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        formulas[ops._scaled_dot_product_flash_attention_for_cpu_backward] = \
            _cpu_sdpa_backward_flops
    return formulas


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """FLOPs counted while a function ran: per operation, and the seconds counting took."""

    by_op: Mapping[str, int]
    seconds: float

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    @property
    def pairwise(self) -> int:
        """The FLOPs of `PAIRWISE_OPS`."""
        return sum(flops for op, flops in self.by_op.items() if op in PAIRWISE_OPS)


def count_flops(run: Callable[[], object]) -> FlopCount:
    """Run `run` (e.g. a forward and backward) under `FlopCounterMode` and count its FLOPs."""
    start = time.perf_counter()
    with flop_counter.FlopCounterMode(display=False,
                                      custom_mapping=_cpu_attention_formulas()) as counter:
        run()
    seconds = time.perf_counter() - start
    by_op = {str(op): int(flops) for op, flops in
             counter.get_flop_counts().get("Global", {}).items()}
    return FlopCount(by_op, seconds)


Shape = tuple[int, int]  # a batch's utterances and padded input frames


def count_model_flops(model: torch.nn.Module, inputs: Sequence[tuple[Any, ...]]) -> FlopCount:
    """The FLOPs of a forward (`loss, _ = model(*args)`) and backward of `model` on each of
    `inputs`, counted on a copy of it with the random state restored afterwards: counting
    changes the rounding of some kernels, and the model and its training go on exactly as
    if nothing had been counted (a compiled model's copy runs eagerly: the same FLOPs)."""
    copied = copy.deepcopy(model)
    devices = sorted({t.device for args in inputs for t in args
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"}, key=str)

    def run() -> None:
        for args in inputs:
            loss, _ = copied(*args)
            loss.backward()

    with torch.random.fork_rng(devices=devices):
        return count_flops(run)


@dataclasses.dataclass(frozen=True)
class UpdateFlops:
    """The counted FLOPs of one update (of one or more batches), and how they scale to the
    batches of other updates."""

    total: float
    pairwise: float  # of `total`: attention over pairs of frames
    frames: int  # sum over the counted batches of utterances x padded frames
    frames_squared: int  # ... of utterances x padded frames squared
    count_seconds: float = 0.0  # the counted update's seconds, counting included

    @classmethod
    def from_count(cls, count: FlopCount, shapes: Sequence[Shape]) -> UpdateFlops:
        """The count of an update of batches of `shapes` (utterances, padded frames)."""
        return cls(float(count.total), float(count.pairwise), _frames(shapes, 1),
                   _frames(shapes, 2), count.seconds)

    def scaled(self, shapes: Sequence[Shape]) -> float:
        """The FLOPs of an update of batches of `shapes` (see the module docstring): the
        pairwise part with utterances x frames squared, the rest with utterances x
        frames."""
        if not self.frames:
            return 0.0
        return ((self.total - self.pairwise) * _frames(shapes, 1) / self.frames
                + self.pairwise * _frames(shapes, 2) / self.frames_squared)


def _frames(shapes: Sequence[Shape], power: int) -> int:
    return sum(utterances * frames**power for utterances, frames in shapes)


# --------------------------------------------------------------------------- peaks


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Dense (no sparsity) peak TFLOP/s of a GPU per dtype; None where it has none."""

    name: str
    fp32: float  # without tensor cores
    tf32: float | None
    bf16: float | None
    fp16: float  # tensor cores, float32 accumulation
    source: str


# First match wins: patterns of `torch.cuda.get_device_name()`, the more specific first.
# The datasheets give sparse figures beside dense ones; these are the dense ones.
GPU_PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): SXM FP32 67, TF32 989,
    # BF16/FP16 1,979 TFLOPS with sparsity; NVL FP32 60, TF32 835, BF16/FP16 1,671.
    (r"H200 NVL", DevicePeak("H200 NVL", 60.0, 417.5, 835.5, 835.5, "NVIDIA H200 datasheet")),
    (r"H200", DevicePeak("H200 SXM", 67.0, 494.5, 989.5, 989.5, "NVIDIA H200 datasheet")),
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM FP32 67, TF32 989,
    # BF16/FP16 1,979; PCIe FP32 51, TF32 756, BF16/FP16 1,513; NVL FP32 60, TF32 835,
    # BF16/FP16 1,671 (with sparsity).
    (r"H100 NVL", DevicePeak("H100 NVL", 60.0, 417.5, 835.5, 835.5, "NVIDIA H100 datasheet")),
    (r"H100.*PCIe", DevicePeak("H100 PCIe", 51.0, 378.0, 756.5, 756.5,
                               "NVIDIA H100 datasheet")),
    (r"H100", DevicePeak("H100 SXM", 67.0, 494.5, 989.5, 989.5, "NVIDIA H100 datasheet")),
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), SXM and PCIe alike:
    # FP32 19.5, TF32 156, BF16/FP16 312 (dense).
    (r"A100", DevicePeak("A100", 19.5, 156.0, 312.0, 312.0, "NVIDIA A100 datasheet")),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362.05 (dense; 366 / 733
    # with sparsity).
    (r"L40S", DevicePeak("L40S", 91.6, 183.0, 362.05, 362.05, "NVIDIA L40S datasheet")),
    # NVIDIA L4 datasheet: FP32 30.3, TF32 60, BF16/FP16 121 (dense; 120 / 242 sparse).
    (r"\bL4\b", DevicePeak("L4", 30.3, 60.0, 121.0, 121.0, "NVIDIA L4 datasheet")),
    # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16/FP16 125 (dense).
    (r"\bA10\b", DevicePeak("A10", 31.2, 62.5, 125.0, 125.0, "NVIDIA A10 datasheet")),
    # NVIDIA V100 datasheet: SXM2 FP32 15.7, tensor (FP16) 125; PCIe 14, 112; V100S 16.4,
    # 130. No TF32 nor BF16.
    (r"V100S", DevicePeak("V100S PCIe", 16.4, None, None, 130.0, "NVIDIA V100 datasheet")),
    (r"V100.*PCIE", DevicePeak("V100 PCIe", 14.0, None, None, 112.0, "NVIDIA V100 datasheet")),
    (r"V100", DevicePeak("V100 SXM2", 15.7, None, None, 125.0, "NVIDIA V100 datasheet")),
    # NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: FP32 82.6, TF32 82.6,
    # FP16/BF16 tensor with FP32 accumulation 165.2 (dense; 330.3 sparse).
    (r"RTX 4090", DevicePeak("RTX 4090", 82.6, 82.6, 165.2, 165.2,
                             "NVIDIA Ada Lovelace architecture whitepaper")),
)


def gpu_peak(name: str) -> DevicePeak | None:
    """The peaks of the GPU called `name` (`torch.cuda.get_device_name()`), or None."""
    for pattern, peak in GPU_PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return peak
    return None


def _float32_uses_tf32() -> bool:
    """Whether float32 matrix products may run on TF32 tensor cores (torch's setting,
    `torch.set_float32_matmul_precision`; "highest", the default, keeps them off)."""
    return torch.get_float32_matmul_precision() != "highest"


def device_peak(device: torch.device, dtype: torch.dtype | None) -> tuple[float | None, str]:
    """(peak FLOP/s of `device` for updates in `dtype` (None: float32), what it is); the
    peak is None on a CPU or an unknown GPU, and the text says why."""
    if device.type != "cuda":
        return None, f"no peak known for {device.type}"
    name = torch.cuda.get_device_name(device)
    peak = gpu_peak(name)
    if peak is None:
        return None, f"no peak known for {name} (cat.training.throughput.GPU_PEAKS)"
    if dtype in (None, torch.float32):
        if _float32_uses_tf32() and peak.tf32:
            tflops, kind = peak.tf32, "tf32"
        else:
            tflops, kind = peak.fp32, "fp32"
    elif dtype == torch.bfloat16:
        tflops, kind = peak.bf16, "bf16"
    elif dtype == torch.float16:
        tflops, kind = peak.fp16, "fp16"
    else:
        return None, f"no peak known for {dtype}"
    if tflops is None:
        return None, f"{peak.name} has no {kind} tensor cores"
    return tflops * 1e12, f"{peak.name} dense {kind} {tflops:g} TFLOP/s ({peak.source})"


def measured_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32,
                         size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` products of two `size` x `size` matrices on `device`:
    a measured rate, not a datasheet's peak."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# --------------------------------------------------------------------------- rates


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: `flops` done in `seconds` over the `peak` FLOP/s (None
    without a peak)."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak


def audio_hours_per_device_hour(frames: float, seconds: float, devices: int = 1) -> float:
    """Hours of audio (`frames` input frames of `FRAME_SECONDS`) trained per hour of one
    device, when `devices` devices took `seconds` for them."""
    if seconds <= 0:
        return 0.0
    return frames * FRAME_SECONDS / (seconds * devices)
