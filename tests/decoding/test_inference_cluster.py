"""Stage 4 decoding as array tasks (`decode_set` / `decode_passes` given a launcher) on a
tiny trained model: the local backend runs the tasks as processes, the code path of a
Slurm cluster, and the outputs must be those of the process pool."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import cat
from cat.core.config import load_hyper
from cat.core.io import read_table, write_table
from cat.core.launch import ENDED, Launcher
from cat.decoding.checkpoint import select_checkpoint
from cat.decoding.inference import (
    DecodeOptions,
    FusionSpec,
    decode_passes,
    decode_set,
    plan_batches,
    read_lengths,
)
from cat.lm.ngram import estimate, write_arpa
from cat.stages import driver
from cat.testing.audio_experiment import write_audio_experiment
from cat.training.cli import train

EXP = "exp/tiny"
CHECKPOINT = "exp/tiny/check/avg-best-2.pt"
REPO_ROOT = Path(cat.__file__).resolve().parent.parent
#: what may differ between the pool's decode.log and the array's
TIMING = {"decode_seconds", "rtf", "backend"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trained tiny CTC experiment (its recipe directory)."""
    root = tmp_path_factory.mktemp("cluster")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("OMP_NUM_THREADS", "1")
        write_audio_experiment(root, kind="ctc")
        train(EXP, "cat.ctc.train")
        assert select_checkpoint(EXP, load_hyper(f"{EXP}/hyper-p.json")) == Path(CHECKPOINT)
    return root


@pytest.fixture
def recipe(trained, monkeypatch):
    """`trained`, run from its recipe directory; array tasks import this checkout."""
    monkeypatch.chdir(trained)
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    return trained


def _shares(data: Path, options: DecodeOptions) -> list[list[str]]:
    """The utterances of each of the `nj` shares of a feature dir."""
    batches = plan_batches(read_lengths(data), options.max_frames, options.batch_size)
    return [[key for batch in batches[i::options.nj] for key in batch]
            for i in range(options.nj)]


def _log(out: Path) -> dict:
    return json.loads((out / "decode.log").read_text(encoding="utf-8"))


def test_array_tasks_decode_as_the_process_pool(recipe, tmp_path):
    options = DecodeOptions(beam_size=4, nj=2, max_frames=300, device="cpu")
    data = recipe / "data/fbank/test"
    assert all(_shares(data, options)), "two shares, each with utterances"
    pool, array = tmp_path / "pool", tmp_path / "array"
    decode_set(EXP, data, CHECKPOINT, pool, options)
    decode_set(EXP, data, CHECKPOINT, array, options, Launcher("local"))
    hyp = (pool / "hyp").read_bytes()
    assert (array / "hyp").read_bytes() == hyp
    hyps = read_table(pool / "hyp", allow_empty_value=True)
    assert len(hyps) == 6 and len(set(hyps.values())) >= 4, hyps
    pool_log, array_log = _log(pool), _log(array)
    assert array_log["backend"] == "local" and "backend" not in pool_log
    assert {k: v for k, v in array_log.items() if k not in TIMING} == \
        {k: v for k, v in pool_log.items() if k not in TIMING}
    assert array_log["workers"] == 2 and array_log["device"] == "cpu"
    for task in (1, 2):
        lines = (array / f"log/decode.{task}.log").read_text(encoding="utf-8").splitlines()
        assert lines[-1] == f"{ENDED}0"
    assert not list((array / "log").glob("*.pkl"))


