"""The training manager on tiny experiments: both data paths, resume, accumulation, errors."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import torch

from cat import train as cat_train
from cat.core import config as config_module
from cat.core.commands import run_verb
from cat.core.config import ConfigError
from cat.formats import prep_wds
from cat.testing.training import write_tiny_experiment
from cat.text.tokenizer import save as save_tokenizer
from cat.text.tokenizer import train_sentencepiece
from cat.training.checkpoint import CheckpointManager, load_checkpoint
from cat.training.cli import train
from cat.training.distributed import DistributedContext
from cat.training.manager import Manager
from cat.training.report import DataChangedError

NAME = "exp/tiny"


@pytest.fixture(autouse=True)
def _keep_environment(monkeypatch):
    # hyper-p.json:env is exported by training; restore it after each test.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _scalars(experiment, tag):
    lines = (experiment.exp_dir / "log/scalars.jsonl").read_text(encoding="utf-8").splitlines()
    return [r["value"] for r in map(json.loads, lines) if r["tag"] == tag]


def _utts(experiment, epoch, rank=0):
    path = experiment.exp_dir / f"log/utts/epoch-{epoch:03d}.rank-{rank}.txt"
    return path.read_text(encoding="utf-8").split()


def _latest(experiment):
    return load_checkpoint(CheckpointManager(experiment.exp_dir / "check").latest())


def _set_config(experiment, change):
    path = experiment.exp_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    change(config)
    path.write_text(json.dumps(config), encoding="utf-8")


def test_a_training_start_works_out_the_model_kind_once(tmp_path, monkeypatch):
    """config.json's model kind is worked out when the experiment is loaded and carried
    (`Experiment.kind`) to the command checks, the model and the log."""
    write_tiny_experiment(tmp_path, options={"epochs": 1})
    monkeypatch.chdir(tmp_path)
    original, calls = config_module.model_kind, []

    def counting(config, source="config.json"):
        calls.append(source)
        return original(config, source)

    for module in list(sys.modules.values()):
        if (getattr(module, "__name__", "").startswith("cat")
                and getattr(module, "model_kind", None) is original):
            monkeypatch.setattr(module, "model_kind", counting)
    train(NAME, "cat.ctc.train")
    assert calls == [f"{NAME}/config.json"]


def test_map_style_and_shards_both_reduce_the_loss(tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path, options={"epochs": 3, "log_utterances": True})
    monkeypatch.chdir(tmp_path)
    for path in ("map", "shards"):
        if path == "shards":
            shutil.rmtree(experiment.exp_dir / "check")
            shutil.rmtree(experiment.exp_dir / "log")
            experiment.use_shards(workers=1)
        train(NAME, "cat.ctc.train")
        dev = _scalars(experiment, "loss/dev")
        assert len(dev) == 3 and dev[2] < dev[0] * 0.9, (path, dev)
        train_loss = _scalars(experiment, "loss/train")
        assert len(train_loss) == 30 and sum(train_loss[-5:]) < sum(train_loss[:5])
        assert {"lr", "grad_norm", "throughput/utts_per_second", "data/wait_fraction"} <= \
            {json.loads(line)["tag"] for line in
             (experiment.exp_dir / "log/scalars.jsonl").read_text().splitlines()}
        for epoch in (1, 2, 3):
            keys = _utts(experiment, epoch)
            assert sorted(keys) == experiment.train.keys
            summary = json.loads((experiment.exp_dir / f"log/epoch-{epoch:03d}.json").read_text())
            assert summary["trained"] == 40 and summary["not_trained"] == 0
            assert summary["ranks"][0]["updates"] == summary["steps"] == 10
        assert _utts(experiment, 1) != _utts(experiment, 2)
        checkpoints = CheckpointManager(experiment.exp_dir / "check")
        assert [r["step"] for r in checkpoints.records] == [20, 30]
        latest = _latest(experiment)
        assert latest["step"] == 30 and latest["epoch"] == 4 and latest["data"]["ranks"] is None
        assert latest["data"]["kind"] == ("map" if path == "map" else "stream")
        resolved = json.loads((experiment.exp_dir / "resolved.json").read_text())
        assert resolved["hyper-p"]["train"]["option"]["large_dataset"] is (path == "shards")
        assert resolved["commit"]
        assert (experiment.exp_dir / "monitor.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert list((experiment.exp_dir / "log/tensorboard").glob("events.out.tfevents.*"))


def test_map_style_resume_ends_with_the_same_model(tmp_path, monkeypatch):
    def specaug(config):
        config["specaug"] = {"num_time_masks": 1, "max_time_mask_width": 4,
                             "num_freq_masks": 1, "max_freq_mask_width": 2}

    final = {}
    for run in ("straight", "resumed"):
        experiment = write_tiny_experiment(tmp_path / run, options={"epochs": 2})
        _set_config(experiment, specaug)
        monkeypatch.chdir(experiment.root)
        if run == "resumed":
            experiment.set_options(max_steps=7)
            train(NAME, "cat.ctc.train")
            stopped = _latest(experiment)
            assert stopped["step"] == 7 and stopped["epoch"] == 1
            rank = stopped["data"]["ranks"][0]
            assert (rank["batches"], rank["trained"]) == (7, 28)
            with pytest.raises(FileExistsError, match="pass --resume"):
                train(NAME, "cat.ctc.train")
            experiment.set_options(max_steps=0)
            run_verb("cat.ctc.train", [NAME, "--resume"])
        else:
            train(NAME, "cat.ctc.train")
        final[run] = _latest(experiment)
    assert final["straight"]["step"] == final["resumed"]["step"] == 20
    for key, value in final["straight"]["model"].items():
        assert torch.equal(value, final["resumed"]["model"][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_streaming_resume_trains_the_same_batches_and_model(tmp_path, monkeypatch, workers):
    final, logs, steps = {}, {}, {}
    for run in ("straight", "resumed"):
        experiment = write_tiny_experiment(tmp_path / run, options={
            "epochs": 2, "log_utterances": True, "shuffle_buffer": 6, "sort_buffer": 4,
            "workers": workers})
        experiment.use_shards()
        monkeypatch.chdir(experiment.root)
        if run == "resumed":
            for stop in (3, 7, 13):  # two stops in epoch 1, one in epoch 2
                experiment.set_options(max_steps=stop)
                train(NAME, "cat.ctc.train", resume=stop > 3)
                assert _latest(experiment)["step"] == stop
            experiment.set_options(max_steps=0)
            train(NAME, "cat.ctc.train", resume=True)
        else:
            train(NAME, "cat.ctc.train")
        final[run] = _latest(experiment)
        logs[run] = [(experiment.exp_dir / f"log/utts/epoch-00{e}.rank-0.txt").read_text()
                     for e in (1, 2)]
        summaries = [json.loads((experiment.exp_dir / f"log/epoch-00{e}.json").read_text())
                     for e in (1, 2)]
        for summary in summaries:
            assert summary["trained"] == 40 and summary["not_trained"] == 0
            assert summary["retrained"] == 0 and summary["ranks"][0]["updates"] == \
                summary["steps"]
        steps[run] = [summary["steps"] for summary in summaries]
        coverage = [json.loads(line) for line in
                    (experiment.exp_dir / "log/coverage.jsonl").read_text().splitlines()]
        assert [c["epoch"] for c in coverage] == [1, 2]
        assert coverage[0]["trained"] == 40 and coverage[0]["cut_fraction"] == 0
        assert coverage[0]["cut_lengths"]["count"] == 0
    assert logs["straight"] == logs["resumed"] and steps["straight"] == steps["resumed"]
    # One line per batch: as many as updates.
    assert [len(log.splitlines()) for log in logs["straight"]] == steps["straight"]
    for key, value in final["straight"]["model"].items():
        assert torch.equal(value, final["resumed"]["model"][key]), key


def test_resume_refuses_changed_data_unless_the_epoch_restarts(tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path, options={"epochs": 1, "log_utterances": True})
    experiment.use_shards(max_steps=4)
    monkeypatch.chdir(tmp_path)
    train(NAME, "cat.ctc.train")
    checkpoint = CheckpointManager(experiment.exp_dir / "check").latest()
    experiment.set_options(max_steps=0, max_frames=400)
    with pytest.raises(DataChangedError, match=rf"{checkpoint.name}: epoch 1 cannot continue .*"
                                               r"batching \[4, 0, 12, 8\] -> \[4, 400, 12, 8\]"
                                               r".*weighting 'utterances' -> 'frames'"
                                               r".*--resume-restart-epoch"):
        train(NAME, "cat.ctc.train", resume=True)
    experiment.set_options(max_frames=0)
    repacked = prep_wds.pack_data(experiment.train.feats_scp, experiment.train.text,
                                  tmp_path / "data/wds/train", utts_per_file=5, seed=7)
    assert repacked.shards_written == 8
    with pytest.raises(DataChangedError, match=r"shard .*data-00000.tar changed \(crc32 "):
        train(NAME, "cat.ctc.train", resume=True)
    run_verb("cat.ctc.train", [NAME, "--resume-restart-epoch"])
    summary = json.loads((experiment.exp_dir / "log/epoch-001.json").read_text())
    assert summary["trained"] == 40 and summary["retrained"] == 16
    assert sorted(_utts(experiment, 1)) == experiment.train.keys


def test_time_budget_stops_at_an_update_with_a_checkpoint(tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path, options={"time_budget_minutes": 1e-9})
    monkeypatch.chdir(tmp_path)
    train(NAME, "cat.ctc.train")
    stopped = _latest(experiment)
    assert stopped["step"] == 1 and stopped["epoch"] == 1
    assert stopped["dev_loss"] > 0
    experiment.set_options(time_budget_minutes=0, max_steps=3)
    train(NAME, "cat.ctc.train", resume=True)
    assert _latest(experiment)["step"] == 3


def test_accumulated_gradient_is_the_mean_over_all_tokens(tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path, options={"grad_accum": 2, "grad_norm": 0})
    _set_config(experiment, lambda c: c.update(trainer={"loss_normalization": "token"}))
    monkeypatch.chdir(tmp_path)
    manager = Manager(config_module.load_experiment(NAME), DistributedContext())
    manager.train_data.start_epoch(1, None)
    updater = manager.updater
    batches, exhausted, _ = updater.take(iter(manager.train_data), lambda batch: None)
    assert len(batches) == 2 and not exhausted
    reference = {name: torch.zeros_like(p) for name, p in manager.model.named_parameters()}
    tokens = sum(int(b.label_lens.sum()) for b in batches)
    for batch in batches:
        manager.model.zero_grad()
        loss, stats = manager.model(batch.feats, batch.feat_lens, batch.labels,
                                    batch.label_lens)
        (loss * stats["normalizer"] / tokens).backward()
        for name, parameter in manager.model.named_parameters():
            reference[name] += parameter.grad
    manager.model.zero_grad()
    captured = {}

    def capture(optimizer):
        captured.update({n: p.grad.clone() for n, p in manager.model.named_parameters()})

    monkeypatch.setattr(updater.scaler, "step", capture)
    totals = updater.sync(batches, exhausted, out_of_time=False)
    assert totals.normalizer == tokens and totals.utterances == sum(map(len, batches))
    updater.update(batches, totals.normalizer)
    manager.close()
    for name, gradient in reference.items():
        assert torch.allclose(captured[name], gradient, rtol=1e-4, atol=1e-6), name


def test_inputs_are_checked_before_training(tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path)
    monkeypatch.chdir(tmp_path)
    _set_config(experiment, lambda c: c["encoder"]["kwargs"].update(idim=10))
    with pytest.raises(ValueError, match=r"pack/train.npz: utterance '.*' has features of shape "
                                         r"\(\d+, 8\), but config.json encoder.kwargs.idim is 10"):
        train(NAME, "cat.ctc.train")
    experiment.use_shards()
    with pytest.raises(ValueError, match=r"the shards hold 8-dim features \(index.jsonl\), but "
                                         r"config.json encoder.kwargs.idim is 10"):
        train(NAME, "cat.ctc.train")
    _set_config(experiment, lambda c: c["encoder"]["kwargs"].update(idim=8))
    experiment.set_options(trset="data/wds/{train,test}/data-*.tar")
    with pytest.raises(FileNotFoundError, match=r"trset pattern 'data/wds/\{train,test\}/"
                                                r"data-\*.tar' matches no shard"):
        train(NAME, "cat.ctc.train")
    experiment.set_options(large_dataset=False, trset=None, tokenizer="exp/none.tknz")
    with pytest.raises(FileNotFoundError, match=r"tokenizer file exp/none.tknz does not exist"):
        train(NAME, "cat.ctc.train")
    other = tmp_path / "other.tknz"
    save_tokenizer(train_sentencepiece([experiment.dev.text], "char", 0), other)
    experiment.set_options(tokenizer=str(other))
    with pytest.raises(ValueError, match=r"train.npz was encoded with the tokenizer .*, which "
                                         r"differs from train.option.tokenizer"):
        train(NAME, "cat.ctc.train")
    with pytest.raises(ConfigError, match=r"config.json: describes a ctc model, but "
                                          r"cat.rnnt.train handles rnnt models; run python -m "
                                          r"cat.train"):
        run_verb("cat.rnnt.train", [NAME])


def test_rnnt_training_runs_from_the_command_line(tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path, kind="rnnt", options={"epochs": 1})
    monkeypatch.chdir(tmp_path)

    def to_ctc(config):
        del config["decoder"], config["joiner"]
        config["ctc"] = {"dropout": 0.0}

    _set_config(experiment, to_ctc)
    with pytest.raises(ConfigError, match=r"config.json: describes a ctc model, but "
                                          r"cat.rnnt.train handles rnnt models"):
        run_verb("cat.rnnt.train", [NAME])
    with pytest.raises(ConfigError, match=r"hyper-p.json: train.bin: describes a ctc model, "
                                          r"but cat.rnnt.train handles rnnt models"):
        cat_train.main([NAME])  # the verb trains any kind, but train.bin names the wrong one
    experiment = write_tiny_experiment(tmp_path, kind="rnnt", options={"epochs": 1})
    run_verb("cat.rnnt.train", [NAME])
    latest = _latest(experiment)
    assert latest["step"] == 10 and latest["meta"]["train_bin"] == "cat.rnnt.train"
    assert "transducer.predictor.embedding.weight" in latest["model"]
    assert torch.isfinite(torch.tensor(latest["dev_loss"]))


def test_streamed_dev_set_gives_the_dev_loss_of_the_pack(tmp_path, monkeypatch):
    experiment = write_tiny_experiment(tmp_path, options={"workers": 1})
    monkeypatch.chdir(tmp_path)
    losses = []
    for streamed in (False, True):
        if streamed:
            experiment.set_options(dev_large_dataset=True, devset="data/wds/dev/data-*.tar")
        manager = Manager(config_module.load_experiment(NAME), DistributedContext())
        assert manager.dev_data.num_utts == 8
        losses.append(manager.evaluate())
        # The worker handed its batches over through its shared-memory ring.
        assert manager.dev_data.loader.counts["ring"] > 0
        manager.close()
    assert losses[0] > 0 and losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_checkpoints_written_before_amp_dtype_resume_as_float16_ones(tmp_path, monkeypatch):
    """Checkpoints record the dtype AMP trained in; those written before it trained float16
    on a GPU (nothing on the CPU, which ignores amp)."""
    from pathlib import Path

    from cat.training.manager import ConfigChangedError, training_settings

    write_tiny_experiment(tmp_path, options={"amp": True})
    monkeypatch.chdir(tmp_path)
    manager = Manager(config_module.load_experiment(NAME), DistributedContext())
    try:
        recorded = training_settings(manager.experiment)
        assert recorded["hyper-p.json"]["train.option.amp_dtype"] is None  # on the CPU
        del recorded["hyper-p.json"]["train.option.amp_dtype"]
        manager._check_settings(recorded, Path("old.pt"))
        # on a GPU with bfloat16 (simulated), the old float16 run is a change
        manager.updater.amp, manager.updater.amp_dtype = True, torch.bfloat16
        with pytest.raises(ConfigChangedError, match=r"old\.pt: the training settings changed "
                                                     r"since this checkpoint was written: "
                                                     r"hyper-p\.json: train\.option\.amp_dtype: "
                                                     r"'float16' -> 'bfloat16'"):
            manager._check_settings(recorded, Path("old.pt"))
        manager.updater.amp_dtype = torch.float16
        manager._check_settings(recorded, Path("old.pt"))
    finally:
        manager.close()


def test_throughput_is_logged_in_audio_hours_and_mfu(tmp_path, monkeypatch, caplog):
    """Audio-hours per device-hour from the trained frames; MFU where the device has a
    peak (here a pretended one of 1 TFLOP/s), from the FLOPs counted on the first update."""
    from cat.training import manager as manager_module

    experiment = write_tiny_experiment(tmp_path, options={"epochs": 1, "log_interval": 1})
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO", logger="cat.training.manager")
    counts = []
    original = manager_module.count_model_flops
    monkeypatch.setattr(manager_module, "count_model_flops",
                        lambda *args: counts.append(original(*args)) or counts[-1])
    monkeypatch.setattr(manager_module, "device_peak", lambda device, dtype: (1e12, "1 TFLOP/s"))
    train(NAME, "cat.ctc.train")
    assert len(counts) == 1 and counts[0].total > 0  # once, on the first update
    assert "throughput: MFU against 1 TFLOP/s" in caplog.text
    assert re.search(r"throughput: [0-9.]+ GFLOP counted in the update of 4 x \d+ "
                     r"\(utterances x padded frames\), in [0-9.]+ s", caplog.text)
    utts = _scalars(experiment, "throughput/utts_per_second")
    hours = _scalars(experiment, "throughput/audio_hours_per_hour")
    mfus = _scalars(experiment, "throughput/mfu")
    assert len(utts) == len(hours) == len(mfus) == 10
    # hours of audio per hour / utterances per second: the interval's mean utterance seconds
    durations = [len(f) * 0.01 for f in experiment.train.features.values()]
    for per_hour, per_second in zip(hours, utts, strict=True):
        assert min(durations) <= per_hour / per_second <= max(durations)
    assert all(0 < value < 1 for value in mfus)


def test_no_mfu_without_a_peak(tmp_path, monkeypatch, caplog):
    experiment = write_tiny_experiment(tmp_path, options={"epochs": 1, "log_interval": 5})
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO", logger="cat.training.manager")
    train(NAME, "cat.ctc.train")
    assert "throughput: MFU not logged (no peak known for cpu)" in caplog.text
    assert _scalars(experiment, "throughput/mfu") == []
    assert len(_scalars(experiment, "throughput/audio_hours_per_hour")) == 2
