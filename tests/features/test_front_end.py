"""Front ends (`cat.features.fbank.FRONT_ENDS`): features in pieces equal the whole
recording's, stage 1 records its front end, the stages refuse features of another, and a
model trained on sherpa-onnx's front end runs in sherpa-onnx's recognizer as its factory
methods build it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cat.core.config import ConfigError, validate_hyper
from cat.decoding.online import FeatureStream
from cat.features.extract import extract
from cat.features.fbank import (
    FRONT_END_FILE,
    FRONT_ENDS,
    FbankOptions,
    check_front_end,
    compute_fbank,
    read_front_end,
)
from cat.testing.audio import make_data_dir, synth_waveform


@pytest.mark.parametrize("name", sorted(FRONT_ENDS))
def test_features_of_audio_in_pieces_are_the_whole_recordings(name):
    options = FRONT_ENDS[name]
    waveform = synth_waveform(1.7, seed=3)[:27_233]
    rng = np.random.default_rng(0)
    for _ in range(3):
        stream, start, frames = FeatureStream(options), 0, []
        while start < len(waveform):
            size = int(rng.integers(1, 4000))
            frames.append(stream.accept(16000, waveform[start:start + size]))
            start += size
        frames.append(stream.flush())
        np.testing.assert_allclose(np.concatenate(frames), compute_fbank(waveform, 16000,
                                                                         options),
                                   rtol=0, atol=1e-5)
    # Without snipped edges the last frame (centred 80 samples past its shift's start)
    # reaches past the audio: it comes with flush, reflected.
    stream = FeatureStream(options)
    got = len(stream.accept(16000, waveform))
    whole = len(compute_fbank(waveform, 16000, options))
    assert (got, whole) == ((168, 168) if options.snip_edges else (169, 170))
    assert len(stream.flush()) == whole - got


def test_stage_1_records_its_front_end_and_the_stages_check_it(tmp_path):
    data_dir = make_data_dir(tmp_path / "data", [0.6, 0.8], num_speakers=1, seed=0)
    sherpa = FRONT_ENDS["sherpa-onnx"]
    extract(data_dir, tmp_path / "fbank", options=sherpa, progress=False)
    assert read_front_end(tmp_path / "fbank") == sherpa
    recorded = json.loads((tmp_path / "fbank" / FRONT_END_FILE).read_text())
    assert (recorded["snip_edges"], recorded["high_freq"]) == (False, -400.0)
    check_front_end(tmp_path / "fbank", sherpa, "hyper-p.json")
    with pytest.raises(ValueError, match=r"fbank: its features were computed with the "
                                         r"sherpa-onnx front end \(fbank.json\), but "
                                         r"hyper-p.json declares data.front_end kaldi"):
        check_front_end(tmp_path / "fbank", FbankOptions(), "hyper-p.json")
    # A feature dir without the record holds Kaldi's defaults (stage 1 before it wrote one).
    (tmp_path / "fbank" / FRONT_END_FILE).unlink()
    assert read_front_end(tmp_path / "fbank") == FRONT_ENDS["kaldi"]


def test_audio_shards_take_kaldis_front_end_only():
    hyper = {"data": {"train": "data/train", "front_end": "sherpa-onnx",
                      "shards": {"dir": "data/wds", "audio": {"format": "flac"}}}}
    with pytest.raises(ConfigError, match=r"data.front_end: 'sherpa-onnx' with audio shards"):
        validate_hyper(hyper)
    with pytest.raises(ConfigError, match=r"front_end"):
        validate_hyper({"data": {"front_end": "librosa"}})


def test_stage_2_refuses_features_of_another_front_end(tmp_path, monkeypatch):
    from cat.stages.driver import prepare
    from cat.testing.audio_experiment import write_audio_experiment

    monkeypatch.chdir(tmp_path)
    experiment = write_audio_experiment(tmp_path, epochs=1)
    hyper_path = experiment.exp_dir / "hyper-p.json"
    hyper = json.loads(hyper_path.read_text(encoding="utf-8"))
    hyper["data"]["front_end"] = "sherpa-onnx"
    hyper_path.write_text(json.dumps(hyper), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"data/fbank/train: its features were computed "
                                          r"with the kaldi front end"):
        prepare("exp/tiny")


@pytest.mark.slow
def test_sherpa_onnx_factory_methods_run_a_model_of_their_front_end(tmp_path, monkeypatch):
    """A chunk-trained CTC model on sherpa-onnx's front end, exported: sherpa-onnx's
    `OnlineRecognizer.from_wenet_ctc` with its own defaults (no feature settings given)
    gives the tokens this package's streaming decoder gives on the same audio; the export
    says which front end it takes."""
    sherpa_onnx = pytest.importorskip("sherpa_onnx")
    from cat.ctc import export as ctc_export
    from cat.ctc.stream import CtcChunkSearch
    from cat.decoding.export import export
    from cat.decoding.online import StreamingRecognizer, streaming_encoder
    from cat.decoding.searcher import load_model
    from cat.testing.audio_experiment import train_audio_experiment
    from cat.testing.streams import assert_sherpa_streams_as_ours

    def configure(config: dict) -> None:
        config["encoder"]["kwargs"].update(causal_conv=True, max_chunk_size=8)

    experiment, checkpoint = train_audio_experiment(tmp_path, configure=configure,
                                                    front_end_name="sherpa-onnx")
    monkeypatch.chdir(experiment.root)
    out = export("exp/tiny", tmp_path / "export", checkpoint, chunk_size=4)
    meta = json.loads((out / "export.json").read_text(encoding="utf-8"))
    assert (meta["front_end"], meta["high_freq"], meta["snip_edges"],
            meta["normalize_samples"]) == ("sherpa-onnx", -400.0, 0, 0)
    recognizer = sherpa_onnx.OnlineRecognizer.from_wenet_ctc(
        tokens=str(out / "tokens.txt"), model=str(out / ctc_export.WENET_CTC_NAME),
        chunk_size=4, num_left_chunks=64, num_threads=1)
    model, tokenizer = load_model("exp/tiny", checkpoint, torch.device("cpu"))
    emitted = assert_sherpa_streams_as_ours(
        recognizer, lambda: StreamingRecognizer(streaming_encoder(model, 4),
                                                CtcChunkSearch(model), tokenizer,
                                                FRONT_ENDS["sherpa-onnx"]),
        experiment.test_audio(), tokenizer, pad_seconds=1.0)
    assert emitted >= 10
    # Kaldi's features in the same recognizer give other tokens: the front end matters.
    with pytest.raises(AssertionError):
        assert_sherpa_streams_as_ours(
            recognizer, lambda: StreamingRecognizer(streaming_encoder(model, 4),
                                                    CtcChunkSearch(model), tokenizer),
            experiment.test_audio(), tokenizer, pad_seconds=1.0)
