"""Tiny corpus releases laid out like the real AISHELL-1 and WenetSpeech ones, for tests.

Audio comes from `cat.testing.audio` (16 kHz WAV for AISHELL-1, Ogg Opus for
WenetSpeech). `serve_directory` serves a directory over HTTP on 127.0.0.1 with
Range support (and optional misbehaviour) to test downloads without a network.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import re
import tarfile
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cat.core.io import PathLike
from cat.data.download import md5sum
from cat.testing.audio import make_audio_file

# (set, speaker, utterance id) of each audio file of the default tiny AISHELL-1 release.
TINY_AISHELL_AUDIO: tuple[tuple[str, str, str], ...] = (
    ("train", "S0002", "BAC009S0002W0121"),
    ("train", "S0002", "BAC009S0002W0122"),
    ("train", "S0002", "BAC009S0002W0123"),
    ("train", "S0003", "BAC009S0003W0201"),
    ("train", "S0003", "BAC009S0003W0202"),  # no transcript line
    ("dev", "S0724", "BAC009S0724W0121"),
    ("dev", "S0724", "BAC009S0724W0122"),  # empty transcript
    ("test", "S0764", "BAC009S0764W0121"),
    ("test", "S0764", "BAC009S0764W0122"),  # no transcript line
)
# Transcript lines (word-segmented, as in the release) of the default tiny release.
TINY_AISHELL_TRANSCRIPT: tuple[str, ...] = (
    "BAC009S0002W0121 今天 天气 很 好",
    "BAC009S0002W0122 我们 一起 去 公园 散步",
    "BAC009S0002W0123 城市 交通 越来越 方便",
    "BAC009S0002W0124 这 一 句 没有 录音",  # no audio file
    "BAC009S0003W0201 银行 利率 保持 稳定",
    "BAC009S0724W0121 明天 可能 会 下雨",
    "BAC009S0724W0122",  # empty transcript
    "BAC009S0764W0121 大家 都 很 满意",
)


def write_tar_gz(path: PathLike, files: Mapping[str, bytes]) -> Path:
    """Write a gzip-compressed tar whose members are `name -> content` (names used verbatim)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(content))
    return path


# ----------------------------------------------------------------------------------------------
# AISHELL-1


def make_aishell_release(
    root: PathLike,
    audio: Iterable[tuple[str, str, str]] = TINY_AISHELL_AUDIO,
    transcript: Iterable[str] = TINY_AISHELL_TRANSCRIPT,
) -> Path:
    """Write `root/data_aishell/{wav/<set>/<speaker>/<utt>.wav, transcript/...}`.

    `audio` lists `(set, speaker, utterance)`; `transcript` the lines of
    `aishell_transcript_v0.8.txt`, written verbatim. Returns `root/data_aishell`.
    """
    base = Path(root) / "data_aishell"
    for index, (subset, speaker, utt) in enumerate(audio):
        make_audio_file(base / "wav" / subset / speaker / f"{utt}.wav", 0.1, seed=index)
    transcript_path = base / "transcript" / "aishell_transcript_v0.8.txt"
    transcript_path.parent.mkdir(parents=True, exist_ok=True)
    transcript_path.write_text("".join(f"{line}\n" for line in transcript), encoding="utf-8")
    return base


