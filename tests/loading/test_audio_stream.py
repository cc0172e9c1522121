"""Audio shards in the streaming pipeline: WeNet UIO shards and data.lists, features on the
fly, online speed perturbation, exact resume, and shards on an S3 object store."""

from __future__ import annotations

import errno
import json
import math
import tarfile
import time
import uuid

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from cat.audio.codec import MAX_BYTES_PER_SECOND, decode, encode, ogg_crc, to_float32, to_int16
from cat.audio.speed import choose_factor, speed_perturb
from cat.features.fbank import FbankOptions, compute_fbank, num_frames
from cat.formats.audio_pack import pack_audio
from cat.formats.shard_format import decode_key
from cat.formats.tables import FrameRange, read_labels
from cat.loading import stages
from cat.loading.batch import LengthFilter
from cat.loading.reader import DataUnavailableError
from cat.loading.samples import AudioConfig, StreamConfig
from cat.loading.shardlist import load_shard_list
from cat.loading.stages import HEADER_BYTES
from cat.loading.stream import ShardStream
from cat.testing.audio import make_segmented_data_dir
from cat.testing.epochs import epoch_progress, features_by_key, run_epoch
from cat.testing.seaweedfs import seaweedfs_s3
from cat.testing.training import write_tiny_experiment
from cat.testing.uio import (
    UioUtterance,
    make_uio_corpus,
    synth_wav,
    write_shard_list,
    write_uio_shard,
)
from cat.text import tokenizer as tk
from cat.training.checkpoint import load_checkpoint, save_checkpoint

# WeNet keys: path prefixes and dots (the member extension is what follows the LAST dot).
TEXTS = {"BAC009S0002W0122": "而对楼市成交抑制作用最大的", "A/B/utt.1": "今天天气很好",
         "spk-2/x.y.z": "我们一起去", "IC0001W0001": "北京", "IC0001W0002": "上海市",
         "sp/0.9/IC0001W0003": "天气很好", "Y0000000000_--5llN02F84_S00000": "最大的作用",
         "IC0001W0004": "一起", "IC0001W0005": "成交", "IC0001W0006": "楼市好",
         "IC0001W0007": "作用最大", "IC0001W0008": "今天"}
UTTS_PER_SHARD = 2
FEAT_DIM = 80


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_uio_corpus(tmp_path_factory.mktemp("uio"), TEXTS, UTTS_PER_SHARD)


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    text = folder / "text"
    text.write_text("".join(f"{k.replace('/', '_')} {v}\n" for k, v in TEXTS.items()),
                    encoding="utf-8")
    path = folder / "tokenizer.tknz"
    tk.save(tk.train_sentencepiece([text], "char", 0), path)
    return str(path)


def _audio_of(corpus, key: str) -> bytes:
    return (corpus.raw_list.parent / "wav" / f"{key}.wav").read_bytes()


def _expected_features(corpus, key: str, factor: float = 1.0) -> np.ndarray:
    waveform, _ = decode(_audio_of(corpus, key), key, 16000)
    if factor != 1.0:
        waveform = speed_perturb(waveform, 16000, factor)
    return compute_fbank(to_float32(to_int16(waveform)), 16000, AudioConfig().fbank)


DEFAULT_AUDIO = AudioConfig()


def _stream(patterns, tokenizer, workers=0, audio=DEFAULT_AUDIO, **options) -> ShardStream:
    shards = load_shard_list(patterns, UTTS_PER_SHARD)
    config = {"batch_size": 3, "max_frames": 0, "shuffle_buffer": 4, "sort_buffer": 3,
              "retry_seconds": 0.05, "audio": audio, **options}
    return ShardStream(shards, tokenizer, StreamConfig.with_defaults(**config), None, FEAT_DIM,
                       0, 1, workers)


def _run_epoch(stream, epoch, workers=0, **options):
    """`run_epoch` with each batch's features."""
    return run_epoch(stream, epoch, workers, features=True, **options)


def _keys(batches) -> list[str]:
    return [key for keys, _ in batches for key in keys]