@pytest.mark.slow
def test_array_tasks_search_first_passes_as_the_process_pool(recipe, tmp_path):
    options = DecodeOptions(beam_size=4, nj=2, max_frames=300, device="cpu")
    data = recipe / "data/fbank/test"
    arpa = tmp_path / "lm.arpa"
    texts = [list(text) for text in read_table(recipe / "data/fbank/train/text").values()]
    write_arpa(estimate(texts, 2, (0.5, 1.0, 1.5)), arpa)
    specs = [None, FusionSpec(str(arpa), 0.5, 0.5)]
    for name, launcher in (("pool", None), ("array", Launcher("local"))):
        decode_passes(EXP, data, CHECKPOINT, options,
                      [(spec, tmp_path / name / str(i)) for i, spec in enumerate(specs)],
                      launcher, tmp_path / name / "log")
    assert sorted(p.name for p in (tmp_path / "array/log").glob("*.log")) == \
        ["decode.1.log", "decode.2.log"]
    for index in range(len(specs)):
        pool, array = tmp_path / "pool" / str(index), tmp_path / "array" / str(index)
        for name in ("hyp", "nbest.jsonl"):
            assert (array / name).read_bytes() == (pool / name).read_bytes(), name
        assert {k: v for k, v in _log(array).items() if k not in TIMING} == \
            {k: v for k, v in _log(pool).items() if k not in TIMING}
    assert (tmp_path / "pool/1/hyp").read_bytes() != (tmp_path / "pool/0/hyp").read_bytes()


def _corrupt(data: Path, key: str) -> None:
    """Point `key`'s feats.scp entry at bytes that are no Kaldi matrix."""
    (data / "bad.ark").write_bytes(b"this is not a matrix\n" * 4)
    scp = read_table(data / "feats.scp")
    scp[key] = str(data / "bad.ark") + ":0"
    write_table(data / "feats.scp", sorted(scp.items()))


def test_failed_task_is_named_with_its_log_and_stage_4_exits_1(recipe, tmp_path, monkeypatch,
                                                             caplog):
    copy = tmp_path / "recipe"
    shutil.copytree(recipe, copy, symlinks=True)
    monkeypatch.chdir(copy)
    data = copy / "data/fbank/test"
    options = DecodeOptions(beam_size=4, nj=2, max_frames=300)
    _corrupt(data, _shares(data, options)[1][0])
    assert driver.main(["decode", EXP, "--nj", "2",
                          "--cmd", "launch.sh --backend local"]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["decode: 1 of 2 task(s) failed: task 2 exited with status 1, see "
                      "exp/tiny/decode/test/log/decode.2.log"]
    logs = copy / EXP / "decode/test/log"
    assert "Traceback" in (logs / "decode.2.log").read_text(encoding="utf-8")
    assert (logs / "decode.1.log").read_text(encoding="utf-8").endswith(f"{ENDED}0\n")
    assert not (copy / EXP / "decode/test/hyp").exists()


def test_stage_4_decodes_again_when_the_hotwords_file_changes(recipe, monkeypatch):
    """Stage 4's record of a decoded set covers the hotwords file's content, not only its
    name: an edited list is decoded again, an unchanged one is not."""
    import cat.decoding.inference as inference

    hyper_path = Path(f"{EXP}/hyper-p.json")
    original = hyper_path.read_text(encoding="utf-8")
    hyper = json.loads(original)
    hotwords = Path("hotwords.txt")
    hotwords.write_text("你好\n", encoding="utf-8")
    hyper["inference"]["infer"]["option"] = {
        **hyper["inference"]["infer"].get("option", {}), "method": "beam",
        "hotwords": str(hotwords)}
    calls = []
    real = inference.decode_set
    monkeypatch.setattr(inference, "decode_set",
                        lambda *args, **kwargs: calls.append(args[1]) or real(*args, **kwargs))
    try:
        hyper_path.write_text(json.dumps(hyper), encoding="utf-8")
        driver.decode(EXP)
        decoded = len(calls)
        assert decoded >= 1
        driver.decode(EXP)
        assert len(calls) == decoded, "an unchanged hotwords file needs no new decoding"
        hotwords.write_text("你好\n世界 :3\n", encoding="utf-8")
        driver.decode(EXP)
        assert len(calls) == 2 * decoded, "an edited hotwords file is decoded again"
    finally:
        hyper_path.write_text(original, encoding="utf-8")
        shutil.rmtree(f"{EXP}/decode", ignore_errors=True)
