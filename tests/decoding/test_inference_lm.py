"""Decoding with language models on a tiny experiment: several first passes in one run,
N-best lists on disk, and agreement with the stage-4 decoder when the LM weighs nothing."""

from __future__ import annotations

import json

import pytest
import torch

from cat.core.config import CONFIG_NAME, load_config, load_hyper, tokenizer_file
from cat.core.io import read_table
from cat.decoding.inference import DecodeOptions, FusionSpec, decode_passes, decode_set
from cat.lm.ngram import estimate, write_arpa
from cat.lm.rescore import read_nbest
from cat.models.registry import build_model
from cat.testing.training import write_tiny_experiment
from cat.text.tokenizer import load as load_tokenizer

pytest.importorskip("kenlm")


@pytest.fixture(params=["ctc", "rnnt"])
def experiment(request, tmp_path):
    tiny = write_tiny_experiment(tmp_path, kind=request.param, num_train=12, num_dev=6)
    exp_dir = tiny.exp_dir
    hyper = load_hyper(exp_dir / "hyper-p.json")
    tokenizer = load_tokenizer(tmp_path / tokenizer_file(hyper, "hyper-p.json"))
    torch.manual_seed(0)
    model = build_model(load_config(exp_dir / CONFIG_NAME), tokenizer.vocab_size)
    checkpoint = exp_dir / "random.pt"
    torch.save({"model": model.state_dict()}, checkpoint)
    texts = [list(text) for _, text in read_table(tiny.train.text).items()]
    arpa = tmp_path / "lm.arpa"
    write_arpa(estimate(texts, 3, (0.5, 1.0, 1.5)), arpa)
    return request.param, tiny, checkpoint, arpa


def test_passes_share_a_run_and_a_weightless_lm_changes_nothing(experiment, tmp_path,
                                                                monkeypatch):
    _kind, tiny, checkpoint, arpa = experiment
    monkeypatch.chdir(tiny.root)
    options = DecodeOptions(beam_size=3, nj=1, device="cpu")
    data = tiny.root / "data/fbank/dev"
    passes = [(None, tmp_path / "nolm"), (FusionSpec(str(arpa), 0.0), tmp_path / "zero"),
              (FusionSpec(str(arpa), 2.0, 1.0, str(arpa), 0.5), tmp_path / "lm")]
    summaries = decode_passes(tiny.exp_dir, data, checkpoint, options, passes)
    assert [s.num_utts for s in summaries] == [6, 6, 6]
    nbests = {name: read_nbest(tmp_path / name / "nbest.jsonl")
              for name in ("nolm", "zero", "lm")}
    for name, nbest in nbests.items():
        assert len(nbest) == 6
        hyps = read_table(tmp_path / name / "hyp", allow_empty_value=True)
        for utt, entries in nbest.items():
            assert 1 <= len(entries) <= 3
            scores = [score for _, score in entries]
            assert scores == sorted(scores, reverse=True)
            assert hyps[utt] == entries[0][0]
        log = json.loads((tmp_path / name / "decode.log").read_text())
        assert log["passes_in_run"] == 3 and log["num_utts"] == 6
    assert nbests["zero"] == nbests["nolm"]
    assert nbests["lm"] != nbests["nolm"]
    assert json.loads((tmp_path / "lm" / "decode.log").read_text())["fusion"]["lodr_weight"] \
        == 0.5
    # The LM path without LM decodes exactly as stage 4 does.
    decode_set(tiny.exp_dir, data, checkpoint, tmp_path / "stage4", options)
    assert (tmp_path / "stage4" / "hyp").read_text(encoding="utf-8") == \
        (tmp_path / "nolm" / "hyp").read_text(encoding="utf-8")


def test_greedy_cannot_use_an_lm(experiment, tmp_path):
    _kind, tiny, checkpoint, arpa = experiment
    options = DecodeOptions(method="greedy", nj=1, device="cpu")
    with pytest.raises(ValueError, match="needs method 'beam'"):
        decode_passes(tiny.exp_dir, tiny.root / "data/fbank/dev", checkpoint, options,
                      [(FusionSpec(str(arpa), 0.3), tmp_path / "lm")])
