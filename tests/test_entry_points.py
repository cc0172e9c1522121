"""The verbs `python -m cat.train | decode | export EXP` and CAT's per-family names for them
(`cat.ctc.train`, `cat.rnnt.decode`, ...): the kind comes from config.json, an alias runs
only its kinds, and a verb and its alias give the same model and the same hypotheses."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from cat import train as cat_train
from cat.core.commands import run_verb
from cat.core.config import ConfigError
from cat.decoding.export import export_main
from cat.decoding.inference import main as decode_main
from cat.testing.training import write_tiny_experiment
from cat.training.checkpoint import load_checkpoint

NAME = "exp/tiny"
ATTENTION = {"num_layers": 1, "num_heads": 2, "ffn_dim": 32, "dropout": 0.0,
             "r2l_layers": 1, "reverse_weight": 0.3}


def _experiment(root, kind: str):
    experiment = write_tiny_experiment(root, kind="rnnt" if kind == "rnnt" else "ctc",
                                       num_train=16, num_dev=4, feat_dim=80,
                                       options={"epochs": 1})
    if kind == "u2":
        config = json.loads((experiment.exp_dir / "config.json").read_text())
        config["attention"] = ATTENTION
        (experiment.exp_dir / "config.json").write_text(json.dumps(config))
    return experiment


def _model(experiment) -> dict[str, torch.Tensor]:
    latest = sorted((experiment.exp_dir / "check").glob("ckpt-*.pt"))[-1]
    return load_checkpoint(latest)["model"]


@pytest.mark.parametrize("kind", ["ctc", "rnnt", "u2"])
def test_a_verb_and_its_alias_train_decode_and_export_alike(kind, tmp_path, monkeypatch):
    runs = {}
    for how in ("verb", "alias"):
        experiment = _experiment(tmp_path / how, kind)
        monkeypatch.chdir(experiment.root)
        family = "rnnt" if kind == "rnnt" else "ctc"
        if how == "verb":
            cat_train.main([NAME])
        else:
            run_verb(f"cat.{family}.train", [NAME])
        decode = [NAME, "--data", "data/fbank/dev", "--out", f"{NAME}/decode", "--device",
                  "cpu", "--beam-size", "3", "--checkpoint",
                  str(sorted((experiment.exp_dir / "check").glob("ckpt-*.pt"))[-1])]
        if kind == "u2":
            decode += ["--method", "attention_rescoring"]
        command = "cat.decode" if how == "verb" else f"cat.{family}.decode"
        assert decode_main(command, decode) == 0
        command = "cat.export" if how == "verb" else f"cat.{family}.export"
        assert export_main(command, [NAME]) == 0
        runs[how] = (_model(experiment), (experiment.exp_dir / "decode/hyp").read_text(),
                     json.loads((experiment.exp_dir / "export/export.json").read_text()))
    (verb_model, verb_hyp, verb_export), (alias_model, alias_hyp, alias_export) = \
        runs["verb"], runs["alias"]
    assert verb_model.keys() == alias_model.keys()
    assert all(torch.equal(verb_model[key], alias_model[key]) for key in verb_model)
    assert (kind == "u2") == any(key.startswith("attention.r2l.") for key in verb_model)
    assert verb_hyp == alias_hyp and verb_hyp.count("\n") == 4
    verb_export.pop("checkpoint", None), alias_export.pop("checkpoint", None)
    # The ONNX files are the same bytes; TorchScript archives (model.pt) are not.
    verb_files, alias_files = verb_export.pop("files"), alias_export.pop("files")
    assert {name: record for name, record in verb_files.items() if name.endswith(".onnx")} \
        == {name: record for name, record in alias_files.items() if name.endswith(".onnx")}
    assert verb_export == alias_export
    if kind == "u2":
        _check_nbest_rescoring(experiment)


def _check_nbest_rescoring(experiment) -> None:
    """The N-best passes (stage 5, `Searcher.nbest`) rank by attention rescoring too; with
    the decoder's weight 0 they are the prefix beam search's lists."""
    import kaldiio

    from cat.decoding.searcher import DecodeOptions, Searcher
    from cat.loading.batch import Utterance

    checkpoint = sorted((experiment.exp_dir / "check").glob("ckpt-*.pt"))[-1]
    features = kaldiio.load_scp("data/fbank/dev/feats.scp")
    batch = [Utterance(key, features[key], np.zeros(0, np.int32)) for key in sorted(features)]
    lists = {}
    for method, weight in (("beam", 1.0), ("attention_rescoring", 0.0), ("attention_rescoring",
                                                                          1.0)):
        options = DecodeOptions(method=method, beam_size=3, device="cpu",
                                method_options={"ctc_weight": 1.0, "decoder_weight": weight})
        searcher = Searcher(NAME, checkpoint, options, "cpu", [None])
        lists[method, weight] = [dict(hyps) for _, hyps in searcher.nbest(batch)[0]]
    beam = lists["beam", 1.0]
    assert [list(hyps) for hyps in lists["attention_rescoring", 0.0]] == \
        [list(hyps) for hyps in beam]
    for rescored, searched in zip(lists["attention_rescoring", 1.0], beam, strict=True):
        # The same hypotheses, each scored lower by the decoder's log-probability.
        assert rescored.keys() == searched.keys()
        assert all(rescored[text] < searched[text] for text in searched)


def test_an_alias_refuses_another_kind_and_names_the_verb(tmp_path, monkeypatch, caplog):
    experiment = _experiment(tmp_path, "rnnt")
    monkeypatch.chdir(experiment.root)
    with pytest.raises(ConfigError, match=r"exp/tiny/config.json: describes a rnnt model, but "
                                          r"cat.ctc.train handles ctc and crf models; run "
                                          r"python -m cat.train"):
        run_verb("cat.ctc.train", [NAME])
    assert decode_main("cat.ctc.decode", [NAME, "--data", "data/fbank/dev", "--out", "x"]) == 1
    assert ("describes a rnnt model, but cat.ctc.decode handles ctc and crf models; run "
            "python -m cat.decode") in caplog.text
    assert not (experiment.exp_dir / "check").exists()


@pytest.mark.parametrize("module", ["cat.train", "cat.decode", "cat.stream", "cat.export",
                                    "cat.ctc.train", "cat.ctc.decode", "cat.ctc.stream",
                                    "cat.ctc.export", "cat.rnnt.train", "cat.rnnt.decode",
                                    "cat.rnnt.stream", "cat.rnnt.export"])
def test_the_verbs_and_cat_s_names_run_as_modules(module):
    """CAT's names run their verb by name (`cat.core.commands.run_verb`) under their own."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert f"usage: python -m {module} " in result.stdout


def test_a_command_name_is_checked():
    for name in ("ctc.decode", "catx.decode", "cat."):
        with pytest.raises(ValueError, match="not a command name"):
            run_verb(name)
