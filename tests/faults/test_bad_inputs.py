"""The bad-input catalogue (docs/bad-inputs.md): one test per row, asserting what the user
sees. Errors must name the file and line (or key, checkpoint, rank); skips must be counted
and listed with their reason.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile
import torch

from cat.core import config as config_module
from cat.core.config import ConfigError
from cat.core.io import TableError, write_table
from cat.data import aishell
from cat.decoding.inference import DecodeOptions, decode_set
from cat.features import extract
from cat.features.fbank import read_audio_with_channels
from cat.formats import (
    audio_pack,
    mappack,
    prep_wds,
    shard_check,
    shard_format,
    shard_index,
)
from cat.formats.data_list import DataListError
from cat.loading.reader import DataUnavailableError
from cat.loading.sources import read_shard
from cat.loading.tar import CorruptShardError
from cat.stages import driver
from cat.stages.driver import DegenerateModelError
from cat.testing.audio import (
    make_audio_file,
    make_corrupt_file,
    make_data_dir,
    synth_waveform,
    write_kaldi_data_dir,
)
from cat.testing.features import poison_features, write_feature_corpus
from cat.testing.release import make_aishell_release
from cat.testing.shards import (
    claim_member_size,
    serve_directory,
    truncate_file,
    write_raw_shard,
)
from cat.testing.training import write_tiny_experiment
from cat.testing.uio import UioUtterance, synth_wav, write_uio_shard
from cat.text import tokenizer as tk
from cat.training.checkpoint import CheckpointManager, CheckpointMismatchError
from cat.training.cli import train
from cat.training.manager import ConfigChangedError
from cat.training.report import DataChangedError, NonFiniteTrainingError
from cat.training.update import Updater

NAME = "exp/tiny"
REPO_ROOT = Path(__file__).resolve().parents[2]
GBK_LINE = "BAC009S0002W0003 今天天气很好".encode("gbk")
TEXT_NOT_UTF8 = r"text:3: not valid UTF-8 \(invalid start byte at byte 18 of the line\); " \
                r"it may be GBK/GB18030, which reads 'BAC009S0002W0003 今天天气很好'"


pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _keep_environment(monkeypatch):
    # hyper-p.json:env is exported by training; restore it after each test.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# --------------------------------------------------------------------------- stage 0


def test_aishell_transcript_not_utf8(tmp_path):
    release = make_aishell_release(tmp_path)
    path = release / aishell.TRANSCRIPT
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = GBK_LINE + b"\n"
    path.write_bytes(b"".join(lines))
    with pytest.raises(aishell.AishellError,
                       match=r"aishell_transcript_v0\.8\.txt:2: not valid UTF-8"):
        aishell.read_transcript(path)


# --------------------------------------------------------------------------- stage 1


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """One feature extraction over good and bad recordings; returns (summary, skipped)."""
    root = tmp_path_factory.mktemp("audio")
    good = make_audio_file(root / "good.wav", 1.0, seed=1)
    wav_scp = {
        "good": str(good),
        "missing": str(root / "missing.wav"),
        "truncated": str(make_corrupt_file(root / "truncated.wav", "truncated", good)),
        "garbage": str(make_corrupt_file(root / "garbage.wav", "garbage")),
        "short": str(make_audio_file(root / "short.wav", 0.01, seed=2)),
        "narrowband": str(make_audio_file(root / "narrowband.wav", 1.0, 8000, seed=3)),
        "stereo": str(make_audio_file(root / "stereo.wav", 1.0, channels=2, seed=4)),
    }
    data = write_kaldi_data_dir(root / "data", wav_scp)
    summary = extract.extract(data, root / "fbank", progress=False)
    skipped = dict(line.split(" ", 1) for line in
                   (root / "fbank/skipped.txt").read_text(encoding="utf-8").splitlines())
    frames = dict(line.split() for line in
                  (root / "fbank/utt2num_frames").read_text(encoding="utf-8").splitlines())
    return summary, skipped, frames, root


def test_missing_wav(extracted):
    summary, skipped, _, root = extracted
    assert skipped["missing"] == f"no such file: {root / 'missing.wav'}"
    assert summary.num_skipped == 4


def test_truncated_wav(extracted):
    _, skipped, _, root = extracted
    assert skipped["truncated"].startswith(
        f"truncated audio {root / 'truncated.wav'}: header declares 32000 data bytes, "
        "file holds")


def test_garbage_wav(extracted):
    _, skipped, _, root = extracted
    assert skipped["garbage"].startswith(f"cannot decode {root / 'garbage.wav'}: ")


def test_audio_shorter_than_a_frame(extracted):
    _, skipped, _, _ = extracted
    assert skipped["short"] == "too short for one frame: 160 samples at 16000 Hz, need 400"


def test_8khz_audio(extracted):
    summary, _, frames, _ = extracted
    assert summary.conversions["resampled from 8000 Hz to 16000 Hz"] == 1
    assert frames["narrowband"] == frames["good"] == "98"


def test_stereo_audio(extracted):
    summary, _, frames, _ = extracted
    assert summary.conversions == {"2 channels, channel 0 used": 1,
                                   "resampled from 8000 Hz to 16000 Hz": 1}
    assert frames["stereo"] == "98"


_WRITER = """
import sys, time
from cat.core.io import atomic_write
with atomic_write(sys.argv[1], "wb") as f:
    f.write(bytes(4096))
    f.flush()
    print("writing", flush=True)
    time.sleep(120)
"""


def _writer(path: Path) -> subprocess.Popen:
    """A process inside `atomic_write(path)`, having written 4 KiB of it."""
    process = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)],
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert process.stdout.readline() == "writing\n"
    return process


def test_temporaries_of_writers_killed_with_sigkill(tmp_path, caplog):
    """kill -9 while saving a checkpoint (and its list) or a job's feats.N.scp: the next
    checkpoint manager / stage 1 run removes the temporaries; a live writer's stays."""
    data = make_data_dir(tmp_path, durations=(1.0, 1.2))
    feat_dir, check = tmp_path / "fbank", tmp_path / "check"
    extract.extract(data, feat_dir, progress=False)
    killed = [_writer(path) for path in (check / "ckpt-e001-s00000010.pt",
                                         check / "checkpoints.json",
                                         feat_dir / "arks/feats.1.scp")]
    live = _writer(check / "ckpt-e001-s00000020.pt")
    try:
        for process in killed:
            process.kill()
            process.wait()
        left = sorted(p.name for p in [*check.iterdir(), *(feat_dir / "arks").iterdir()]
                      if ".tmp." in p.name)
        assert left == sorted([f".checkpoints.json.tmp.{killed[1].pid}",
                               f".ckpt-e001-s00000010.pt.tmp.{killed[0].pid}",
                               f".ckpt-e001-s00000020.pt.tmp.{live.pid}",
                               f".feats.1.scp.tmp.{killed[2].pid}"])
        CheckpointManager(check)
        assert sorted(p.name for p in check.iterdir()) == \
            [f".ckpt-e001-s00000020.pt.tmp.{live.pid}"]
        (feat_dir / "arks/done.1").unlink()  # the job killed while writing feats.1.scp
        extract.extract(data, feat_dir, progress=False)
        assert not list((feat_dir / "arks").glob(".*.tmp.*"))
        assert f"removed {check}/.ckpt-e001-s00000010.pt.tmp.{killed[0].pid}, left by a " \
               f"writer (process {killed[0].pid}) that was killed" in caplog.text
    finally:
        live.kill()
        live.wait()