@pytest.mark.parametrize("workers", [0, 2])
def test_uio_shards_train_every_key_once_with_fbank_of_its_audio(corpus, tokenizer, workers):
    stream = _stream([str(s) for s in corpus.shards], tokenizer, workers)
    batches, progress = _run_epoch(stream, 1, workers)
    found = features_by_key(batches)
    assert sorted(found) == sorted(TEXTS)
    for key, features in found.items():
        expected = _expected_features(corpus, key)
        assert features.shape == expected.shape == (len(expected), FEAT_DIM)
        np.testing.assert_allclose(features, expected, rtol=0, atol=1e-4)
    summary = progress.summary()
    assert summary["trained"] == len(TEXTS) and not summary["dropped"]


def test_data_list_in_shard_and_raw_mode_reads_the_same_utterances(corpus, tokenizer,
                                                                   tmp_path):
    from_shards = features_by_key(_run_epoch(_stream(str(corpus.shards[0].parent)
                                                      + "/shards_*.tar", tokenizer), 1)[0])
    for data_list in (corpus.shard_list, corpus.raw_list):
        batches, progress = _run_epoch(_stream(str(data_list), tokenizer), 1)
        found = features_by_key(batches)
        assert sorted(found) == sorted(from_shards)
        for key, features in found.items():
            np.testing.assert_array_equal(features, from_shards[key])
        assert progress.summary()["trained"] == len(TEXTS)
    # Relative shard paths are relative to the list; a relative raw `wav` likewise.
    relative = write_shard_list(corpus.shard_list.parent / "relative.list",
                                [s.relative_to(corpus.shard_list.parent) for s in corpus.shards])
    assert sorted(_keys(_run_epoch(_stream(str(relative), tokenizer), 1)[0])) == sorted(TEXTS)
    # A raw entry whose audio file is gone is dropped and counted, not silently lost.
    lines = corpus.raw_list.read_text(encoding="utf-8").splitlines()
    broken = tmp_path / "raw.list"
    broken.write_text("\n".join([*lines[:-1], lines[-1].replace(".wav", ".missing.wav")])
                      + "\n", encoding="utf-8")
    batches, progress = _run_epoch(_stream(str(broken), tokenizer), 1)
    assert len(_keys(batches)) == len(TEXTS) - 1
    assert sum(progress.summary()["dropped"].values()) == 1


def test_bad_data_lists_are_errors_naming_file_and_line(tmp_path, tokenizer):
    cases = {"mixed.list": ("/a/shard.tar\n{\"key\": \"k\", \"wav\": \"k.wav\", \"txt\": \"x\"}\n",
                            r"mixed.list:2: the list mixes shard paths and raw"),
             "nokey.list": ("{\"wav\": \"k.wav\", \"txt\": \"x\"}\n",
                            r"nokey.list:1: 'key' is missing"),
             "json.list": ("{\"key\": \n", r"json.list:1: not JSON"),
             "notxt.list": ("{\"key\": \"k\", \"wav\": \"k.wav\"}\n",
                            r"notxt.list:1: no 'txt' \(the transcript training needs\)"),
             "empty.list": ("\n\n", r"empty.list: an empty data.list")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=message):
            load_shard_list(str(tmp_path / name), 1)
    (tmp_path / "gbk.list").write_bytes("/数据/shard.tar\n".encode("gbk"))
    with pytest.raises(ValueError, match=r"gbk.list:1: not UTF-8"):
        load_shard_list(str(tmp_path / "gbk.list"), 1)


def test_speed_perturbation_is_drawn_per_utterance_and_epoch_and_reproducible(corpus,
                                                                             tokenizer):
    factors = (0.9, 1.0, 1.1)
    audio = AudioConfig(speed_perturb=factors)
    shards = [str(s) for s in corpus.shards]
    drawn = set()
    epochs = []
    for epoch in (1, 2):
        found = features_by_key(_run_epoch(_stream(shards, tokenizer, audio=audio, seed=7),
                                            epoch)[0])
        assert sorted(found) == sorted(TEXTS)
        for key, features in found.items():
            factor = choose_factor(factors, 7, epoch, key)
            drawn.add(factor)
            np.testing.assert_allclose(features, _expected_features(corpus, key, factor),
                                       rtol=0, atol=1e-4)
        again = features_by_key(_run_epoch(_stream(shards, tokenizer, workers=2, audio=audio,
                                                    seed=7), epoch, 2)[0])
        assert all(np.array_equal(again[k], found[k]) for k in found)
        epochs.append({k: len(v) for k, v in found.items()})
    assert drawn == set(factors)
    assert epochs[0] != epochs[1]  # other factors in another epoch


