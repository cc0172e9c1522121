"""ONNX export of CTC and RNN-T experiments (`python -m cat.ctc.export`, `cat.rnnt.export`):
onnxruntime and sherpa-onnx give PyTorch's greedy hypotheses on a tiny model whose
features are stage 1's fbank of real audio files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile
import torch

from cat.ctc import export as ctc_export
from cat.decoding.export import ExportError, export, export_main, read_metadata, sherpa_recognizer
from cat.decoding.searcher import load_model
from cat.rnnt import export as rnnt_export
from cat.rnnt.search import rnnt_greedy_search
from cat.testing.audio_experiment import train_audio_experiment
from cat.testing.training import write_tiny_experiment

pytestmark = pytest.mark.slow  # trains three tiny models (about 50 s in all)

EXP = "exp/tiny"


@pytest.fixture(scope="module", params=["ctc", "rnnt-stateless", "rnnt-lstm"])
def trained(request, tmp_path_factory):
    """(variant, experiment, checkpoint): one epoch of training, then the blank bias
    lowered so that greedy search emits tokens that depend on the features."""
    variant = request.param
    kind = variant.split("-")[0]

    def configure(config: dict) -> None:
        if variant == "rnnt-stateless":
            config["decoder"] = {"type": "StatelessPredictor",
                                 "kwargs": {"embed_dim": 8, "context_size": 2}}
        if variant == "ctc":  # an 8x frame-rate reduction, as the synthetic recipes have
            config["encoder"]["kwargs"]["time_reduction_factor"] = 2

    experiment, checkpoint = train_audio_experiment(tmp_path_factory.mktemp(variant), kind,
                                                    configure=configure)
    return variant, experiment, checkpoint


@pytest.fixture
def recipe(trained, monkeypatch):
    """`trained`, run from its recipe directory (paths in hyper-p.json are relative)."""
    monkeypatch.chdir(trained[1].root)
    return trained


def _references(kind: str, experiment, checkpoint: Path, max_symbols: int = 3):
    """PyTorch's greedy token ids per test utterance, and the tokenizer."""
    model, tokenizer = load_model(experiment.exp_dir, checkpoint, torch.device("cpu"))
    feats = dict(kaldiio.load_scp(str(experiment.test_features / "feats.scp")))
    hyps = {}
    with torch.no_grad():
        for key, matrix in sorted(feats.items()):
            x, lengths = torch.from_numpy(np.array(matrix))[None], torch.tensor([len(matrix)])
            if kind == "ctc":
                hyps[key] = model.decode(x, lengths, method="greedy")[0]
            else:
                encoder_out, out_lens = model.encoder(x, lengths)
                head = model.transducer
                hyps[key] = rnnt_greedy_search(head.predictor, head.joiner, encoder_out,
                                               out_lens, max_symbols)[0]
    return hyps, feats, tokenizer


def test_onnxruntime_gives_pytorch_hypotheses(recipe, tmp_path):
    variant, experiment, checkpoint = recipe
    kind = variant.split("-")[0]
    out = export(experiment.exp_dir, tmp_path / "export", checkpoint)
    hyps, feats, _ = _references(kind, experiment, checkpoint)
    # Hypotheses that differ from each other: a wrong input would show.
    assert all(hyps.values()) and len({tuple(h) for h in hyps.values()}) >= 4, hyps
    runner = (ctc_export.OnnxCtcDecoder if kind == "ctc" else rnnt_export.OnnxRnntDecoder)(out)
    assert {key: runner.decode(matrix) for key, matrix in feats.items()} == hyps
    if kind == "ctc":
        model, _ = load_model(experiment.exp_dir, checkpoint, torch.device("cpu"))
        matrix = feats[sorted(feats)[0]]
        with torch.no_grad():
            expected = model.log_probs(torch.from_numpy(matrix)[None],
                                       torch.tensor([len(matrix)]))[0].numpy()
        got = runner.session.run(None, {"x": matrix[None], "x_lens": np.array([len(matrix)])})
        np.testing.assert_allclose(got[0], expected, atol=1e-4)


