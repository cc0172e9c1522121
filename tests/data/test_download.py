"""Tests for cat.data.download and AISHELL-1's download_and_extract, against a local server."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from cat.core.io import read_table
from cat.data import aishell
from cat.data import download as download_module
from cat.data.aishell import AishellError, download_and_extract, prepare
from cat.data.download import ChecksumError, DownloadError, download, md5sum
from cat.testing.release import make_aishell_archives, serve_directory, write_tar_gz


def make_blob(directory: Path, size: int = 300_000) -> tuple[Path, str]:
    """A file of pseudo-random bytes (so resumed bytes at a wrong offset would show)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    path = directory / "blob.bin"
    path.write_bytes(data)
    return path, hashlib.md5(data).hexdigest()


def test_download_verifies_and_is_idempotent(tmp_path: Path) -> None:
    source, md5 = make_blob(tmp_path / "mirror")
    target = tmp_path / "dl" / "blob.bin"
    with serve_directory(tmp_path / "mirror") as server:
        assert download(f"{server.url}/blob.bin", target, md5.upper(), progress=False) == target
        assert target.read_bytes() == source.read_bytes()
        assert server.requests == [("/blob.bin", None)]
        download(f"{server.url}/blob.bin", target, md5, progress=False)
        download(f"{server.url}/blob.bin", target, progress=False)
        assert server.requests == [("/blob.bin", None)]
    assert sorted(p.name for p in target.parent.iterdir()) == ["blob.bin"]


def test_cli_downloads_into_a_directory(tmp_path: Path) -> None:
    source, md5 = make_blob(tmp_path / "mirror")
    (tmp_path / "dl").mkdir()
    with serve_directory(tmp_path / "mirror") as server:
        url = f"{server.url}/blob.bin"
        assert download_module.main([url, str(tmp_path / "dl"), "--md5", md5]) == 0
        assert download_module.main([url, str(tmp_path / "dl" / "b"), "--md5", "1" * 32]) == 1
    assert (tmp_path / "dl" / "blob.bin").read_bytes() == source.read_bytes()
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == ["blob.bin"]


def test_checksum_mismatch_leaves_no_file(tmp_path: Path) -> None:
    _, md5 = make_blob(tmp_path / "mirror")
    wrong = "0123456789abcdef0123456789abcdef"
    target = tmp_path / "dl" / "blob.bin"
    with serve_directory(tmp_path / "mirror") as server:
        url = f"{server.url}/blob.bin"
        with pytest.raises(ChecksumError) as caught:
            download(url, target, wrong, progress=False)
    assert str(caught.value) == (
        f"{target} (downloaded from {url}): md5 mismatch: expected {wrong}, got {md5}")
    assert list(target.parent.iterdir()) == []


def test_existing_file_with_wrong_sum_is_an_error(tmp_path: Path) -> None:
    target = tmp_path / "blob.bin"
    target.write_bytes(b"corrupt")
    with pytest.raises(ChecksumError) as caught:
        download("http://127.0.0.1:9/never-requested", target, "0" * 32, progress=False)
    assert str(caught.value) == (
        f"{target} (existing file; delete it to download again): md5 mismatch: expected "
        f"{'0' * 32}, got {hashlib.md5(b'corrupt').hexdigest()}")
    assert target.read_bytes() == b"corrupt"
    with pytest.raises(ValueError, match="not an md5 hex digest: 'xyz'"):
        download("http://127.0.0.1:9/x", tmp_path / "other", "xyz")


def test_interrupted_download_resumes_with_range(tmp_path: Path) -> None:
    source, md5 = make_blob(tmp_path / "mirror")
    target = tmp_path / "dl" / "blob.bin"
    with serve_directory(tmp_path / "mirror", drop_after=100_000) as server:
        download(f"{server.url}/blob.bin", target, md5, retry_wait=0, progress=False)
    assert server.requests == [("/blob.bin", None), ("/blob.bin", "bytes=100000-")]
    assert target.read_bytes() == source.read_bytes()
    assert not target.with_name("blob.bin.part").exists()


def test_server_ignoring_range_restarts(tmp_path: Path) -> None:
    source, md5 = make_blob(tmp_path / "mirror")
    target = tmp_path / "dl" / "blob.bin"
    with serve_directory(tmp_path / "mirror", ignore_range=True, drop_after=100_000) as server:
        download(f"{server.url}/blob.bin", target, md5, retry_wait=0, progress=False)
    assert server.requests == [("/blob.bin", None), ("/blob.bin", "bytes=100000-")]
    assert target.read_bytes() == source.read_bytes()


def test_complete_part_file_is_finished_without_body(tmp_path: Path) -> None:
    source, md5 = make_blob(tmp_path / "mirror", 1000)
    target = tmp_path / "dl" / "blob.bin"
    target.parent.mkdir()
    target.with_name("blob.bin.part").write_bytes(source.read_bytes())
    with serve_directory(tmp_path / "mirror") as server:
        download(f"{server.url}/blob.bin", target, md5, retry_wait=0, progress=False)
    assert server.requests == [("/blob.bin", "bytes=1000-")]
    assert md5sum(target) == md5


def test_missing_file_fails_without_retrying(tmp_path: Path) -> None:
    (tmp_path / "mirror").mkdir()
    with serve_directory(tmp_path / "mirror") as server:
        url = f"{server.url}/absent.tgz"
        with pytest.raises(DownloadError, match=f"^{url}: HTTP 404"):
            download(url, tmp_path / "absent.tgz", retry_wait=0, progress=False)
    assert server.requests == [("/absent.tgz", None)]


