"""Stage 1's jobs as the tasks of an array (`--cmd`, `cat.core.launch`; the local backend
here, Slurm in tests/recipes/test_slurm_recipe.py): the same bytes as the process pool, a
failed task named with its log, and a re-run that redoes only that task."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest

from cat.core.io import read_table
from cat.core.launch import Launcher
from cat.features.extract import FeatureExtractionError, extract
from cat.features.fbank import PipeCommandError, read_audio
from cat.testing.audio import make_data_dir, write_kaldi_data_dir

DURATIONS = (1.0, 1.3, 0.8, 1.6, 1.1, 0.9)


def _files(feat_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(feat_dir)) for p in feat_dir.rglob("*")
                  if p.is_file() and p.parts[-2] != "log" and p.name != "job.json")


def test_array_tasks_write_the_bytes_of_the_process_pool(tmp_path):
    data = make_data_dir(tmp_path / "corpus", DURATIONS)
    pool = extract(data, tmp_path / "pool", nj=3, speed_factors=(0.9,), progress=False)
    array = extract(data, tmp_path / "array", nj=3, speed_factors=(0.9,), progress=False,
                    launcher=Launcher())
    assert (pool.num_utterances, pool.num_frames) == (array.num_utterances, array.num_frames)
    assert array.jobs_run == (1, 2, 3)
    assert _files(tmp_path / "pool") == _files(tmp_path / "array")
    for name in _files(tmp_path / "pool"):
        if name.endswith((".scp", "feats.scp")) or name.startswith("arks/done."):
            continue  # they name the feature dir (absolute ark paths)
        assert filecmp.cmp(tmp_path / "pool" / name, tmp_path / "array" / name, shallow=False), \
            name
    scp = {k: v.replace(str(tmp_path / "array"), "X")
           for k, v in read_table(tmp_path / "array/feats.scp").items()}
    assert scp == {k: v.replace(str(tmp_path / "pool"), "X")
                   for k, v in read_table(tmp_path / "pool/feats.scp").items()}
    for task in (1, 2, 3):
        log = (tmp_path / f"array/log/extract.{task}.log").read_text()
        assert f"job {task}: " in log and log.rstrip().endswith("# ended with status 0")


def test_a_command_that_cannot_run_stops_its_job_and_the_rerun_redoes_only_it(
        tmp_path, monkeypatch):
    data = make_data_dir(tmp_path / "corpus", DURATIONS)
    wav_scp = read_table(data / "wav.scp")
    victim = sorted(wav_scp)[2]
    # A program this machine lacks (a cluster node without sox, say): status 127.
    wav_scp[victim] = f"cat-audio-tool {wav_scp[victim]} |"
    write_kaldi_data_dir(data, wav_scp, read_table(data / "text"), read_table(data / "utt2spk"))
    feat_dir = tmp_path / "fbank"
    with pytest.raises(FeatureExtractionError, match="1 feature job"):
        extract(data, feat_dir, nj=3, progress=False, launcher=Launcher())
    job = next(i for i in (1, 2, 3)
               if victim in read_table(feat_dir / f"split3/{i}/wav.scp"))
    log = (feat_dir / f"log/extract.{job}.log").read_text()
    assert "PipeCommandError: command 'cat-audio-tool" in log and "status 127: not found" in log
    assert log.rstrip().endswith("# ended with status 1")
    assert not (feat_dir / "feats.scp").exists()  # nothing under a final name

    tool = tmp_path / "bin" / "cat-audio-tool"
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\nexec cat "$@"\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    summary = extract(data, feat_dir, nj=3, progress=False, launcher=Launcher())
    assert summary.jobs_run == (job,)
    assert sorted(summary.jobs_reused) == sorted({1, 2, 3} - {job})
    assert summary.num_utterances == len(DURATIONS) and summary.num_skipped == 0


def test_a_failing_command_is_still_a_counted_skip(tmp_path):
    """Only a command the shell cannot run stops the job; one that runs and fails is the
    recording's problem, skipped and listed."""
    with pytest.raises(PipeCommandError, match="status 127"):
        read_audio("no-such-program-here x.wav |")
    data = make_data_dir(tmp_path / "corpus", DURATIONS[:3])
    wav_scp = read_table(data / "wav.scp")
    victim = sorted(wav_scp)[0]
    wav_scp[victim] = "false |"
    write_kaldi_data_dir(data, wav_scp, read_table(data / "text"), read_table(data / "utt2spk"))
    summary = extract(data, tmp_path / "fbank", nj=2, progress=False, launcher=Launcher())
    assert summary.num_skipped == 1
    assert "exited with status 1" in read_table(tmp_path / "fbank/skipped.txt")[victim]


@pytest.mark.parametrize("fix", ["command become a file", "file of another size"])
def test_a_fixed_line_keeps_every_other_recording_in_its_job(tmp_path, fix):
    """Fixing a failed line changes no other job, whatever wav.scp holds: a line that was a
    command (jobs dealt by count) becoming a file (then every size is known), or a file
    replaced by one of another size (jobs dealt by size), moves no other recording."""
    data = make_data_dir(tmp_path / "corpus", DURATIONS)
    wav_scp = read_table(data / "wav.scp")
    victim = sorted(wav_scp)[2]
    fixed_path = wav_scp[victim]
    if fix == "command become a file":
        wav_scp[victim] = f"cat-audio-tool {fixed_path} |"  # status 127: the job stops
    else:
        wav_scp[victim] = str(tmp_path / "not-yet-copied.wav")  # skipped, not stopped
    write_kaldi_data_dir(data, wav_scp, read_table(data / "text"), read_table(data / "utt2spk"))
    feat_dir = tmp_path / "fbank"
    if fix == "command become a file":
        with pytest.raises(FeatureExtractionError, match="1 feature job"):
            extract(data, feat_dir, nj=3, progress=False, launcher=Launcher())
    else:
        assert extract(data, feat_dir, nj=3, progress=False, launcher=Launcher()).num_skipped == 1
    before = {i: sorted(read_table(feat_dir / f"split3/{i}/wav.scp")) for i in (1, 2, 3)}
    job = next(i for i, recordings in before.items() if victim in recordings)

    wav_scp[victim] = fixed_path
    write_kaldi_data_dir(data, wav_scp, read_table(data / "text"), read_table(data / "utt2spk"))
    summary = extract(data, feat_dir, nj=3, progress=False, launcher=Launcher())
    after = {i: sorted(read_table(feat_dir / f"split3/{i}/wav.scp")) for i in (1, 2, 3)}
    assert after == before
    assert summary.jobs_run == (job,)
    assert summary.num_utterances == len(DURATIONS) and summary.num_skipped == 0