@pytest.mark.parametrize(("workers", "stops"), [(0, (1, 3)), (2, (2,))])
def test_resume_continues_exactly_with_the_same_perturbed_features(corpus, tokenizer, workers,
                                                                   stops, tmp_path):
    audio = AudioConfig(speed_perturb=(0.9, 1.0, 1.1))
    shards = [str(s) for s in corpus.shards]

    def stream():
        return _stream(shards, tokenizer, workers, audio=audio, batch_size=2, shuffle_buffer=5)

    full, _ = _run_epoch(stream(), 2, workers)
    for stop in stops:
        first, progress = _run_epoch(stream(), 2, workers, limit=stop)
        path = tmp_path / f"state-{stop}.pt"
        save_checkpoint(path, {"format": "cat-checkpoint", "version": 1,
                               "data": progress.state()})
        resumed_stream = stream()
        resumed = epoch_progress(resumed_stream, 2, workers)
        resumed.restore(load_checkpoint(path)["data"])
        rest, resumed = _run_epoch(resumed_stream, 2, workers, progress=resumed)
        assert resumed.summary()["retrained"] == 0
        if workers == 0:
            assert _keys(first + rest) == _keys(full)
            for (_, a), (_, b) in zip(first + rest, full, strict=True):
                assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
        whole = features_by_key(full)
        for key, features in features_by_key(first + rest).items():
            np.testing.assert_array_equal(features, whole[key])


def test_feature_and_audio_shards_need_the_matching_settings(corpus, tokenizer):
    with pytest.raises(ValueError, match=r"shards_000000000.tar: utterance "
                                         r"'BAC009S0002W0122' is wav audio, but "
                                         r"train.option.audio is not set"):
        _run_epoch(_stream([str(corpus.shards[0])], tokenizer, audio=None), 1)
    with pytest.raises(ValueError, match=r"train.option.audio makes 40-dim"):
        _stream([str(corpus.shards[0])], tokenizer,
                audio=AudioConfig(fbank=FbankOptions(num_mel_bins=40)))


# ------------------------------------------------------------------ hostile audio members


def _opus(key: str, seconds: float = 0.8) -> bytes:
    waveform, _ = decode(synth_wav(seconds, seed=len(key)), key)
    return encode(waveform, 16000, "opus")


def _claim_granule(data: bytes, granule: int) -> bytes:
    """Opus `data` whose last page (CRC made valid) claims `granule` samples at 48 kHz."""
    out = bytearray(data)
    last = data.rindex(b"OggS")
    out[last + 6:last + 14] = granule.to_bytes(8, "little", signed=True)
    out[last + 22:last + 26] = bytes(4)
    out[last + 22:last + 26] = ogg_crc(bytes(out[last:])).to_bytes(4, "little")
    return bytes(out)


def _drops(progress) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in progress.drop_lines)


def test_hostile_cut_and_failing_audio_members_are_counted_drops(tokenizer, tmp_path,
                                                                 monkeypatch):
    """An Opus member whose last page claims 2^60 samples (valid CRC), one cut after a
    whole page, and a member whose decoding fails with an error of another type: each a
    counted drop naming its shard and key; the other utterances train."""
    keys = sorted(TEXTS)[:6]
    audio = {key: _opus(key) for key in keys}
    hostile = audio[keys[1]] = _claim_granule(audio[keys[1]], 1 << 60)
    audio[keys[2]] = audio[keys[2]][:audio[keys[2]].rindex(b"OggS")]
    shards = [write_uio_shard(tmp_path / f"shards_{n:09d}.tar",
                              [UioUtterance(key, audio[key], TEXTS[key], "opus")
                               for key in keys[3 * n:3 * n + 3]]) for n in (0, 1)]
    failing = f"{keys[4]}.opus"

    def decode_or_fail(data, name, *args):
        if name.endswith(failing):
            raise MemoryError("no memory left")
        return decode(data, name, *args)

    monkeypatch.setattr(stages, "decode", decode_or_fail)
    batches, progress = _run_epoch(_stream([str(s) for s in shards], tokenizer), 1)
    assert sorted(_keys(batches)) == sorted([keys[0], keys[3], keys[5]])
    assert progress.summary()["dropped"] == {"bad_audio": 3}
    head = hostile.index(b"OpusHead")
    pre_skip = int.from_bytes(hostile[head + 10:head + 12], "little")
    drops = _drops(progress)
    assert drops[keys[1]] == (
        f"bad_audio corrupt audio {shards[0]}:{keys[1]}.opus: its header claims "
        f"{(1 << 60) - pre_skip} samples, more than {len(hostile)} bytes of OGG can hold (at "
        f"most {2880 * len(hostile)})")
    assert drops[keys[2]] == (f"bad_audio truncated audio {shards[0]}:{keys[2]}.opus: Ogg "
                              "stream 1 ends without its last page (cut short)")
    assert drops[keys[4]] == (f"bad_audio cannot decode audio shard {shards[1]}: utterance "
                              f"'{keys[4]}': MemoryError: no memory left")