def make_aishell_archives(
    dest: PathLike,
    audio: Iterable[tuple[str, str, str]] = TINY_AISHELL_AUDIO,
    transcript: Iterable[str] = TINY_AISHELL_TRANSCRIPT,
) -> dict[str, str]:
    """Write `data_aishell.tgz` and `resource_aishell.tgz` into `dest` as OpenSLR ships them.

    `data_aishell.tgz` holds `data_aishell/transcript/...` and one
    `data_aishell/wav/<speaker>.tar.gz` per speaker, each holding `<set>/<speaker>/*.wav`.
    Returns the md5 of each archive by file name.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as staging:
        base = make_aishell_release(staging, audio, transcript)
        wav_dir = base / "wav"
        members: dict[str, bytes] = {}
        for speaker_dir in sorted(p for p in wav_dir.glob("*/*") if p.is_dir()):
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w:gz") as tar:
                tar.add(speaker_dir, arcname=str(speaker_dir.relative_to(wav_dir)))
            members[f"data_aishell/wav/{speaker_dir.name}.tar.gz"] = inner.getvalue()
        transcript_path = base / "transcript" / "aishell_transcript_v0.8.txt"
        members[f"data_aishell/{transcript_path.relative_to(base)}"] = transcript_path.read_bytes()
        write_tar_gz(dest / "data_aishell.tgz", members)
    write_tar_gz(dest / "resource_aishell.tgz", {
        "resource_aishell/lexicon.txt": "今天 j in1 t ian1\n".encode(),
        "resource_aishell/speaker.info": b"0002 F\n",
    })
    return {name: md5sum(dest / name) for name in ("data_aishell.tgz", "resource_aishell.tgz")}


# ----------------------------------------------------------------------------------------------
# WenetSpeech


def wenetspeech_audio(aid: str, path: str, duration: float,
                      segments: Sequence[tuple[str, float, float, str, Sequence[str]]],
                      source: str = "youtube") -> dict:
    """One `audios` entry of WenetSpeech.json; segments are `(sid, begin, end, text, subsets)`."""
    return {
        "aid": aid, "duration": duration, "format": "opus", "md5": "0" * 32, "path": path,
        "source": source, "tag": "",
        "segments": [
            {"sid": sid, "begin_time": begin, "end_time": end, "confidence": 1.0, "text": text,
             "subsets": list(subsets)}
            for sid, begin, end, text, subsets in segments
        ],
    }


def tiny_wenetspeech_audios() -> list[dict]:
    """The `audios` of the default tiny WenetSpeech release.

    Covers S within M within L, a weakly labelled W segment, DEV/TEST_NET/TEST_MEETING,
    a `<SIL>`-only text, a text with an embedded `<MUSIC>` tag, an empty text, a zero
    length segment, a segment ending past the audio, and an audio file that is missing
    on disk (`Y0000000005_missing`).
    """
    youtube, podcast = "Y0000000000_--5llN02F84", "X0000000001_12345678"
    return [
        wenetspeech_audio(youtube, f"audio/train/youtube/B00000/{youtube}.opus", 4.0, [
            (f"{youtube}_S00000", 0.0, 1.0, "今天天气很好", ["S", "M", "L"]),
            (f"{youtube}_S00001", 1.0, 2.0, "我们 一起 去", ["M", "L"]),
            (f"{youtube}_S00002", 2.0, 2.5, "<SIL>", ["M", "L"]),
            (f"{youtube}_S00003", 2.5, 3.0, "", ["M", "L"]),
            (f"{youtube}_S00004", 3.0, 3.0, "零长度", ["S", "M", "L"]),
            (f"{youtube}_S00005", 3.5, 4.5, "超出音频", ["M", "L"]),
            (f"{youtube}_S00006", 3.0, 3.5, "大家好", ["L"]),
            (f"{youtube}_S00007", 0.5, 1.5, "弱标签", ["W"]),
        ]),
        wenetspeech_audio(podcast, f"audio/train/podcast/B00000/{podcast}.opus", 3.0, [
            (f"{podcast}_S00000", 0.25, 2.0, "播客 节目", ["S", "M", "L"]),
            (f"{podcast}_S00001", 2.0, 3.0, "<MUSIC>音乐", ["M", "L"]),
        ], source="podcast"),
        wenetspeech_audio("Y0000000002_dev", "audio/dev/youtube/B00000/Y0000000002_dev.opus",
                          2.0, [("Y0000000002_dev_S00000", 0.0, 1.5, "开发 集", ["DEV"])]),
        wenetspeech_audio("Y0000000003_net", "audio/test_net/youtube/B00000/Y0000000003_net.opus",
                          2.0, [("Y0000000003_net_S00000", 0.5, 2.0, "网络 测试", ["TEST_NET"])]),
        wenetspeech_audio("X0000000004_meeting", "audio/test_meeting/X0000000004_meeting.opus",
                          2.0, [("X0000000004_meeting_S00000", 0.0, 1.0, "会议",
                                 ["TEST_MEETING"])], source="meeting"),
        wenetspeech_audio("Y0000000005_missing",
                          "audio/train/youtube/B00000/Y0000000005_missing.opus", 2.0, [
                              ("Y0000000005_missing_S00000", 0.0, 1.0, "文件 缺失",
                               ["S", "M", "L"]),
                              ("Y0000000005_missing_S00001", 1.0, 2.0, "也 缺失", ["DEV"]),
                          ]),
    ]


def write_wenetspeech_json(path: PathLike, audios: Iterable[dict]) -> Path:
    """Write WenetSpeech.json with the release's top-level keys and the given `audios`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"dataset": "WenetSpeech", "language": "Mandarin", "version": "1.0.0",
              "description": "tiny test release", "url": "https://wenet.org.cn/WenetSpeech"}
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, ensure_ascii=False)[:-1] + ', "audios": [\n')
        for index, audio in enumerate(audios):
            f.write((",\n" if index else "") + json.dumps(audio, ensure_ascii=False))
        f.write("\n]}\n")
    return path