def test_commands_in_wav_scp_and_trset_run_in_a_shell(tmp_path):
    """Documented, not refused: a `wav.scp` command and a `trset` `pipe:` entry are shell
    command lines (`;` and the rest work), so they must come from a trusted source."""
    good = make_audio_file(tmp_path / "good.wav", 0.5)
    waveform, rate, _ = read_audio_with_channels(f"cat {good}; touch {tmp_path}/wav-scp |")
    assert rate == 16000 and len(waveform) == 8000 and (tmp_path / "wav-scp").exists()
    experiment = write_tiny_experiment(tmp_path / "recipe", num_train=5)
    shard = experiment.train_shards[0]
    names = [name for name, _ in read_shard(f"pipe:cat {shard}; touch {tmp_path}/trset")]
    assert len(names) == 10 and (tmp_path / "trset").exists()


def test_wav_scp_not_utf8(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "wav.scp").write_bytes(b"a /audio/a.wav\n" + "b /音频/b.wav\n".encode("gbk"))
    with pytest.raises(TableError, match=r"wav\.scp:2: not valid UTF-8 \(invalid continuation "
                                         r"byte at byte 4 of the line\); it may be GBK"):
        extract.extract(data, tmp_path / "fbank", progress=False)


def test_duplicate_id_in_wav_scp(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "wav.scp").write_text("a /audio/a.wav\na /audio/b.wav\n", encoding="utf-8")
    with pytest.raises(TableError, match=r"wav\.scp:2: duplicate key 'a' \(first on line 1\)"):
        extract.extract(data, tmp_path / "fbank", progress=False)


def test_no_readable_audio_at_all(tmp_path):
    data = write_kaldi_data_dir(tmp_path / "data", {"a": str(tmp_path / "a.wav")})
    with pytest.raises(extract.FeatureExtractionError,
                       match=r"no utterance got features; reasons in .*skipped\.txt"):
        extract.extract(data, tmp_path / "fbank", progress=False)


# --------------------------------------------------------------------------- stage 2


@pytest.fixture
def corpus(tmp_path):
    return write_feature_corpus(tmp_path / "feats", num_utts=6, dim=4)


@pytest.fixture
def tokenizer_file(tmp_path, corpus):
    path = tmp_path / "tokenizer.tknz"
    tk.save(tk.train_sentencepiece([corpus.text], "char", 0), path)
    return path


def _gbk_text(corpus) -> Path:
    lines = corpus.text.read_bytes().splitlines(keepends=True)
    lines[2] = GBK_LINE + b"\n"
    corpus.text.write_bytes(b"".join(lines))
    return corpus.text


def _scp_with_spaced_id(corpus) -> Path:
    lines = corpus.feats_scp.read_text(encoding="utf-8").splitlines()
    key, location = lines[1].split(" ", 1)
    lines[1] = f"{key[:8]} {key[8:]} {location}"
    corpus.feats_scp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return corpus.feats_scp


def test_gbk_text_tokenizer_training(corpus):
    with pytest.raises(TableError, match=TEXT_NOT_UTF8):
        tk.train_sentencepiece([_gbk_text(corpus)], "char", 0)


def test_gbk_text_map_pack(corpus, tokenizer_file, tmp_path):
    with pytest.raises(TableError, match=TEXT_NOT_UTF8):
        mappack.write_map_pack(corpus.feats_scp, _gbk_text(corpus), tokenizer_file,
                            tmp_path / "train.npz")
    assert not (tmp_path / "train.npz").exists()


def test_gbk_text_shards(corpus, tmp_path):
    with pytest.raises(TableError, match=TEXT_NOT_UTF8):
        prep_wds.pack_data(corpus.feats_scp, _gbk_text(corpus), tmp_path / "wds")
    assert not list((tmp_path / "wds").glob("*.tar"))


SPACED_ID = (r"feats\.scp:2: 3 fields where '<utterance id> <ark path>:<byte offset>' is "
             r"expected: 'BAC009S0 001W0003 .*feats\.2\.ark:\d+'; utterance ids \(and ark "
             r"paths\) cannot contain whitespace")


def test_scp_id_with_whitespace_shards(corpus, tmp_path):
    with pytest.raises(TableError, match=SPACED_ID):
        prep_wds.pack_data(_scp_with_spaced_id(corpus), corpus.text, tmp_path / "wds")


def test_scp_id_with_whitespace_map_pack(corpus, tokenizer_file, tmp_path):
    with pytest.raises(TableError, match=SPACED_ID):
        mappack.write_map_pack(_scp_with_spaced_id(corpus), corpus.text, tokenizer_file,
                            tmp_path / "train.npz")


def test_scp_points_at_a_missing_ark(corpus, tmp_path):
    (corpus.directory / "feats.1.ark").unlink()
    with pytest.raises(TableError, match=r"feats\.scp:1: utterance 'BAC009S0001W0000': ark "
                                         r".*feats\.1\.ark does not exist"):
        prep_wds.pack_data(corpus.feats_scp, corpus.text, tmp_path / "wds")


def test_scp_offset_past_the_end_of_its_ark(corpus, tmp_path):
    lines = corpus.feats_scp.read_text(encoding="utf-8").splitlines()
    key, location = lines[1].split(" ", 1)
    ark = location.rsplit(":", 1)[0]
    lines[1] = f"{key} {ark}:{os.path.getsize(ark) + 100}"
    scp = tmp_path / "feats.scp"
    scp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(TableError, match=rf"feats\.scp:2: utterance '{key}': offset \d+ is "
                                         r"past the end of ark .*feats\.\d\.ark \(\d+ bytes; "
                                         r"truncated, or rewritten after the scp\?\)"):
        prep_wds.pack_data(scp, corpus.text, tmp_path / "wds")
    assert not (tmp_path / "wds").exists()


def _dropped(path: Path) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in path.read_text(encoding="utf-8").splitlines())


def test_ids_of_scp_and_text_differ(corpus, tmp_path):
    text = dict(corpus.transcripts)
    del text[corpus.keys[0]]
    text["orphan"] = "你好"
    write_table(corpus.text, text.items())
    summary = prep_wds.pack_data(corpus.feats_scp, corpus.text, tmp_path / "wds")
    assert summary.dropped == {"no_label": 1, "no_features": 1}
    dropped = _dropped(tmp_path / "wds" / shard_format.DROPPED_NAME)
    assert dropped == {corpus.keys[0]: "no_label", "orphan": "no_features"}


def test_text_starting_with_a_byte_order_mark(corpus, tmp_path, caplog):
    corpus.text.write_bytes(b"\xef\xbb\xbf" + corpus.text.read_bytes())
    summary = prep_wds.pack_data(corpus.feats_scp, corpus.text, tmp_path / "wds")
    assert summary.dropped == {}
    assert f"{corpus.text}: starts with a UTF-8 byte-order mark (BOM); it is ignored" \
        in caplog.text


def test_empty_transcript(corpus, tmp_path):
    write_table(corpus.text, {**corpus.transcripts, corpus.keys[1]: ""}.items())
    summary = prep_wds.pack_data(corpus.feats_scp, corpus.text, tmp_path / "wds")
    assert summary.dropped == {"empty_label": 1}
    assert _dropped(tmp_path / "wds" / shard_format.DROPPED_NAME) == {corpus.keys[1]: "empty_label"}


def test_space_only_transcript(corpus, tokenizer_file, tmp_path):
    lines = [f"{key} {'   ' if key == corpus.keys[2] else text}\n"
             for key, text in corpus.transcripts.items()]
    corpus.text.write_text("".join(lines), encoding="utf-8")
    counts = mappack.write_map_pack(corpus.feats_scp, corpus.text, tokenizer_file,
                                 tmp_path / "train.npz")
    assert counts["dropped_empty_label"] == 1 and counts["num_utts"] == 5
    assert _dropped(tmp_path / "train.dropped.txt") == {corpus.keys[2]: "empty_label"}


