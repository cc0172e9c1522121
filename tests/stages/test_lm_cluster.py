"""Stage 5 as array tasks (`decode_lm` given a launcher) on a tiny trained model: LM
estimation, TLG graphs, first passes and WFST decoding run as the tasks of arrays through
the local backend (the code path of a Slurm cluster), and give the figures of the run
without one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import cat
from cat.core.config import CONFIG_NAME, HYPER_NAME, load_config
from cat.core.io import read_table
from cat.core.launch import ENDED, Launcher
from cat.models.registry import build_model
from cat.stages.lm import decode_lm
from cat.testing.audio_experiment import write_audio_experiment
from cat.text.tokenizer import load as load_tokenizer
from cat.training.checkpoint import CheckpointManager

pytest.importorskip("kenlm")
pytest.importorskip("kaldifst")

EXP = "exp/tiny"
REPO_ROOT = Path(cat.__file__).resolve().parent.parent
LMS = {"lm-char-3gram": ("char", 3), "lm-char-2gram": ("char", 2),
       "lm-word-2gram": ("word", 2)}
SETTINGS = {
    "char-3gram": {"fusion": {"lm": "exp/lm-char-3gram", "alpha": [0.3, 0.6], "beta": 0.5,
                              "lodr": "exp/lm-char-2gram", "lodr_weight": [0.0, 0.2]}},
    "word-2gram": {"rescore": {"lm": "exp/lm-word-2gram", "alpha": [0.3, 0.6],
                               "beta": [0.0, 1.0]}},
    "tlg": {"wfst": {"lm": "exp/lm-word-2gram", "lm_weight": [0.5, 1.0]}},
}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """A tiny CTC experiment with LM experiments and `inference.lm` settings, not yet
    through stage 5. Its model is randomly initialised: a model this small trained on a
    few seconds of audio outputs blanks only, and TLG decoding would find no word."""
    root = tmp_path_factory.mktemp("lm-cluster")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        write_audio_experiment(root, kind="ctc")
    exp_dir = root / EXP
    tokenizer = load_tokenizer(exp_dir / "tokenizer.tknz")
    torch.manual_seed(0)
    model = build_model(load_config(exp_dir / CONFIG_NAME), tokenizer.vocab_size)
    CheckpointManager(exp_dir / "check").save({"model": model.state_dict()}, 1, 1, 1.0)
    for name, (unit, order) in LMS.items():
        (root / "exp" / name).mkdir(parents=True)
        (root / "exp" / name / "lm.json").write_text(json.dumps(
            {"unit": unit, "order": order, "text": ["data/fbank/train/text"],
             "discount_fallback": [0.5, 1.0, 1.5]}), encoding="utf-8")
    hyper = json.loads((exp_dir / HYPER_NAME).read_text(encoding="utf-8"))
    del hyper["inference"]["avgmodel"]  # the one checkpoint
    hyper["inference"]["lm"] = {"settings": SETTINGS}
    (exp_dir / HYPER_NAME).write_text(json.dumps(hyper, ensure_ascii=False), encoding="utf-8")
    return root


def _stage5(recipe: Path, copy: Path, launcher: Launcher | None, monkeypatch) -> Path:
    shutil.copytree(recipe, copy, symlinks=True)
    monkeypatch.chdir(copy)
    return decode_lm(EXP, nj=2, launcher=launcher)


def _figures(table: Path) -> list[list[str]]:
    """The rows of RESULTS-lm.md without their RTF cells (timings)."""
    rows = []
    for line in table.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) > 2 and re.fullmatch(r"[0-9.]+", cells[2]):
            rows.append(cells[:2] + cells[2::2])
    return rows


def _outputs(copy: Path) -> dict[str, bytes]:
    """What stage 5 wrote that holds no timing: LMs, weights, hypotheses, N-best lists."""
    exp = copy / EXP / "decode-lm"
    files = [*copy.glob("exp/lm-*/lm.arpa"), *exp.glob("*/weights.json"),
             *exp.glob("**/hyp"), *exp.glob("**/nbest.jsonl"), *exp.glob("*/graph/TLG.fst")]
    return {str(path.relative_to(copy)): path.read_bytes() for path in files}


@pytest.mark.slow
def test_stage_5_through_array_tasks_gives_the_figures_of_the_run_without(recipe, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    here = _stage5(recipe, tmp_path / "here", None, monkeypatch)
    array = _stage5(recipe, tmp_path / "array", Launcher("local"), monkeypatch)
    figures = _figures(here)
    assert [row[0] for row in figures] == ["none", "char-3gram", "word-2gram", "tlg"]
    assert _figures(array) == figures
    expected = _outputs(tmp_path / "here")
    assert len(expected) == 21, sorted(expected)
    tlg = read_table(tmp_path / "here" / EXP / "decode-lm/tlg/test/hyp", allow_empty_value=True)
    assert len(tlg) == 6 and any(tlg.values()), tlg
    assert _outputs(tmp_path / "array") == expected
    # Every part ran as array tasks, each with its log.
    exp = tmp_path / "array" / EXP / "decode-lm"
    logs = {str(path.relative_to(exp)) for path in exp.glob("**/*.log")
            if path.parent.name == "log"}
    assert logs == {"log/train-lm.1.log", "log/train-lm.2.log", "log/train-lm.3.log",
                    "log/tlg.1.log", "first-pass/test/log/decode.1.log",
                    "first-pass/test/log/decode.2.log", "tlg/log/wfst-test.1.log",
                    "tlg/log/wfst-test.2.log"}
    for log in logs:
        assert (exp / log).read_text(encoding="utf-8").endswith(f"{ENDED}0\n"), log
    first_pass = json.loads((exp / "first-pass/test/nolm/decode.log").read_text())
    assert (first_pass["backend"], first_pass["workers"]) == ("local", 2)
    assert not (tmp_path / "here" / EXP / "decode-lm/log").exists()