def make_wenetspeech_release(root: PathLike, audios: Sequence[dict] | None = None,
                             missing: Iterable[str] = ("Y0000000005_missing",)) -> Path:
    """Write `root/WenetSpeech.json` and an Opus file per audio (except the `missing` aids).

    Defaults to `tiny_wenetspeech_audios()`. Returns `root`.
    """
    root = Path(root)
    audios = tiny_wenetspeech_audios() if audios is None else audios
    skipped = set(missing)
    for index, audio in enumerate(audios):
        if audio["aid"] not in skipped:
            make_audio_file(root / audio["path"], float(audio["duration"]), seed=index)
    write_wenetspeech_json(root / "WenetSpeech.json", audios)
    return root


# ----------------------------------------------------------------------------------------------
# A local HTTP mirror


@dataclass
class MirrorServer:
    """A running local mirror: `url` of its root and the `requests` it answered."""

    url: str
    requests: list[tuple[str, str | None]] = field(default_factory=list)


def _handler_class(directory: Path, server: MirrorServer, ignore_range: bool,
                   drop_after: int | None) -> type[http.server.BaseHTTPRequestHandler]:
    dropped: set[str] = set()
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            """Keep test output quiet."""

        def do_GET(self) -> None:
            range_header = self.headers.get("Range")
            with lock:
                server.requests.append((self.path, range_header))
            target = directory / self.path.lstrip("/")
            if not target.is_file():
                self.send_error(404)
                return
            data = target.read_bytes()
            start = 0
            match = re.fullmatch(r"bytes=(\d+)-", range_header or "")
            if match and not ignore_range:
                start = int(match.group(1))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            with lock:
                drop = drop_after is not None and self.path not in dropped
                dropped.add(self.path)
            if drop:
                # Simulate a connection lost mid-transfer on the first request for a file.
                self.wfile.write(body[:drop_after])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@contextlib.contextmanager
def serve_directory(directory: PathLike, ignore_range: bool = False,
                    drop_after: int | None = None) -> Iterator[MirrorServer]:
    """Serve `directory` over HTTP on 127.0.0.1 (a free port) while the block runs.

    Supports `Range: bytes=N-`. With `ignore_range` the server answers every request
    with the whole file (200). With `drop_after`, the first request for each file gets
    the full `Content-Length` header but only `drop_after` body bytes before the
    connection closes.
    """
    mirror = MirrorServer(url="")
    handler = _handler_class(Path(directory), mirror, ignore_range, drop_after)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    mirror.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    try:
        yield mirror
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