def test_duplicate_id_in_text(corpus, tmp_path):
    with pytest.raises(TableError, match=r"text:1: duplicate utterance 'BAC009S0001W0000' "
                                         r"\(also in .*text\)"):
        prep_wds.pack_data(corpus.feats_scp, [corpus.text, corpus.text], tmp_path / "wds")


def test_overlapping_length_groups(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"frame ranges '10:1000' and '500:2000' overlap"):
        prep_wds.pack_data(corpus.feats_scp, corpus.text, tmp_path / "wds",
                           filter_group=["10:1000", "500:2000"])


def test_nothing_left_to_pack(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"no utterances left to pack into .*wds "
                                         r"\(6 dropped \(out_of_range=6\); see .*dropped\.txt\)"):
        prep_wds.pack_data(corpus.feats_scp, corpus.text, tmp_path / "wds",
                           filter_group=["1000:"])


def test_wav_scp_command_without_segments_audio_shards(tmp_path):
    source = make_audio_file(tmp_path / "audio" / "a.wav", 1.0)
    data = write_kaldi_data_dir(tmp_path / "data", {"a": f"cat {source} |"}, {"a": "你好"})
    with pytest.raises(TableError, match=r"data/wav\.scp:1: recording 'a' is a command "
                                         r"\('cat .*a\.wav \|'\) and .*data has no segments "
                                         r"file: its duration cannot be known without decoding"):
        audio_pack.pack_audio(data, tmp_path / "wds", "opus")
    assert not (tmp_path / "wds").exists()


def test_bad_audio_audio_shards(tmp_path):
    good = make_audio_file(tmp_path / "audio" / "good.wav", 1.0)
    full = make_audio_file(tmp_path / "audio" / "full.wav", 1.0)
    wav_scp = {"good": str(good), "missing": str(tmp_path / "audio" / "missing.wav"),
               "garbage": str(make_corrupt_file(tmp_path / "audio" / "garbage.wav", "garbage")),
               "truncated": str(make_corrupt_file(tmp_path / "audio" / "truncated.wav",
                                                  "truncated", full))}
    data = write_kaldi_data_dir(tmp_path / "data", wav_scp, dict.fromkeys(wav_scp, "你好"))
    summary = audio_pack.pack_audio(data, tmp_path / "wds", "flac")
    assert summary.dropped == {"bad_audio": 3} and summary.num_utts == {".": 1}
    dropped = _dropped(tmp_path / "wds" / shard_format.DROPPED_NAME)
    assert dropped["missing"] == f"bad_audio no such file: {wav_scp['missing']}"
    assert dropped["garbage"] == f"bad_audio cannot decode {wav_scp['garbage']}: Error " \
                                 f"opening '{wav_scp['garbage']}': Format not recognised."
    assert dropped["truncated"] == f"bad_audio truncated audio {wav_scp['truncated']}: " \
                                   "header declares 32000 data bytes, file holds 15978"


def test_segment_past_the_recording_audio_shards(tmp_path):
    long = make_audio_file(tmp_path / "audio" / "long.wav", 3.0)
    data = write_kaldi_data_dir(tmp_path / "data", {"long": str(long)},
                                {"a": "你好", "b": "再见"},
                                segments={"a": ("long", 0.0, 1.0), "b": ("long", 2.5, 3.6)})
    summary = audio_pack.pack_audio(data, tmp_path / "wds", "opus")
    assert summary.dropped == {"bad_segment": 1}
    assert _dropped(tmp_path / "wds" / shard_format.DROPPED_NAME) == {
        "b": "bad_segment segment ends at 3.6 s, more than 0.05 s after the recording end "
             "(3.0 s)"}


def test_undecodable_audio_member_validate(tmp_path):
    data = make_data_dir(tmp_path / "corpus", durations=(1.0, 1.2))
    out = tmp_path / "wds"
    audio_pack.pack_audio(data, out, "flac")
    shard = out / "data-00000.tar"
    with tarfile.open(shard) as tar:
        member = tar.getmembers()[0]
    damaged = bytearray(shard.read_bytes())
    damaged[member.offset_data:member.offset_data + 64] = bytes(64)
    shard.write_bytes(bytes(damaged))
    with pytest.raises(SystemExit) as exit_info:
        prep_wds.main(["validate", str(out)])
    assert exit_info.value.code == 1
    problems = shard_check.validate(out)
    assert f"{shard}: crc32 differs from the index" in problems
    assert any(p.startswith(f"cannot decode audio {shard}:{member.name}: ") for p in problems)


def test_pickle_as_tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.tknz"
    path.write_bytes(pickle.dumps({"vocab": ["a", "b"]}))
    with pytest.raises(tk.TokenizerFileError,
                       match=r"tokenizer\.tknz: not a tokenizer file \(not UTF-8 JSON"):
        tk.load(path)


def test_non_finite_feature_value_map_pack(corpus, tokenizer_file, tmp_path):
    poison_features(corpus.feats_scp, corpus.keys[3])
    poison_features(corpus.feats_scp, corpus.keys[5], float("inf"), (2, 1))
    counts = mappack.write_map_pack(corpus.feats_scp, corpus.text, tokenizer_file,
                                    tmp_path / "train.npz")
    assert counts["dropped_non_finite"] == 2 and counts["num_utts"] == len(corpus.keys) - 2
    dropped = _dropped(mappack.dropped_log_path(tmp_path / "train.npz"))
    assert dropped == {corpus.keys[3]: "non_finite nan=1 inf=0",
                       corpus.keys[5]: "non_finite nan=0 inf=1"}


def test_non_finite_feature_value_shards(corpus, tmp_path):
    poison_features(corpus.feats_scp, corpus.keys[3])
    summary = prep_wds.pack_data(corpus.feats_scp, corpus.text, tmp_path / "wds",
                                 utts_per_file=4)
    assert summary.dropped == {"non_finite": 1}
    assert summary.num_utts == {".": len(corpus.keys) - 1}
    assert _dropped(tmp_path / "wds" / shard_format.DROPPED_NAME) == {
        corpus.keys[3]: "non_finite nan=1 inf=0"}
    index = [json.loads(line) for line in
             (tmp_path / "wds/index.jsonl").read_text(encoding="utf-8").splitlines()[1:]]
    assert sum(line["num_utts"] for line in index) == len(corpus.keys) - 1
    assert corpus.keys[3] not in {key for line in index for key in line["keys"]}


# --------------------------------------------------------------------------- stage 3


@pytest.fixture
def experiment(tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path, options={"epochs": 1})
    monkeypatch.chdir(tmp_path)
    return experiment


def _hyper_with(experiment, **option):
    hyper = experiment.hyper()
    hyper["train"]["option"].update(option)
    experiment.hyper_path.write_text(json.dumps(hyper), encoding="utf-8")
    return config_module.load_experiment(NAME)


def _set_config(experiment, change) -> None:
    path = experiment.exp_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    change(config)
    path.write_text(json.dumps(config), encoding="utf-8")


def test_unknown_key(experiment):
    with pytest.raises(ConfigError, match=r"hyper-p\.json: train\.option: unknown key "
                                          r"'mixup'; allowed keys: amp, amp_dtype, audio, "
                                          r"bad_shard_limit, batch_size"):
        _hyper_with(experiment, mixup=True)


def test_misspelled_key(experiment):
    with pytest.raises(ConfigError, match=r"train\.option: unknown key 'large-dataset' \(did "
                                          r"you mean 'large_dataset'\?\)"):
        _hyper_with(experiment, **{"large-dataset": True})


def test_wrong_type(experiment):
    with pytest.raises(ConfigError, match=r"train\.option\.batch_size: 'four' is not of "
                                          r"type 'integer'"):
        _hyper_with(experiment, batch_size="four")


