"""Streaming recognition (`cat.decoding.online`, `cat.ctc.stream`, `cat.rnnt.stream`):
audio in pieces of any size gives the hypotheses of the chunk-masked model's full
forward, partial results grow, and bad inputs are clear errors."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from cat.ctc import export as ctc_export
from cat.ctc.stream import CtcChunkSearch
from cat.decoding.export import ExportError, export, read_metadata
from cat.decoding.online import (
    StreamingError,
    StreamingRecognizer,
    decode_utterance,
    streaming_encoder,
)
from cat.decoding.searcher import load_model
from cat.features.fbank import compute_fbank
from cat.models.chunked import OnnxChunkEncoder
from cat.models.registry import build_model
from cat.rnnt import export as rnnt_export
from cat.rnnt.search import rnnt_greedy_search
from cat.rnnt.stream import RnntChunkSearch
from cat.testing.audio_experiment import train_audio_experiment
from cat.testing.streams import assert_sherpa_streams_as_ours
from cat.testing.training import tiny_model_config

SEARCHES = {"ctc": CtcChunkSearch, "rnnt": RnntChunkSearch}


class _Ids:
    """A tokenizer whose text is the token ids."""

    def decode(self, ids):
        return " ".join(map(str, ids))


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_model_config(kind, 80)
    config["encoder"]["kwargs"].update(causal_conv=True, max_chunk_size=8,
                                       time_reduction_factor=2)
    model = build_model(config, num_classes=12)
    head = model.ctc if kind == "ctc" else model.transducer.joiner.out
    with torch.no_grad():  # a blank-light random model: tokens on most frames
        head.bias[0] -= 1.0
    return model.eval()


def _audio(seconds: float = 2.3) -> np.ndarray:
    rng = np.random.default_rng(0)
    envelope = np.repeat(rng.uniform(0.01, 0.3, int(seconds * 10)), 1600)
    return (rng.normal(size=len(envelope)) * envelope).astype(np.float32)


def _reference(kind: str, model, samples: np.ndarray, chunk_size: int) -> list[int]:
    """The chunk-masked model's full forward, greedy search."""
    feats = torch.from_numpy(compute_fbank(samples, 16000))[None]
    lengths = torch.tensor([feats.size(1)])
    model.encoder.set_decode_chunk_size(chunk_size)
    try:
        with torch.no_grad():
            if kind == "ctc":
                return model.decode(feats, lengths, method="greedy")[0]
            out, out_lens = model.encoder(feats, lengths)
            head = model.transducer
            return rnnt_greedy_search(head.predictor, head.joiner, out, out_lens)[0]
    finally:
        model.encoder.set_decode_chunk_size(0)


def _recognizer(kind: str, model, chunk_size: int) -> StreamingRecognizer:
    return StreamingRecognizer(streaming_encoder(model, chunk_size),
                               SEARCHES[kind](model, chunk_size), _Ids())


@pytest.mark.parametrize("kind", ["ctc", "rnnt"])
@pytest.mark.parametrize("chunk_size", [2, 8])
def test_streaming_equals_the_chunk_masked_forward(kind, chunk_size):
    model, samples = _model(kind), _audio()
    expected = _reference(kind, model, samples, chunk_size)
    assert len(expected) >= 5
    recognizer = _recognizer(kind, model, chunk_size)
    partials = [recognizer.accept_waveform(16000, samples[start:start + 4000])
                for start in range(0, len(samples), 4000)]
    assert recognizer.finish() == " ".join(map(str, expected))
    # Partial results come before the end and only grow.
    assert any(partials[:-2]) and all(b.startswith(a) for a, b in pairwise(partials))


@pytest.mark.parametrize("kind", ["ctc", "rnnt"])
def test_any_piece_sizes_give_the_one_piece_result(kind):
    model, samples = _model(kind), _audio()
    one = _recognizer(kind, model, 4)
    one.accept_waveform(16000, samples)
    expected = one.finish()
    rng = np.random.default_rng(1)
    for _ in range(2):
        recognizer, start = _recognizer(kind, model, 4), 0
        while start < len(samples):
            size = int(rng.integers(1, 5000))
            recognizer.accept_waveform(16000, samples[start:start + size])
            start += size
        assert recognizer.finish() == expected


def test_latencies():
    model, samples = _model("ctc"), _audio()
    result = decode_utterance(_recognizer("ctc", model, 4), samples, 16000, 0.1)
    assert result.seconds == pytest.approx(2.3)
    # The first token comes with the first chunks, long before the end of the audio.
    assert 0.3 < result.first_token_latency < 1.5
    assert 0.0 <= result.final_latency < 1.0


