"""The loader's features of audio shards (`Judge.finish`) against stage 1's of the same audio."""

from __future__ import annotations

import tarfile

import kaldiio
import numpy as np
import pytest
import torch
import torchaudio.compliance.kaldi

from cat.audio.codec import decode
from cat.features.extract import extract
from cat.formats.audio_pack import pack_audio
from cat.formats.shard_format import decode_key, split_member_name
from cat.loading.samples import AudioConfig
from cat.loading.stages import Judge
from cat.testing.audio import make_data_dir


def _torchaudio_fbank(waveform: np.ndarray) -> np.ndarray:
    """The reference: torchaudio's Kaldi fbank on int16-range samples, 80 bins, no dither."""
    tensor = torch.from_numpy(waveform.astype(np.float32)).unsqueeze(0) * 32768
    return torchaudio.compliance.kaldi.fbank(tensor, num_mel_bins=80, dither=0.0,
                                             sample_frequency=16000.0).numpy()


def _loader_features(shards) -> dict[str, np.ndarray]:
    """Each member of the audio shards through the loader's stage 2 and stage 4."""
    judge = Judge(80, "test", [str(p) for p in shards], lambda text: [5] * len(text), None,
                  strict=True, audio=AudioConfig())
    features = {}
    for number, path in enumerate(shards):
        with tarfile.open(path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
        for name, data in members.items():
            stem, extension = split_member_name(name)
            if extension == "txt":
                continue
            sample = {"shard": number, "key": decode_key(stem), "name": stem,
                      extension: data, "txt": members[f"{stem}.txt"]}
            judge(sample)
            assert "error" not in sample and "drop" not in sample, sample.get("drop")
            judge.finish(sample)
            features[sample["key"]] = sample["features"]
    return features


@pytest.mark.parametrize("audio_format", ["wav", "flac"])
def test_stage1_and_loader_features_of_the_same_audio_are_equal_and_kaldis(tmp_path,
                                                                         audio_format):
    data_dir = make_data_dir(tmp_path / "corpus", durations=(0.9, 1.7, 0.03, 2.2),
                             extension=f".{audio_format}")
    extract(data_dir, tmp_path / "fbank", progress=False)
    stage1 = {k: np.asarray(m) for k, m in
              kaldiio.load_scp(str(tmp_path / "fbank" / "feats.scp")).items()}
    pack_audio(data_dir, tmp_path / "shards", audio_format, utts_per_file=2)
    shards = sorted((tmp_path / "shards").glob("*.tar"))
    loader = _loader_features(shards)
    assert sorted(loader) == sorted(stage1) and len(stage1) == 4
    for key, features in loader.items():
        np.testing.assert_array_equal(features, stage1[key])
        audio, rate = decode((data_dir.parent / "audio" / f"{key}.{audio_format}")
                             .read_bytes(), key)
        assert rate == 16000
        np.testing.assert_allclose(features, _torchaudio_fbank(audio), rtol=0, atol=1e-4)