def test_unknown_model_config_key(experiment):
    _set_config(experiment, lambda c: c["encoder"]["kwargs"].update(hdimm=32))
    with pytest.raises(ConfigError, match=r"config\.json: encoder\.kwargs: unknown key "
                                          r"'hdimm' \(did you mean 'hdim'\?\)"):
        config_module.load_experiment(NAME)


def test_invalid_json(experiment):
    experiment.hyper_path.write_text('{"train": {"bin": "cat.ctc.train",\n "option": }}',
                                     encoding="utf-8")
    with pytest.raises(ConfigError, match=r"hyper-p\.json:2:12: invalid JSON: Expecting value"):
        config_module.load_experiment(NAME)


def test_stall_limit_not_below_collective_timeout(experiment):
    with pytest.raises(ConfigError, match=r"train\.option\.stall_seconds: 600 must be below "
                                          r"dist_timeout_seconds \(300\)"):
        _hyper_with(experiment, stall_seconds=600)


def test_feature_dimension_mismatch_map_style(experiment):
    _set_config(experiment, lambda c: c["encoder"]["kwargs"].update(idim=80))
    with pytest.raises(ValueError, match=r"pack/train\.npz: utterance '\w+' has features of "
                                         r"shape \(\d+, 8\), but config\.json "
                                         r"encoder\.kwargs\.idim is 80"):
        train(NAME, "cat.ctc.train")


def test_feature_dimension_mismatch_shards(experiment):
    experiment.use_shards()
    _set_config(experiment, lambda c: c["encoder"]["kwargs"].update(idim=80))
    with pytest.raises(ValueError, match=r"the shards hold 8-dim features \(index\.jsonl\), "
                                         r"but config\.json encoder\.kwargs\.idim is 80"):
        train(NAME, "cat.ctc.train")


def test_trset_matching_nothing(experiment):
    experiment.set_options(large_dataset=True, trset="data/wds/trian/data-*.tar")
    with pytest.raises(FileNotFoundError, match=r"trset pattern 'data/wds/trian/data-\*\.tar' "
                                                r"matches no shard"):
        train(NAME, "cat.ctc.train")


def test_truncated_shard_is_skipped_and_counted(experiment, caplog):
    truncate_file(experiment.train_shards[3], 0.5)
    experiment.use_shards(bad_shard_limit=0.2)
    train(NAME, "cat.ctc.train")
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["corrupt_shards"] == ["data/wds/train/data-00003.tar"]
    assert summary["corrupt_missing"] >= 1 and summary["trained"] < 40
    assert "skipping the rest of shard data/wds/train/data-00003.tar: ends after" in caplog.text


def test_truncated_shard_with_strict_shards(experiment):
    truncate_file(experiment.train_shards[3], 0.5)
    experiment.use_shards(strict_shards=True)
    with pytest.raises(CorruptShardError, match=r"data/wds/train/data-00003\.tar: .*"
                                                r"(incomplete_sample|ends after).*strict_shards"):
        train(NAME, "cat.ctc.train")


def test_more_bad_shards_than_the_limit(experiment):
    truncate_file(experiment.train_shards[3], 0.5)
    experiment.use_shards()
    with pytest.raises(DataUnavailableError, match=r"1 of the rank's 8 shards this epoch "
                                                   r"failed, more than bad_shard_limit=0\.1; "
                                                   r"storage: .*data/wds/train; last failures: "
                                                   r"data/wds/train/data-00003\.tar \(corrupt"):
        train(NAME, "cat.ctc.train")


def test_shards_swapped_on_disk(experiment):
    first, second = experiment.train_shards[1], experiment.train_shards[4]
    os.rename(first, first.with_suffix(".tmp"))
    os.rename(second, first)
    os.rename(first.with_suffix(".tmp"), second)
    experiment.use_shards(bad_shard_limit=0.3)
    train(NAME, "cat.ctc.train")
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert sorted(summary["corrupt_shards"]) == ["data/wds/train/data-00001.tar",
                                                 "data/wds/train/data-00004.tar"]
    assert summary["corrupt_missing"] == 10 and summary["trained"] == 30
    shutil.rmtree(experiment.exp_dir / "check")
    experiment.use_shards(strict_shards=True)
    with pytest.raises(CorruptShardError, match=r"data-0000[14]\.tar: holds '.*' as its "
                                                r"utterance 0, where its index lists '.*': it "
                                                r"does not match its index"):
        train(NAME, "cat.ctc.train")


def test_shard_bytes_changed(experiment):
    path = experiment.train_shards[2]
    data = bytearray(path.read_bytes())
    data[1536 + 300] ^= 0x01  # a feature value of the first utterance
    path.write_bytes(bytes(data))
    experiment.use_shards(bad_shard_limit=0.2)
    train(NAME, "cat.ctc.train")
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["corrupt_shards"] == ["data/wds/train/data-00002.tar"]
    shutil.rmtree(experiment.exp_dir / "check")
    experiment.use_shards(strict_shards=True)
    with pytest.raises(CorruptShardError, match=r"data-00002\.tar: its bytes differ from its "
                                                r"index \(crc32 [0-9a-f]{8}, index "
                                                r"[0-9a-f]{8}; its 5 utterances were read\)"):
        train(NAME, "cat.ctc.train")