def test_audio_at_another_sample_rate():
    recognizer = _recognizer("ctc", _model("ctc"), 4)
    with pytest.raises(StreamingError, match="audio at 8000 Hz: the model takes 16000 Hz "
                                             "audio; resample it first"):
        recognizer.accept_waveform(8000, _audio()[:8000])


@pytest.fixture(scope="module", params=["ctc", "rnnt"])
def chunk_experiment(request, tmp_path_factory):
    """(kind, experiment, checkpoint) of a tiny chunk-trained model (stateless predictor),
    one epoch, blank bias lowered so that greedy search emits tokens."""
    kind = request.param

    def configure(config: dict) -> None:
        config["encoder"]["kwargs"].update(causal_conv=True, max_chunk_size=8)
        if kind == "rnnt":
            config["decoder"] = {"type": "StatelessPredictor",
                                 "kwargs": {"embed_dim": 8, "context_size": 2}}

    experiment, checkpoint = train_audio_experiment(tmp_path_factory.mktemp(f"stream-{kind}"),
                                                    kind, configure=configure)
    return kind, experiment, checkpoint


@pytest.mark.slow
def test_onnx_streaming_gives_pytorch_streaming_hypotheses(chunk_experiment, tmp_path,
                                                           monkeypatch):
    kind, experiment, checkpoint = chunk_experiment
    monkeypatch.chdir(experiment.root)
    out = export("exp/tiny", tmp_path / "export", checkpoint, chunk_size=4)
    meta = json.loads((out / "export.json").read_text(encoding="utf-8"))
    assert (meta["chunk_size"], meta["stride"], meta["frames_per_chunk"]) == (4, 16, 19)
    model, tokenizer = load_model("exp/tiny", checkpoint, torch.device("cpu"))
    emitted = 0
    for key, path in sorted(experiment.test_audio().items()):
        samples, rate = soundfile.read(str(path), dtype="float32")
        expected = _reference(kind, model, samples, 4)
        emitted += len(expected)
        search = (ctc_export.OnnxCtcChunkSearch() if kind == "ctc"
                  else rnnt_export.OnnxRnntChunkSearch(rnnt_export.OnnxRnntDecoder(out)))
        recognizer = StreamingRecognizer(OnnxChunkEncoder(out), search, tokenizer)
        for start in range(0, len(samples), 1234):
            recognizer.accept_waveform(rate, samples[start:start + 1234])
        recognizer.finish()
        assert search.tokens == expected, key
    assert emitted >= 10
    with pytest.raises(ValueError, match="chunk size 9: this model was trained on chunks"):
        export("exp/tiny", tmp_path / "export9", checkpoint, chunk_size=9)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_experiment", ["ctc"], indirect=True)
def test_sherpa_onnx_online_wenet_ctc_gives_pytorch_streaming_hypotheses(chunk_experiment,
                                                                          tmp_path,
                                                                          monkeypatch):
    """`streaming_wenet_ctc.onnx` in sherpa-onnx's `OnlineRecognizer` (model type
    `wenet_ctc`, audio in pieces of random sizes) gives the tokens of this package's
    streaming decoder on the same audio."""
    kind, experiment, checkpoint = chunk_experiment
    monkeypatch.chdir(experiment.root)
    out = export("exp/tiny", tmp_path / "export", checkpoint, chunk_size=4)
    meta = read_metadata(out / ctc_export.WENET_CTC_NAME)
    assert {key: meta[key] for key in ("head", "num_blocks", "subsampling_factor",
                                       "right_context")} == {
        "head": "2", "num_blocks": "1", "subsampling_factor": "4", "right_context": "6"}
    model, tokenizer = load_model("exp/tiny", checkpoint, torch.device("cpu"))
    recognizer = ctc_export.sherpa_online_recognizer(out, num_left_chunks=64)
    emitted = assert_sherpa_streams_as_ours(
        recognizer, lambda: _recognizer(kind, model, 4), experiment.test_audio(), tokenizer,
        pad_seconds=1.0)
    assert emitted >= 10
    _factory_defaults_are_refused(out)


