"""Tests for cat.data.datadir: writing data directories and validating them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kaldiio
import pytest

from cat.core.io import read_table
from cat.data.datadir import (
    DataDirError,
    SkipReport,
    derive_spk2utt,
    find_problems,
    main,
    validate_data_dir,
    write_data_dir,
)
from cat.testing.audio import make_audio_file, write_kaldi_data_dir

REPO_ROOT = Path(__file__).resolve().parents[2]

UTT2SPK = {"S0001W0001": "S0001", "S0001W0002": "S0001", "S0002W0003": "S0002"}
TEXT = {"S0001W0001": "今天天气很好", "S0001W0002": "我们去公园", "S0002W0003": "明天下雨"}


def good_dir(tmp_path: Path, segments: bool = False) -> Path:
    """A consistent data dir (wav.scp per utterance, or per recording with segments)."""
    if segments:
        wav_scp = {"rec1": "/audio/rec1.wav", "rec2": "/audio/rec2.wav"}
        segs = {"S0001W0001": ("rec1", 0.0, 1.5), "S0001W0002": ("rec1", 1.5, 2.0),
                "S0002W0003": ("rec2", 0.25, 1.0)}
    else:
        wav_scp = {utt: f"/audio/{utt}.wav" for utt in UTT2SPK}
        segs = None
    return write_kaldi_data_dir(tmp_path / "data", wav_scp, TEXT, UTT2SPK, segs)


def problems_of(path: Path, **kwargs) -> list[str]:
    with pytest.raises(DataDirError) as caught:
        validate_data_dir(path, **kwargs)
    assert caught.value.total == len(caught.value.problems)
    return caught.value.problems


def test_accepts_good_dirs(tmp_path: Path) -> None:
    plain = good_dir(tmp_path / "plain")
    validate_data_dir(plain)
    assert find_problems(plain) == ([], 0)
    with_segments = good_dir(tmp_path / "segments", segments=True)
    validate_data_dir(with_segments)
    (with_segments / "feats.scp").write_text(
        "".join(f"{utt} feats.ark:{i * 10}\n" for i, utt in enumerate(sorted(UTT2SPK))))
    (with_segments / "utt2num_frames").write_text(
        "".join(f"{utt} {100 + i}\n" for i, utt in enumerate(sorted(UTT2SPK))))
    validate_data_dir(with_segments, require=("wav.scp", "text", "utt2spk", "spk2utt",
                                              "feats.scp"))


def test_unsorted_table_names_file_line_and_key(tmp_path: Path) -> None:
    data = good_dir(tmp_path)
    (data / "text").write_text("S0001W0002 我们\nS0001W0001 今天\nS0002W0003 明天\n")
    assert problems_of(data) == [
        f"{data}/text:2: not sorted in byte order: key 'S0001W0001' comes after 'S0001W0002' "
        "(line 1); sort with LC_ALL=C sort"
    ]


def test_duplicate_keys_adjacent_and_not(tmp_path: Path) -> None:
    data = good_dir(tmp_path)
    (data / "text").write_text(
        "S0001W0001 今天\nS0001W0001 今天\nS0001W0002 我们\nS0002W0003 明天\n")
    assert problems_of(data) == [f"{data}/text:2: duplicate key 'S0001W0001' (also on line 1)"]
    # In an unsorted table the duplicate is found when the keys are sorted for comparison.
    (data / "text").write_text(
        "S0001W0002 我们\nS0001W0001 今天\nS0002W0003 明天\nS0001W0001 今天\n")
    problems = problems_of(data)
    assert problems[0].startswith(f"{data}/text:2: not sorted in byte order")
    assert problems[1:] == [f"{data}/text:4: duplicate key 'S0001W0001' (also on line 2)"]


def test_missing_and_extra_utterances(tmp_path: Path) -> None:
    data = good_dir(tmp_path)
    (data / "text").write_text("S0001W0001 今天\nS0002W0003 明天\nS0009W0009 多余\n")
    (data / "wav.scp").write_text("S0001W0001 /a.wav\nS0001W0002 /b.wav\n")
    assert problems_of(data) == [
        f"{data}/utt2spk:2: utterance 'S0001W0002' is missing from text",
        f"{data}/utt2spk:3: utterance 'S0002W0003' is missing from wav.scp",
        f"{data}/text:3: utterance 'S0009W0009' is missing from utt2spk, wav.scp",
    ]


def test_inconsistent_spk2utt(tmp_path: Path) -> None:
    data = good_dir(tmp_path)
    (data / "spk2utt").write_text("S0001 S0001W0001\nS0003 S0002W0003\n")
    assert problems_of(data) == [
        f"{data}/spk2utt:2: speaker 'S0003' is not in utt2spk",
        f"{data}/spk2utt: speaker 'S0002' of utt2spk has no line",
        f"{data}/spk2utt:1: speaker 'S0001' disagrees with utt2spk: missing ['S0001W0002'], "
        "not mapped to this speaker in utt2spk []",
    ]
    (data / "spk2utt").write_text("S0001 S0001W0001 S0001W0002 S0002W0003\nS0002 S0002W0003\n")
    assert problems_of(data) == [
        f"{data}/spk2utt:1: speaker 'S0001' disagrees with utt2spk: missing [], "
        "not mapped to this speaker in utt2spk ['S0002W0003']",
    ]
    (data / "spk2utt").write_text("S0001 S0001W0001 S0001W0002 S0001W0001\nS0002 S0002W0003\n")
    assert problems_of(data) == [
        f"{data}/spk2utt:1: speaker 'S0001' lists utterances more than once: ['S0001W0001']",
    ]


def test_bad_segments(tmp_path: Path) -> None:
    data = good_dir(tmp_path, segments=True)
    (data / "segments").write_text(
        "S0001W0001 rec1 1.5 1.5\n"
        "S0001W0002 rec1 -0.5 2.0\n"
        "S0002W0003 rec3 0.0 1.0\n"
        "S0002W0004 rec2 zero 1.0\n"
        "S0002W0005 rec2 1.0\n"
    )
    assert problems_of(data) == [
        f"{data}/segments:1: segment 'S0001W0001': need 0 <= start < end, got start=1.5 end=1.5",
        f"{data}/segments:2: segment 'S0001W0002': need 0 <= start < end, got start=-0.5 end=2.0",
        f"{data}/segments:3: segment 'S0002W0003' refers to recording 'rec3', which is not in "
        "wav.scp",
        f"{data}/segments:4: segment 'S0002W0004': start/end are not numbers: 'rec2 zero 1.0'",
        f"{data}/segments:5: segment 'S0002W0005': expected '<recording> <start> <end>', "
        "got 'rec2 1.0'",
        f"{data}/segments:4: utterance 'S0002W0004' is missing from utt2spk, text",
        f"{data}/segments:5: utterance 'S0002W0005' is missing from utt2spk, text",
    ]


def test_feats_and_frames_must_cover_the_same_utterances(tmp_path: Path) -> None:
    data = good_dir(tmp_path)
    (data / "feats.scp").write_text("S0001W0001 f.ark:1\nS0001W0002 f.ark:2\n")
    (data / "utt2num_frames").write_text("S0001W0001 10\nS0001W0002 0\nS0002W0003 x\n")
    assert problems_of(data) == [
        f"{data}/utt2num_frames:2: utterance 'S0001W0002': frame count must be a positive "
        "integer, got '0'",
        f"{data}/utt2num_frames:3: utterance 'S0002W0003': frame count must be a positive "
        "integer, got 'x'",
        f"{data}/utt2spk:3: utterance 'S0002W0003' is missing from feats.scp",
    ]


def test_malformed_lines_and_missing_files(tmp_path: Path) -> None:
    data = good_dir(tmp_path)
    (data / "text").write_bytes("S0001W0001 今天\n\n S0001W0002 我们\nS0002W0003\n"
                                .encode() + b"S0002W0004 \xff\n")
    (data / "wav.scp").unlink()
    (data / "utt2spk").write_text("S0001W0001 S0001\nS0001W0002 S0001 extra\nS0002W0003 S0002\n")
    assert problems_of(data) == [
        f"{data}/wav.scp: required file is missing",
        f"{data}/utt2spk:2: utterance 'S0001W0002': speaker must be one token, "
        "got 'S0001 extra'",
        f"{data}/text:2: empty line",
        f"{data}/text:3: line starts with whitespace: ' S0001W0002 我们'",
        f"{data}/text:4: key 'S0002W0003' has no value",
        f"{data}/text:5: not valid UTF-8 (invalid start byte)",
        f"{data}/utt2spk:2: utterance 'S0001W0002' is missing from text",
        f"{data}/utt2spk:3: utterance 'S0002W0003' is missing from text",
    ]
    validate_data_dir(good_dir(tmp_path / "no_text"), require=("wav.scp", "utt2spk"))
    (tmp_path / "no_text" / "data" / "text").unlink()
    validate_data_dir(tmp_path / "no_text" / "data", require=("wav.scp", "utt2spk", "spk2utt"))
    assert problems_of(tmp_path / "absent") == [f"{tmp_path}/absent: not a directory"]


def test_reports_all_problems_up_to_a_cap(tmp_path: Path) -> None:
    utts = [f"S0001W{i:04d}" for i in range(40)]
    data = write_kaldi_data_dir(tmp_path / "data", {u: "/a.wav" for u in utts},
                                {u: "好" for u in utts[:5]}, {u: "S0001" for u in utts})
    with pytest.raises(DataDirError) as caught:
        validate_data_dir(data, max_problems=10)
    error = caught.value
    assert (len(error.problems), error.total) == (10, 35)
    assert error.problems[0] == f"{data}/utt2spk:6: utterance 'S0001W0005' is missing from text"
    assert str(error).splitlines()[0] == f"{data}: 35 problem(s) in data directory:"
    assert str(error).splitlines()[-1] == "  ... and 25 more"


def test_write_data_dir_sorts_derives_and_validates(tmp_path: Path) -> None:
    audio = {utt: make_audio_file(tmp_path / "audio" / f"{utt}.wav", 0.1, seed=i)
             for i, utt in enumerate(UTT2SPK)}
    data = write_data_dir(
        tmp_path / "data",
        wav_scp=[(utt, str(path)) for utt, path in reversed(audio.items())],
        text=reversed(TEXT.items()),
        utt2spk=reversed(UTT2SPK.items()),
        extra_files={"prep.log": "# kept: 3\n"},
    )
    assert read_table(data / "utt2spk") == UTT2SPK
    assert list(read_table(data / "text")) == sorted(TEXT)
    assert (data / "spk2utt").read_text() == "S0001 S0001W0001 S0001W0002\nS0002 S0002W0003\n"
    assert (data / "prep.log").read_text() == "# kept: 3\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audio", "data"]
    # A real third-party reader loads the audio through our wav.scp.
    for utt, (rate, samples) in kaldiio.load_scp(str(data / "wav.scp")).items():
        assert (utt in UTT2SPK, rate, len(samples)) == (True, 16000, 1600)


def test_write_data_dir_segments_and_replacement(tmp_path: Path) -> None:
    target = tmp_path / "data"
    target.mkdir()
    (target / "stale").write_text("old\n")
    write_data_dir(target, wav_scp=[("rec1", "/r1.wav")], text=TEXT.items(),
                   utt2spk=UTT2SPK.items(),
                   segments=[("S0002W0003", ("rec1", 2, 3)), ("S0001W0001", "rec1 0.0 1.0"),
                             ("S0001W0002", ("rec1", 1.0, 2.0))])
    assert (target / "segments").read_text() == (
        "S0001W0001 rec1 0.0 1.0\nS0001W0002 rec1 1.0 2.0\nS0002W0003 rec1 2 3\n")
    assert sorted(p.name for p in target.iterdir()) == [
        "segments", "spk2utt", "text", "utt2spk", "wav.scp"]


def test_write_data_dir_failure_leaves_previous_dir(tmp_path: Path) -> None:
    target = good_dir(tmp_path)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(DataDirError) as caught:
        write_data_dir(target, wav_scp=[("u1", "/a.wav"), ("u1", "/b.wav")],
                       text=[("u1", "好")], utt2spk=[("u1", "s1")])
    assert caught.value.problems == [f"{target}/wav.scp:2: duplicate key 'u1' (also on line 1)"]
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_derive_spk2utt_and_skip_report() -> None:
    assert derive_spk2utt([("a1", "a"), ("a2", "a"), ("b1", "b")]) == {
        "a": ["a1", "a2"], "b": ["b1"]}
    report = SkipReport("train", kept=2)
    report.skip("no_transcript", "u1", "/x/u1.wav")
    report.skip("empty_text", "u2")
    report.skip("no_transcript", "u3", "/x/u3.wav")
    assert report.counts() == {"no_transcript": 2, "empty_text": 1}
    assert report.summary() == "train: kept 2, skipped 3 (no_transcript=2, empty_text=1)"
    assert report.log_text() == (
        "# set: train\n# kept: 2\n# skipped no_transcript: 2\n# skipped empty_text: 1\n"
        "no_transcript u1 /x/u1.wav\nempty_text u2\nno_transcript u3 /x/u3.wav\n")
    assert SkipReport("dev").summary() == "dev: kept 0, skipped 0"


def test_cli_and_shell_wrapper(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = good_dir(tmp_path)
    assert main(["validate", str(data)]) == 0
    (data / "text").unlink()
    assert main(["validate", str(data)]) == 1
    assert f"{data}/text: required file is missing" in caplog.text
    assert main(["validate", "--no-text", str(data)]) == 0
    assert main(["validate", "--require-feats", "--no-text", str(data)]) == 1
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO_ROOT)}
    wrapper = str(REPO_ROOT / "utils" / "validate_data_dir.sh")
    ok = subprocess.run(["bash", wrapper, "--no-text", str(data)], env=env,
                        capture_output=True, text=True)
    assert (ok.returncode, "data directory is valid" in ok.stderr) == (0, True)
    bad = subprocess.run(["bash", wrapper, str(data)], env=env, capture_output=True, text=True)
    assert (bad.returncode, f"{data}/text: required file is missing" in bad.stderr) == (1, True)
