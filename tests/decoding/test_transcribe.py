"""Transcribing audio directly (`python -m cat.<family>.decode --audio/--wav-scp/--data-list`)
against stage 4's decoding of stage 1's features, on a tiny trained model whose features
are the fbank of real audio files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile

from cat.core.io import read_table, write_table
from cat.core.process import process_pool
from cat.decoding.audio import from_wav_scp
from cat.decoding.inference import DecodeOptions, decode_set, main
from cat.decoding.transcribe import _features, _pooled_features, transcribe
from cat.features.extract import extract
from cat.features.fbank import FbankOptions
from cat.testing.audio import make_corrupt_file, write_kaldi_data_dir
from cat.testing.audio_experiment import write_audio_experiment
from cat.testing.training import write_tiny_experiment
from cat.testing.uio import UioUtterance, write_raw_list, write_shard_list, write_uio_shard
from cat.training.cli import train
from cat.utils import pipeline

EXP = "exp/tiny"
CHECKPOINT = "exp/tiny/check/avg-best-2.pt"


@pytest.fixture(scope="module", params=["ctc", "rnnt"])
def trained(request, tmp_path_factory):
    """(kind, experiment, stage 4's hypotheses of the test set)."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("OMP_NUM_THREADS", "1")
        experiment = write_audio_experiment(root, kind=kind)
        train(EXP, f"cat.{kind}.train")
        pipeline.decode(EXP, nj=1)
    hyps = read_table(root / EXP / "decode/test/hyp", allow_empty_value=True)
    # Hypotheses that differ from each other: a wrong feature would show.
    assert len(hyps) == 6 and all(hyps.values()) and len(set(hyps.values())) >= 4, hyps
    return kind, experiment, hyps


@pytest.fixture
def recipe(trained, monkeypatch):
    """`trained`, run from its recipe directory."""
    monkeypatch.chdir(trained[1].root)
    return trained


def stage4_hyp(experiment) -> str:
    return (experiment.root / EXP / "decode/test/hyp").read_text(encoding="utf-8")


def test_audio_files_give_stage_4_hypotheses(recipe, tmp_path, capsys):
    kind, experiment, hyps = recipe
    audio = experiment.test_audio()
    wavs = [str(audio[utt]) for utt in sorted(audio)]
    assert main(kind, [EXP, "--audio", *wavs, "--out", str(tmp_path / "wav")]) == 0
    assert (tmp_path / "wav/hyp").read_text(encoding="utf-8") == stage4_hyp(experiment)
    log = json.loads((tmp_path / "wav/decode.log").read_text(encoding="utf-8"))
    # What stage 4 decodes with: the checkpoint and hyper-p.json's options.
    assert log["checkpoint"] == CHECKPOINT and log["beam_size"] == 4
    assert log["max_frames"] == 300 and log["device"] == "cpu"
    assert (log["num_utts"], log["num_skipped"]) == (6, 0)
    frames = read_table(experiment.test_features / "utt2num_frames")
    assert log["audio_seconds"] == pytest.approx(sum(map(int, frames.values())) / 100, abs=0.01)
    assert (tmp_path / "wav/skipped.txt").read_text(encoding="utf-8") == ""

    # FLAC is lossless: the same hypotheses; on standard output, in argument order.
    flacs = []
    for wav in reversed(wavs):
        flacs.append(str(tmp_path / Path(wav).with_suffix(".flac").name))
        samples, rate = soundfile.read(wav, dtype="int16")
        soundfile.write(flacs[-1], samples, rate)
    capsys.readouterr()
    assert main(kind, [EXP, "--audio", *flacs]) == 0
    out, err = capsys.readouterr()
    keys = [Path(flac).stem for flac in flacs]
    assert out.splitlines() == [f"{key} {hyps[key]}" for key in keys]
    assert "RTF" in err and "6 utterances" in err


@pytest.mark.slow
def test_wav_scp_and_data_lists_give_stage_4_hypotheses(recipe, tmp_path):
    kind, experiment, hyps = recipe
    audio = experiment.test_audio()
    utts = sorted(audio)
    # wav.scp with Kaldi pipe entries, decoded by 2 processes.
    wav_scp = {utt: (f"cat {path} |" if i % 2 else str(path))
               for i, (utt, path) in enumerate(audio.items())}
    write_table(tmp_path / "wav.scp", wav_scp.items())
    assert main(kind, [EXP, "--wav-scp", str(tmp_path / "wav.scp"), "--nj", "2",
                       "--out", str(tmp_path / "scp")]) == 0
    assert (tmp_path / "scp/hyp").read_text(encoding="utf-8") == stage4_hyp(experiment)
    assert json.loads((tmp_path / "scp/decode.log").read_text())["workers"] == 2

    # WeNet keys may hold dots and a path prefix.
    keys = {utt: (f"spk{i}/{utt}.v1" if i % 2 else utt) for i, utt in enumerate(utts)}
    expected = {keys[utt]: hyps[utt] for utt in utts}
    write_raw_list(tmp_path / "raw.list", [(keys[utt], audio[utt], "") for utt in utts])
    shards = [write_uio_shard(tmp_path / f"shards/shard-{n}.tar",
                              [UioUtterance(keys[utt], audio[utt].read_bytes(), "")
                               for utt in utts[n::2]]) for n in range(2)]
    write_shard_list(tmp_path / "shard.list", shards)
    for name in ("raw.list", "shard.list"):
        out_dir = tmp_path / f"out-{name}"
        assert main(kind, [EXP, "--data-list", str(tmp_path / name),
                           "--out", str(out_dir)]) == 0
        assert read_table(out_dir / "hyp", allow_empty_value=True) == expected, name


def test_unreadable_audio_is_reported_and_skipped(recipe, tmp_path, caplog):
    kind, experiment, _ = recipe
    audio = experiment.test_audio()
    garbage = make_corrupt_file(tmp_path / "garbage.wav", "garbage")
    rows = [(utt, str(path)) for utt, path in sorted(audio.items())]
    rows[2:2] = [("bad-garbage", str(garbage)), ("bad-missing", str(tmp_path / "none.wav"))]
    write_table(tmp_path / "wav.scp", rows, sort=False)
    assert main(kind, [EXP, "--wav-scp", str(tmp_path / "wav.scp"),
                       "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out/hyp").read_text(encoding="utf-8") == stage4_hyp(experiment)
    skipped = read_table(tmp_path / "out/skipped.txt")
    assert list(skipped) == ["bad-garbage", "bad-missing"]
    assert skipped["bad-garbage"].startswith(f"{tmp_path / 'wav.scp'}:3: cannot decode")
    assert skipped["bad-missing"] == f"{tmp_path / 'wav.scp'}:4: no such file: " \
                                     f"{tmp_path / 'none.wav'}"
    assert json.loads((tmp_path / "out/decode.log").read_text())["num_skipped"] == 2
    assert "skipped bad-missing" in caplog.text

    write_table(tmp_path / "bad.scp", rows[2:4])
    caplog.clear()
    assert main(kind, [EXP, "--wav-scp", str(tmp_path / "bad.scp")]) == 1
    assert "nothing to transcribe in" in caplog.text and "2 utterance(s), all skipped" \
        in caplog.text


def test_segments_and_small_windows_give_stage_4_hypotheses(recipe, tmp_path):
    """Segments of one long recording; features gathered 1.5 s at a time."""
    kind, experiment, _ = recipe
    audio = experiment.test_audio()
    pieces, segments, position = [], {}, 0.0
    for utt in sorted(audio):
        samples, rate = soundfile.read(audio[utt], dtype="int16")
        pieces += [samples, np.zeros(rate // 4, np.int16)]
        segments[f"long-{utt}"] = ("long", position, position + len(samples) / rate)
        position += len(samples) / rate + 0.25
    soundfile.write(tmp_path / "long.flac", np.concatenate(pieces), 16000)
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"long": str(tmp_path / "long.flac")},
                                    segments=segments)
    extract(data_dir, tmp_path / "fbank", progress=False)
    options = DecodeOptions(beam_size=4, max_frames=300, device="cpu")
    decode_set(EXP, tmp_path / "fbank", CHECKPOINT, tmp_path / "stage4", kind, options)
    stage4 = read_table(tmp_path / "stage4/hyp", allow_empty_value=True)
    assert len(stage4) == 6

    assert main(kind, [EXP, "--wav-scp", str(data_dir / "wav.scp"), "--segments",
                       str(data_dir / "segments"), "--out", str(tmp_path / "out")]) == 0
    assert read_table(tmp_path / "out/hyp", allow_empty_value=True) == stage4
    transcript = transcribe(EXP, from_wav_scp(data_dir / "wav.scp", data_dir / "segments"),
                            CHECKPOINT, kind, options, window_frames=150)
    assert dict(transcript.hypotheses) == stage4


def test_zero_weight_lm_changes_nothing(recipe, tmp_path):
    pytest.importorskip("kenlm")
    from cat.lm.ngram import estimate, write_arpa
    from cat.lm.rescore import read_nbest

    kind, experiment, hyps = recipe
    texts = [list(text) for text in read_table(experiment.train_data / "text").values()]
    write_arpa(estimate(texts, 2, (0.5, 1.0)), tmp_path / "lm.arpa")
    wavs = [str(path) for path in experiment.test_audio().values()]
    assert main(kind, [EXP, "--audio", *wavs, "--lm", str(tmp_path / "lm.arpa"), "--alpha",
                       "0", "--out", str(tmp_path / "out")]) == 0
    assert read_table(tmp_path / "out/hyp", allow_empty_value=True) == hyps
    nbest = read_nbest(tmp_path / "out/nbest.jsonl")
    assert {utt: entries[0][0] for utt, entries in nbest.items()} == hyps


def test_a_model_of_other_features_is_refused(tmp_path, monkeypatch, caplog):
    experiment = write_tiny_experiment(tmp_path)  # 8-dim features
    wav = tmp_path / "a.wav"
    soundfile.write(wav, np.zeros(8000, np.int16), 16000)
    monkeypatch.chdir(tmp_path)
    assert main("ctc", [str(experiment.exp_dir), "--audio", str(wav),
                        "--checkpoint", "none.pt"]) == 1
    assert f"{experiment.exp_dir / 'config.json'}: encoder.kwargs.idim is 8, but audio is " \
           "turned into stage 1's 80-dim fbank" in caplog.text


@pytest.mark.slow
def test_a_feature_pool_feeds_the_decoder_in_list_order(recipe):
    """The GPU path: `nj` processes compute features for one decoding process (checked
    here on the CPU: the same utterances, features and order as computed in-process)."""
    _, experiment, _ = recipe
    audio = from_wav_scp(experiment.test_data / "wav.scp")
    keys = list(read_table(experiment.test_data / "wav.scp"))
    fbank = FbankOptions()
    expected = list(_features(enumerate(audio.recordings), fbank))
    with process_pool(2) as pool:
        pooled = list(_pooled_features(pool, audio.recordings, fbank, ahead=2))
    assert [(order, key) for order, key, _ in pooled] == [((i, 0), key)
                                                         for i, key in enumerate(keys)]
    for (_, key, features), (_, _, reference) in zip(pooled, expected, strict=True):
        np.testing.assert_array_equal(features, reference, err_msg=key)
