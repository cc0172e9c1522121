"""Tar shards: plain-webdataset round trip, length groups, index, validation, resumption."""

from __future__ import annotations

import io
import json
import os
import runpy
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import webdataset as wds

import cat
from cat.core.io import write_table
from cat.formats import prep_wds, shard_check, shard_format, tables
from cat.testing.features import utterance_ids, write_feature_corpus

REPO_ROOT = Path(cat.__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Dotted speed-perturbation ids, three arks, frames 5..60."""
    directory = tmp_path_factory.mktemp("corpus")
    return write_feature_corpus(directory, keys=utterance_ids(10, speed_perturb=True),
                                num_arks=3, dim=6, frame_range=(5, 60), spaces=True)


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (relative path -> bytes), hidden ones included."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _read_webdataset(urls: list[Path]) -> dict[str, dict]:
    samples = {}
    for sample in wds.WebDataset([str(u) for u in urls], shardshuffle=False).decode():
        key = shard_format.decode_key(sample["__key__"])
        assert key not in samples
        samples[key] = sample
    return samples


def test_keys_are_escaped_reversibly():
    for key in ("sp0.9-BAC009S0002W0122", "a%2Eb", "x/y.z", "%", "..", "plain-id_1"):
        encoded = shard_format.encode_key(key)
        assert "." not in encoded and "/" not in encoded
        assert shard_format.decode_key(encoded) == key
    assert shard_format.encode_key("sp0.9-utt") == "sp0%2E9-utt"
    with pytest.raises(ValueError, match="stray"):
        shard_format.decode_key("a%41")


def test_plain_webdataset_reads_back_identical_features_and_text(corpus, tmp_path):
    out = tmp_path / "wds"
    summary = prep_wds.pack_data(str(corpus.feats_scp), str(corpus.text), out, utts_per_file=7)
    assert summary.num_utts == {".": len(corpus.keys)}
    assert summary.num_shards == {".": 5}
    samples = _read_webdataset(sorted(out.glob("data-*.tar")))
    source = kaldiio.load_scp(str(corpus.feats_scp))
    assert sorted(samples) == corpus.keys
    assert any("." in key for key in samples)
    for key, sample in samples.items():
        assert sample["npy"].dtype == np.float32
        assert np.array_equal(sample["npy"], source[key])
        assert sample["txt"] == corpus.transcripts[key]
    assert shard_check.validate(out) == []


def test_length_groups_accounting_index_and_shuffling(corpus, tmp_path):
    texts = dict(corpus.transcripts)
    del texts[corpus.keys[0]]
    texts[corpus.keys[1]] = ""
    texts["orphan"] = "的一"
    write_table(tmp_path / "text", texts.items())
    out = tmp_path / "wds"
    groups = ["15:30", ":15", "40:"]
    summary = prep_wds.pack_data([corpus.feats_scp], [tmp_path / "text"], out,
                                 filter_group=groups, utts_per_file=4, seed=3)

    frames = {k: len(v) for k, v in corpus.features.items()}
    usable = [k for k in corpus.keys if k not in corpus.keys[:2]]
    expected = {"0_15": [k for k in usable if frames[k] < 15],
                "15_30": [k for k in usable if 15 <= frames[k] < 30],
                "40_": [k for k in usable if frames[k] >= 40]}
    gap = [k for k in usable if 30 <= frames[k] < 40]
    assert all(expected.values()) and gap
    assert sorted(p.name for p in out.iterdir()) == ["0_15", "15_30", "40_", "dropped.txt"]
    assert summary.num_utts == {name: len(keys) for name, keys in expected.items()}
    assert summary.dropped == {"no_label": 1, "empty_label": 1, "no_features": 1,
                               "out_of_range": len(gap)}
    assert summary.num_input == len(corpus.keys) + 1 == \
        sum(summary.num_utts.values()) + sum(summary.dropped.values())
    log = dict(line.split(" ", 1) for line in
               (out / "dropped.txt").read_text(encoding="utf-8").splitlines())
    assert log[corpus.keys[0]] == "no_label" and log[corpus.keys[1]] == "empty_label"
    assert log["orphan"] == "no_features"
    assert {k for k, v in log.items() if v.startswith("out_of_range")} == set(gap)

    for name, keys in expected.items():
        index = shard_format.read_index(out / name)
        assert index.header["frame_range"] == str(tables.FrameRange.parse(
            next(g for g in groups if tables.FrameRange.parse(g).name == name)))
        assert index.num_utts == len(keys)
        assert index.num_frames == sum(frames[k] for k in keys)
        sizes = [r["num_utts"] for r in index.shards]
        assert max(sizes) <= 4 and max(sizes) - min(sizes) <= 1
        indexed = [k for r in index.shards for k in r["keys"]]
        assert sorted(indexed) == keys
        for record, path in zip(index.shards, index.paths(), strict=True):
            assert record["frames"] == [frames[k] for k in record["keys"]]
            assert record["num_bytes"] == path.stat().st_size
            assert record["crc32"] == f"{zlib.crc32(path.read_bytes()):08x}"
            with tarfile.open(path) as tar:
                names = tar.getnames()
            assert names == [f"{shard_format.encode_key(k)}.{ext}" for k in record["keys"]
                             for ext in ("npy", "txt")]
        samples = _read_webdataset(index.paths())
        assert sorted(samples) == keys
        assert [int(samples[k]["npy"].shape[0]) for k in indexed] == \
            [f for r in index.shards for f in r["frames"]]
    # Shuffled before sharding (seeded), so shards do not follow id order.
    shuffled = [k for r in shard_format.read_index(out / "0_15").shards for k in r["keys"]]
    assert shuffled != sorted(shuffled)
    other = tmp_path / "other-seed"
    prep_wds.pack_data([corpus.feats_scp], [tmp_path / "text"], other, filter_group=groups,
                       utts_per_file=4, seed=4)
    other_keys = [k for r in shard_format.read_index(other / "0_15").shards for k in r["keys"]]
    assert other_keys != shuffled


def test_overlapping_groups_and_bad_options_are_rejected(corpus, tmp_path):
    out = tmp_path / "wds"
    with pytest.raises(ValueError, match="overlap"):
        prep_wds.pack_data(corpus.feats_scp, corpus.text, out, filter_group=["10:100", "50:"])
    with pytest.raises(ValueError, match="invalid shard name format"):
        prep_wds.pack_data(corpus.feats_scp, corpus.text, out, fmt="data.tar")
    with pytest.raises(ValueError, match="dtype"):
        prep_wds.pack_data(corpus.feats_scp, corpus.text, out, dtype="int8")
    assert not out.exists()
    with pytest.raises(ValueError, match="no utterances left"):
        prep_wds.pack_data(corpus.feats_scp, corpus.text, out, filter_group=["100000:"])
    assert len((out / "dropped.txt").read_text(encoding="utf-8").splitlines()) == \
        len(corpus.keys)
    assert not (out / "100000_" / "index.jsonl").exists()


def test_validate_finds_damage_and_index_mismatch(corpus, tmp_path):
    out = tmp_path / "wds"
    prep_wds.pack_data(corpus.feats_scp, corpus.text, out, utts_per_file=10)
    assert shard_check.validate(out) == []
    shard0, shard1 = out / "data-00000.tar", out / "data-00001.tar"
    original0, original1 = shard0.read_bytes(), shard1.read_bytes()

    with tarfile.open(shard0) as tar:
        third = tar.getmembers()[2]
    shard0.write_bytes(original0[: third.offset_data + 100])  # cut inside a member
    problems = shard_check.validate(out)
    assert f"{shard0}: unreadable tar after 2 members: unexpected end of data" in problems
    assert any("data-00000.tar" in p and "bytes, index says" in p for p in problems)
    shard0.write_bytes(original0[: third.offset])  # cut between members
    assert f"{shard0}: ends after 2 of 20 members (10 utterances; truncated?)" in \
        shard_check.validate(out)
    shard0.write_bytes(original0)

    with tarfile.open(shard1) as tar:
        first = tar.getmembers()[0]
    flipped = bytearray(original1)
    flipped[first.offset_data + 130] ^= 0xFF  # a feature value, past the 128-byte npy header
    shard1.write_bytes(bytes(flipped))
    assert [p for p in shard_check.validate(out) if "data-00001.tar" in p] == \
        [f"{shard1}: crc32 differs from the index"]
    shard1.write_bytes(original1)

    index_path = out / shard_format.INDEX_NAME
    lines = index_path.read_text(encoding="utf-8").splitlines()
    record = json.loads(lines[1])
    record["keys"][0], record["keys"][1] = record["keys"][1], record["keys"][0]
    index_path.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n",
                          encoding="utf-8")
    problems = shard_check.validate(out)
    assert any("member 0 is" in p for p in problems)

    record = json.loads(lines[1])
    header = json.loads(lines[0])
    record["frames"][0] += 1
    record["num_frames"] += 1
    header["num_frames"] += 1
    index_path.write_text("\n".join([json.dumps(header), json.dumps(record), *lines[2:]]) + "\n",
                          encoding="utf-8")
    problems = shard_check.validate(out)
    assert len(problems) == 1 and "shape" in problems[0] and "index says" in problems[0]

    index_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "data-00099.tar").write_bytes(b"")
    (out / ".data-00003.tar.tmp.123").write_bytes(b"")
    assert sorted(shard_check.validate(out)) == [
        f"{out / '.data-00003.tar.tmp.123'}: leftover temporary file",
        f"{out / 'data-00099.tar'}: shard not listed in index.jsonl"]
    with pytest.raises(SystemExit) as exit_info:
        prep_wds.main(["validate", str(out)])
    assert exit_info.value.code == 1


_KILL_SCRIPT = """
import os, signal, sys
import kaldiio
from cat.formats import prep_wds

calls = 0
original = kaldiio.load_mat

def dying_load_mat(*args, **kwargs):
    global calls
    calls += 1
    if calls == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)