def test_audio_longer_than_the_length_filter_is_dropped_undecoded_or_unread(tokenizer,
                                                                            tmp_path):
    """By the length its header claims, before decoding (the frame count exactly that of
    the decoded, speed-perturbed audio); by its size, before reading, when larger than
    any audio of its format the filter keeps."""
    keys = sorted(TEXTS)[:4]
    audio = {keys[0]: ("wav", synth_wav(0.9)), keys[1]: ("wav", synth_wav(2.0, seed=1)),
             keys[2]: ("opus", _opus(keys[2], 2.0)),
             keys[3]: ("wav", encode(np.zeros(150 * 16000, np.int16), 16000, "wav"))}
    shard = write_uio_shard(tmp_path / "shards_000000000.tar",
                            [UioUtterance(k, audio[k][1], TEXTS[k], audio[k][0]) for k in keys])
    length_filter = LengthFilter(FrameRange(10, 150), np.arange(3001), 1, False)
    perturb = AudioConfig(speed_perturb=(0.9, 1.1))
    stream = ShardStream(load_shard_list([str(shard)], 4), tokenizer,
                         StreamConfig.with_defaults(batch_size=3, max_frames=0, audio=perturb),
                         length_filter, FEAT_DIM)
    batches, progress = _run_epoch(stream, 1)
    assert _keys(batches) == [keys[0]]
    assert progress.summary()["dropped"] == {"out_of_range": 2, "too_long": 1}
    drops = _drops(progress)
    for key in keys[1:3]:
        factor = choose_factor(perturb.speed_perturb, 0, 1, key)
        decoded = speed_perturb(decode(audio[key][1], key, 16000)[0], 16000, factor)
        frames = num_frames(len(decoded), perturb.fbank)
        assert drops[key] == (f"out_of_range num_frames={frames} range=[10:150) (the length "
                              "its header claims; not decoded)")
    # The longest audio kept: 24239 samples give 149 frames, from 26663 at factor 1.1.
    longest = math.ceil(1.1 * (149 * 160 + 400 - 1 + 0.5)) - 1
    cap = HEADER_BYTES + math.ceil(longest / 16000 * MAX_BYTES_PER_SECOND["wav"])
    assert drops[keys[3]] == (f"too_long member {shard}:{keys[3]}.wav of "
                              f"{len(audio[keys[3]][1])} bytes, more than the {cap} a .wav "
                              "member within the length filter may take; not read")


# ------------------------------------------------------------------ an S3 object store


@pytest.fixture
def s3_corpus(corpus, tmp_path, monkeypatch):
    with seaweedfs_s3(tmp_path / "server") as server:
        server.create_bucket("speech")
        urls = server.upload_folder(corpus.shards[0].parent, "speech", "uio/train")
        for name, value in server.environment().items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        yield server, sorted(urls)