def _peak_rss_kib(reset: bool = False) -> int:
    """This process's peak resident memory (VmHWM), after resetting it when asked."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0])


def test_tar_header_claiming_a_huge_member(experiment, caplog):
    name = claim_member_size(experiment.train_shards[3], 1 << 40, member=4)
    experiment.use_shards(bad_shard_limit=0.5)
    before = _peak_rss_kib(reset=True)
    train(NAME, "cat.ctc.train")
    assert _peak_rss_kib() - before < 1 << 20  # KiB: less than 1 GiB more
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["corrupt_shards"] == ["data/wds/train/data-00003.tar"]
    assert "skipping the rest of shard data/wds/train/data-00003.tar: CorruptShardError: " \
           f"data/wds/train/" \
           f"data-00003.tar: member {name!r}: its tar header claims 1099511627776 bytes, " \
           "more than the whole shard (its index)" in caplog.text


def test_undecodable_member_with_strict_shards(experiment, tmp_path):
    features = np.zeros((60, 8), np.float32)
    shard = write_raw_shard(tmp_path / "bad/data-0.tar",
                            [("utt1", features, "的一"), ("utt2", features, "是在")],
                            npy_bytes={"utt2": b"garbage"})
    experiment.use_shards(trset=str(shard), utts_per_shard_estimate=2, strict_shards=True)
    with pytest.raises(ValueError, match=r"shard .*bad/data-0\.tar: utterance 'utt2': "
                                         r"corrupt_features not \.npy data \(strict_shards"):
        train(NAME, "cat.ctc.train")


@pytest.fixture
def audio_experiment(tmp_path, monkeypatch):
    """The tiny experiment with an 80-dim model (and dev set), for audio training data."""
    experiment = write_tiny_experiment(tmp_path, feat_dim=80, options={"epochs": 1})
    monkeypatch.chdir(tmp_path)
    return experiment


def _audio_shards(experiment, trset, **options):
    """Stream `trset` as audio: 80-dim fbank computed on the fly."""
    experiment.use_shards(trset=trset, audio={"speed_perturb": [0.9, 1.0, 1.1]}, **options)


def _uio_utterances(experiment, count):
    texts = experiment.train.transcripts
    return [UioUtterance(key, synth_wav(0.8, seed=i), texts[key])
            for i, key in enumerate(sorted(texts)[:count])]


def test_audio_shards_without_audio_settings(audio_experiment, tmp_path):
    experiment = audio_experiment
    data_dir = make_data_dir(tmp_path / "corpus")
    audio_pack.pack_audio(data_dir, experiment.root / "data/wds_audio", "flac")
    experiment.use_shards(trset="data/wds_audio/data-*.tar")
    with pytest.raises(ValueError, match=r"data/wds_audio/index\.jsonl lists audio shards, but "
                                         r"train\.option\.audio \(how audio becomes "
                                         r"features\) is not set"):
        train(NAME, "cat.ctc.train")


def test_undecodable_audio_member_in_training(audio_experiment):
    experiment = audio_experiment
    utterances = _uio_utterances(experiment, 6)
    utterances[2] = dataclasses.replace(utterances[2], audio=b"RIFF garbage")
    for number in range(2):
        write_uio_shard(experiment.root / f"uio/shards_{number:09d}.tar",
                        utterances[3 * number:3 * number + 3])
    _audio_shards(experiment, "uio/shards_*.tar", utts_per_shard_estimate=3)
    train(NAME, "cat.ctc.train")
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["trained"] == 5 and list(summary["dropped"]) == ["bad_audio"]
    drops = (experiment.exp_dir / "log/drops/epoch-001.rank-0.txt").read_text()
    assert f"{utterances[2].key} bad_audio cannot decode audio " in drops
    assert "uio/shards_000000000.tar:" in drops


def _wav(duration: float, rate: int, channels: int = 1, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, synth_waveform(duration, rate, seed, channels), rate,
                    format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def test_audio_converted_and_unknown_characters_in_training(audio_experiment):
    """Streaming audio of 8 and 44.1 kHz (resampled), stereo (channel 0), a transcript
    with a character the tokenizer does not know: trained, and counted per epoch."""
    experiment = audio_experiment
    utterances = _uio_utterances(experiment, 6)
    utterances[0] = dataclasses.replace(utterances[0], audio=_wav(0.8, 8000))
    utterances[1] = dataclasses.replace(utterances[1], audio=_wav(0.8, 44100))
    utterances[2] = dataclasses.replace(utterances[2], audio=_wav(0.8, 16000, channels=2))
    utterances[3] = dataclasses.replace(utterances[3], text=utterances[3].text + "龘")
    for number in range(2):
        write_uio_shard(experiment.root / f"uio/shards_{number:09d}.tar",
                        utterances[3 * number:3 * number + 3])
    _audio_shards(experiment, "uio/shards_*.tar", utts_per_shard_estimate=3)
    train(NAME, "cat.ctc.train")
    noted = {"resampled from 8000 Hz to 16000 Hz": 1, "resampled from 44100 Hz to 16000 Hz": 1,
             "2 channels, channel 0 used": 1, "transcript with <unk> tokens": 1}
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["trained"] == 6 and summary["noted"] == noted
    coverage = json.loads((experiment.exp_dir / "log/coverage.jsonl").read_text())
    assert coverage["noted"] == noted


def _uio_shards_sharing_a_key(experiment) -> str:
    """Two shards of 3 utterances, the second holding the first's second utterance too."""
    utterances = _uio_utterances(experiment, 5)
    write_uio_shard(experiment.root / "uio/shards_000000000.tar", utterances[:3])
    write_uio_shard(experiment.root / "uio/shards_000000001.tar",
                    [utterances[3], utterances[1], utterances[4]])
    return utterances[1].key


def test_same_key_in_two_shards_of_other_tools_indexed(audio_experiment):
    key = _uio_shards_sharing_a_key(audio_experiment)
    with pytest.raises(ValueError, match=rf"uio: key '{key}' is in shards "
                                         r"shards_000000000\.tar and shards_000000001\.tar: an "
                                         r"utterance must be in one shard \(it would be "
                                         r"trained twice per epoch\)"):
        shard_index.index_folder(audio_experiment.root / "uio")
    assert not (audio_experiment.root / "uio/index.jsonl").exists()


def test_same_key_in_two_shards_of_other_tools_streamed(audio_experiment):
    experiment = audio_experiment
    key = _uio_shards_sharing_a_key(experiment)
    _audio_shards(experiment, "uio/shards_*.tar", utts_per_shard_estimate=3)
    train(NAME, "cat.ctc.train")
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["trained"] == 5 and summary["dropped"] == {"duplicate_key": 1}
    drops = (experiment.exp_dir / "log/drops/epoch-001.rank-0.txt").read_text()
    assert f"{key} duplicate_key also in shard uio/shards_000000000.tar" in drops


def test_malformed_raw_data_list(audio_experiment):
    experiment = audio_experiment
    listing = experiment.root / "data.list"
    listing.write_text('{"key": "a", "wav": "a.wav", "txt": "的"}\n{"key": "b", "wav": }\n',
                       encoding="utf-8")
    _audio_shards(experiment, "data.list")
    with pytest.raises(DataListError, match=r"data\.list:2: not JSON: Expecting value"):
        train(NAME, "cat.ctc.train")


def test_raw_data_list_entry_whose_audio_is_missing(audio_experiment, caplog):
    experiment = audio_experiment
    lines = []
    for utterance in _uio_utterances(experiment, 4):
        path = experiment.root / "wav" / f"{utterance.key}.wav"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(utterance.audio)
        lines.append(json.dumps({"key": utterance.key, "wav": f"wav/{utterance.key}.wav",
                                 "txt": utterance.text}, ensure_ascii=False))
    gone = experiment.root / "wav" / f"{_uio_utterances(experiment, 4)[1].key}.wav"
    gone.unlink()
    (experiment.root / "data.list").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _audio_shards(experiment, "data.list")
    train(NAME, "cat.ctc.train")
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["trained"] == 3
    assert summary["dropped"] == {"incomplete_sample": 1}
    assert f"cannot read {gone}: [Errno 2] No such file or directory" in caplog.text


@pytest.mark.slow
def test_shard_server_dropping_connections(experiment):
    drops = {f"data-{i:05d}.tar": ["drop"] * 4 for i in range(8)}
    with serve_directory(experiment.root / "data/wds/train", drops) as url:
        experiment.use_shards(trset=f"{url}/data-0000{{0..7}}.tar", read_ahead_mb=0)
        with pytest.raises(DataUnavailableError, match=r"1 of the rank's 8 shards this epoch "
                                                       r"failed, more than bad_shard_limit=0\.1; "
                                                       r"storage: http://127\.0\.0\.1:\d+; .*"
                                                       r"unavailable after 4 attempts: cannot "
                                                       r"fetch it: RemoteDisconnected"):
            train(NAME, "cat.ctc.train")


@pytest.mark.slow
def test_presigned_url_signatures_in_logs_and_errors(experiment):
    """Presigned shard URLs: the query strings (signature, credential) are redacted in the
    log, the error and the epoch records, while the reads use them."""
    secret = "X-Amz-Credential=AKIDEXAMPLE&X-Amz-Signature=5ec7e75ec7e7"
    runs = []
    for limit in (0.5, 0.1):  # the shard counted; then an error
        drops = {"data-00003.tar": ["drop"] * 4}
        with serve_directory(experiment.root / "data/wds/train", drops) as url:
            experiment.use_shards(trset=f"{url}/data-0000{{0..7}}.tar?{secret}",
                                  read_ahead_mb=0, bad_shard_limit=limit)
            shutil.rmtree(experiment.exp_dir / "check", ignore_errors=True)
            runs.append(subprocess.run([sys.executable, "-m", "cat.ctc.train", NAME],
                                       cwd=experiment.root, capture_output=True, text=True,
                                       timeout=240,
                                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}))
        if limit == 0.5:
            assert runs[0].returncode == 0, runs[0].stderr[-3000:]
            assert f"skipping the rest of shard {url}/data-00003.tar?<redacted>: " \
                   "unavailable" in runs[0].stderr, runs[0].stderr[-3000:]
            summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
            assert summary["unavailable_shards"] == [f"{url}/data-00003.tar?<redacted>"]
    failed = runs[1]
    assert failed.returncode != 0 and "DataUnavailableError" in failed.stderr
    assert f"last failures: {url}/data-00003.tar?<redacted> (unavailable" in failed.stderr
    logs = [run.stderr for run in runs] + [
        p.read_bytes().decode("utf-8", "replace")
        for p in (experiment.exp_dir / "log").rglob("*") if p.is_file()]
    assert not [log for log in logs if "5ec7e75ec7e7" in log or "AKIDEXAMPLE" in log]


