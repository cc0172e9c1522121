"""CUSIDE experiments end to end: a tiny CTC and RNN-T model trained with chunks and a
simulated right context (`trainer.chunk_size`) streams in PyTorch (`python -m cat.stream`)
and from its export in onnxruntime with the hypotheses of `python -m cat.decode
--chunk-size` (the chunked forward of the whole utterance)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
import torch

from cat.core.io import read_table
from cat.ctc import export as ctc_export
from cat.ctc.stream import CtcChunkSearch
from cat.decoding import online
from cat.decoding.export import ExportError, export, onnx_chunk_encoder
from cat.decoding.inference import main as decode_main
from cat.decoding.online import StreamingRecognizer, streaming_encoder
from cat.decoding.searcher import load_model
from cat.features.fbank import compute_fbank
from cat.models.cuside_streaming import OnnxCusideEncoder
from cat.rnnt import export as rnnt_export
from cat.rnnt.stream import RnntChunkSearch
from cat.testing.audio_experiment import train_audio_experiment
from cat.testing.streams import assert_sherpa_streams_as_ours

CHUNK = 2  # encoder frames: 8 feature frames at 4x subsampling


@pytest.fixture(scope="module", params=["ctc", "rnnt"])
def cuside_experiment(request, tmp_path_factory):
    """(kind, experiment, checkpoint) of a tiny CUSIDE model, one epoch, blank bias lowered
    so that greedy search emits tokens."""
    kind = request.param

    def configure(config: dict) -> None:
        config["trainer"] = {"chunk_size": 12, "context_size_left": 12,
                             "context_size_right": 6, "jitter_range": 1, "simu": True,
                             "simu_hdim": 8, "simu_layers": 2}
        if kind == "rnnt":
            config["decoder"] = {"type": "StatelessPredictor",
                                 "kwargs": {"embed_dim": 8, "context_size": 2}}

    experiment, checkpoint = train_audio_experiment(
        tmp_path_factory.mktemp(f"cuside-{kind}"), kind, configure=configure)
    return kind, experiment, checkpoint


def _chunked_greedy(model, samples: np.ndarray, right_context: str | None) -> list[int]:
    feats = torch.from_numpy(compute_fbank(samples, 16000))[None]
    model.set_decode_chunk_size(CHUNK, right_context)
    try:
        with torch.no_grad():
            return model.decode(feats, torch.tensor([feats.size(1)]), method="greedy")[0]
    finally:
        model.set_decode_chunk_size(0)


def _search(kind: str, model):
    return CtcChunkSearch(model) if kind == "ctc" else RnntChunkSearch(model)


@pytest.mark.slow
@pytest.mark.parametrize("right_context", ["simulated", "real"])
def test_streaming_gives_the_chunked_decoding_hypotheses(cuside_experiment, right_context,
                                                         tmp_path, monkeypatch):
    kind, experiment, checkpoint = cuside_experiment
    monkeypatch.chdir(experiment.root)
    model, tokenizer = load_model("exp/tiny", checkpoint, torch.device("cpu"))
    rng = np.random.default_rng(0)
    emitted = 0
    for key, path in sorted(experiment.test_audio().items()):
        samples, rate = soundfile.read(str(path), dtype="float32")
        expected = _chunked_greedy(model, samples, right_context)
        emitted += len(expected)
        recognizer = StreamingRecognizer(streaming_encoder(model, CHUNK, right_context),
                                         _search(kind, model), tokenizer)
        start = 0
        while start < len(samples):  # pieces of random sizes
            size = int(rng.integers(100, 5000))
            recognizer.accept_waveform(rate, samples[start:start + size])
            start += size
        recognizer.finish()
        assert recognizer.search.tokens == expected, key
    assert emitted >= 10
    # The commands: stage 4's decoding in chunks and streaming give the same text.
    assert decode_main("cat.decode", [
        "exp/tiny", "--data", str(experiment.root / "data/fbank/test"),
        "--checkpoint", str(checkpoint), "--out", str(tmp_path / "decode"), "--method",
        "greedy", "--chunk-size", str(CHUNK), "--right-context", right_context]) == 0
    assert online.main(f"cat.{kind}.stream", [
        "exp/tiny", "--wav-scp", str(experiment.test_data / "wav.scp"),
        "--chunk-size", str(CHUNK), "--right-context", right_context,
        "--checkpoint", str(checkpoint), "--out", str(tmp_path / "stream")]) == 0
    decoded = read_table(tmp_path / "decode" / "hyp", allow_empty_value=True)
    streamed = read_table(tmp_path / "stream" / "hyp", allow_empty_value=True)
    assert decoded == streamed
    summary = json.loads((tmp_path / "stream" / "stream.json").read_text(encoding="utf-8"))
    assert summary["right_context"] == right_context


@pytest.mark.slow
def test_the_export_streams_in_onnxruntime(cuside_experiment, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    kind, experiment, checkpoint = cuside_experiment
    monkeypatch.chdir(experiment.root)
    out = export("exp/tiny", tmp_path / "export", checkpoint, chunk_size=CHUNK)
    meta = json.loads((out / "export.json").read_text(encoding="utf-8"))
    assert (meta["streaming"], meta["chunk_size"], meta["stride"], meta["right_context"]) == (
        "cuside", CHUNK, 8, "simulated")
    assert (out / ctc_export.WENET_CTC_NAME).exists() == (kind == "ctc")
    model, tokenizer = load_model("exp/tiny", checkpoint, torch.device("cpu"))
    encoder = onnx_chunk_encoder(out)
    assert isinstance(encoder, OnnxCusideEncoder)
    emitted = 0
    for key, path in sorted(experiment.test_audio().items()):
        samples, rate = soundfile.read(str(path), dtype="float32")
        expected = _chunked_greedy(model, samples, None)
        emitted += len(expected)
        search = (ctc_export.OnnxCtcChunkSearch() if kind == "ctc"
                  else rnnt_export.OnnxRnntChunkSearch(rnnt_export.OnnxRnntDecoder(out)))
        encoder.reset()
        recognizer = StreamingRecognizer(encoder, search, tokenizer)
        for start in range(0, len(samples), 1234):
            recognizer.accept_waveform(rate, samples[start:start + 1234])
        recognizer.finish()
        assert search.tokens == expected, key
    assert emitted >= 10
    with pytest.raises(ValueError, match="chunk size 5: this CUSIDE model was trained on "
                                         "chunks of 2 to 4"):
        export("exp/tiny", tmp_path / "export5", checkpoint, chunk_size=5)
    with pytest.raises(ExportError, match=r"no streaming\.onnx"):
        onnx_chunk_encoder(export("exp/tiny", tmp_path / "offline", checkpoint))


def _factory_refuses_other_settings(out, audio: dict) -> None:
    """sherpa-onnx's own factory (`from_wenet_ctc`, which reads neither setting from the
    model) with fewer left chunks than the left context needs, or its defaults (chunk 16,
    4 left chunks): an error naming the settings to use, never wrong text."""
    import sherpa_onnx

    samples, rate = soundfile.read(str(sorted(audio.items())[0][1]), dtype="float32")
    for settings, message in (({"chunk_size": CHUNK, "num_left_chunks": 3},
                               "run_with_chunk_size_2_and_num_left_chunks_at_least_4"),
                              ({}, "invalid dimensions for input: x")):
        recognizer = sherpa_onnx.OnlineRecognizer.from_wenet_ctc(
            tokens=str(out / "tokens.txt"), model=str(out / ctc_export.WENET_CTC_NAME),
            num_threads=1, **settings)
        stream = recognizer.create_stream()
        stream.accept_waveform(rate, np.concatenate([samples, np.zeros(rate, np.float32)]))
        with pytest.raises(RuntimeError, match=message):
            while recognizer.is_ready(stream):
                recognizer.decode_stream(stream)


@pytest.mark.slow
def test_sherpa_onnx_online_runs_the_cuside_export(cuside_experiment, tmp_path, monkeypatch):
    """The export in sherpa-onnx's `OnlineRecognizer`, audio in pieces of random sizes: CTC's
    `streaming_wenet_ctc.onnx` (model type `wenet_ctc`, its caches holding the left
    context and the simulation's state), the transducer's `streaming_encoder_lstm.onnx`
    (model type `lstm`, its `c` state holding them) with the decoder and joiner; this
    package's streaming tokens."""
    pytest.importorskip("sherpa_onnx")
    kind, experiment, checkpoint = cuside_experiment
    monkeypatch.chdir(experiment.root)
    # sherpa-onnx's transducer greedy search emits one token per frame at most.
    monkeypatch.setattr("cat.rnnt.stream.MAX_SYMBOLS_PER_FRAME", 1)
    out = export("exp/tiny", tmp_path / "export", checkpoint, chunk_size=CHUNK)
    if kind == "ctc":
        with pytest.raises(ExportError, match=r"keeps 8 frames of left context in the "
                                              r"runtime's cache: num_left_chunks must be at "
                                              r"least 4"):
            ctc_export.sherpa_online_recognizer(out, num_left_chunks=3)
        meta = json.loads((out / "export.json").read_text(encoding="utf-8"))
        assert meta["wenet_ctc_runtime"] == {"chunk_size": CHUNK, "num_left_chunks": 4,
                                             "num_left_chunks_is": "minimum"}
        recognizer = ctc_export.sherpa_online_recognizer(out)  # export.json's settings
        _factory_refuses_other_settings(out, experiment.test_audio())
    else:
        recognizer = rnnt_export.sherpa_online_recognizer(out)
    model, tokenizer = load_model("exp/tiny", checkpoint, torch.device("cpu"))
    emitted = assert_sherpa_streams_as_ours(
        recognizer, lambda: StreamingRecognizer(streaming_encoder(model, CHUNK),
                                                _search(kind, model), tokenizer),
        experiment.test_audio(), tokenizer, pad_seconds=0.5)
    assert emitted >= 10