kaldiio.load_mat = dying_load_mat
prep_wds.pack_data(sys.argv[1], sys.argv[2], sys.argv[4], utts_per_file=4)
"""


def test_killed_pack_resumes_to_identical_shards(corpus, tmp_path):
    reference = tmp_path / "reference"
    prep_wds.pack_data(corpus.feats_scp, corpus.text, reference, utts_per_file=4)
    out = tmp_path / "wds"
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # Dies while writing the 3rd shard (its 3rd utterance).
    result = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(corpus.feats_scp),
                             str(corpus.text), "11", str(out)], env=env, capture_output=True)
    assert result.returncode == -9, result.stderr.decode()
    left = sorted(p.name for p in out.iterdir())
    assert "data-00000.tar" in left and "data-00001.tar" in left
    assert "data-00002.tar" not in left and "index.jsonl" not in left
    assert any(name.startswith(".data-00002.tar.tmp.") for name in left)

    summary = prep_wds.pack_data(corpus.feats_scp, corpus.text, out, utts_per_file=4)
    assert summary.shards_kept == 2
    assert summary.shards_written == summary.num_shards["."] - 2
    assert _files(out) == _files(reference)
    assert shard_check.validate(out) == []


def test_rerun_keeps_finished_shards_and_refuses_foreign_ones(corpus, tmp_path):
    out = tmp_path / "wds"
    prep_wds.pack_data(corpus.feats_scp, corpus.text, out, utts_per_file=4)
    before = _files(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    summary = prep_wds.pack_data(corpus.feats_scp, corpus.text, out, utts_per_file=4)
    assert summary.shards_written == 0 and summary.shards_kept == len(mtimes)
    assert _files(out) == before
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.tar")} == mtimes
    # Different settings: same names are rewritten, but leftovers would be read as data.
    with pytest.raises(FileExistsError, match=r"data-00002\.tar, data-00003\.tar"):
        prep_wds.pack_data(corpus.feats_scp, corpus.text, out, utts_per_file=20)


@pytest.mark.slow
def test_two_processes_write_the_same_bytes_as_one(corpus, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    prep_wds.pack_data(corpus.feats_scp, corpus.text, one, filter_group=["5:30", "30:"],
                       utts_per_file=3, num_jobs=1)
    prep_wds.pack_data(corpus.feats_scp, corpus.text, two, filter_group=["5:30", "30:"],
                       utts_per_file=3, num_jobs=2)
    assert _files(one) == _files(two)
    assert shard_check.validate(two / "30_", num_jobs=2) == []


def test_float16_halves_feature_bytes(corpus, tmp_path):
    out = tmp_path / "wds"
    prep_wds.pack_data(corpus.feats_scp, corpus.text, out, dtype="float16", utts_per_file=100)
    samples = _read_webdataset([out / "data-00000.tar"])
    for key, sample in samples.items():
        assert sample["npy"].dtype == np.float16
        assert np.array_equal(sample["npy"], corpus.features[key].astype(np.float16))
    index = shard_format.read_index(out)
    assert index.header["dtype"] == "float16"
    assert shard_check.validate(out) == []
    full = tmp_path / "full"
    prep_wds.pack_data(corpus.feats_scp, corpus.text, full, utts_per_file=100)
    feature_bytes = sum(f.nbytes for f in corpus.features.values())
    saved = (full / "data-00000.tar").stat().st_size - (out / "data-00000.tar").stat().st_size
    assert abs(saved - feature_bytes / 2) < 10240  # up to one tar record of padding


def test_recipes_pack_the_groups_their_experiment_names(corpus, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    exp = tmp_path / "exp/shards"
    exp.mkdir(parents=True)
    hyper = {"data": {"train": str(corpus.directory),
                      "shards": {"dir": "data/wds/train", "filter_group": ["5:30", "30:"],
                                 "utts_per_file": 7}},
             "train": {"bin": "cat.ctc.train", "option": {"large_dataset": True}}}
    (exp / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    for recipe in ("aishell", "wenetspeech"):
        wrapper = REPO_ROOT / "egs" / recipe / "local" / "prep_wds.py"
        monkeypatch.setattr(sys, "argv", [str(wrapper), "pack-exp", str(exp)])
        runpy.run_path(str(wrapper), run_name="__main__")
        assert sorted(p.name for p in (tmp_path / "data/wds/train").iterdir()) == \
            ["30_", "5_30", "dropped.txt"]
        assert (tmp_path / "data/wds/train.done").is_file()
    assert "shards in data/wds/train are up to date" in caplog.text  # the second run
    groups = {g: shard_format.read_index(tmp_path / "data/wds/train" / g)
              for g in ("5_30", "30_")}
    assert sum(index.num_utts for index in groups.values()) == len(corpus.keys)
    assert groups["30_"].header["utts_per_file"] == 7
    hyper["data"].pop("shards")
    (exp / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    with pytest.raises(ValueError, match=r"large_dataset is true, so data.shards must say"):
        prep_wds.pack_experiment(exp)
    hyper["train"]["option"]["large_dataset"] = False
    (exp / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    assert prep_wds.pack_experiment(exp) is None
    prep_wds.main(["pack", "--scp", str(corpus.feats_scp), "--text", str(corpus.text),
                   "--out", str(tmp_path / "flat"), "--utts-per-file", "50"])
    assert shard_format.read_index(tmp_path / "flat").num_utts == len(corpus.keys)


def test_a_failing_worker_names_the_utterance_and_leaves_no_partial_file(corpus, tmp_path):
    reference = tmp_path / "reference"
    prep_wds.pack_data(corpus.feats_scp, corpus.text, reference, utts_per_file=4)
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    lines = corpus.feats_scp.read_text(encoding="utf-8").splitlines()
    victim, location = lines[5].split(" ", 1)
    ark, offset = location.rsplit(":", 1)
    lines[5] = f"{victim} {ark}:{int(offset) + 3}"  # points into the middle of a matrix
    (bad_dir / "feats.scp").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (bad_dir / "utt2num_frames").write_bytes(corpus.utt2num_frames.read_bytes())
    out = tmp_path / "wds"
    with pytest.raises(ValueError, match=f"cannot read the features of '{victim}'"):
        prep_wds.pack_data(bad_dir / "feats.scp", corpus.text, out, utts_per_file=4,
                           num_jobs=2)
    left = [p.name for p in out.iterdir()]
    assert not [name for name in left if ".tmp." in name] and "index.jsonl" not in left
    prep_wds.pack_data(corpus.feats_scp, corpus.text, out, utts_per_file=4, num_jobs=2)
    assert _files(out) == _files(reference)


def test_empty_matrices_survive_the_round_trip(tmp_path):
    corpus = write_feature_corpus(tmp_path / "corpus", keys=["empty", "sp1.1-full"],
                                  num_frames=[0, 3], dim=4)
    out = tmp_path / "wds"
    prep_wds.pack_data(corpus.feats_scp, corpus.text, out)
    samples = _read_webdataset([out / "data-00000.tar"])
    assert samples["empty"]["npy"].shape == (0, 4)
    assert np.array_equal(samples["sp1.1-full"]["npy"], corpus.features["sp1.1-full"])
    assert shard_check.validate(out) == []


@pytest.mark.parametrize("recipe", ["aishell", "wenetspeech"])
def test_spec_interface_imports_from_the_recipe_and_packs_what_webdataset_reads(
        corpus, tmp_path, recipe):
    """As the large-dataset design shows it: `from prep_wds import pack_data` in local/."""
    local = REPO_ROOT / "egs" / recipe / "local"
    out = tmp_path / "wds"
    script = (
        "import inspect, sys\n"
        "from prep_wds import UTTS_PER_FILE, pack_data\n"
        "params = inspect.signature(pack_data).parameters\n"
        "assert UTTS_PER_FILE == 2000, UTTS_PER_FILE\n"
        "assert list(params)[:5] == ['f_scps', 'f_labels', 'd_out', 'fmt', 'filter_group']\n"
        "assert params['fmt'].default == 'data-%05d.tar'\n"
        "assert params['filter_group'].default is None\n"
        "pack_data(sys.argv[1], sys.argv[2], sys.argv[3], filter_group=['0:1000'])\n")
    # Without path.sh's PYTHONPATH: the wrapper finds the checkout that holds it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script, str(corpus.feats_scp),
                           str(corpus.text), str(out)],
                          cwd=local, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = sorted(str(p) for p in (out / "0_1000").glob("data-*.tar"))
    assert shards and (out / "0_1000" / "data-00000.tar").exists()
    seen = {}
    for sample in wds.WebDataset(shards, shardshuffle=False):
        key = shard_format.decode_key(sample["__key__"])
        seen[key] = (np.load(io.BytesIO(sample["npy"])), sample["txt"].decode("utf-8"))
    assert set(seen) == set(corpus.features)
    for key, (matrix, text) in seen.items():
        assert np.array_equal(matrix, corpus.features[key])  # bit-exact
        assert matrix.dtype == corpus.features[key].dtype
        assert text == corpus.transcripts[key]