def test_epoch_that_trains_nothing(experiment):
    for shard in experiment.train_shards:  # listed, but nothing can be read from them
        shard.unlink()
        shard.mkdir()
    experiment.use_shards(bad_shard_limit=1.0)
    with pytest.raises(DataUnavailableError, match=r"epoch 1 trained no utterance: 8 "
                                                   r"unavailable \(.*; storage: .*data/wds/"
                                                   r"train\) \(see log/epoch-001\.json\)"):
        train(NAME, "cat.ctc.train")
    assert not CheckpointManager(experiment.exp_dir / "check").records


def test_resume_after_the_shards_were_repacked(experiment):
    experiment.use_shards(max_steps=3)
    train(NAME, "cat.ctc.train")
    prep_wds.pack_data(experiment.train.feats_scp, experiment.train.text,
                       experiment.root / "data/wds/train", utts_per_file=5, seed=3)
    experiment.set_options(max_steps=0)
    with pytest.raises(DataChangedError, match=r"ckpt-e001-s00000003\.pt: epoch 1 cannot "
                                               r"continue where it stopped, because what "
                                               r"decides its data changed: shard data/wds/train/"
                                               r"data-00000\.tar changed \(crc32 .*"
                                               r"--resume-restart-epoch"):
        train(NAME, "cat.ctc.train", resume=True)
    assert CheckpointManager(experiment.exp_dir / "check").latest().name == \
        "ckpt-e001-s00000003.pt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny experiment trained for one epoch (copied by the tests that change it)."""
    root = tmp_path_factory.mktemp("trained")
    write_tiny_experiment(root, options={"epochs": 1})
    here = Path.cwd()
    os.chdir(root)
    try:
        train(NAME, "cat.ctc.train")
    finally:
        os.chdir(here)
    return root


@pytest.fixture
def trained_copy(trained, tmp_path, monkeypatch):
    root = tmp_path / "copy"
    shutil.copytree(trained, root, symlinks=True)
    monkeypatch.chdir(root)
    return root


def _widen_model(root: Path) -> None:
    path = root / NAME / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["encoder"]["kwargs"]["hdim"] = 24
    path.write_text(json.dumps(config), encoding="utf-8")


MISMATCH = (r"ckpt-e002-s00000010\.pt does not fit the model built from exp/tiny/config\.json: "
            r"'encoder\.subsampling\.out\.weight' has shape \(16, 4\) in the checkpoint but "
            r"\(24, 4\) in the model \(39 more differences\)\. Was config\.json \(or the "
            r"tokenizer\) changed after the checkpoint was written\?")


def test_resume_after_the_model_config_changed(trained_copy):
    _widen_model(trained_copy)
    with pytest.raises(CheckpointMismatchError, match=MISMATCH):
        train(NAME, "cat.ctc.train", resume=True)


def _global_cmvn(config):
    config["encoder"]["kwargs"]["global_cmvn"] = True


def test_non_finite_feature_value_training(experiment):
    # A pack written before the value went bad (packing now drops it as non_finite).
    key = sorted(experiment.train.features)[7]
    poison_features(experiment.train.feats_scp, key)
    # The global CMVN reads its utterances as the loader does: the same error, before any
    # statistics are computed from it.
    _set_config(experiment, _global_cmvn)
    with pytest.raises(ValueError, match=rf"pack/train\.npz: utterance '{key}' has non-finite "
                                         r"features \(nan=1 inf=0\); pack it again"):
        train(NAME, "cat.ctc.train")
    assert not CheckpointManager(experiment.exp_dir / "check").records
    _set_config(experiment, lambda config: config["encoder"]["kwargs"].pop("global_cmvn"))
    with pytest.raises(ValueError, match=rf"pack/train\.npz: utterance '{key}' has non-finite "
                                         r"features \(nan=1 inf=0\); pack it again"):
        train(NAME, "cat.ctc.train")


def test_non_finite_feature_value_streaming(experiment):
    key = sorted(experiment.train.features)[7]
    poison_features(experiment.train.feats_scp, key)
    # Shards another tool wrote with the bad value in them (ours drop it when packing).
    for shard in experiment.train_shards:
        shard.unlink()
    for index, keys in enumerate(np.array_split(sorted(experiment.train.features), 8)):
        write_raw_shard(experiment.root / f"data/wds/train/data-{index:05d}.tar",
                        [(k, _load_mat(experiment.train.feats_scp, k),
                          experiment.train.transcripts[k]) for k in keys])
    (experiment.root / "data/wds/train/index.jsonl").unlink()
    shard_index.index_folder(experiment.root / "data/wds/train")
    experiment.use_shards()
    train(NAME, "cat.ctc.train")
    record = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text(encoding="utf-8"))
    assert record["dropped"].get("non_finite") == 1
    drops = (experiment.exp_dir / "log/drops/epoch-001.rank-0.txt").read_text(encoding="utf-8")
    assert f"{key} non_finite nan=1 inf=0" in drops


def _load_mat(feats_scp: Path, key: str) -> np.ndarray:
    scp = dict(line.split(" ", 1) for line in feats_scp.read_text(encoding="utf-8").splitlines())
    return kaldiio.load_mat(scp[key].strip())


def test_nan_learning_rate(experiment):
    _set_config(experiment, lambda config: config["scheduler"]["kwargs"].update(
        peak_lr=float("nan")))
    with pytest.raises(ConfigError, match=r"exp/tiny/config\.json: scheduler\.kwargs\.peak_lr: "
                                          r"nan is not a finite number"):
        train(NAME, "cat.ctc.train")
    _set_config(experiment, lambda config: config["scheduler"]["kwargs"].update(peak_lr=0))
    with pytest.raises(ConfigError, match=r"scheduler\.kwargs\.peak_lr: 0 is less than or equal "
                                          r"to the minimum of 0"):
        train(NAME, "cat.ctc.train")


def _non_finite_gradients(monkeypatch, every: int = 1) -> None:
    """Every `every`-th update gets a non-finite gradient norm."""
    clip = torch.nn.utils.clip_grad_norm_
    calls = []

    def clip_or_nan(parameters, max_norm):
        norm = clip(parameters, max_norm)
        calls.append(1)
        return torch.tensor(float("nan")) if len(calls) % every == 0 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_or_nan)


def test_updates_skipped_for_a_non_finite_gradient(experiment, monkeypatch):
    _non_finite_gradients(monkeypatch)
    with pytest.raises(NonFiniteTrainingError, match=r"epoch 1: 10 of its 10 updates were "
                                                     r"skipped for a non-finite gradient norm, "
                                                     r"more than train\.option\."
                                                     r"max_skipped_updates=0\.05"):
        train(NAME, "cat.ctc.train")
    assert not CheckpointManager(experiment.exp_dir / "check").records
    coverage = json.loads((experiment.exp_dir / "log/coverage.jsonl").read_text(
        encoding="utf-8"))
    assert (coverage["trained"], coverage["skipped"], coverage["skipped_updates"]) == (0, 40, 10)
    # Within the limit, the skipped utterances are counted, the others trained.
    shutil.rmtree(experiment.exp_dir / "log")
    monkeypatch.undo()
    monkeypatch.chdir(experiment.root)
    _non_finite_gradients(monkeypatch, every=5)
    experiment.set_options(max_skipped_updates=0.2)
    train(NAME, "cat.ctc.train")
    coverage = json.loads((experiment.exp_dir / "log/coverage.jsonl").read_text(
        encoding="utf-8"))
    assert (coverage["trained"], coverage["skipped"], coverage["skipped_updates"]) == (32, 8, 2)


