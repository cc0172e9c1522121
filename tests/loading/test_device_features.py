"""Features of audio shards computed on the training device (`train.option.audio.features:
device`): the workers hand over 16-bit waveforms, `Batch.featurize` computes the batch's
fbank where the batch is. The batches (keys, order, frame counts) are those the workers'
features give, and the features agree within 1e-4, for every audio format, with and
without speed perturbation, through the DataLoader's hand-over and the shared-memory ring."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cat.formats.audio_pack import pack_audio
from cat.loading.batch import LengthFilter
from cat.loading.samples import AudioConfig, StreamConfig, features_location
from cat.loading.shardlist import load_shard_list
from cat.loading.stream import ShardStream
from cat.loading.transport import RingLoader, SharedCollate
from cat.testing.audio import make_data_dir
from cat.testing.epochs import epoch_progress
from cat.text import tokenizer as tk

FEAT_DIM = 80
TOLERANCE = 1e-4
# Mixed lengths: 0.03 s has no frame (dropped by the length filter), the others span 4x.
DURATIONS = (0.9, 2.4, 0.6, 1.7, 0.03, 1.2, 2.0, 0.75, 1.45)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here"))]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """{audio format: (shard pattern, tokenizer)} of one small corpus."""
    root = tmp_path_factory.mktemp("device-features")
    data_dir = make_data_dir(root / "corpus", DURATIONS, num_speakers=3)
    tokenizer = root / "tokenizer.tknz"
    tk.save(tk.train_sentencepiece([data_dir / "text"], "char", 0), tokenizer)
    out = {}
    for audio_format in ("wav", "flac", "opus"):
        pack_audio(data_dir, root / audio_format, audio_format, utts_per_file=3)
        out[audio_format] = (str(root / audio_format / "*.tar"), str(tokenizer))
    return out


def _length_filter() -> LengthFilter:
    frames = np.arange(4000)
    return LengthFilter(None, np.maximum(((frames - 1) // 2 - 1) // 2, 0), 4, ctc=False)


def _stream(pattern: str, tokenizer: str, audio: AudioConfig, workers: int,
            shared: SharedCollate | None = None) -> ShardStream:
    config = StreamConfig.with_defaults(batch_size=3, max_frames=0, shuffle_buffer=4,
                                        sort_buffer=5, seed=3, audio=audio)
    extra = {} if shared is None else {"collate_fn": shared}
    return ShardStream(load_shard_list(pattern), tokenizer, config, _length_filter(),
                       FEAT_DIM, 0, 1, workers, **extra)


def _batches(stream: ShardStream, epoch: int, workers: int, device: str,
             loader=None) -> list[tuple[list[str], np.ndarray, list[np.ndarray]]]:
    """(keys, frame counts, features computed on `device`) of each batch of an epoch."""
    progress = epoch_progress(stream, epoch, workers)
    stream.set_epoch(epoch, progress.positions)
    if loader is None:
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
    out = []
    for batch in loader:
        progress.update(batch, trained=True)
        if not len(batch):
            continue
        on_device = batch.to(device).featurize()
        assert on_device.feats.device.type == device and on_device.waves is None
        out.append((list(batch.keys), batch.feat_lens.numpy().copy(),
                    [on_device.feats[i, :n].cpu().numpy()
                     for i, n in enumerate(batch.feat_lens.tolist())]))
    summary = progress.summary()
    assert summary["trained"] + sum(summary["dropped"].values()) == summary["expected"]
    return out


def _assert_same_batches(worker_batches, device_batches) -> None:
    assert [keys for keys, _, _ in device_batches] == [keys for keys, _, _ in worker_batches]
    for (_, lens, feats), (_, device_lens, device_feats) in zip(
            worker_batches, device_batches, strict=True):
        np.testing.assert_array_equal(device_lens, lens)
        for ours, theirs in zip(device_feats, feats, strict=True):
            assert ours.shape == theirs.shape
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("speed_perturb", [(), (0.9, 1.0, 1.1)])
@pytest.mark.parametrize("audio_format", ["wav", "flac", "opus"])
def test_device_features_equal_the_workers_batch_for_batch(shards, audio_format, speed_perturb,
                                                           device):
    pattern, tokenizer = shards[audio_format]
    audio = AudioConfig(speed_perturb=speed_perturb)
    workers = _batches(_stream(pattern, tokenizer, audio, 0), 2, 0, device)
    on_device = _batches(_stream(pattern, tokenizer,
                                 dataclasses.replace(audio, on_device=True), 0), 2, 0, device)
    assert sum(len(keys) for keys, _, _ in workers) == len(DURATIONS) - 1  # 0.03 s dropped
    _assert_same_batches(workers, on_device)


@pytest.mark.parametrize("audio_format", ["flac", "opus"])
def test_waveforms_cross_the_workers_ring_and_the_plain_hand_over(shards, audio_format):
    """Two workers, as training runs them: waveform batches in ring slots (int16), and
    through torch's own hand-over when no slot is free; the same batches either way."""
    pattern, tokenizer = shards[audio_format]
    audio = AudioConfig(speed_perturb=(0.9, 1.0, 1.1))
    workers = _batches(_stream(pattern, tokenizer, audio, 2), 1, 2, "cpu")
    device_audio = dataclasses.replace(audio, on_device=True)
    plain = _batches(_stream(pattern, tokenizer, device_audio, 2), 1, 2, "cpu")
    _assert_same_batches(workers, plain)
    shared = SharedCollate(slot_bytes=2 * 3 * 2 * 16000, num_slots=4)
    stream = _stream(pattern, tokenizer, device_audio, 2, shared)
    loader = RingLoader(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2),
                        shared)
    ringed = _batches(stream, 1, 2, "cpu", loader)
    assert loader.counts["ring"] > 0
    _assert_same_batches(workers, ringed)
    loader.close()


def test_auto_is_the_device_on_a_gpu_and_the_workers_on_the_cpu():
    assert features_location("auto", torch.device("cpu")) == "workers"
    assert features_location("auto", torch.device("cuda", 0)) == "device"
    assert features_location("auto", None) == "workers"
    assert features_location("device", torch.device("cpu")) == "device"
    assert features_location("workers", torch.device("cuda", 0)) == "workers"
    with pytest.raises(ValueError, match=r"audio\.features: 'gpu'"):
        features_location("gpu", None)
    option = AudioConfig.from_option({"features": "auto"}, True, torch.device("cuda", 0))
    assert option.on_device
    assert not AudioConfig.from_option({}, True, torch.device("cpu")).on_device