@pytest.mark.slow
def test_s3_shards_stream_like_local_ones_and_a_dead_store_stops_the_epoch(corpus, tokenizer,
                                                                          s3_corpus, tmp_path):
    server, urls = s3_corpus
    assert urls[0].startswith("s3://speech/uio/train/") and len(urls) == len(corpus.shards)
    local = _run_epoch(_stream([str(s) for s in corpus.shards], tokenizer), 3)[0]
    last = len(corpus.shards) - 1
    for patterns in (f"s3://speech/uio/train/shards_{{000000000..{last:09d}}}.tar",
                     "s3://speech/uio/train/shards_*.tar",
                     str(write_shard_list(tmp_path / "s3.list", urls))):
        stream = _stream(patterns, tokenizer)
        assert stream.shards.urls == urls
        batches = _run_epoch(stream, 3)[0]
        assert _keys(batches) == _keys(local)
        for (_, a), (_, b) in zip(batches, local, strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    # The store dies after the first batch: the epoch stops with an error naming the
    # store and the shards, within a bounded time, instead of hanging or training on.
    stream = _stream(urls, tokenizer, batch_size=1, shuffle_buffer=0, sort_buffer=1,
                     read_ahead_mb=0, read_retries=1, read_timeout=5)
    stopped = []

    def kill(batches):
        if batches == 1:
            server.stop()
            stopped.append(time.monotonic())

    with pytest.raises(DataUnavailableError) as raised:
        _run_epoch(stream, 3, on_batch=kill)
    seconds = time.monotonic() - stopped[0]
    message = str(raised.value)
    assert "storage: s3://speech at http://127.0.0.1:" in message
    assert "s3://speech/uio/train/shards_" in message and "unavailable" in message
    assert seconds < 60, f"took {seconds:.1f} s to give up"


# ------------------------------------------------------- stores fsspec reaches (memory://)


class _FailingMemory(MemoryFileSystem):
    """fsspec's memory store as `failmem://`, whose reads fail once `broken` is set (a
    store going down: every read is a reset connection)."""

    protocol = "failmem"
    broken = False

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.replace("failmem://", "memory://", 1))

    def _open(self, path, mode="rb", **kwargs):
        if type(self).broken:
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        file = super()._open(path, mode, **kwargs)
        real = file.read

        def read(*arguments):
            if type(self).broken:
                raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
            return real(*arguments)

        file.read = read
        return file