def test_non_finite_dev_loss(experiment, monkeypatch):
    monkeypatch.setattr(Updater, "evaluate", lambda self, loader: float("nan"))
    with pytest.raises(NonFiniteTrainingError, match=r"epoch 1, step 10: the dev loss is nan: "
                                                     r"the model diverged or was fed non-finite "
                                                     r"numbers; no checkpoint was written"):
        train(NAME, "cat.ctc.train")
    assert not CheckpointManager(experiment.exp_dir / "check").records


def test_resume_after_the_learning_rate_or_grad_accum_changed(trained_copy, caplog):
    config_path = trained_copy / NAME / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["scheduler"]["kwargs"]["peak_lr"] = 0.001
    config_path.write_text(json.dumps(config), encoding="utf-8")
    hyper = json.loads((trained_copy / NAME / "hyper-p.json").read_text(encoding="utf-8"))
    hyper["train"]["option"].update(grad_accum=2, epochs=2)
    (trained_copy / NAME / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    with pytest.raises(ConfigChangedError, match=r"ckpt-e002-s00000010\.pt: the training "
                                                 r"settings changed since this checkpoint was "
                                                 r"written: config\.json: scheduler\.kwargs\."
                                                 r"peak_lr: 0\.003 -> 0\.001; hyper-p\.json: "
                                                 r"train\.option\.grad_accum: 1 -> 2\. .*"
                                                 r"--resume-allow-config-change"):
        train(NAME, "cat.ctc.train", resume=True)
    train(NAME, "cat.ctc.train", allow_config_change=True)
    assert "resuming with changed training settings (--resume-allow-config-change): " \
           "config.json: scheduler.kwargs.peak_lr: 0.003 -> 0.001" in caplog.text
    assert CheckpointManager(trained_copy / NAME / "check").latest().name == \
        "ckpt-e003-s00000015.pt"


def another_tokenizer_of_the_same_size(path: Path) -> None:
    """Replace the tokenizer file at `path` by a tokenizer of as many ids that maps them to
    other pieces: every weight still fits, every id means something else."""
    tokenizer = tk.load(path)
    pieces = [tokenizer.id_to_piece(index) for index in range(2, tokenizer.vocab_size)]
    tk.save(tk.JiebaTokenizer([tk.BLANK, tk.UNK, *reversed(pieces)]), path)


def test_resume_after_the_front_end_or_the_tokenizer_changed(trained_copy, caplog):
    """The checkpoint records the front end and the tokenizer its model was trained with;
    --resume refuses another one by name (before: it trained on, exit 0)."""
    checkpoints = CheckpointManager(trained_copy / NAME / "check")
    settings = torch.load(checkpoints.latest(), weights_only=True)["meta"]["settings"]
    tokenizer = tk.load(trained_copy / NAME / "tokenizer.tknz")
    assert settings["front_end"]["name"] == "kaldi" and settings["front_end"]["high_freq"] == 0
    assert settings["tokenizer"] == {"digest": tk.digest(tokenizer),
                                     "vocab_size": tokenizer.vocab_size}
    hyper_path = trained_copy / NAME / "hyper-p.json"
    hyper = json.loads(hyper_path.read_text(encoding="utf-8"))
    hyper["data"]["front_end"] = "sherpa-onnx"
    # Streamed: the shards hold text, tokenized as they are read (a map pack holds ids, and
    # names a tokenizer other than the one it was packed with itself).
    hyper["train"]["option"].update(epochs=2, large_dataset=True,
                                    trset="data/wds/train/data-*.tar", dev_large_dataset=True,
                                    devset="data/wds/dev/data-*.tar")
    hyper_path.write_text(json.dumps(hyper), encoding="utf-8")
    another_tokenizer_of_the_same_size(trained_copy / NAME / "tokenizer.tknz")
    with pytest.raises(ConfigChangedError, match=r"ckpt-e002-s00000010\.pt: the training "
                                                 r"settings changed since this checkpoint was "
                                                 r"written: hyper-p\.json: data\.front_end: "
                                                 r"high_freq: 0\.0 -> -400\.0; hyper-p\.json: "
                                                 r"data\.front_end: name: \"kaldi\" -> "
                                                 r"\"sherpa-onnx\"; hyper-p\.json: "
                                                 r"data\.front_end: snip_edges: true -> false; "
                                                 r"the tokenizer: digest: \"[0-9a-f]{16}\" -> "
                                                 r"\"[0-9a-f]{16}\"\. .*--resume-allow-config-"):
        train(NAME, "cat.ctc.train", resume=True)
    train(NAME, "cat.ctc.train", allow_config_change=True)
    assert "resuming with changed training settings (--resume-allow-config-change): " \
           "hyper-p.json: data.front_end: high_freq: 0.0 -> -400.0" in caplog.text


def test_resume_without_a_checkpoint(experiment):
    with pytest.raises(FileNotFoundError, match=r"--resume: no checkpoint in exp/tiny/check"):
        train(NAME, "cat.ctc.train", resume=True)


def test_training_again_over_checkpoints(trained_copy):
    with pytest.raises(FileExistsError, match=r"exp/tiny/check already holds checkpoints; "
                                              r"pass --resume to continue"):
        train(NAME, "cat.ctc.train")


# --------------------------------------------------------------------------- stage 4


def _decode(root: Path, checkpoint: Path, data: str = "data/fbank/dev") -> None:
    decode_set(NAME, data, checkpoint, root / "decode",
               DecodeOptions(method="greedy", device="cpu"))


def _latest(root: Path) -> Path:
    return CheckpointManager(root / NAME / "check").latest()


def test_decode_with_a_changed_model_config(trained_copy):
    _widen_model(trained_copy)
    with pytest.raises(CheckpointMismatchError, match=MISMATCH):
        _decode(trained_copy, _latest(trained_copy))


def test_decode_a_file_that_is_not_a_checkpoint(trained_copy):
    garbage = trained_copy / "model.pt"
    garbage.write_bytes(np.random.default_rng(0).bytes(1000))
    with pytest.raises(ValueError, match=r"model\.pt: not a readable checkpoint \(not a "
                                         r"weights-only torch\.save file: Unsupported operand"):
        _decode(trained_copy, garbage)


def test_decode_scp_id_with_whitespace(trained_copy):
    scp = trained_copy / "data/fbank/dev/feats.scp"
    lines = scp.read_text(encoding="utf-8").splitlines()
    key, location = lines[1].split(" ", 1)
    lines[1] = f"{key[:6]} {key[6:]} {location}"
    scp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(TableError, match=r"dev/feats\.scp:2: 3 fields where '<utterance id> "
                                         r"<ark path>:<byte offset>' is expected"):
        _decode(trained_copy, _latest(trained_copy))
    assert not (trained_copy / "decode/hyp").exists()


def test_pickle_payload_as_checkpoint(trained_copy):
    path = trained_copy / "model.pt"
    marker = trained_copy / "payload-ran"
    torch.save({"format": "cat-checkpoint", "model": _Payload(str(marker))}, path)
    with pytest.raises(ValueError) as error:
        _decode(trained_copy, path)
    message = str(error.value)
    assert re.match(r".*model\.pt: refused: not a plain checkpoint, it holds pickled Python "
                    r"objects other than tensors and plain data \(it refers to \S+\); loading them "
                    r"could run code, so it is not loaded", message)
    assert "weights_only" not in message and not marker.exists()


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_decode_a_checkpoint_that_outputs_only_blanks(trained_copy):
    check = trained_copy / NAME / "check"
    for path in check.glob("ckpt-*.pt"):
        state = torch.load(path, weights_only=True)
        state["model"]["ctc.weight"].zero_()
        state["model"]["ctc.bias"].fill_(-10.0)
        state["model"]["ctc.bias"][0] = 10.0  # blank
        torch.save(state, path)
    with pytest.raises(DegenerateModelError, match=r"the model exp/tiny/.*\.pt \(trained for "
                                                   r"10 updates\) is degenerate: every "
                                                   r"hypothesis of dev is empty or one token "
                                                   r"repeated"):
        driver.decode(NAME)
    results = (trained_copy / NAME / "RESULTS.md").read_text(encoding="utf-8")
    assert "**Not a result**: the model" in results and "(trained for 10 updates)" in results
    # Pipeline smoke tests opt in to recording it: marked, warned, stage 4 ends normally.
    hyper_path = trained_copy / NAME / "hyper-p.json"
    hyper = json.loads(hyper_path.read_text(encoding="utf-8"))
    hyper.setdefault("inference", {}).setdefault("er", {})["allow_degenerate"] = True
    hyper_path.write_text(json.dumps(hyper), encoding="utf-8")
    assert driver.decode(NAME) == Path(NAME) / "RESULTS.md"
    assert "**Not a result**: the model" in (trained_copy / NAME / "RESULTS.md").read_text(
        encoding="utf-8")


# --------------------------------------------------------------------------- the catalogue


def test_export_without_a_checkpoint(tmp_path, monkeypatch):
    from cat.decoding.export import ExportError, export

    monkeypatch.chdir(tmp_path)
    write_tiny_experiment(tmp_path, kind="ctc")
    with pytest.raises(ExportError, match=r"^cannot export exp/tiny: exp/tiny/check: no "
                                          r"checkpoint \(run stage 3 first\)$"):
        export("exp/tiny")
    assert not (tmp_path / "exp/tiny/export").exists()


def _streaming_encoder(max_chunk_size: int):
    from cat.models.encoder import ConformerNet

    return ConformerNet(80, 16, 1, 2, kernel_size=3, subsampling_channels=4,
                        causal_conv=bool(max_chunk_size), max_chunk_size=max_chunk_size).eval()


def test_stream_with_an_untrained_chunk_size():
    from cat.models.chunked import StreamingEncoder

    with pytest.raises(ValueError, match=r"^chunk size 9: this model was trained on chunks of 1 "
                                         r"to 8 frames \(encoder.kwargs.min_chunk_size, "
                                         r"max_chunk_size\)$"):
        StreamingEncoder(_streaming_encoder(8), 9)
    with pytest.raises(ValueError, match=r"^chunk size 4: this model was trained with full "
                                         r"context only \(encoder.kwargs.max_chunk_size 0\)$"):
        StreamingEncoder(_streaming_encoder(0), 4)


def test_stream_audio_at_another_sample_rate():
    from cat.ctc.stream import CtcChunkSearch
    from cat.decoding.online import StreamingError, StreamingRecognizer
    from cat.models.chunked import CachedChunkEncoder, StreamingEncoder

    encoder = CachedChunkEncoder(StreamingEncoder(_streaming_encoder(8), 4))
    model = _streaming_encoder(8)  # any module with a head will do: nothing is encoded
    model.first_head = None
    recognizer = StreamingRecognizer(encoder, CtcChunkSearch(model), None)
    with pytest.raises(StreamingError, match=r"^audio at 8000 Hz: the model takes 16000 Hz "
                                             r"audio; resample it first$"):
        recognizer.accept_waveform(8000, np.zeros(8000, np.float32))


def _test_functions(root: Path) -> set[str]:
    """Names of the test functions of every test module under `root`."""
    import ast

    return {node.name for path in root.rglob("test_*.py")
            for node in ast.parse(path.read_text(encoding="utf-8")).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_row_of_the_catalogue_has_its_test():
    """Each row names its tests (here, or in the module of the package they test), and
    every test of this module has its row."""
    root = Path(__file__).resolve().parents[2]
    catalogue = root / "docs" / "bad-inputs.md"
    rows = [line for line in catalogue.read_text(encoding="utf-8").splitlines()
            if line.startswith("| ") and not line.startswith("| input")]
    named = [re.findall(r"`(test_\w+)`", row.rstrip(" |").rsplit("| ", 1)[1]) for row in rows]
    assert len(rows) >= 20
    assert all(named), [row for row, names in zip(rows, named, strict=True) if not names]
    everywhere = _test_functions(root / "tests")
    assert sorted({n for names in named for n in names} - everywhere) == []
    here = {name for name in globals() if name.startswith("test_")
            and name != "test_every_row_of_the_catalogue_has_its_test"}
    assert sorted(here - {n for names in named for n in names}) == []


# ------------------------------------------------------------------ CTC-CRF (lexicons, graphs)


def test_words_missing_from_the_lexicon(tmp_path):
    from cat.graph.den_graph import build_for_tokenizer
    from cat.text.lexicon import LexiconTokenizer

    tokenizer = LexiconTokenizer.from_lexicon({"今天": ["j", "in1", "t", "ian1"],
                                               "好": ["h", "ao3"]})
    # 今天好 is no lexicon word: spelt by its lexicon words; 冷 has no entry: <unk>, counted
    assert tokenizer.pronounce("今天好") == ["j", "in1", "t", "ian1", "h", "ao3"]
    assert tokenizer.encode("好冷") == [tokenizer.unit_to_id["h"], tokenizer.unit_to_id["ao3"], 1]
    assert tokenizer.missing == {"冷": 1}
    tk.save(tokenizer, tmp_path / "t.tknz")
    write_table(tmp_path / "text", {"u1": "今天好", "u2": "好冷", "u3": "今天"}.items())
    graph = build_for_tokenizer(tmp_path / "t.tknz", [tmp_path / "text"],
                                tmp_path / "den_lm.npz", order=2)
    assert graph.info["left_out_unk"] == 1 and graph.info["sentences"] == 2


def test_lexicon_line_without_phones(tmp_path):
    from cat.text.lexicon import LexiconError, read_lexicon

    (tmp_path / "lexicon.txt").write_text("今天 j in1 t ian1\n天气\n", encoding="utf-8")
    with pytest.raises(LexiconError, match=r"lexicon\.txt:2: word '天气' has no phones"):
        read_lexicon(tmp_path / "lexicon.txt")


def test_den_lm_of_another_tokenizer(tmp_path):
    from cat.graph.denominator import (
        DenGraphError,
        build_den_graph,
        load_den_graph,
        save_den_graph,
    )

    save_den_graph(build_den_graph([[2, 3], [3, 4]], 5, order=2,
                                   units=["<blk>", "<unk>", "a", "b", "c"]),
                   tmp_path / "den_lm.npz")
    with pytest.raises(DenGraphError, match="built for another tokenizer"):
        load_den_graph(tmp_path / "den_lm.npz", 5, ["<blk>", "<unk>", "x", "y", "z"])
    with pytest.raises(DenGraphError, match="built for 5 classes, the model has 7"):
        load_den_graph(tmp_path / "den_lm.npz", 7)


def test_den_lm_that_does_not_exist(tmp_path):
    from cat.graph.denominator import DenGraphError, load_den_graph

    with pytest.raises(DenGraphError, match=r"den_lm\.npz: denominator graph \(trainer\.den_lm"
                                            r"\) does not exist"):
        load_den_graph(tmp_path / "den_lm.npz", 5)
