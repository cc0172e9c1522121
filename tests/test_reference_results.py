"""Reference results: the tiny CTC, RNN-T and CTC-CRF experiments train to, and decode to,
what `tests/reference/<kind>.json` recorded.

Each kind's tiny experiment (`cat.testing.training.write_tiny_experiment`, fixed seed, one
torch thread; CTC-CRF adds a bigram denominator graph) is trained with `python -m cat.train`
for 9 updates (3 epochs of 12 utterances in batches of 4), then its 6 dev utterances are
decoded with `python -m cat.decode`, greedy and beam search of width 4 (prefix beam search
for CTC and CTC-CRF). The test compares with the reference:

* the hypotheses of both searches, exactly;
* the training loss of every update (`exp/<name>/log/scalars.jsonl`) and the sum and sum
  of squares (float64) of every tensor of the final model, to a relative tolerance of
  1e-4, since floating point may differ in the last bits from one CPU to another. A
  sum's tolerance is relative to its tensor's norm times the square root of its size:
  the sum of a tensor of mixed signs cancels, and Adam turns an element's small
  gradient into a full step whatever its last bits, so a few elements of a tensor with
  small gradients move by rounding (the relative-position projection of the tiny
  model's attention did, 2.7e-4 of its norm, between two CPUs). The attention's key
  bias is not compared: softmax over the keys is the same whatever is added to all of
  a query's scores, so its gradient is zero but for rounding, which Adam makes full
  steps of (9e-9 against 1e-2 to 35 for the other tensors of the tiny model). Tensor
  names recorded in an earlier layout are compared under their current names
  (`cat.models.model.upgrade_state_dict`).

A refactor that is meant to leave training and decoding alone must leave these results
alone. A change that means to change them (initialisation, optimizer, loss, data order,
search) regenerates the references deliberately, and its commit says so:

    CAT_UPDATE_REFERENCE=1 python -m pytest tests/test_reference_results.py

With `CAT_UPDATE_REFERENCE=1` the test writes the files instead of comparing (and passes);
review their diff before committing it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from cat import train as cat_train
from cat.decoding.inference import main as decode_main
from cat.graph.den_graph import build_for_tokenizer
from cat.models.model import upgrade_state_dict
from cat.testing.training import TinyExperiment, write_tiny_experiment
from cat.training.checkpoint import load_checkpoint

UPDATE_VARIABLE = "CAT_UPDATE_REFERENCE"
REFERENCE_DIR = Path(__file__).parent / "reference"
NAME = "exp/tiny"
SEED = 3
REL_TOL = 1e-4
#: Tensors whose gradient is zero in exact arithmetic (see the module docstring).
ROUNDING_ONLY = ("attn.linear_k.bias",)
METHODS = ("greedy", "beam")
OPTIONS = {"epochs": 3, "batch_size": 4, "threads": 1, "workers": 0, "log_interval": 1}


def _experiment(root: Path, kind: str) -> TinyExperiment:
    """The tiny experiment of `kind`; CTC-CRF is the CTC one with a denominator graph."""
    experiment = write_tiny_experiment(root, NAME, kind="rnnt" if kind == "rnnt" else "ctc",
                                       num_train=12, num_dev=6, feat_dim=8,
                                       options=OPTIONS, seed=SEED)
    if kind == "crf":
        build_for_tokenizer(experiment.exp_dir / "tokenizer.tknz", [experiment.train.text],
                            experiment.exp_dir / "den_lm.npz", order=2)
        path = experiment.exp_dir / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        config["trainer"] = {"use_crf": True, "den_lm": f"{NAME}/den_lm.npz"}
        path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return experiment


def _checkpoint(experiment: TinyExperiment) -> Path:
    return sorted((experiment.exp_dir / "check").glob("ckpt-*.pt"))[-1]


def _losses(experiment: TinyExperiment) -> list[float]:
    """The training loss of every update, in update order."""
    losses = {}
    with open(experiment.exp_dir / "log/scalars.jsonl", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record["tag"] == "loss/train":
                losses[record["step"]] = record["value"]
    return [losses[step] for step in sorted(losses)]


def _weights(experiment: TinyExperiment) -> dict[str, list[float]]:
    """[sum, sum of squares] (float64) of every floating-point tensor of the final model,
    and its size (not written to the reference)."""
    model = load_checkpoint(_checkpoint(experiment))["model"]
    summary = {}
    for key in sorted(model):
        tensor = model[key]
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float64)
            summary[key] = [tensor.sum().item(), tensor.square().sum().item(),
                            tensor.numel()]
    return summary


def _hypotheses(experiment: TinyExperiment, method: str) -> list[str]:
    """The `hyp` lines of the dev set decoded with `method`."""
    out = f"{NAME}/decode-{method}"
    assert decode_main("cat.decode", [
        NAME, "--data", "data/fbank/dev", "--out", out, "--device", "cpu", "--nj", "1",
        "--method", method, "--beam-size", "4", "--checkpoint",
        str(_checkpoint(experiment))]) == 0
    return (experiment.root / out / "hyp").read_text(encoding="utf-8").splitlines()


def _results(root: Path, kind: str) -> dict[str, Any]:
    experiment = _experiment(root, kind)
    cat_train.main([NAME])
    return {"losses": _losses(experiment), "weights": _weights(experiment),
            "hypotheses": {method: _hypotheses(experiment, method) for method in METHODS}}


def _close(reference: float, actual: float, scale: float) -> bool:
    return math.isclose(actual, reference, rel_tol=REL_TOL, abs_tol=REL_TOL * scale)


def _loss_differences(reference: list[float], actual: list[float]) -> list[str]:
    if len(reference) != len(actual):
        return [f"training ran {len(actual)} updates, the reference {len(reference)}"]
    for step, (ref, got) in enumerate(zip(reference, actual, strict=True), start=1):
        if not _close(ref, got, 0.0):
            return [f"training loss first differs at update {step}: {got!r}, reference "
                    f"{ref!r}"]
    return []


def _weight_differences(reference: dict[str, list[float]], actual: dict[str, list[float]]
                        ) -> list[str]:
    if reference.keys() != actual.keys():
        return [f"model tensors differ: only in the reference "
                f"{sorted(reference.keys() - actual.keys())}, only now "
                f"{sorted(actual.keys() - reference.keys())}"]
    differing = [key for key, (ref_sum, ref_squares) in reference.items()
                 if not key.endswith(ROUNDING_ONLY)
                 and not (_close(ref_sum, actual[key][0],
                                 math.sqrt(ref_squares * actual[key][2]))
                          and _close(ref_squares, actual[key][1], 0.0))]
    if not differing:
        return []
    key = differing[0]
    return [f"final weights differ in {len(differing)} of {len(reference)} tensors, first in "
            f"{key}: [sum, sum of squares] {actual[key]}, reference {reference[key]}"]


def _hypothesis_differences(reference: dict[str, list[str]], actual: dict[str, list[str]]
                            ) -> list[str]:
    found = []
    for method in METHODS:
        ref, got = reference.get(method, []), actual[method]
        if len(ref) != len(got):
            found.append(f"{method} decoded {len(got)} utterances, the reference {len(ref)}")
            continue
        differing = [(r, g) for r, g in zip(ref, got, strict=True) if r != g]
        if differing:
            found.append(f"{method} hypotheses differ for {len(differing)} of {len(ref)} "
                         f"utterances, first: {differing[0][1]!r}, reference "
                         f"{differing[0][0]!r}")
    return found


def _differences(reference: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    return (_loss_differences(reference["losses"], actual["losses"])
            + _weight_differences(upgrade_state_dict(reference["weights"]), actual["weights"])
            + _hypothesis_differences(reference["hypotheses"], actual["hypotheses"]))


@pytest.mark.parametrize("kind", ["ctc", "rnnt", "crf"])
def test_tiny_experiments_give_the_reference_results(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    actual = _results(tmp_path, kind)
    path = REFERENCE_DIR / f"{kind}.json"
    if os.environ.get(UPDATE_VARIABLE) == "1":
        path.parent.mkdir(exist_ok=True)
        recorded = {**actual, "weights": {key: value[:2]
                                          for key, value in actual["weights"].items()}}
        path.write_text(json.dumps(recorded, ensure_ascii=False, indent=1) + "\n",
                        encoding="utf-8")
        return
    assert path.is_file(), (f"{path.name}: no reference; write it with {UPDATE_VARIABLE}=1 "
                            f"(see this module's docstring)")
    differences = _differences(json.loads(path.read_text(encoding="utf-8")), actual)
    assert not differences, (
        f"the tiny {kind} experiment no longer gives tests/reference/{kind}.json:\n  "
        + "\n  ".join(differences)
        + f"\nIf the change means to change training or decoding, regenerate the reference "
          f"with {UPDATE_VARIABLE}=1 python -m pytest tests/{Path(__file__).name} and say so "
          f"in the commit; otherwise the change altered results it should not have.")
