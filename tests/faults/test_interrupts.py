"""Stages 1 and 2 interrupted: SIGINT to the whole process group (a terminal's Ctrl-C), or
SIGTERM to the stage script alone (a scheduler, `kill`), mid-work. Within 3 s no process of
the stage is left, no file under a final name is partial, and the re-run completes with
the bytes of an uninterrupted run. Stage 3 interrupted by SIGTERM to a recipe's run.sh,
training here or as a Slurm job: nothing is left running (the job cancelled, not
requeued), and run.sh again resumes exactly."""

from __future__ import annotations

import filecmp
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import kaldiio
import pytest

import cat
from cat.core.io import read_table, write_table
from cat.formats.shard_pack import START_WORKERS_VARIABLE
from cat.testing.audio import make_data_dir
from cat.testing.features import write_feature_corpus
from cat.testing.processes import ProcessTree, alive, wait_until
from cat.testing.slurm import job_states, run_client
from cat.testing.training import epoch_coverage, latest_step, write_tiny_experiment
from cat.training.checkpoint import CheckpointManager
from cat.training.preemption import STOPPED_EXIT_STATUS

REPO_ROOT = Path(cat.__file__).resolve().parent.parent
ENVIRONMENT = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
GONE_WITHIN_SECONDS = 3
START_SECONDS = 120

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _slow_data_dir(root: Path) -> Path:
    """16 recordings read through a command that takes 0.4 s each (stage 1 takes seconds)."""
    data = make_data_dir(root, durations=[1.0 + 0.1 * i for i in range(16)])
    wav_scp = {key: f"sleep 0.4; cat {path} |" for key, path in read_table(data / "wav.scp")
               .items()}
    write_table(data / "wav.scp", sorted(wav_scp.items()))
    return data


def _extract(data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "cat.features.extract", "--nj", "2", "--no-progress",
            str(data), str(out)]


def _stage_script(tmp_path: Path, command: list[str]) -> list[str]:
    """The command run as utils/asr.sh runs a stage's command (`run` of stage_lib.sh)."""
    script = tmp_path / "stage.sh"
    script.write_text(f"set -euo pipefail\n. {REPO_ROOT}/utils/stage_lib.sh\n"
                      f"run {' '.join(command)}\necho finished\n")
    return ["bash", str(script)]


def _interrupt(tree: ProcessTree, how: str) -> None:
    """Ctrl-C (SIGINT to the group) or SIGTERM to the top process alone; then check that
    every process seen is gone within GONE_WITHIN_SECONDS."""
    tree.remember()
    if how == "sigint-group":
        os.killpg(tree.process.pid, signal.SIGINT)
    else:
        os.kill(tree.process.pid, signal.SIGTERM)
    tree.process.wait(timeout=30)
    assert tree.process.returncode != 0
    gone = wait_until(lambda: not alive(list(tree.seen)), GONE_WITHIN_SECONDS, 0.05)
    survivors = {tree.seen[i] for i in alive(list(tree.seen))}
    assert gone, f"processes outlived the interrupted stage by {GONE_WITHIN_SECONDS} s: " \
                 f"{survivors}"


@pytest.mark.parametrize("how", ["sigint-group", "sigterm-script"])
def test_stage_1_interrupted(tmp_path, how):
    data = _slow_data_dir(tmp_path / "corpus")
    clean = tmp_path / "clean"
    subprocess.run(_extract(data, clean), env=ENVIRONMENT, check=True, capture_output=True,
                   timeout=300)
    out = tmp_path / "fbank"
    command = _extract(data, out)
    if how == "sigterm-script":
        command = _stage_script(tmp_path, command)
    with ProcessTree.start(command, cwd=tmp_path, env=ENVIRONMENT) as tree:
        tree.wait_for(lambda: any((out / "arks").glob("*.ark.tmp")), START_SECONDS,
                      "an ark being written")
        _interrupt(tree, how)
        assert "finished" not in tree.output()
    assert not (out / "feats.scp").exists()
    for ark in (out / "arks").glob("feats.*.ark"):  # a complete ark, or none
        matrices = dict(kaldiio.load_ark(str(ark)))
        assert matrices and all(m.shape[1] == 80 for m in matrices.values())
    subprocess.run(_extract(data, out), env=ENVIRONMENT, check=True, capture_output=True,
                   timeout=300)
    for name in ("arks/feats.1.ark", "arks/feats.2.ark", "utt2num_frames", "text"):
        assert filecmp.cmp(out / name, clean / name, shallow=False), name


