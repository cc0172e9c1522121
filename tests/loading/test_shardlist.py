"""Shard lists: patterns, index counts (local, http with query strings, pipe:), rank split."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from cat.formats import shard_format
from cat.formats.shard_format import read_index_counts
from cat.loading import shardlist
from cat.loading.shardlist import (
    assign_shards,
    describe_change,
    expand_shard_patterns,
    load_shard_list,
)
from cat.testing.shards import serve_directory
from cat.testing.training import write_tiny_experiment


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    write_tiny_experiment(root, num_train=36, utts_per_shard=4)
    return root / "data/wds/train"


def test_patterns_are_brace_expanded_globbed_and_sorted(shard_dir):
    root = str(shard_dir)
    everything = expand_shard_patterns(f"{root}/data-*.tar")
    assert everything == sorted(everything) and len(everything) == 9
    assert expand_shard_patterns(f"{root}/data-0000{{0..2}}.tar") == everything[:3]
    assert expand_shard_patterns([f"{root}/data-0000{{3,1}}.tar", f"{root}/data-00008.tar"]) \
        == [everything[3], everything[1], everything[8]]
    assert expand_shard_patterns("pipe:cat x-{0..1}.tar") == ["pipe:cat x-0.tar",
                                                             "pipe:cat x-1.tar"]
    with pytest.raises(FileNotFoundError, match=r"trset pattern '.*/nothing-\*.tar' matches "
                                                r"no shard"):
        expand_shard_patterns(f"{root}/nothing-*.tar")
    with pytest.raises(FileNotFoundError, match=r"\(expanded: '.*/data-00009.tar'\)"):
        expand_shard_patterns(f"{root}/data-0000{{8..9}}.tar")
    with pytest.raises(ValueError, match="listed twice"):
        expand_shard_patterns([f"{root}/data-*.tar", f"{root}/data-00001.tar"])


def test_shard_list_takes_counts_from_the_index(shard_dir):
    shards = load_shard_list(f"{shard_dir}/data-*.tar")
    index = shard_format.read_index(shard_dir)
    assert [Path(u).name for u in shards.urls] == [r["shard"] for r in index.shards]
    assert shards.num_utts.tolist() == [r["num_utts"] for r in index.shards]
    assert shards.num_frames.tolist() == [r["num_frames"] for r in index.shards]
    assert shards.crc32 == [r["crc32"] for r in index.shards]
    assert shards.feat_dim == 8 and shards.longest == max(max(r["frames"]) for r in index.shards)
    assert not shards.estimated.any()
    frames = shards.utterance_frames([0, 4])
    assert {s: f.tolist() for s, f in frames.items()} == \
        {0: index.shards[0]["frames"], 4: index.shards[4]["frames"]}
    assert shards.index_entry(6)["keys"] == index.shards[6]["keys"]


def test_index_entries_are_read_over_http_with_or_without_range_requests(shard_dir):
    index = shard_format.read_index(shard_dir)
    for ranges in (False, True):  # without Range support the whole file comes
        with serve_directory(shard_dir, ranges=ranges) as url:
            shards = load_shard_list(f"{url}/data-0000{{0..8}}.tar")
            assert shards.index_entry(5)["keys"] == index.shards[5]["keys"]


def test_counts_parse_only_the_prefix_of_each_line_but_old_indexes_still_load(shard_dir,
                                                                              tmp_path):
    counts = read_index_counts(str(shard_dir / "index.jsonl"))
    index = shard_format.read_index(shard_dir)
    assert {name: values[:4] for name, values in counts.shards.items()} == {
        r["shard"]: (r["num_utts"], r["num_frames"], r["longest"], r["crc32"])
        for r in index.shards}
    lines = (shard_dir / "index.jsonl").read_bytes().splitlines(keepends=True)
    for position, record in enumerate(index.shards, 1):  # where each shard's line is
        offset, length, size = counts.shards[record["shard"]][4:]
        assert (offset, length) == (sum(map(len, lines[:position])), len(lines[position]))
        assert size == record["num_bytes"] == (shard_dir / record["shard"]).stat().st_size
    # An index without `longest` and with other field order (an older writer).
    lines = (shard_dir / "index.jsonl").read_text(encoding="utf-8").splitlines()
    old = [lines[0]]
    for line in lines[1:]:
        record = json.loads(line)
        del record["longest"]
        old.append(json.dumps(dict(reversed(list(record.items())))))
    (tmp_path / "index.jsonl").write_text("\n".join(old) + "\n", encoding="utf-8")
    old_counts = read_index_counts(str(tmp_path / "index.jsonl")).shards
    assert {n: v[:4] for n, v in old_counts.items()} == \
        {n: v[:4] for n, v in counts.shards.items()}
    (tmp_path / "index.jsonl").write_text(lines[0] + "\n{broken\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"index.jsonl:2: not JSON"):
        read_index_counts(str(tmp_path / "index.jsonl"))


def test_index_locations_and_names_of_urls_and_paths(shard_dir, tmp_path):
    local = str(shard_dir / "data-00000.tar")
    assert shardlist.index_location(local) == str(shard_dir / "index.jsonl")
    assert shardlist.index_location("https://host/a/b/data-1.tar") == \
        "https://host/a/b/index.jsonl"
    # A presigned or token URL keeps its query string for the index next to it.
    assert shardlist.index_location("https://host/a/data-1.tar?token=x&sig=y") == \
        "https://host/a/index.jsonl?token=x&sig=y"
    assert shardlist.shard_name("https://host/a/data-1.tar?token=x") == "data-1.tar"
    assert shardlist.shard_name("http://host/a%20b/data%201.tar") == "data 1.tar"
    assert shardlist.index_location(f"pipe:cat {local}") == str(shard_dir / "index.jsonl")
    assert shardlist.index_location("pipe:curl -s http://h/x/d-1.tar") == "http://h/x/index.jsonl"
    assert shardlist.index_location("pipe:curl -s 'http://h/x/d-1.tar?t=1'") == \
        "http://h/x/index.jsonl?t=1"
    assert shardlist.index_location("pipe:aws s3 cp s3://b/d-1.tar -") is None
    spaced = tmp_path / "with space"
    shutil.copytree(shard_dir, spaced)
    shards = load_shard_list(f"{spaced}/data-*.tar")
    assert shards.num_utts.tolist() == load_shard_list(f"{shard_dir}/data-*.tar").num_utts.tolist()
    assert shardlist.shard_name(shards.urls[0]) == "data-00000.tar"


def test_http_shards_with_query_strings_find_their_index(shard_dir):
    local = load_shard_list(f"{shard_dir}/data-*.tar")
    with serve_directory(shard_dir) as url:
        shards = load_shard_list(f"{url}/data-0000{{0..8}}.tar?token=abc")
    assert shards.num_utts.tolist() == local.num_utts.tolist()
    assert shards.crc32 == local.crc32 and not shards.estimated.any()


def test_index_missing_needs_an_estimate(shard_dir, tmp_path):
    for name in ("data-00000.tar", "data-00001.tar"):
        shutil.copy(shard_dir / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match=r"data-00000.tar: no utterance count \(no index "
                                                r"found at .*index.jsonl\).*utts_per_shard_"
                                                r"estimate"):
        load_shard_list(f"{tmp_path}/data-*.tar")
    shards = load_shard_list(f"{tmp_path}/data-*.tar", 100)
    assert shards.estimated.all() and shards.num_utts.tolist() == [100, 100]


def test_identity_follows_contents_not_locations(shard_dir, tmp_path):
    shards = load_shard_list(f"{shard_dir}/data-*.tar")
    moved = tmp_path / "moved"
    shutil.copytree(shard_dir, moved)
    assert load_shard_list(f"{moved}/data-*.tar").identity() == shards.identity()
    record = json.loads((moved / "index.jsonl").read_text().splitlines()[3])
    index = (moved / "index.jsonl").read_text().replace(record["crc32"], "0badc0de")
    (moved / "index.jsonl").write_text(index)
    changed = load_shard_list(f"{moved}/data-*.tar")
    assert changed.identity()["digest"] != shards.identity()["digest"]
    assert describe_change(shards.identity(), changed.identity(), changed.urls) == \
        f"shard {changed.urls[2]} changed (crc32 {record['crc32']} -> 0badc0de; repacked?)"
    fewer = load_shard_list(f"{moved}/data-0000{{0..7}}.tar")
    assert "has 8 shards, it had 9" in describe_change(shards.identity(), fewer.identity(),
                                                       fewer.urls)


def test_shards_are_dealt_largest_first_and_reshuffled_every_epoch():
    weights = np.array([5, 5, 5, 5, 1, 9, 2, 8, 5, 5, 5], np.float64)
    plans = {epoch: assign_shards(weights, seed=3, epoch=epoch, world_size=3)
             for epoch in range(1, 6)}
    for plan in plans.values():
        assert sorted(np.concatenate(plan).tolist()) == list(range(11))
        loads = [weights[p].sum() for p in plan]
        # Largest first: the loads differ by at most the smallest shard dealt last.
        assert max(loads) - min(loads) <= 5
    assert len({tuple(map(tuple, plan)) for plan in plans.values()}) == 5
    assert len({tuple(sorted(plan[0])) for plan in plans.values()}) > 1  # no static rank slice
    again = assign_shards(weights, seed=3, epoch=2, world_size=3)
    assert all(np.array_equal(a, b) for a, b in zip(again, plans[2], strict=True))
    in_order = assign_shards(weights, 0, 1, 2, shuffle=False)
    assert [p.tolist() for p in in_order] == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]]


def test_dealing_keeps_uneven_shards_within_one_shard_of_balance():
    rng = np.random.default_rng(0)
    for seed in range(200):
        sizes = rng.integers(4, 31, 5).astype(np.float64)
        for world_size in (2, 3):
            loads = [sizes[p].sum() for p in assign_shards(sizes, seed, 1, world_size)]
            assert max(loads) - min(loads) <= sizes.max()
    # 5 shards on 3 ranks: 13, 10 and 9 open the ranks, 8 and 6 go to the lightest.
    sizes = np.array([8, 10, 9, 13, 6], np.float64)
    for epoch in (1, 2, 3):
        loads = sorted(sizes[p].sum() for p in assign_shards(sizes, 0, epoch, 3))
        assert loads == [13, 16, 17]