@pytest.fixture
def memory_corpus(corpus):
    fs = fsspec.filesystem("memory")
    folder = f"/speech-{uuid.uuid4().hex[:8]}/uio/train"
    for shard in corpus.shards:
        fs.pipe_file(f"{folder}/{shard.name}", shard.read_bytes())
    fsspec.register_implementation("failmem", _FailingMemory, clobber=True)
    yield folder
    _FailingMemory.broken = False
    fs.rm(folder.split("/uio")[0], recursive=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_memory_store_shards_train_like_local_ones(corpus, tokenizer, memory_corpus, workers,
                                                   tmp_path):
    local = _run_epoch(_stream([str(s) for s in corpus.shards], tokenizer), 3)[0]
    urls = [f"memory://{memory_corpus}/{s.name}" for s in corpus.shards]
    listing = write_shard_list(tmp_path / "memory.list", urls)
    for patterns in (f"memory://{memory_corpus}/shards_*.tar", str(listing)):
        stream = _stream(patterns, tokenizer, workers)
        assert [u.rpartition("/")[2] for u in stream.shards.urls] == \
            [s.name for s in corpus.shards]
        batches, progress = _run_epoch(stream, 3, workers)
        assert sorted(_keys(batches)) == sorted(TEXTS)
        if workers == 0:
            assert _keys(batches) == _keys(local)
        assert progress.summary()["trained"] == len(TEXTS)


def test_a_store_failing_mid_epoch_stops_it_with_data_unavailable(corpus, tokenizer,
                                                                  memory_corpus):
    stream = _stream(f"failmem://{memory_corpus}/shards_*.tar", tokenizer, batch_size=1,
                     shuffle_buffer=0, sort_buffer=1, read_ahead_mb=0, read_retries=1,
                     read_timeout=5)

    def fail(batches):
        if batches == 1:
            _FailingMemory.broken = True

    with pytest.raises(DataUnavailableError) as raised:
        _run_epoch(stream, 3, on_batch=fail)
    message = str(raised.value)
    assert "storage: failmem://speech-" in message and "unavailable after 2 attempts" in message
    assert "ConnectionResetError" in message and "failmem:///speech-" in message


# ------------------------------------------------------------ shards of our own packer


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Opus shards of segmented recordings (WenetSpeech's layout), with their index."""
    root = tmp_path_factory.mktemp("packed")
    data_dir = make_segmented_data_dir(root / "corpus", durations=(6.0, 4.5, 3.2))
    pack_audio(data_dir, root / "shards", "opus", utts_per_file=3)
    text = read_labels(data_dir / "text")
    tokenizer = root / "tokenizer.tknz"
    tk.save(tk.train_sentencepiece([data_dir / "text"], "char", 0), tokenizer)
    return root / "shards", text, str(tokenizer)


def test_packed_audio_shards_stream_with_exact_counts_and_their_decoded_audio(packed):
    folder, text, tokenizer = packed
    stream = _stream(f"{folder}/*.tar", tokenizer)
    assert not stream.shards.estimated.any() and stream.shards.contents == {
        "audio": str(folder / "index.jsonl")}
    assert stream.shards.num_utts.sum() == len(text)
    batches, progress = _run_epoch(stream, 1)
    found = features_by_key(batches)
    assert sorted(found) == sorted(text)
    members = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".opus"):
                    members[decode_key(member.name[:-len(".opus")])] = \
                        tar.extractfile(member).read()
    for key, features in found.items():
        waveform, _ = decode(members[key], key, 16000)
        expected = compute_fbank(to_float32(to_int16(waveform)), 16000, AudioConfig().fbank)
        np.testing.assert_allclose(features, expected, rtol=0, atol=1e-4)
    summary = progress.summary()
    assert summary["trained"] == summary["expected"] == len(text)
    assert summary["not_trained"] == 0
    # Stage 2's data.list (WeNet shard mode) names the same shards, with their index.
    listed = _stream(str(folder / "data.list"), tokenizer)
    assert listed.shards.urls == stream.shards.urls and not listed.shards.estimated.any()
    assert _keys(_run_epoch(listed, 1)[0]) == _keys(batches)


def test_audio_settings_must_match_what_the_index_says_the_shards_hold(packed, tmp_path):
    folder, _, tokenizer = packed
    with pytest.raises(ValueError, match=r"index.jsonl lists audio shards, but "
                                         r"train.option.audio .* is not set"):
        _stream(f"{folder}/*.tar", tokenizer, audio=None)
    experiment = write_tiny_experiment(tmp_path, num_train=10)
    with pytest.raises(ValueError, match=r"index.jsonl lists feature shards, but "
                                         r"train.option.audio is set"):
        _stream(str(experiment.root / "data/wds/train/data-*.tar"), tokenizer)
    with pytest.raises(ValueError, match=r"trset mixes feature and audio shards"):
        _stream([f"{folder}/*.tar", str(experiment.root / "data/wds/train/data-*.tar")],
                tokenizer)


def test_raw_list_pieces_are_cut_from_their_file(corpus, tokenizer, tmp_path):
    key = "A/B/utt.1"
    wav = corpus.raw_list.parent / "wav" / f"{key}.wav"
    listing = tmp_path / "pieces.list"
    listing.write_text("".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in [
        {"key": "first", "wav": str(wav), "txt": "今天", "start": 0.0, "end": 0.3},
        {"key": "rest", "wav": str(wav), "txt": "天气", "start": 0.3, "end": -1},
        {"key": "outside", "wav": str(wav), "txt": "很好", "start": 9.0, "end": 10.0}]),
        encoding="utf-8")
    found = features_by_key(_run_epoch(_stream(str(listing), tokenizer), 1)[0])
    waveform, _ = decode(wav.read_bytes(), key)
    for name, (begin, end) in {"first": (0, 4800), "rest": (4800, len(waveform))}.items():
        expected = compute_fbank(to_float32(to_int16(waveform[begin:end])), 16000,
                                 AudioConfig().fbank)
        np.testing.assert_allclose(found[name], expected, rtol=0, atol=1e-4)
    assert "outside" not in found


def test_shards_compressed_other_than_with_gzip_are_refused_by_name(tmp_path):
    corpus = make_uio_corpus(tmp_path, {"a": "今天", "b": "天气"})
    xz = corpus.shards[0].with_name("shards_000000000.tar.xz")
    xz.write_bytes(b"")
    with pytest.raises(ValueError, match=r"shards_000000000\.tar\.xz \(from .*\) is not "
                                         r"gzip-compressed but compressed otherwise"):
        load_shard_list(str(xz), 1)