@pytest.mark.parametrize("how", ["sigint-group", "sigterm-script"])
def test_stage_2_interrupted(tmp_path, how):
    corpus = write_feature_corpus(tmp_path / "feats", num_utts=3000, dim=80)

    def pack(out: Path) -> list[str]:
        return [sys.executable, "-m", "cat.formats.prep_wds", "pack", "--scp",
                str(corpus.feats_scp), "--text", str(corpus.text), "--out", str(out), "--nj",
                "2", "--utts-per-file", "20"]

    environment = {**ENVIRONMENT, START_WORKERS_VARIABLE: "1"}
    clean = tmp_path / "clean"
    with ProcessTree.start(pack(clean), cwd=tmp_path, env=environment) as tree:
        assert tree.process.wait(timeout=300) == 0, tree.output()[-3000:]
    out = tmp_path / "wds"
    command = pack(out) if how == "sigint-group" else _stage_script(tmp_path, pack(out))
    with ProcessTree.start(command, cwd=tmp_path, env=environment) as tree:
        tree.wait_for(lambda: len(list(out.glob("data-*.tar"))) >= 3, START_SECONDS,
                      "3 finished shards")
        _interrupt(tree, how)
    finished = sorted(out.glob("data-*.tar"))
    assert len(finished) < len(list(clean.glob("data-*.tar"))), "packing ended first"
    assert not (out / "index.jsonl").exists()
    for shard in finished:  # every shard under its final name is complete
        with tarfile.open(shard) as tar:
            assert len(tar.getmembers()) == 40
        assert filecmp.cmp(shard, clean / shard.name, shallow=False)
    with ProcessTree.start(pack(out), cwd=tmp_path, env=environment) as tree:
        assert tree.process.wait(timeout=300) == 0, tree.output()[-3000:]
    for shard in clean.glob("*"):
        if shard.is_file():
            assert filecmp.cmp(out / shard.name, shard, shallow=False), shard.name


def _recipe_with_a_tiny_experiment(root: Path):
    """The AISHELL recipe's run.sh and cmd.sh in a scratch tree (path.sh and utils/ linked
    from the checkout), holding a tiny streaming experiment exp/tiny of 400 utterances."""
    for name in ("path.sh", "utils"):
        (root / name).symlink_to(REPO_ROOT / name)
    recipe = root / "egs" / "aishell"
    recipe.mkdir(parents=True)
    for name in ("run.sh", "cmd.sh"):
        shutil.copy(REPO_ROOT / "egs/aishell" / name, recipe)
    experiment = write_tiny_experiment(recipe, num_train=400, utts_per_shard=10, options={
        "epochs": 1, "batch_size": 4, "check_freq": 10, "keep_checkpoints": 3,
        "log_utterances": True, "workers": 1})
    experiment.use_shards()
    return experiment


@pytest.mark.parametrize(("backend", "how"), [
    ("local", "sigterm-run.sh"), ("slurm", "sigterm-run.sh"), ("slurm", "sigint-group")])
def test_run_sh_interrupted_ends_stage_3_its_training_and_its_slurm_job(tmp_path, request,
                                                                        backend, how):
    """SIGTERM to a recipe's run.sh (a scheduler, `kill`), or Ctrl-C, reaches asr.sh, the
    stage command and the training: they save, end and release the lock, the Slurm job is
    cancelled for good, the output says how to resume; run.sh again resumes exactly."""
    experiment = _recipe_with_a_tiny_experiment(tmp_path)
    recipe = experiment.root
    command = ["bash", "run.sh", "--stage", "3", "--stop_stage", "3", "--exp", "exp/tiny"]
    if backend == "slurm":
        request.getfixturevalue("slurm_cluster")
        command += ["--cmd_backend", "slurm", "--train_mem", "1G", "--nproc", "2"]
    # Read now: SLURM_CONF names the test cluster once its fixture has started it.
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("PYTEST")}
    environment.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    with ProcessTree.start(command, cwd=recipe, env=environment) as tree:
        tree.wait_for(lambda: latest_step(experiment.exp_dir) >= 10, START_SECONDS,
                      "a checkpoint at update 10")
        tree.remember()
        jobs = (run_client(["squeue", "--noheader", "--name=train", "--format=%i"]).split()
                if backend == "slurm" else [])
        if how == "sigint-group":
            os.killpg(tree.process.pid, signal.SIGINT)
        else:
            os.kill(tree.process.pid, signal.SIGTERM)
        assert tree.process.wait(timeout=200) == STOPPED_EXIT_STATUS, tree.output()[-3000:]
        gone = wait_until(lambda: not alive(list(tree.seen)), GONE_WITHIN_SECONDS, 0.05)
        assert gone, f"processes outlived run.sh: {[tree.seen[i] for i in alive(list(tree.seen))]}"
        output = tree.output()
    assert "run stage 3 again to resume it: bash run.sh --stage 3 --exp exp/tiny" in output
    assert not (experiment.exp_dir / "train.lock").exists()
    stopped_at = CheckpointManager(experiment.exp_dir / "check").records[-1]
    # Saved when the signal came (a checkpoint without a dev loss), or the signal came
    # before the first update after the periodic checkpoint (check_freq 10, with its dev
    # loss), which already holds that step; whether no update was lost is checked below.
    assert stopped_at["dev_loss"] is None or stopped_at["step"] % 10 == 0, stopped_at
    if backend == "slurm":
        assert len(jobs) == 1
        fields = next(iter(job_states(jobs[0]).values()))
        print(f"{how}: Slurm job {jobs[0]} {fields['JobState']}, restarts "
              f"{fields['Restarts']}")
        assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0"
        assert not run_client(["squeue", "--noheader", "--format=%i"]).split()

    resumed = subprocess.run(command, cwd=recipe, env=environment, capture_output=True,
                             text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    coverage = epoch_coverage(experiment.exp_dir, experiment.train.keys)
    print(f"{how} ({backend}) after update {stopped_at['step']}, run.sh again: {coverage}")
    assert coverage.trained == 400
    assert coverage.missing == [] and coverage.duplicated == [] and coverage.retrained == 0