def test_connection_refused_is_retried_then_reported(tmp_path: Path) -> None:
    with serve_directory(tmp_path) as server:
        url = f"{server.url}/gone"
    # The server is shut down: every attempt is refused.
    with pytest.raises(DownloadError, match=f"^{url}: giving up after 2 retries"):
        download(url, tmp_path / "gone", retries=2, retry_wait=0, progress=False)


def test_aishell_download_and_extract(tmp_path: Path) -> None:
    md5s = make_aishell_archives(tmp_path / "mirror")
    dest = tmp_path / "corpus"
    with serve_directory(tmp_path / "mirror") as server:
        release = download_and_extract(dest, server.url, md5s, progress=False)
        assert sorted(server.requests) == [("/data_aishell.tgz", None),
                                           ("/resource_aishell.tgz", None)]
        assert release == dest / "data_aishell"
        wavs = sorted(str(p.relative_to(release)) for p in release.rglob("*.wav"))
        assert wavs == [
            "wav/dev/S0724/BAC009S0724W0121.wav", "wav/dev/S0724/BAC009S0724W0122.wav",
            "wav/test/S0764/BAC009S0764W0121.wav", "wav/test/S0764/BAC009S0764W0122.wav",
            "wav/train/S0002/BAC009S0002W0121.wav", "wav/train/S0002/BAC009S0002W0122.wav",
            "wav/train/S0002/BAC009S0002W0123.wav", "wav/train/S0003/BAC009S0003W0201.wav",
            "wav/train/S0003/BAC009S0003W0202.wav",
        ]
        assert list((release / "wav").glob("*.tar.gz")) == []
        assert sorted(p.name for p in (dest / "resource_aishell").iterdir()) == [
            ".done", ".extracted", "lexicon.txt", "speaker.info"]
        assert sorted(p.name for p in dest.iterdir()) == [
            "data_aishell", "data_aishell.tgz", "resource_aishell", "resource_aishell.tgz"]
        # A second run finds the markers and makes no request at all.
        assert aishell.main(["download", str(dest), "--base-url", server.url]) == 0
        assert len(server.requests) == 2
    prepare(dest, tmp_path / "data")
    assert list(read_table(tmp_path / "data" / "train" / "text")) == [
        "BAC009S0002W0121", "BAC009S0002W0122", "BAC009S0002W0123", "BAC009S0003W0201"]


def test_aishell_checksum_mismatch(tmp_path: Path) -> None:
    md5s = make_aishell_archives(tmp_path / "mirror")
    wrong = {**md5s, "resource_aishell.tgz": "f" * 32}
    with serve_directory(tmp_path / "mirror") as server, pytest.raises(ChecksumError) as caught:
        download_and_extract(tmp_path / "corpus", server.url, wrong, progress=False)
    assert f"expected {'f' * 32}, got {md5s['resource_aishell.tgz']}" in str(caught.value)
    assert not (tmp_path / "corpus" / "resource_aishell.tgz").exists()
    assert not (tmp_path / "corpus" / "resource_aishell").exists()
    assert (tmp_path / "corpus" / "data_aishell" / ".done").exists()


def test_unsafe_archive_member_is_rejected(tmp_path: Path) -> None:
    archive = write_tar_gz(tmp_path / "mirror" / "data_aishell.tgz",
                           {"data_aishell/ok.txt": b"fine", "../escaped.txt": b"evil"})
    with serve_directory(tmp_path / "mirror") as server, pytest.raises(AishellError) as caught:
        download_and_extract(tmp_path / "corpus", server.url,
                             {"data_aishell.tgz": md5sum(archive)}, progress=False)
    assert str(caught.value).startswith(f"{tmp_path}/corpus/data_aishell.tgz: unsafe archive "
                                        "member:")
    assert not (tmp_path / "escaped.txt").exists()
    assert not (tmp_path / "corpus" / "data_aishell" / ".extracted").exists()


def test_interrupted_extraction_resumes_without_downloading_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md5s = make_aishell_archives(tmp_path / "mirror")
    dest = tmp_path / "corpus"
    real_extract = aishell._extract
    extracted: list[str] = []

    def fail_on_third(archive: Path, target: Path) -> None:
        extracted.append(archive.name)
        if len(extracted) == 3:
            raise OSError("No space left on device")
        real_extract(archive, target)

    monkeypatch.setattr(aishell, "_extract", fail_on_third)
    with serve_directory(tmp_path / "mirror") as server:
        with pytest.raises(OSError, match="No space left"):
            download_and_extract(dest, server.url, md5s, progress=False)
        assert extracted == ["data_aishell.tgz", "S0002.tar.gz", "S0003.tar.gz"]
        assert sorted(p.name for p in (dest / "data_aishell" / "wav").glob("*.tar.gz")) == [
            "S0003.tar.gz", "S0724.tar.gz", "S0764.tar.gz"]
        monkeypatch.setattr(aishell, "_extract", real_extract)
        download_and_extract(dest, server.url, md5s, progress=False)
    assert server.requests == [("/data_aishell.tgz", None), ("/resource_aishell.tgz", None)]
    assert len(list((dest / "data_aishell" / "wav").rglob("*.wav"))) == 9
    assert list((dest / "data_aishell" / "wav").glob("*.tar.gz")) == []
    assert (dest / "data_aishell" / ".done").exists()