def _factory_defaults_are_refused(out: Path) -> None:
    """A model trained with all left context, exported for chunks of 4: sherpa-onnx's own
    factory with its defaults (chunk 16, 4 left chunks; it reads neither from the model)
    or with 4 left chunks stops at the first chunk naming the settings to use (before:
    text of an untrained chunk size, exit 0); this package's helper refuses before."""
    import sherpa_onnx

    meta = json.loads((out / "export.json").read_text(encoding="utf-8"))
    assert meta["wenet_ctc_runtime"] == {"chunk_size": 4, "num_left_chunks": 16,
                                         "num_left_chunks_is": "minimum"}
    samples = np.random.default_rng(0).normal(scale=0.1, size=32000).astype(np.float32)
    for settings in ({}, {"chunk_size": 4, "num_left_chunks": 4}):
        recognizer = sherpa_onnx.OnlineRecognizer.from_wenet_ctc(
            tokens=str(out / "tokens.txt"), model=str(out / ctc_export.WENET_CTC_NAME),
            num_threads=1, **settings)
        stream = recognizer.create_stream()
        stream.accept_waveform(16000, samples)
        with pytest.raises(RuntimeError, match="run_with_chunk_size_4_and_num_left_chunks_"
                                               "at_least_16/Gather"):
            while recognizer.is_ready(stream):
                recognizer.decode_stream(stream)
    with pytest.raises(ExportError, match=r"trained with all left context \(encoder\.kwargs\."
                                          r"left_chunks -1\); num_left_chunks must be at "
                                          r"least 16 \(export\.json wenet_ctc_runtime\), "
                                          r"not 4"):
        ctc_export.sherpa_online_recognizer(out, num_left_chunks=4)
    ctc_export.sherpa_online_recognizer(out)  # export.json's settings


@pytest.mark.slow
def test_a_model_of_limited_left_chunks_refuses_other_runtime_settings(tmp_path, monkeypatch):
    """A U2 model trained to attend to 2 earlier chunks: export.json says so, and sherpa-onnx's
    own factory with its default 4 left chunks (which it never reads from the model) stops
    with an error naming the settings, where it gave other text than the model's."""
    import sherpa_onnx

    from cat.core.config import load_experiment
    from cat.testing.training import write_tiny_experiment
    from cat.text.tokenizer import load as load_tokenizer
    from cat.training.checkpoint import CheckpointManager
    from cat.training.manager import training_settings

    monkeypatch.chdir(tmp_path)
    write_tiny_experiment(tmp_path, feat_dim=80, num_train=8, num_dev=4)
    config_path = tmp_path / "exp/tiny/config.json"
    config = json.loads(config_path.read_text())
    config["encoder"]["kwargs"].update(causal_conv=True, max_chunk_size=4, left_chunks=2)
    config_path.write_text(json.dumps(config))
    experiment = load_experiment("exp/tiny")
    vocab = load_tokenizer("exp/tiny/tokenizer.tknz").vocab_size
    model = build_model(experiment.config, vocab)
    CheckpointManager("exp/tiny/check").save(
        {"format": "cat-checkpoint", "version": 1, "model": model.state_dict(), "epoch": 1,
         "step": 1, "meta": {"num_classes": vocab, "settings": training_settings(experiment)}},
        1, 1, dev_loss=1.0)
    out = export("exp/tiny", tmp_path / "export", chunk_size=4)
    meta = json.loads((out / "export.json").read_text(encoding="utf-8"))
    assert meta["wenet_ctc_runtime"] == {"chunk_size": 4, "num_left_chunks": 2,
                                         "num_left_chunks_is": "exact"}
    assert read_metadata(out / ctc_export.WENET_CTC_NAME)["num_left_chunks"] == "2"
    samples = np.random.default_rng(0).normal(scale=0.1, size=32000).astype(np.float32)
    for left, refused in ((4, True), (2, False)):
        recognizer = sherpa_onnx.OnlineRecognizer.from_wenet_ctc(
            tokens=str(out / "tokens.txt"), model=str(out / ctc_export.WENET_CTC_NAME),
            chunk_size=4, num_left_chunks=left, num_threads=1)
        stream = recognizer.create_stream()
        stream.accept_waveform(16000, samples)

        def decode(recognizer=recognizer, stream=stream) -> None:
            while recognizer.is_ready(stream):
                recognizer.decode_stream(stream)

        if refused:
            with pytest.raises(RuntimeError, match="run_with_chunk_size_4_and_"
                                                   "num_left_chunks_2/Gather"):
                decode()
        else:
            decode()
    ctc_export.sherpa_online_recognizer(out)  # export.json's settings


@pytest.mark.slow
@pytest.mark.parametrize("chunk_experiment", ["rnnt"], indirect=True)
def test_sherpa_onnx_online_transducer_gives_pytorch_streaming_hypotheses(chunk_experiment,
                                                                          tmp_path,
                                                                          monkeypatch):
    """`streaming_encoder_lstm.onnx` of a chunk-trained transducer (sherpa-onnx's online
    `lstm` layout, its `c` state holding the key-value cache, the convolution frames and
    the cache's fill) with the export's decoder and joiner in sherpa-onnx's
    `OnlineRecognizer` gives this package's streaming tokens."""
    kind, experiment, checkpoint = chunk_experiment
    monkeypatch.chdir(experiment.root)
    # sherpa-onnx's greedy search emits one token per frame at most.
    monkeypatch.setattr("cat.rnnt.stream.MAX_SYMBOLS_PER_FRAME", 1)
    out = export("exp/tiny", tmp_path / "export", checkpoint, chunk_size=4)
    meta = read_metadata(out / rnnt_export.LSTM_LAYOUT_NAME)
    assert (meta["model_type"], meta["T"], meta["decode_chunk_len"]) == ("lstm", "19", "16")
    model, tokenizer = load_model("exp/tiny", checkpoint, torch.device("cpu"))
    recognizer = rnnt_export.sherpa_online_recognizer(out)
    emitted = assert_sherpa_streams_as_ours(
        recognizer, lambda: _recognizer(kind, model, 4), experiment.test_audio(), tokenizer,
        pad_seconds=1.0)
    assert emitted >= 10


