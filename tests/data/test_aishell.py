"""Tests for cat.data.aishell: AISHELL-1 data preparation (download: test_download.py)."""

from __future__ import annotations

from pathlib import Path

import kaldiio
import pytest

from cat.core.io import read_table
from cat.data import aishell
from cat.data.aishell import AishellError, find_release, prepare, read_transcript
from cat.testing.release import TINY_AISHELL_AUDIO, TINY_AISHELL_TRANSCRIPT, make_aishell_release

EXPECTED_TEXT = {
    "train": {
        "BAC009S0002W0121": "今天天气很好",
        "BAC009S0002W0122": "我们一起去公园散步",
        "BAC009S0002W0123": "城市交通越来越方便",
        "BAC009S0003W0201": "银行利率保持稳定",
    },
    "dev": {"BAC009S0724W0121": "明天可能会下雨"},
    "test": {"BAC009S0764W0121": "大家都很满意"},
}


def expected_tables(release: Path, subset: str) -> dict[str, str]:
    utts = EXPECTED_TEXT[subset]
    speakers = {utt: utt[6:11] for utt in utts}
    spk2utt: dict[str, list[str]] = {}
    for utt in utts:
        spk2utt.setdefault(speakers[utt], []).append(utt)
    return {
        "wav.scp": "".join(f"{u} {release}/wav/{subset}/{u[6:11]}/{u}.wav\n" for u in utts),
        "text": "".join(f"{u} {t}\n" for u, t in utts.items()),
        "utt2spk": "".join(f"{u} {s}\n" for u, s in speakers.items()),
        "spk2utt": "".join(f"{s} {' '.join(us)}\n" for s, us in spk2utt.items()),
    }


def snapshot(directory: Path) -> dict[Path, bytes]:
    """Every file under `directory` (hidden ones included) with its bytes."""
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_prepare_tiny_release(tmp_path: Path) -> None:
    release = make_aishell_release(tmp_path / "corpus")
    reports = prepare(tmp_path / "corpus", tmp_path / "data")
    transcript = release / "transcript" / "aishell_transcript_v0.8.txt"
    for subset in ("train", "dev", "test"):
        data = tmp_path / "data" / subset
        assert sorted(p.name for p in data.iterdir()) == [
            "prep.log", "spk2utt", "text", "utt2spk", "wav.scp"]
        for name, content in expected_tables(release, subset).items():
            assert (data / name).read_text(encoding="utf-8") == content, (subset, name)
    assert {name: (r.kept, r.skipped) for name, r in reports.items()} == {
        "train": (4, [
            ("no_transcript", "BAC009S0003W0202",
             f"{release}/wav/train/S0003/BAC009S0003W0202.wav"),
            ("no_audio", "BAC009S0002W0124", f"{transcript}:4"),
        ]),
        "dev": (1, [("empty_transcript", "BAC009S0724W0122", f"{transcript}:7")]),
        "test": (1, [("no_transcript", "BAC009S0764W0122",
                      f"{release}/wav/test/S0764/BAC009S0764W0122.wav")]),
        "unassigned": (0, []),
    }
    assert (tmp_path / "data" / "dev" / "prep.log").read_text(encoding="utf-8") == (
        "# set: dev\n# kept: 1\n# skipped empty_transcript: 1\n"
        f"empty_transcript BAC009S0724W0122 {transcript}:7\n")
    assert (tmp_path / "data" / "prep.log").read_text(encoding="utf-8") == (
        f"# AISHELL-1 preparation from {release}\n"
        "# blank transcript lines ignored: 0\n"
        "# train: kept 4, skipped 2 (no_transcript=1, no_audio=1)\n"
        "# dev: kept 1, skipped 1 (empty_transcript=1)\n"
        "# test: kept 1, skipped 1 (no_transcript=1)\n"
        "# transcript lines without audio whose speaker has no audio: 0\n")
    # kaldiio reads every utterance's audio through the absolute paths of wav.scp.
    rate, samples = kaldiio.load_scp(str(tmp_path / "data" / "train" / "wav.scp"))[
        "BAC009S0002W0121"]
    assert (rate, samples.shape) == (16000, (1600,))


def test_root_variants_give_the_same_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    release = make_aishell_release(tmp_path / "corpus")
    prepare(tmp_path / "corpus", tmp_path / "a")
    prepare(release, tmp_path / "b")
    monkeypatch.chdir(tmp_path)
    prepare("corpus", "c")
    for subset in ("train", "dev", "test"):
        for name in ("wav.scp", "text", "utt2spk", "spk2utt", "prep.log"):
            content = (tmp_path / "a" / subset / name).read_bytes()
            assert (tmp_path / "b" / subset / name).read_bytes() == content
            assert (tmp_path / "c" / subset / name).read_bytes() == content
    assert find_release("corpus") == release
    with pytest.raises(AishellError, match="no AISHELL-1 release here"):
        find_release(tmp_path / "a")


