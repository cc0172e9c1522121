"""How many worker processes packing starts, and shards written by this process and
workers together."""

from __future__ import annotations

import os

from cat.formats import prep_wds, shard_pack
from cat.testing.features import write_feature_corpus


def test_workers_start_only_when_the_work_and_the_cpus_pay_for_them(monkeypatch):
    monkeypatch.setattr(shard_pack, "usable_cpus", lambda: 4)
    pays = shard_pack.WORKER_PAYS_FACTOR * shard_pack.WORKER_START_SECONDS
    assert shard_pack.plan_workers(1, 100, None) == 0
    assert shard_pack.plan_workers(8, 100, None) == 3  # this process is the fourth
    assert shard_pack.plan_workers(8, 2, None) == 1
    assert shard_pack.plan_workers(2, 100, 1.9 * pays) == 0  # 382 MB: not worth a start
    assert shard_pack.plan_workers(2, 100, 2 * pays) == 1
    assert shard_pack.plan_workers(8, 100, 100 * pays) == 3
    monkeypatch.setattr(shard_pack, "usable_cpus", lambda: 1)
    assert shard_pack.plan_workers(8, 100, 100 * pays) == 0


def test_usable_cpus_leave_out_the_loaded_ones(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    assert shard_pack.usable_cpus() == 3
    monkeypatch.setattr(os, "getloadavg", lambda: (17.0, 0.0, 0.0))
    assert shard_pack.usable_cpus() == 1


def test_this_process_and_a_worker_write_the_same_shards_as_one(tmp_path, monkeypatch):
    corpus = write_feature_corpus(tmp_path / "corpus", num_utts=24, dim=4)
    prep_wds.pack_data(corpus.feats_scp, corpus.text, tmp_path / "one", utts_per_file=2)
    started = []
    plan = shard_pack.plan_workers
    monkeypatch.setattr(shard_pack, "plan_workers",
                        lambda *args: started.append(plan(8, args[1], None)) or started[-1])
    monkeypatch.setattr(shard_pack, "usable_cpus", lambda: 2)
    prep_wds.pack_data(corpus.feats_scp, corpus.text, tmp_path / "two", utts_per_file=2,
                       num_jobs=2)
    assert started == [1]
    files = {p.name: p.read_bytes() for p in (tmp_path / "one").iterdir()}
    assert files == {p.name: p.read_bytes() for p in (tmp_path / "two").iterdir()}