def test_torchscript_export_equals_pytorch(recipe, tmp_path):
    # The TorchScript trace written next to each ONNX model, on inputs of other lengths
    # than the trace's example (a batch of three).
    variant, experiment, checkpoint = recipe
    kind = variant.split("-")[0]
    out = export(experiment.exp_dir, tmp_path / "export", checkpoint)
    model, _ = load_model(experiment.exp_dir, checkpoint, torch.device("cpu"))
    feats = dict(kaldiio.load_scp(str(experiment.test_features / "feats.scp")))
    matrices = [torch.from_numpy(np.array(feats[key])) for key in sorted(feats)[:3]]
    x = torch.nn.utils.rnn.pad_sequence(matrices, batch_first=True)
    lengths = torch.tensor([len(m) for m in matrices])
    extra = {"metadata.json": ""}
    traced = torch.jit.load(str(out / ("model.pt" if kind == "ctc" else "encoder.pt")),
                            _extra_files=extra)
    assert json.loads(extra["metadata.json"])["family"] == kind
    with torch.no_grad():
        if kind == "ctc":
            expected, expected_lens = model.log_probs(x, lengths)
        else:  # encoder.onnx / .pt hold the joiner's projection of the encoder's output
            encoder_out, expected_lens = model.encoder(x, lengths)
            expected = model.transducer.joiner.project_encoder(encoder_out)
        got, got_lens = traced(x, lengths)
    assert got_lens.tolist() == expected_lens.tolist()
    for i, n in enumerate(expected_lens.tolist()):
        torch.testing.assert_close(got[i, :n], expected[i, :n], atol=1e-5, rtol=0)


def test_sherpa_onnx_gives_pytorch_hypotheses_from_audio(recipe, tmp_path):
    variant, experiment, checkpoint = recipe
    kind = variant.split("-")[0]
    out = export(experiment.exp_dir, tmp_path / "export", checkpoint)
    if variant == "rnnt-lstm":
        with pytest.raises(ExportError, match="stateless predictor"):
            sherpa_recognizer(out)
        return
    # sherpa-onnx's transducer greedy search emits one token per frame at most, and never
    # <unk>: the same search in PyTorch.
    hyps, _, tokenizer = _references(kind, experiment, checkpoint, max_symbols=1)
    recognizer = sherpa_recognizer(out)
    got = {}
    for key, path in sorted(experiment.test_audio().items()):
        samples, rate = soundfile.read(str(path), dtype="float32")
        stream = recognizer.create_stream()
        stream.accept_waveform(rate, samples)
        recognizer.decode_stream(stream)
        got[key] = list(stream.result.tokens)
    expected = {key: [tokenizer.id_to_piece(t) for t in hyp if kind == "ctc" or t != 1]
                for key, hyp in hyps.items()}
    assert all(expected.values())
    assert got == expected


def test_export_command_uses_stage_4_checkpoint(recipe, capsys):
    variant, experiment, _ = recipe
    kind = variant.split("-")[0]
    assert export_main(f"cat.{kind}.export", [EXP]) == 0
    out = experiment.exp_dir / "export"
    assert capsys.readouterr().out.strip() == str(Path(EXP) / "export")
    names = ["model.onnx"] if kind == "ctc" else ["encoder.onnx", "decoder.onnx", "joiner.onnx"]
    traced = [name.replace(".onnx", ".pt") for name in names]
    assert sorted(p.name for p in out.iterdir()) == \
        sorted([*names, *traced, "export.json", "tokens.txt"])
    assert not (experiment.exp_dir / "export.tmp").exists()
    meta = json.loads((out / "export.json").read_text(encoding="utf-8"))
    assert meta["checkpoint"] == "avg-best-2.pt" and meta["family"] == kind
    factor = 8 if kind == "ctc" else 4
    assert (meta["sample_rate"], meta["feature_dim"], meta["subsampling_factor"]) == \
        (16000, 80, factor)
    onnx_meta = read_metadata(out / names[0])
    assert onnx_meta["subsampling_factor"] == str(factor) and onnx_meta["snip_edges"] == "1"
    tokens = (out / "tokens.txt").read_text(encoding="utf-8").splitlines()
    assert tokens[0] == "<blk> 0" and tokens[1] == "<unk> 1"
    assert len(tokens) == meta["vocab_size"]
    if variant == "rnnt-stateless":
        assert read_metadata(out / "decoder.onnx")["context_size"] == "2"