@pytest.mark.slow
@pytest.mark.parametrize("chunk_experiment", ["ctc"], indirect=True)
def test_streaming_tlg_decoding_ends_with_the_whole_utterance_wfst_result(chunk_experiment,
                                                                         tmp_path,
                                                                         monkeypatch):
    """`python -m cat.stream --tlg`: the chunks' posteriors decoded with TLG as they come
    give the words of WFST decoding of the whole utterance's (chunk-masked) posteriors."""
    from cat.core.io import read_table
    from cat.decoding import online
    from cat.decoding.wfst import decoding_graph
    from cat.graph.tlg import decode
    from cat.lm.ngram import estimate, write_arpa

    _kind, experiment, checkpoint = chunk_experiment
    monkeypatch.chdir(experiment.root)
    model, tokenizer = load_model("exp/tiny", checkpoint, torch.device("cpu"))
    texts = read_table(experiment.root / "data/fbank/train/text").values()
    arpa = tmp_path / "lm.arpa"
    write_arpa(estimate([list(text.replace(" ", "")) for text in texts], 2,
                        discount_fallback=(0.5, 1.0, 1.5)), arpa)
    graph = decoding_graph(tokenizer, arpa, tmp_path / "graph")
    assert online.main("cat.stream", [
        "exp/tiny", "--wav-scp", str(experiment.test_data / "wav.scp"), "--chunk-size", "4",
        "--checkpoint", str(checkpoint), "--tlg", str(tmp_path / "graph"),
        "--lm-weight", "0.5", "--out", str(tmp_path / "out")]) == 0
    hyps = read_table(tmp_path / "out" / "hyp", allow_empty_value=True)
    words = 0
    model.encoder.set_decode_chunk_size(4)
    for key, path in sorted(experiment.test_audio().items()):
        samples, rate = soundfile.read(str(path), dtype="float32")
        feats = torch.from_numpy(compute_fbank(samples, rate))[None]
        with torch.no_grad():
            log_probs, _ = model.log_probs(feats, torch.tensor([feats.size(1)]))
        expected = "".join(decode(graph, log_probs[0].numpy(), lm_weight=0.5))
        assert hyps[key] == expected, key
        words += len(expected)
    assert words >= 5
    from cat.decoding.wfst import TlgChunkSearch, hotword_boosts

    with pytest.raises(ValueError, match="WFST decoding needs the frame posteriors"):
        TlgChunkSearch(_model("rnnt"), graph)
    # Hotwords in streaming: the graph built with the phrases boosted; the same final words
    # as WFST decoding of the whole utterance with that graph, and the phrases more often.
    keys = sorted(experiment.test_audio())
    refs = read_table(experiment.test_data / "text")
    phrases = sorted({refs[key].replace(" ", "")[:2] for key in keys})
    (tmp_path / "hot.txt").write_text("".join(f"{p}\n" for p in phrases), encoding="utf-8")
    assert online.main("cat.stream", [
        "exp/tiny", "--wav-scp", str(experiment.test_data / "wav.scp"), "--chunk-size", "4",
        "--checkpoint", str(checkpoint), "--tlg", str(tmp_path / "hot-graph"),
        "--lm-arpa", str(arpa), "--hotwords", str(tmp_path / "hot.txt"),
        "--hotwords-score", "4", "--lm-weight", "0.5", "--out", str(tmp_path / "hot")]) == 0
    boosted = decoding_graph(tokenizer, arpa, tmp_path / "hot-graph",
                             hotword_boosts(tmp_path / "hot.txt", tokenizer, 4.0))
    hot = read_table(tmp_path / "hot" / "hyp", allow_empty_value=True)
    for key, path in sorted(experiment.test_audio().items()):
        samples, rate = soundfile.read(str(path), dtype="float32")
        feats = torch.from_numpy(compute_fbank(samples, rate))[None]
        with torch.no_grad():
            log_probs, _ = model.log_probs(feats, torch.tensor([feats.size(1)]))
        assert hot[key] == "".join(decode(boosted, log_probs[0].numpy(), lm_weight=0.5)), key
    found = sum(phrase in hot[key] for key in keys for phrase in phrases)
    assert found > sum(phrase in hyps[key] for key in keys for phrase in phrases)
