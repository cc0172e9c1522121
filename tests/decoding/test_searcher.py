"""The model decoding builds (`cat.decoding.searcher.load_model`): a `config.json` changed
since the checkpoint was trained is refused by decoding, transcription, streaming and
export, naming the changed keys, unless the change is accepted explicitly; averaged
checkpoints keep the config their checkpoints were trained with; checkpoints written
before checkpoints recorded it decode with a warning."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from cat.core.config import ConfigError, load_experiment
from cat.decoding.audio import from_files
from cat.decoding.checkpoint import ModelConfigChangedError, select_checkpoint
from cat.decoding.export import export_main
from cat.decoding.inference import decode_set
from cat.decoding.inference import main as decode_main
from cat.decoding.online import main as stream_main
from cat.decoding.searcher import DecodeOptions, Searcher, load_model
from cat.decoding.transcribe import transcribe
from cat.models.registry import build_model
from cat.testing.training import write_tiny_experiment
from cat.text.tokenizer import load as load_tokenizer
from cat.training.checkpoint import CheckpointManager
from cat.training.manager import training_settings

NAME = "exp/tiny"
CONFIG = f"{NAME}/config.json"
FIRST = f"{NAME}/check/ckpt-e001-s00000010.pt"
OPTIONS = DecodeOptions(method="greedy", device="cpu")
ACCEPT = ("Restore it, or accept the change explicitly: --allow-config-change (the decode, "
          "stream and export commands), or inference.infer.option.allow_config_change: true "
          "in hyper-p.json (stage 4 and the decode command)")


def _changes(checkpoint: str) -> str:
    """The error of a model whose convolutions became causal and whose frame rate halved
    (no parameters change: the weights still fit)."""
    return (f"{checkpoint}: {CONFIG} changed since this model was trained: "
            "encoder.kwargs.causal_conv: (absent) -> true; encoder.kwargs.max_chunk_size: "
            "(absent) -> 4; encoder.kwargs.time_reduction_factor: (absent) -> 2; "
            "encoder.kwargs.time_reduction_mode: (absent) -> \"subsample\". The model built "
            f"from it would compute something else with the same weights. {ACCEPT}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny experiment (80-dim features) with three checkpoints in the training's
    format, as a training of its config.json writes them (weights of an untrained model)."""
    root = tmp_path_factory.mktemp("recipe")
    experiment = write_tiny_experiment(root, feat_dim=80, num_train=8, num_dev=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        loaded = load_experiment(NAME)
        vocab = load_tokenizer(f"{NAME}/tokenizer.tknz").vocab_size
        manager = CheckpointManager(f"{NAME}/check", keep=5)
        for step in (10, 20, 30):
            torch.manual_seed(step)
            model = build_model(loaded.config, vocab)
            manager.save({"format": "cat-checkpoint", "version": 1,
                          "model": model.state_dict(), "epoch": 1, "step": step,
                          "meta": {"num_classes": vocab, "train_bin": "cat.ctc.train",
                                   "settings": training_settings(loaded)}},
                         1, step, dev_loss=1.0 / step)
    return experiment


@pytest.fixture
def recipe(trained, monkeypatch):
    """`trained`, run from its recipe directory; config.json and hyper-p.json restored
    after the test."""
    monkeypatch.chdir(trained.root)
    saved = {path: path.read_text() for path in (trained.exp_dir / "config.json",
                                                 trained.hyper_path,
                                                 trained.exp_dir / "tokenizer.tknz")}
    yield trained
    for path, text in saved.items():
        path.write_text(text)
    for made in ("check/avg-best-2.pt", "check/avg-best-2.pt.done", "decode", "export",
                 "stream"):
        path = trained.exp_dir / made
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _make_streaming(experiment) -> None:
    """Edit config.json as a user turning on streaming and CAT's time reduction after
    training would: no parameter changes."""
    path = experiment.exp_dir / "config.json"
    config = json.loads(path.read_text())
    config["encoder"]["kwargs"].update(causal_conv=True, max_chunk_size=4,
                                       time_reduction_factor=2,
                                       time_reduction_mode="subsample")
    path.write_text(json.dumps(config))


def _accept_in_hyper(experiment) -> None:
    hyper = experiment.hyper()
    hyper["inference"]["infer"]["option"]["allow_config_change"] = True
    experiment.hyper_path.write_text(json.dumps(hyper))


def _wav(directory: Path) -> Path:
    path = directory / "utt.wav"
    samples = np.random.default_rng(0).normal(scale=0.1, size=16000).astype(np.float32)
    soundfile.write(path, samples, 16000)
    (directory / "wav.scp").write_text(f"utt {path}\n")
    return path


def test_decoding_a_model_whose_config_changed_since_training_is_refused(recipe):
    _make_streaming(recipe)
    with pytest.raises(ModelConfigChangedError, match=re.escape(_changes(FIRST))):
        decode_set(NAME, "data/fbank/dev", FIRST, f"{NAME}/decode", OPTIONS)
    assert not (recipe.exp_dir / "decode/hyp").exists()


def test_transcription_and_streaming_refuse_it_too(recipe, capsys):
    _make_streaming(recipe)
    with pytest.raises(ModelConfigChangedError, match=re.escape(_changes(FIRST))):
        Searcher(NAME, FIRST, OPTIONS, "cpu")
    wav = _wav(recipe.root)
    with pytest.raises(ModelConfigChangedError, match=re.escape(_changes(FIRST))):
        transcribe(NAME, from_files([str(wav)]), FIRST, OPTIONS)
    status = stream_main("cat.ctc.stream", [
        NAME, "--wav-scp", "wav.scp", "--chunk-size", "4", "--checkpoint", FIRST,
        "--out", f"{NAME}/stream"])
    assert status == 1
    assert f"error: {_changes(FIRST)}" in capsys.readouterr().err
    assert not (recipe.exp_dir / "stream").exists()


def test_export_refuses_it_and_writes_nothing(recipe, capsys):
    _make_streaming(recipe)
    # Stage 4's model: the average of the two best checkpoints, which keeps their config.
    assert export_main("cat.ctc.export", [NAME]) == 1
    assert f"error: {_changes(f'{NAME}/check/avg-best-2.pt')}" in capsys.readouterr().err
    assert not (recipe.exp_dir / "export").exists()


def test_the_decode_and_export_commands_refuse_it_unless_told_to_accept_it(recipe, caplog):
    _make_streaming(recipe)
    decode = [NAME, "--data", "data/fbank/dev", "--checkpoint", FIRST, "--out",
              f"{NAME}/decode", "--method", "greedy", "--device", "cpu"]
    assert decode_main("cat.ctc.decode", decode) == 1
    assert _changes(FIRST) in caplog.text
    assert decode_main("cat.ctc.decode", [*decode, "--allow-config-change"]) == 0
    assert (recipe.exp_dir / "decode/hyp").is_file()
    assert export_main("cat.ctc.export",
                       [NAME, "--checkpoint", FIRST, "--allow-config-change"]) == 0
    assert (recipe.exp_dir / "export/model.onnx").is_file()


def test_averaged_checkpoints_record_the_config_they_were_trained_with(recipe):
    average = select_checkpoint(NAME, recipe.hyper())
    assert average == Path(f"{NAME}/check/avg-best-2.pt")
    saved = torch.load(average, weights_only=True)
    assert saved["averaged_from"] == ["ckpt-e001-s00000030.pt", "ckpt-e001-s00000020.pt"]
    assert saved["meta"]["settings"]["config.json"] == json.loads(
        (recipe.exp_dir / "config.json").read_text())
    _make_streaming(recipe)
    with pytest.raises(ModelConfigChangedError, match=re.escape(_changes(str(average)))):
        load_model(NAME, average, torch.device("cpu"))


def test_an_accepted_change_is_logged_and_decoded(recipe, capsys, caplog):
    _make_streaming(recipe)
    _accept_in_hyper(recipe)
    options = DecodeOptions.of_experiment(recipe.hyper(), "hyper-p.json",
                                          {"method": "greedy", "device": "cpu"})
    assert options.allow_config_change
    with caplog.at_level(logging.WARNING):
        decode_set(NAME, "data/fbank/dev", FIRST, f"{NAME}/decode", options)
    assert (f"{FIRST}: {CONFIG} changed since this model was trained (accepted by "
            "allow_config_change): encoder.kwargs.causal_conv: (absent) -> true;"
            in caplog.text)
    log = json.loads((recipe.exp_dir / "decode/decode.log").read_text())
    assert log["allow_config_change"] is True and log["num_utts"] == 4
    hyper = recipe.hyper()  # streaming: accepted on its command line
    hyper["inference"]["infer"]["option"].pop("allow_config_change")
    recipe.hyper_path.write_text(json.dumps(hyper))
    _wav(recipe.root)
    assert stream_main("cat.ctc.stream", [
        NAME, "--wav-scp", "wav.scp", "--chunk-size", "4", "--checkpoint", FIRST,
        "--out", f"{NAME}/stream", "--allow-config-change"]) == 0
    assert (recipe.exp_dir / "stream/hyp").is_file()


def test_optimizer_settings_are_not_part_of_the_model(recipe, caplog):
    path = recipe.exp_dir / "config.json"
    config = json.loads(path.read_text())
    config["scheduler"]["kwargs"]["peak_lr"] = 0.5
    path.write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        load_model(NAME, FIRST, torch.device("cpu"))
    assert "changed since" not in caplog.text


def test_a_checkpoint_without_a_recorded_config_decodes_with_a_warning(recipe, caplog):
    old = recipe.exp_dir / "old.pt"
    state = torch.load(FIRST, weights_only=True)
    del state["meta"]["settings"]
    torch.save(state, old)
    _make_streaming(recipe)
    with caplog.at_level(logging.WARNING):
        load_model(NAME, old, torch.device("cpu"))
    assert (f"{old} records no config.json (written before checkpoints recorded theirs): "
            f"{CONFIG} cannot be compared with the config it was trained with, only the "
            "parameter shapes are") in caplog.text
    old.unlink()


FRONT_END_CHANGES = ('hyper-p.json: data.front_end: high_freq: 0.0 -> -400.0; hyper-p.json: '
                     'data.front_end: name: "kaldi" -> "sherpa-onnx"; hyper-p.json: '
                     'data.front_end: snip_edges: true -> false')


def _interface_error(checkpoint: str, changes: str) -> str:
    return (f"{checkpoint}: what defines the model's input and output changed since it was "
            f"trained: {changes}. Features of another front end, or ids of another tokenizer, "
            f"give wrong text without an error. {ACCEPT}")


def test_a_front_end_edited_after_training_is_refused_by_every_verb(recipe, capsys, caplog):
    """hyper-p.json's data.front_end edited after training: decoding, transcription,
    streaming and export compute it (before: they did, exit 0), so each refuses it, naming
    the key and how to accept it; accepted, it is logged."""
    hyper = recipe.hyper()
    hyper["data"]["front_end"] = "sherpa-onnx"
    recipe.hyper_path.write_text(json.dumps(hyper))
    error = re.escape(_interface_error(FIRST, FRONT_END_CHANGES))
    with pytest.raises(ModelConfigChangedError, match=error):
        decode_set(NAME, "data/fbank/dev", FIRST, f"{NAME}/decode", OPTIONS)
    wav = _wav(recipe.root)
    with pytest.raises(ModelConfigChangedError, match=error):
        transcribe(NAME, from_files([str(wav)]), FIRST, OPTIONS)
    assert stream_main("cat.ctc.stream", [NAME, "--wav-scp", "wav.scp", "--chunk-size", "4",
                                          "--checkpoint", FIRST, "--out", f"{NAME}/stream"]) == 1
    assert f"error: {_interface_error(FIRST, FRONT_END_CHANGES)}" in capsys.readouterr().err
    assert export_main("cat.ctc.export", [NAME, "--checkpoint", FIRST]) == 1
    assert f"error: {_interface_error(FIRST, FRONT_END_CHANGES)}" in capsys.readouterr().err
    assert not (recipe.exp_dir / "export").exists() and not (recipe.exp_dir / "stream").exists()
    with caplog.at_level(logging.WARNING):
        assert decode_main("cat.ctc.decode", [NAME, "--audio", str(wav), "--checkpoint", FIRST,
                                              "--method", "greedy", "--device", "cpu",
                                              "--allow-config-change"]) == 0
    assert (f"{FIRST}: what defines the model's input and output changed since it was "
            f"trained (accepted by allow_config_change): {FRONT_END_CHANGES}") in caplog.text


def test_another_tokenizer_than_the_models_is_refused(recipe):
    """A tokenizer of as many ids as the model's, mapping them to other pieces: every
    weight fits, every id would be read as another piece; refused by its digest."""
    from tests.faults.test_bad_inputs import another_tokenizer_of_the_same_size

    another_tokenizer_of_the_same_size(recipe.exp_dir / "tokenizer.tknz")
    with pytest.raises(ModelConfigChangedError, match=re.escape(_interface_error(
            FIRST, 'the tokenizer: digest: "').rsplit("digest", 1)[0]) +
            r'digest: "[0-9a-f]{16}" -> "[0-9a-f]{16}"\. Features of another front end'):
        decode_set(NAME, "data/fbank/dev", FIRST, f"{NAME}/decode", OPTIONS)


def test_features_of_another_front_end_than_the_models_are_refused(recipe, caplog):
    """`python -m cat.decode EXP --data DIR`: DIR's features (its fbank.json) must be of the
    front end the model was trained on, as stage 4 checks its test sets (before: decoded
    into wrong text, exit 0)."""
    from cat.features.fbank import FRONT_ENDS, write_front_end

    other = recipe.root / "data/fbank-sherpa-onnx/dev"
    shutil.copytree(recipe.root / "data/fbank/dev", other)
    write_front_end(other, FRONT_ENDS["sherpa-onnx"])
    decode = [NAME, "--data", str(other), "--checkpoint", FIRST, "--out", f"{NAME}/decode",
              "--method", "greedy", "--device", "cpu"]
    assert decode_main("cat.ctc.decode", decode) == 1
    assert (f"{other}: its features were computed with the sherpa-onnx front end (fbank.json), "
            f"but {FIRST} was trained on the kaldi front end (high_freq: 0.0 -> -400.0; "
            "snip_edges: true -> false): it would decode them into wrong text without an "
            "error. Extract them with that front end (run.sh --front_end kaldi), or accept "
            "the change explicitly: --allow-config-change") in caplog.text
    assert not (recipe.exp_dir / "decode/hyp").exists()
    assert decode_main("cat.ctc.decode", [*decode, "--allow-config-change"]) == 0
    assert "(accepted by allow_config_change)" in caplog.text
    shutil.rmtree(recipe.root / "data/fbank-sherpa-onnx")


def test_search_settings_reach_only_the_searches_that_take_them():
    options = DecodeOptions.from_dict({"method": "beam", "blank_penalty": 1.5}, "hyper-p.json")
    assert options.search_settings(("blank_penalty",), "exp/x/config.json") == {
        "blank_penalty": 1.5}
    with pytest.raises(ValueError, match=r"exp/x/config\.json: blank_penalty: this model's"):
        options.search_settings((), "exp/x/config.json")
    assert DecodeOptions.from_dict({}, "hyper-p.json").search_settings((), "config.json") == {}
    rescoring = DecodeOptions.from_dict({"method": "attention_rescoring",
                                         "reverse_weight": 0.3}, "hyper-p.json")
    assert rescoring.search_settings(("ctc_weight", "reverse_weight"), "config.json") == {
        "ctc_weight": rescoring.option("ctc_weight"), "reverse_weight": 0.3}


#: `decode.log`'s record of the options before the heads declared theirs: every option
#: with its built-in default.
RECORDED_DEFAULTS = {
    "method": "beam", "beam_size": 10, "ctc_weight": 0.5, "decoder_weight": 1.0,
    "reverse_weight": None, "hotwords": None, "hotwords_score": 1.5, "blank_penalty": 0.0,
    "chunk_size": 0, "right_context": None, "tlg": None, "lm_weight": 1.0, "wfst_beam": 16.0,
    "nj": 1, "max_frames": 40000, "batch_size": 64, "device": "auto",
    "allow_config_change": False}


@pytest.mark.parametrize("hyper", sorted(Path(__file__).resolve().parents[2].glob(
    "egs/*/exp/*/hyper-p.json")), ids=lambda path: f"{path.parts[-4]}/{path.parts[-2]}")
def test_the_recipes_decoding_options_read_as_before(hyper):
    """Every recipe's `inference.infer.option` validates, and decodes with the settings it
    gave before the options were the heads' (what `decode.log` records, default or not)."""
    given = json.loads(hyper.read_text())["inference"]["infer"].get("option", {})
    options = DecodeOptions.from_dict(given, str(hyper))
    assert options.record() == {**RECORDED_DEFAULTS, **given}
    assert set(options.method_options) <= {"ctc_weight", "decoder_weight", "reverse_weight",
                                           "blank_penalty"}


def test_a_key_two_methods_take_is_one_setting_with_each_methods_meaning():
    """`ctc_weight` and `decoder_weight` weigh other scores in attention rescoring (the
    search's, the attention decoder's) than in joint rescoring (the CTC head's, the
    transducer's): one key each, one default, and the help names both meanings."""
    from cat.decoding.searcher import method_options, options_schema

    options = method_options()
    assert options["ctc_weight"].description == (
        "joint_rescoring (ctc): weight of the CTC head's log-likelihood; "
        "attention_rescoring (attention): weight of the search's score")
    assert options["blank_penalty"].description.startswith("greedy and beam (transducer): ")
    schema = options_schema()["properties"]
    assert schema["method"]["enum"] == ["greedy", "beam", "joint_rescoring",
                                        "attention_rescoring"]
    assert schema["decoder_weight"] == {"type": "number", "minimum": 0,
                                        "description": options["decoder_weight"].description}
    with pytest.raises(ConfigError, match=r"hyper-p\.json: ctc_weight: -1 is less than the "
                                          r"minimum of 0"):
        DecodeOptions.from_dict({"ctc_weight": -1}, "hyper-p.json")
    with pytest.raises(ConfigError, match=r"unknown key 'blank_weight'.* blank_penalty, "):
        DecodeOptions.from_dict({"blank_weight": 1.0}, "hyper-p.json")
    with pytest.raises(ValueError, match="blank_weight: no decoding method declares it"):
        DecodeOptions(method_options={"blank_weight": 1.0})


def test_heads_declaring_one_key_differently_are_refused(monkeypatch):
    from cat.decoding import searcher
    from cat.models.heads import DecodeMethod, DecodeOption

    declared = [
        ("ctc", "joint_rescoring", DecodeMethod("x", {"ctc_weight": DecodeOption(
            {"type": "number", "minimum": 0}, 0.5, "weight of the CTC head's")})),
        ("attention", "attention_rescoring", DecodeMethod("y", {"ctc_weight": DecodeOption(
            {"type": "number", "minimum": 0}, 0.3, "weight of the search's")}))]
    monkeypatch.setattr(searcher, "decode_methods", lambda: declared)
    with pytest.raises(ValueError, match="'ctc_weight': ctc's joint_rescoring and "
                                         "attention's attention_rescoring declare it"):
        searcher.method_options()
