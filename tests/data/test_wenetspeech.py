"""Tests for cat.data.wenetspeech: streaming WenetSpeech.json into Kaldi data directories."""

from __future__ import annotations

import io
import json
from decimal import Decimal
from pathlib import Path

import pytest
import soundfile

from cat.core.io import read_table
from cat.data import wenetspeech
from cat.data.wenetspeech import WenetSpeechError, iter_audios, prepare, set_name
from cat.testing.release import (
    make_wenetspeech_release,
    tiny_wenetspeech_audios,
    wenetspeech_audio,
    write_wenetspeech_json,
)

YOUTUBE, PODCAST = "Y0000000000_--5llN02F84", "X0000000001_12345678"


def tables(data: Path) -> dict[str, str]:
    return {name: (data / name).read_text(encoding="utf-8")
            for name in ("wav.scp", "segments", "text", "utt2spk", "spk2utt")}


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny release, written once (Opus encoding is the slow part)."""
    return make_wenetspeech_release(tmp_path_factory.mktemp("wenetspeech"))


def test_prepare_m_and_eval_sets(release: Path, tmp_path: Path) -> None:
    reports = prepare(release, tmp_path / "data")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "dev", "prep.log", "test_meeting", "test_net", "train_m"]
    audio = f"{release}/audio"
    assert tables(tmp_path / "data" / "train_m") == {
        "wav.scp": f"{PODCAST} {audio}/train/podcast/B00000/{PODCAST}.opus\n"
                   f"{YOUTUBE} {audio}/train/youtube/B00000/{YOUTUBE}.opus\n",
        "segments": f"{PODCAST}_S00000 {PODCAST} 0.25 2.0\n"
                    f"{YOUTUBE}_S00000 {YOUTUBE} 0.0 1.0\n"
                    f"{YOUTUBE}_S00001 {YOUTUBE} 1.0 2.0\n",
        "text": f"{PODCAST}_S00000 播客节目\n{YOUTUBE}_S00000 今天天气很好\n"
                f"{YOUTUBE}_S00001 我们一起去\n",
        "utt2spk": f"{PODCAST}_S00000 {PODCAST}\n{YOUTUBE}_S00000 {YOUTUBE}\n"
                   f"{YOUTUBE}_S00001 {YOUTUBE}\n",
        "spk2utt": f"{PODCAST} {PODCAST}_S00000\n{YOUTUBE} {YOUTUBE}_S00000 {YOUTUBE}_S00001\n",
    }
    dev, net, meeting = "Y0000000002_dev", "Y0000000003_net", "X0000000004_meeting"
    assert tables(tmp_path / "data" / "dev") == {
        "wav.scp": f"{dev} {audio}/dev/youtube/B00000/{dev}.opus\n",
        "segments": f"{dev}_S00000 {dev} 0.0 1.5\n",
        "text": f"{dev}_S00000 开发集\n",
        "utt2spk": f"{dev}_S00000 {dev}\n",
        "spk2utt": f"{dev} {dev}_S00000\n",
    }
    assert read_table(tmp_path / "data" / "test_net" / "segments") == {
        f"{net}_S00000": f"{net} 0.5 2.0"}
    assert read_table(tmp_path / "data" / "test_meeting" / "text") == {
        f"{meeting}_S00000": "会议"}
    missing = f"{audio}/train/youtube/B00000/Y0000000005_missing.opus"
    assert {name: (r.kept, r.skipped) for name, r in reports.items()} == {
        "train_m": (3, [
            ("tagged_text", f"{YOUTUBE}_S00002", "<SIL>"),
            ("empty_text", f"{YOUTUBE}_S00003", ""),
            ("bad_time", f"{YOUTUBE}_S00004", "begin=3.0 end=3.0"),
            ("beyond_duration", f"{YOUTUBE}_S00005", "begin=3.5 end=4.5 duration=4.0"),
            ("tagged_text", f"{PODCAST}_S00001", "<MUSIC>音乐"),
            ("missing_audio", "Y0000000005_missing_S00000", missing),
        ]),
        "dev": (1, [("missing_audio", "Y0000000005_missing_S00001", missing)]),
        "test_net": (1, []),
        "test_meeting": (1, []),
    }
    assert (tmp_path / "data" / "train_m" / "prep.log").read_text(encoding="utf-8") == (
        "# set: train_m\n# kept: 3\n# skipped tagged_text: 2\n# skipped empty_text: 1\n"
        "# skipped bad_time: 1\n# skipped beyond_duration: 1\n# skipped missing_audio: 1\n"
        f"tagged_text {YOUTUBE}_S00002 <SIL>\nempty_text {YOUTUBE}_S00003\n"
        f"bad_time {YOUTUBE}_S00004 begin=3.0 end=3.0\n"
        f"beyond_duration {YOUTUBE}_S00005 begin=3.5 end=4.5 duration=4.0\n"
        f"tagged_text {PODCAST}_S00001 <MUSIC>音乐\n"
        f"missing_audio Y0000000005_missing_S00000 {missing}\n")
    assert (tmp_path / "data" / "prep.log").read_text(encoding="utf-8") == (
        f"# WenetSpeech preparation from {release}/WenetSpeech.json\n"
        "# audios: 6, segments: 15\n"
        "# train_m: kept 3, skipped 6 (tagged_text=2, empty_text=1, bad_time=1, "
        "beyond_duration=1, missing_audio=1)\n"
        "# dev: kept 1, skipped 1 (missing_audio=1)\n"
        "# test_net: kept 1, skipped 0\n# test_meeting: kept 1, skipped 0\n")


@pytest.mark.parametrize(("subset", "kept", "skip_counts"), [
    ("S", [f"{PODCAST}_S00000", f"{YOUTUBE}_S00000"], {"bad_time": 1, "missing_audio": 1}),
    ("L", [f"{PODCAST}_S00000", f"{YOUTUBE}_S00000", f"{YOUTUBE}_S00001", f"{YOUTUBE}_S00006"],
     {"tagged_text": 2, "empty_text": 1, "bad_time": 1, "beyond_duration": 1,
      "missing_audio": 1}),
    ("W", [f"{YOUTUBE}_S00007"], {}),
])
def test_training_subset_selection(release: Path, tmp_path: Path, subset: str, kept: list[str],
                                   skip_counts: dict[str, int]) -> None:
    reports = prepare(release, tmp_path / "data", train_subset=subset, eval_subsets=())
    name = set_name(subset)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["prep.log", name]
    assert list(read_table(tmp_path / "data" / name / "text")) == kept
    assert (reports[name].kept, reports[name].counts()) == (len(kept), skip_counts)


def test_segments_lie_within_the_real_audio(release: Path, tmp_path: Path) -> None:
    prepare(release, tmp_path / "data", train_subset="L")
    for name in ("train_l", "dev", "test_net", "test_meeting"):
        wav_scp = read_table(tmp_path / "data" / name / "wav.scp")
        for sid, value in read_table(tmp_path / "data" / name / "segments").items():
            aid, begin, end = value.split()
            info = soundfile.info(wav_scp[aid])
            assert (info.samplerate, info.format, info.subtype) == (16000, "OGG", "OPUS")
            assert 0 <= float(begin) < float(end) <= info.duration, sid


def test_max_overshoot_keeps_segments_ending_just_past_the_audio(release: Path,
                                                                 tmp_path: Path) -> None:
    reports = prepare(release, tmp_path / "data", eval_subsets=(), max_overshoot=0.5)
    assert "beyond_duration" not in reports["train_m"].counts()
    assert read_table(tmp_path / "data" / "train_m" / "segments")[f"{YOUTUBE}_S00005"] == (
        f"{YOUTUBE} 3.5 4.5")


def test_rerun_and_cli_give_the_same_result(release: Path, tmp_path: Path) -> None:
    prepare(release, tmp_path / "data", train_subset="L", eval_subsets=("DEV",))
    first = {p: p.read_bytes() for p in sorted((tmp_path / "data").rglob("*")) if p.is_file()}
    argv = ["prepare", str(release), str(tmp_path / "data"), "--train-subset", "L",
            "--eval-subsets", "DEV"]
    assert wenetspeech.main(argv) == 0
    assert {p: p.read_bytes() for p in sorted((tmp_path / "data").rglob("*"))
            if p.is_file()} == first
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["dev", "prep.log", "train_l"]


def test_unknown_subset_tag_names_the_segment(tmp_path: Path) -> None:
    audios = tiny_wenetspeech_audios()[:1]
    audios[0]["segments"][1]["subsets"] = ["M", "XL"]
    write_wenetspeech_json(tmp_path / "WenetSpeech.json", audios)
    with pytest.raises(WenetSpeechError) as caught:
        prepare(tmp_path, tmp_path / "data")
    assert str(caught.value) == (
        f"{tmp_path}/WenetSpeech.json: audios[0] (aid {YOUTUBE}) segments[1] "
        f"(sid {YOUTUBE}_S00001): unknown subset tag(s) ['XL']; known: "
        "['DEV', 'L', 'M', 'S', 'TEST_MEETING', 'TEST_NET', 'W']")
    assert not (tmp_path / "data").exists() or list((tmp_path / "data").iterdir()) == []


def test_malformed_entries_and_files(tmp_path: Path) -> None:
    audios = tiny_wenetspeech_audios()[:2]
    del audios[1]["path"]
    write_wenetspeech_json(tmp_path / "WenetSpeech.json", audios)
    with pytest.raises(WenetSpeechError, match=rf"audios\[1\] \(aid {PODCAST}\): missing key "
                                               "'path'"):
        prepare(tmp_path, tmp_path / "data")
    audios = tiny_wenetspeech_audios()[:1]
    audios[0]["segments"][0]["end_time"] = "1.0"
    write_wenetspeech_json(tmp_path / "WenetSpeech.json", audios)
    with pytest.raises(WenetSpeechError, match=rf"\(sid {YOUTUBE}_S00000\): key 'end_time' has "
                                               "the wrong type: '1.0'"):
        prepare(tmp_path, tmp_path / "data")
    (tmp_path / "WenetSpeech.json").write_text('{"audios": [{"aid": "a", ')
    with pytest.raises(WenetSpeechError, match=r"WenetSpeech\.json: invalid JSON"):
        prepare(tmp_path, tmp_path / "data")
    (tmp_path / "WenetSpeech.json").write_text('{"dataset": "WenetSpeech"}')
    with pytest.raises(WenetSpeechError, match=r"WenetSpeech\.json: no entries under 'audios'"):
        prepare(tmp_path, tmp_path / "data")
    with pytest.raises(WenetSpeechError, match="no such file"):
        prepare(tmp_path / "elsewhere", tmp_path / "data")
    with pytest.raises(WenetSpeechError, match="unknown training subset 'XL'"):
        prepare(tmp_path, tmp_path / "data", train_subset="XL")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "WenetSpeech.json") in (
        [], ["data"])


def test_a_set_without_usable_segments_is_an_error(release: Path, tmp_path: Path) -> None:
    audios = [a for a in tiny_wenetspeech_audios() if a["aid"] != "X0000000004_meeting"]
    json_path = write_wenetspeech_json(tmp_path / "other.json", audios)
    with pytest.raises(WenetSpeechError, match=r"no usable segments for \['test_meeting'\]"):
        prepare(release, tmp_path / "data", json_path=json_path)
    assert not (tmp_path / "data" / "train_m").exists()


class CountingReader(io.RawIOBase):
    """A binary stream that counts the bytes its consumer has read."""

    def __init__(self, raw: io.BufferedIOBase):
        self.raw = raw
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        count = self.raw.readinto(buffer)
        self.bytes_read += count
        return count


def test_parser_streams(tmp_path: Path) -> None:
    audios = (wenetspeech_audio(f"Y{i:010d}", f"audio/train/youtube/B00000/Y{i:010d}.opus", 10.0,
                                [(f"Y{i:010d}_S00000", 0.0, 1.0, "今天天气很好", ["S", "M", "L"])])
              for i in range(4000))
    path = write_wenetspeech_json(tmp_path / "WenetSpeech.json", audios)
    size = path.stat().st_size
    with open(path, "rb") as f:
        reader = CountingReader(f)
        entries = iter_audios(reader)
        first = next(entries)
        read_at_first = reader.bytes_read
        assert (first["aid"], first["duration"]) == ("Y0000000000", Decimal("10.0"))
        assert sum(1 for _ in entries) == 3999
    assert size > 1_000_000
    assert read_at_first <= 128 * 1024


def test_prepare_never_loads_the_whole_json(release: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the JSON must be streamed, not loaded whole")

    monkeypatch.setattr(json, "load", refuse)
    monkeypatch.setattr(json, "loads", refuse)
    reports = prepare(release, tmp_path / "data")
    assert reports["train_m"].kept == 3