def test_rerun_gives_the_same_result(tmp_path: Path) -> None:
    make_aishell_release(tmp_path / "corpus")
    prepare(tmp_path / "corpus", tmp_path / "data")
    first = snapshot(tmp_path / "data")
    assert len(first) == 16
    assert aishell.main(["prepare", str(tmp_path / "corpus"), str(tmp_path / "data")]) == 0
    assert snapshot(tmp_path / "data") == first


def test_transcript_without_known_speaker_and_blank_lines(tmp_path: Path) -> None:
    release = make_aishell_release(
        tmp_path / "corpus", TINY_AISHELL_AUDIO,
        (*TINY_AISHELL_TRANSCRIPT, "", "BAC009S0999W0001 无人 认领", "  "))
    reports = prepare(tmp_path / "corpus", tmp_path / "data")
    transcript = release / "transcript" / "aishell_transcript_v0.8.txt"
    assert reports["unassigned"].skipped == [("no_audio", "BAC009S0999W0001", f"{transcript}:10")]
    summary = (tmp_path / "data" / "prep.log").read_text(encoding="utf-8").splitlines()
    assert summary[1] == "# blank transcript lines ignored: 2"
    assert summary[-2:] == ["# transcript lines without audio whose speaker has no audio: 1",
                            f"no_audio BAC009S0999W0001 {transcript}:10"]


def test_read_transcript_removes_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("\ufeffBAC009S0002W0121 今天  天气\t很 好 \nBAC009S0002W0122\t明天\u3000见\r\n",
                    encoding="utf-8")
    transcripts, blank = read_transcript(path)
    assert {u: (t.text, t.line) for u, t in transcripts.items()} == {
        "BAC009S0002W0121": ("今天天气很好", 1), "BAC009S0002W0122": ("明天见", 2)}
    assert blank == 0


@pytest.mark.parametrize(("lines", "message"), [
    (["BAC009S0002W0121 好", " BAC009S0002W0122 好"], ":2: line starts with whitespace"),
    (["BAC009S0002W0121 好", "BAC009S0002W0121 好"],
     ":2: duplicate utterance 'BAC009S0002W0121' (first on line 1)"),
    (["BAC009S0002W0121好的"], ":1: expected '<utterance-id> <words>'"),
])
def test_malformed_transcript_names_file_and_line(tmp_path: Path, lines: list[str],
                                                  message: str) -> None:
    release = make_aishell_release(tmp_path / "corpus", TINY_AISHELL_AUDIO, lines)
    with pytest.raises(AishellError) as caught:
        prepare(tmp_path / "corpus", tmp_path / "data")
    assert f"{release}/transcript/aishell_transcript_v0.8.txt{message}" in str(caught.value)
    assert not (tmp_path / "data").exists()


def test_invalid_utf8_transcript(tmp_path: Path) -> None:
    release = make_aishell_release(tmp_path / "corpus")
    transcript = release / "transcript" / "aishell_transcript_v0.8.txt"
    transcript.write_bytes(transcript.read_bytes() + b"BAC009S0002W0125 \xe4\xbd\n")
    with pytest.raises(AishellError, match=r"aishell_transcript_v0\.8\.txt:9: not valid UTF-8"):
        read_transcript(transcript)


def test_layout_errors(tmp_path: Path) -> None:
    release = make_aishell_release(tmp_path / "corpus", [("train", "S0002", "BAC009S0002W0121"),
                                                         ("dev", "S0724", "BAC009S0724W0121")])
    (release / "wav" / "S0764.tar.gz").write_bytes(b"")
    with pytest.raises(AishellError) as caught:
        prepare(release, tmp_path / "data")
    assert str(caught.value) == (f"{release}/wav/test: missing set directory; extract the "
                                 "per-speaker archives wav/*.tar.gz first")
    make_aishell_release(tmp_path / "corpus", [("test", "S0002", "BAC009S0002W0121")])
    with pytest.raises(AishellError, match="utterance 'BAC009S0002W0121' also in"):
        prepare(release, tmp_path / "data")


def test_a_set_without_usable_utterances_is_an_error(tmp_path: Path) -> None:
    make_aishell_release(tmp_path / "corpus", TINY_AISHELL_AUDIO,
                         [line for line in TINY_AISHELL_TRANSCRIPT if "S0764" not in line])
    with pytest.raises(AishellError, match=r"no usable utterances in \['test'\]"):
        prepare(tmp_path / "corpus", tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_non_wav_entries_are_counted(tmp_path: Path) -> None:
    release = make_aishell_release(tmp_path / "corpus")
    (release / "wav" / "dev" / "S0724" / "notes.txt").write_text("x")
    (release / "wav" / "dev" / "README").write_text("x")
    reports = prepare(release, tmp_path / "data")
    assert sorted(reports["dev"].skipped)[-2:] == [
        ("ignored_file", f"{release}/wav/dev/README", ""),
        ("ignored_file", f"{release}/wav/dev/S0724/notes.txt", ""),
    ]
    assert read_table(tmp_path / "data" / "dev" / "text") == EXPECTED_TEXT["dev"]