def _loaders(kind: str):
    """What reads an export folder: sherpa-onnx's recognizer (over this toolkit's helper),
    and the onnxruntime decoder of the family."""
    if kind == "ctc":
        return [sherpa_recognizer, ctc_export.OnnxCtcDecoder]
    return [rnnt_export.OnnxRnntDecoder]


def test_an_export_folder_is_checked_against_its_export_json(recipe, tmp_path):
    """export.json records the size and sha256 of each file: a model file of another export
    and a tokens.txt shorter than the vocabulary are errors naming the file when the
    folder is loaded (before: sherpa-onnx returned another model's text, exit 0, or died in
    IndexError: _Map_base::at)."""
    variant, experiment, checkpoint = recipe
    kind = variant.split("-")[0]
    out = export(experiment.exp_dir, tmp_path / "export", checkpoint)
    meta = json.loads((out / "export.json").read_text(encoding="utf-8"))
    assert set(meta["files"]) == {p.name for p in out.iterdir()} - {"export.json"}
    assert meta["files"]["tokens.txt"]["bytes"] == (out / "tokens.txt").stat().st_size
    for load in _loaders(kind):
        load(out)
    state = torch.load(checkpoint, weights_only=True)
    state["model"] = {name: value + 0.01 if value.is_floating_point() else value
                      for name, value in state["model"].items()}
    torch.save(state, tmp_path / "other.pt")
    other = export(experiment.exp_dir, tmp_path / "other", tmp_path / "other.pt")
    name = "model.onnx" if kind == "ctc" else "encoder.onnx"
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    shutil.copy(other / name, damaged / name)
    for load in _loaders(kind):
        with pytest.raises(ExportError, match=rf"{damaged / name}: not the file this export "
                                              r"wrote \(\d+ bytes, export\.json records \d+ "
                                              r"bytes\): another model's"):
            load(damaged)
    flipped = bytearray((out / name).read_bytes())
    flipped[len(flipped) // 2] ^= 1  # the same size, one bit changed
    (damaged / name).write_bytes(bytes(flipped))
    with pytest.raises(ExportError, match=rf"{damaged / name}: not the file this export wrote "
                                          r"\(sha256 [0-9a-f]{16}, export\.json records "
                                          r"[0-9a-f]{16}\)"):
        _loaders(kind)[0](damaged)
    shutil.copy(out / name, damaged / name)
    tokens = (out / "tokens.txt").read_text(encoding="utf-8").splitlines()
    (damaged / "tokens.txt").write_text("\n".join(tokens[:-3]) + "\n", encoding="utf-8")
    for load in _loaders(kind):
        with pytest.raises(ExportError, match=rf"{damaged / 'tokens.txt'}: {len(tokens) - 3} "
                                              r"tokens, but the model's vocabulary \(export\."
                                              rf"json vocab_size\) is {len(tokens)}"):
            load(damaged)


@pytest.mark.parametrize("kind", ["ctc", "rnnt"])
def test_export_without_checkpoint_is_an_error(kind, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_tiny_experiment(tmp_path, kind=kind)
    assert export_main(f"cat.{kind}.export", [EXP]) == 1
    error = capsys.readouterr().err
    assert "cannot export exp/tiny" in error and "no checkpoint" in error
    assert not (tmp_path / EXP / "export").exists()
    other = "rnnt" if kind == "ctc" else "ctc"
    with pytest.raises(ExportError, match=f"describes a {kind} model; export it with "
                                          "cat.export"):
        export(EXP, kind=other)
