"""Stage 2's packing as the tasks of an array (`--cmd`, `cat.core.launch`; the local
backend here, Slurm in tests/recipes/test_slurm_recipe.py): feature and audio shards and
their index byte-identical to the process pool's; a re-run after a failed task writes only
the shards that are missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from cat.core.launch import ArrayJobError, Launcher
from cat.formats import shard_check, shard_format
from cat.formats.audio_pack import pack_audio
from cat.formats.prep_wds import pack_data
from cat.testing.audio import make_data_dir, make_segmented_data_dir
from cat.testing.features import write_feature_corpus


def _shard_files(directory: Path) -> dict[str, bytes]:
    """Every output file's bytes but the task logs (and `data.list`, which names the
    folder)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and "log" not in p.relative_to(directory).parts
            and p.name != "data.list"}


def test_feature_shards_from_array_tasks_are_those_of_the_pool(tmp_path):
    corpus = write_feature_corpus(tmp_path / "feats", num_utts=60, dim=8)
    options = {"filter_group": ["0:70", "70:"], "utts_per_file": 4, "num_jobs": 3}
    pack_data(corpus.feats_scp, corpus.text, tmp_path / "pool", **options)
    summary = pack_data(corpus.feats_scp, corpus.text, tmp_path / "array", **options,
                        launcher=Launcher())
    assert summary.shards_written == sum(summary.num_shards.values())
    assert _shard_files(tmp_path / "pool") == _shard_files(tmp_path / "array")
    assert sorted(p.name for p in (tmp_path / "array/log").iterdir()) == \
        ["pack.1.log", "pack.2.log", "pack.3.log"]
    for group in ("0_70", "70_"):
        assert shard_check.validate(tmp_path / "array" / group) == []


def test_audio_shards_from_array_tasks_are_those_of_the_pool(tmp_path):
    dirs = [make_data_dir(tmp_path / "whole", durations=(1.0, 1.3, 0.8, 1.6), extension=".flac"),
            make_segmented_data_dir(tmp_path / "long")]
    pack_audio(dirs, tmp_path / "pool", "opus", utts_per_file=3, num_jobs=2)
    pack_audio(dirs, tmp_path / "array", "opus", utts_per_file=3, num_jobs=2,
               launcher=Launcher())
    assert _shard_files(tmp_path / "pool") == _shard_files(tmp_path / "array")


def test_a_failed_packing_task_leaves_the_others_shards_for_the_rerun(tmp_path):
    corpus = write_feature_corpus(tmp_path / "feats", num_utts=24, dim=8)
    out = tmp_path / "wds"
    # A shard name taken by a directory: the task writing it fails, the others finish.
    (out / "data-00004.tar").mkdir(parents=True)
    with pytest.raises(ArrayJobError) as caught:
        pack_data(corpus.feats_scp, corpus.text, out, utts_per_file=4, num_jobs=3,
                  launcher=Launcher())
    (task, (what, log)), = caught.value.failures.items()
    assert "IsADirectoryError" in log.read_text() and what == "exited with status 1"
    assert not (out / shard_format.INDEX_NAME).exists()
    written = sorted(p.name for p in out.glob("data-*.tar") if p.is_file())
    # Tasks take shards 0 and 3, 1 and 4, 2 and 5: the second wrote shard 1, then failed.
    assert written == [f"data-{i:05d}.tar" for i in (0, 1, 2, 3, 5)]
    (out / "data-00004.tar").rmdir()
    summary = pack_data(corpus.feats_scp, corpus.text, out, utts_per_file=4, num_jobs=3,
                        launcher=Launcher())
    assert (summary.shards_written, summary.shards_kept) == (1, 5)
    assert shard_check.validate(out) == []
    assert task == 2
