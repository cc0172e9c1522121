"""The contract of `TrainData`, held by both kinds (map pack, tar shards) on one tiny corpus.

Each test builds the data through `build_train_data` and then uses only the interface,
as the Manager does: two epochs each yield every utterance exactly once, a state taken
mid-epoch resumes in a new instance with exactly the utterances not yet seen, the epoch's
logs and counts say what was trained, and `close` leaves no loader worker behind.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch

from cat.core.config import load_experiment
from cat.loading.batch import LengthFilter
from cat.testing.processes import descendants, wait_until
from cat.testing.training import TinyExperiment, write_tiny_experiment
from cat.training.distributed import DistributedContext
from cat.training.report import epoch_record
from cat.training.train_data import TrainData, build_train_data

KINDS = ("map", "stream")
FEAT_DIM = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyExperiment:
    """40 utterances as a map pack and as 8 shards of 5 (one worker reads them)."""
    return write_tiny_experiment(tmp_path_factory.mktemp("contract"),
                                 options={"workers": 1, "log_utterances": True})


@pytest.fixture(autouse=True)
def _in_recipe(tiny, monkeypatch):
    # Paths in hyper-p.json are relative to the recipe directory, as in training.
    monkeypatch.chdir(tiny.root)


def _pass_all(longest: int) -> LengthFilter:
    return LengthFilter(None, np.arange(longest + 1), 1, ctc=False)


def _open(tiny: TinyExperiment, kind: str, log_dir) -> TrainData:
    """The kind's training data, built as training builds it."""
    if kind == "stream":
        tiny.use_shards()
    else:
        tiny.set_options(large_dataset=False, trset=None)
    options = load_experiment(tiny.name).options
    data = build_train_data(options, _pass_all, FEAT_DIM, DistributedContext(), log_dir)
    assert isinstance(data, TrainData) and data.kind == kind
    return data


def _take(data: TrainData, count: int | None = None) -> list[list[str]]:
    """The keys of up to `count` batches (all: the epoch's rest), each noted trained."""
    taken = []
    for batch in data:
        data.note(batch, trained=True)
        if len(batch):
            taken.append(list(batch.keys))
        if count is not None and len(taken) == count:
            break
    return taken


def _flat(batches: list[list[str]]) -> list[str]:
    return [key for batch in batches for key in batch]


def _log_lines(log_dir, part: str, epoch: int) -> list[str]:
    path = log_dir / part / f"epoch-{epoch:03d}.rank-0.txt"
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


@pytest.mark.parametrize("kind", KINDS)
def test_two_epochs_each_yield_every_utterance_once_with_their_logs(tiny, tmp_path, kind):
    data = _open(tiny, kind, tmp_path)
    mean_frames = np.mean([len(f) for f in tiny.train.features.values()])
    assert data.longest == max(len(f) for f in tiny.train.features.values())
    assert data.corpus_mean_frames() == pytest.approx(mean_frames)
    orders = []
    try:
        for epoch in (1, 2):
            data.start_epoch(epoch, None)
            batches = _take(data)
            keys = _flat(batches)
            assert sorted(keys) == tiny.train.keys, f"{kind} epoch {epoch}"
            orders.append(keys)
            summary = data.summary()
            assert (summary["expected"], summary["trained"], summary["not_trained"]) == \
                (40, 40, 0)
            assert sum(summary["dropped"].values()) == 0
            assert data.trained() == 40 and data.state()["trained"] == 40
            assert TrainData.trained_in(data.state()) == 40
            # The logs list the trained batches, one line each, and nothing dropped.
            assert _log_lines(tmp_path, "utts", epoch) == [" ".join(b) for b in batches]
            assert _log_lines(tmp_path, "drops", epoch) == []
            padding = data.padding()
            assert padding["frames"] == sum(len(f) for f in tiny.train.features.values())
            assert padding["padded_frames"] > padding["frames"]
            record = epoch_record(epoch, len(batches), [{**summary, **padding}])
            assert record["trained"] == 40 and record["not_trained"] == 0
            assert record["padding_share"] == pytest.approx(
                1 - padding["frames"] / padding["padded_frames"])
            data.check_epoch(record)  # nothing failed: no error
            data.end_epoch(len(batches))
            assert data.steps_hint() is not None and data.steps_hint() > 0
    finally:
        data.close()
    assert orders[0] != orders[1], "the epochs' orders must differ"


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_taken_mid_epoch_resumes_with_the_utterances_not_yet_seen(tiny, tmp_path,
                                                                         kind):
    first = _open(tiny, kind, tmp_path)
    try:
        first.start_epoch(1, None)
        seen = _flat(_take(first, 4))
        # Through a checkpoint: torch.save, and a weights-only load as resume does.
        buffer = io.BytesIO()
        torch.save(first.state(), buffer)
        identity = json.loads(json.dumps(first.identity()))
        # Trained after the checkpoint by a run then killed: not in the state, so again.
        assert _take(first, 2)
    finally:
        first.close()
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert TrainData.trained_in(state) == len(seen) > 0
    second = _open(tiny, kind, tmp_path)
    try:
        assert second.identity_changes(identity) == []
        second.start_epoch(1, state)
        rest = _flat(_take(second))
        assert not set(seen) & set(rest), f"{kind}: trained again after the resume"
        assert sorted(seen + rest) == tiny.train.keys, f"{kind}: missing after the resume"
        assert second.trained() == 40 and second.summary()["not_trained"] == 0
        # The padding count carries on from the state: all the epoch's frames, once.
        assert second.padding()["frames"] == sum(len(f) for f in tiny.train.features.values())
        second.end_epoch(None)
    finally:
        second.close()
    # The resumed epoch's log is that of an uninterrupted one: each utterance once.
    assert sorted(" ".join(_log_lines(tmp_path, "utts", 1)).split()) == tiny.train.keys


@pytest.mark.parametrize("kind", KINDS)
def test_identity_changes_name_a_changed_setting(tiny, tmp_path, kind):
    data = _open(tiny, kind, tmp_path)
    try:
        recorded = {**data.identity(), "seed": 7}
        assert data.identity_changes(recorded) == ["seed 7 -> 0"]
        assert "older format" in data.identity_changes(None)[0]
    finally:
        data.close()


@pytest.mark.parametrize("kind", KINDS)
def test_close_leaves_no_loader_worker(tiny, tmp_path, kind):
    before = set(descendants(os.getpid()))
    data = _open(tiny, kind, tmp_path)
    data.start_epoch(1, None)
    assert _take(data, 1)
    workers = set(descendants(os.getpid())) - before
    assert workers, f"{kind}: the loader should run a worker process"
    data.close()
    assert wait_until(lambda: not workers & set(descendants(os.getpid())), 10), \
        f"{kind}: worker processes left after close: {sorted(workers)}"


@pytest.mark.parametrize("kind", KINDS)
def test_feature_samples_are_the_loaders_utterances(tiny, tmp_path, kind):
    data = _open(tiny, kind, tmp_path)
    try:
        samples = list(data.feature_samples(1000))
    finally:
        data.close()
    assert len(samples) == 40
    by_key = {name.rsplit(": ", 1)[1]: features for name, features in samples}
    assert sorted(by_key) == tiny.train.keys
    assert all(np.array_equal(by_key[k], f) for k, f in tiny.train.features.items())
