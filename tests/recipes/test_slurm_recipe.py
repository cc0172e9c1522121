"""The tiny AISHELL recipe through stages 1-4 twice, with `cmd_backend` local and slurm
(the real one-node Slurm of `slurm_cluster`): features, packs and shards byte-identical,
the same CER; and a Slurm array task that fails (a `wav.scp` command the node cannot
run) named with its log, the re-run submitting only that task."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from cat.core.io import read_table, write_table
from cat.testing.audio import make_data_dir

ROOT = Path(__file__).resolve().parents[2]
SLURM = ("--cmd_backend", "slurm", "--mem_per_job", "1G", "--train_mem", "2G")
TINY = ("--synthetic", "true", "--synthetic_utts", "60", "--exp", "exp/tiny-ctc")
CER_LINE = re.compile(r"^\| (\w+) \| ([0-9.]+) \| (\d+) / (\d+) \|", re.MULTILINE)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _recipe_copy(root: Path) -> Path:
    root.mkdir(parents=True)
    for name in ("path.sh", "utils"):
        (root / name).symlink_to(ROOT / name)
    recipe = root / "egs" / "aishell"
    recipe.mkdir(parents=True)
    for name in ("run.sh", "cmd.sh"):
        shutil.copy(ROOT / "egs/aishell" / name, recipe)
    shutil.copytree(ROOT / "egs/aishell/local", recipe / "local")
    shutil.copytree(ROOT / "egs/aishell/exp/tiny-ctc", recipe / "exp/tiny-ctc",
                    ignore=shutil.ignore_patterns("*.done"))
    return recipe


def _run(recipe: Path, *args: str) -> tuple[str, float]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST")}
    started = time.monotonic()
    proc = subprocess.run(["bash", "run.sh", *args], cwd=recipe, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr, time.monotonic() - started


def _cers(recipe: Path) -> dict[str, tuple[float, int, int]]:
    table = (recipe / "exp/tiny-ctc/RESULTS.md").read_text(encoding="utf-8")
    return {m[1]: (float(m[2]), int(m[3]), int(m[4])) for m in CER_LINE.finditer(table)}


def _outputs(recipe: Path) -> list[Path]:
    """The files of stages 1 and 2 that do not name their own directory."""
    found = [*recipe.glob("data/fbank/*/arks/feats.*.ark"),
             *recipe.glob("data/fbank/*/utt2num_frames"), *recipe.glob("data/fbank/*/text"),
             *recipe.glob("exp/tiny-ctc/pack/*.npz"), *recipe.glob("exp/tiny-ctc/tokenizer.*"),
             *recipe.glob("data/wds/**/*.tar"), *recipe.glob("data/wds/**/index.jsonl")]
    return sorted(path.relative_to(recipe) for path in found)


def _without_fingerprints(index: Path) -> list[dict]:
    lines = [json.loads(line) for line in index.read_text(encoding="utf-8").splitlines()]
    return [{k: v for k, v in line.items() if k != "fingerprint"} for line in lines]


def _pack_arrays(recipe: Path, path: Path) -> dict[str, list]:
    with np.load(recipe / path) as pack:
        arrays = {name: pack[name].tolist() for name in pack.files}
    arrays["ark_paths"] = [p.replace(str(recipe), "<recipe>") for p in arrays["ark_paths"]]
    return arrays


def test_stages_1_to_4_on_slurm_match_the_local_run(tmp_path, slurm_cluster):
    local = _recipe_copy(tmp_path / "local")
    _run(local, *TINY, "--stage", "0", "--stop_stage", "0")
    cluster = _recipe_copy(tmp_path / "slurm")
    for name in ("corpus", "data"):
        shutil.copytree(local / name, cluster / name, symlinks=True)
    times: dict[str, list[float]] = {"local": [], "slurm": []}
    for stage in (1, 2, 3, 4):
        for name, recipe, extra in (("local", local, ()), ("slurm", cluster, SLURM)):
            log, seconds = _run(recipe, *TINY, "--stage", str(stage), "--stop_stage",
                                str(stage), *extra)
            times[name].append(seconds)
            if name == "slurm" and stage in (1, 4):
                assert "through the slurm backend" in log, log[-3000:]
    # Stage 2's shards too (the tiny experiment trains map-style): the recipe's packer.
    for recipe, extra in ((local, ()), (cluster, SLURM)):
        command = [sys.executable, "local/prep_wds.py", "pack", "--scp",
                   "data/fbank/train_sp/feats.scp", "--text", "data/fbank/train_sp/text",
                   "--out", "data/wds/train", "--nj", "2", "--utts-per-file", "16"]
        if extra:
            command += ["--cmd", "launch.sh --backend slurm --poll-seconds 0.2"]
        subprocess.run(command, cwd=recipe, check=True, timeout=600, capture_output=True)
    print("stage seconds 1-4: local " + " ".join(f"{t:.1f}" for t in times["local"]) +
          "; slurm " + " ".join(f"{t:.1f}" for t in times["slurm"]))

    outputs = _outputs(local)
    assert outputs == _outputs(cluster)
    assert any(p.suffix == ".ark" for p in outputs) and any(p.suffix == ".tar" for p in outputs)
    for path in outputs:
        if path.name == "index.jsonl":  # shard fingerprints hash the input arks' paths
            assert _without_fingerprints(local / path) == _without_fingerprints(cluster / path)
        elif path.suffix == ".npz":  # map packs point into the arks by absolute path
            assert _pack_arrays(local, path) == _pack_arrays(cluster, path), path
        else:
            assert filecmp.cmp(local / path, cluster / path, shallow=False), path
    assert (cluster / "data/fbank/train_sp/log/extract.1.log").read_text().rstrip() \
        .endswith("# ended with status 0")
    assert list((cluster / "data/wds/train/log").glob("pack.*.log"))
    assert (cluster / "exp/tiny-ctc/log/train.slurm.log").read_text().rstrip() \
        .endswith("# ended with status 0")
    assert list((cluster / "exp/tiny-ctc/decode/test/log").glob("decode.*.log"))
    assert _cers(local) == _cers(cluster) and set(_cers(local)) == {"dev", "test"}


@pytest.mark.parametrize("fix", ["install the program", "name the file instead"])
def test_a_failed_slurm_task_is_named_and_the_rerun_submits_only_it(tmp_path, slurm_cluster,
                                                                    fix):
    """Whatever the fix (the program installed; the line turned into the file's path, after
    which every line is a file: jobs would be dealt by size, not by count), the re-run
    submits the failed task alone: the other recordings stay in their jobs."""
    data = make_data_dir(tmp_path / "corpus", (1.0, 1.3, 0.8, 1.6, 1.1, 0.9))
    wav_scp = read_table(data / "wav.scp")
    victim = sorted(wav_scp)[4]
    audio_file = wav_scp[victim]
    wav_scp[victim] = f"cat-audio-tool {audio_file} |"  # a program the node lacks
    write_table(data / "wav.scp", sorted(wav_scp.items()))
    command = [sys.executable, "-m", "cat.features.extract", "--nj", "3", "--no-progress",
               "--cmd", "launch.sh --backend slurm --poll-seconds 0.2", str(data),
               str(tmp_path / "fbank")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    failed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert failed.returncode == 1
    job = next(i for i in (1, 2, 3)
               if victim in read_table(tmp_path / f"fbank/split3/{i}/wav.scp"))
    log = tmp_path / f"fbank/log/extract.{job}.log"
    assert f"job {job} failed (exited with status 1); see {log}" in failed.stderr
    assert "status 127: not found" in log.read_text()

    if fix == "install the program":
        tool = tmp_path / "bin/cat-audio-tool"
        tool.parent.mkdir()
        tool.write_text('#!/bin/sh\nexec cat "$@"\n')
        tool.chmod(0o755)
        env["PATH"] = f"{tool.parent}{os.pathsep}{env['PATH']}"
    else:
        wav_scp[victim] = audio_file
        write_table(data / "wav.scp", sorted(wav_scp.items()))
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                           check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    submitted = re.search(r"--array=(\S+) ", rerun.stderr)
    print(f"fix: {fix}; the failed task {job}; the re-run submitted --array="
          f"{submitted and submitted[1]}")
    assert f"extract: 1 task(s) ({job}) through the slurm backend" in rerun.stderr
    assert f"--array={job} " in rerun.stderr
    features = kaldiio.load_scp(str(tmp_path / "fbank/feats.scp"))
    assert len(features) == 6 and np.isfinite(features[victim]).all()
