"""Tests of config validation, the model registry and CTC training end to end."""

from __future__ import annotations

import copy
import inspect
import json
import re

import pytest
import torch

from cat.core.config import ConfigError, load_config, model_kind, validate_config
from cat.core.config import load_config_schema as load_schema
from cat.ctc.head import CTCHead
from cat.models.cuside import ContextChunking
from cat.models.encoder import ConformerNet
from cat.models.model import AsrModel
from cat.models.registry import (
    ENCODERS,
    build_model,
    check_command,
    count_parameters,
    family,
)
from cat.models.specaug import SpecAugment
from cat.rnnt.model import (
    JOINERS,
    PREDICTORS,
    JointNet,
    LSTMPredictor,
    StatelessPredictor,
    TransducerHead,
)
from cat.training.scheduler import SCHEDULERS, build_scheduler


def ctc_config() -> dict:
    return {
        "specaug": {"num_freq_masks": 2, "max_freq_mask_width": 4, "num_time_masks": 2,
                    "max_time_mask_ratio": 0.05},
        "encoder": {"type": "ConformerNet",
                    "kwargs": {"idim": 16, "hdim": 32, "num_cells": 1, "num_heads": 2,
                               "kernel_size": 3, "dropout": 0.0, "conv_norm": "layernorm"}},
        "ctc": {"dropout": 0.0},
        "trainer": {"loss_normalization": "utterance"},
        "scheduler": {"type": "SchedulerNoam",
                      "kwargs": {"peak_lr": 3e-3, "warmup_steps": 20, "stop_step": 1000},
                      "optimizer": {"type": "AdamW", "kwargs": {"betas": [0.9, 0.98]}}},
    }


def rnnt_config() -> dict:
    config = ctc_config()
    del config["ctc"]
    config["decoder"] = {"type": "LSTMPredictor", "kwargs": {"embed_dim": 16, "hdim": 24}}
    config["joiner"] = {"type": "JointNet", "kwargs": {"hdim": 24}}
    return config


def error_message(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(config)
    return str(info.value)


def test_schema_is_a_valid_draft_2020_12_schema():
    import jsonschema

    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_build_ctc_and_rnnt_models():
    ctc = build_model(ctc_config(), num_classes=10)
    assert isinstance(ctc, AsrModel) and ctc.head_names == ("ctc",)
    assert isinstance(ctc.encoder, ConformerNet)
    assert isinstance(ctc.specaug, SpecAugment)
    assert isinstance(ctc.ctc, CTCHead) and ctc.ctc.out_features == 10
    rnnt = build_model(rnnt_config(), num_classes=10)
    assert isinstance(rnnt, AsrModel) and rnnt.head_names == ("transducer",)
    assert isinstance(rnnt.transducer, TransducerHead)
    assert isinstance(rnnt.transducer.predictor, LSTMPredictor)
    assert rnnt.transducer.joiner.out.out_features == 10
    assert rnnt.transducer.joiner.enc_proj.in_features == 32
    assert rnnt.transducer.joiner.pred_proj.in_features == 24
    assert model_kind(ctc_config()) == "ctc"
    assert model_kind(rnnt_config()) == "rnnt"
    assert count_parameters(ctc) == sum(p.numel() for p in ctc.parameters())
    assert count_parameters(rnnt) > count_parameters(ctc)
    # Frame posteriors (what WFST decoding reads) come from a CTC head, not a transducer.
    assert ctc.frame_posteriors and not rnnt.frame_posteriors
    with pytest.raises(TypeError, match="gives no log-probabilities per frame"):
        rnnt.log_probs(torch.zeros(1, 20, 16), torch.tensor([20]))


def test_stateless_predictor_from_config():
    config = rnnt_config()
    config["decoder"] = {"type": "StatelessPredictor", "kwargs": {"embed_dim": 16,
                                                                  "context_size": 2}}
    model = build_model(config, num_classes=7)
    assert isinstance(model.transducer.predictor, StatelessPredictor)
    assert model.transducer.predictor.context_size == 2


def test_specaug_is_optional():
    config = ctc_config()
    del config["specaug"]
    assert build_model(config, num_classes=5).specaug is None


def test_misspelled_encoder_key_names_key_and_allowed_keys():
    config = ctc_config()
    config["encoder"]["kwargs"]["num_cell"] = config["encoder"]["kwargs"].pop("num_cells")
    message = error_message(config)
    assert "encoder.kwargs: unknown key 'num_cell' (did you mean 'num_cells'?)" in message
    assert ("allowed keys: causal_conv, conv_norm, dropout, dropout_attn, ffn_mult, "
            "full_context_prob, global_cmvn, hdim, idim, kernel_size, left_chunks, "
            "max_chunk_size, min_chunk_size, num_cells, num_heads, subsampling, "
            "subsampling_channels, time_reduction_factor, time_reduction_mode, "
            "time_reduction_position") in message
    assert "'num_cells' is a required property" in message


def test_misspelled_top_level_and_nested_keys():
    config = ctc_config()
    config["specaugment"] = config.pop("specaug")
    config["scheduler"]["optimizer"]["kwargs"]["weight_decy"] = 0.1
    message = error_message(config)
    assert "config.json: (top level): unknown key 'specaugment'" in message
    assert ("allowed keys: attention, ctc, decoder, encoder, joiner, scheduler, specaug, "
            "trainer") in message
    assert ("scheduler.optimizer.kwargs: unknown key 'weight_decy' (did you mean "
            "'weight_decay'?); allowed keys: amsgrad, betas, eps, weight_decay") in message


def test_per_type_kwargs_are_checked():
    config = rnnt_config()
    config["decoder"] = {"type": "StatelessPredictor", "kwargs": {"hdim": 16}}
    message = error_message(config)
    assert "decoder.kwargs: unknown key 'hdim'; allowed keys: context_size, embed_dim" in message
    config["decoder"] = {"type": "LSTMPredictor", "kwargs": {"context_size": 2}}
    assert "allowed keys: dropout, embed_dim, hdim, num_layers" in error_message(config)


def test_num_classes_is_rejected_with_a_hint():
    config = ctc_config()
    config["encoder"]["kwargs"]["num_classes"] = 4232
    assert "num_classes comes from the tokenizer" in error_message(config)


def test_unknown_type_and_bad_values():
    config = ctc_config()
    config["encoder"]["type"] = "Conformer"
    assert "encoder.type: 'Conformer' is not one of ['ConformerNet']" in error_message(config)
    config = ctc_config()
    config["scheduler"]["kwargs"]["warmup_steps"] = "many"
    assert "scheduler.kwargs.warmup_steps: 'many' is not of type 'integer'" in \
        error_message(config)
    config = ctc_config()
    config["scheduler"]["optimizer"]["kwargs"]["betas"] = [0.9]
    assert "scheduler.optimizer.kwargs.betas" in error_message(config)


def test_optimizer_lr_is_rejected():
    config = ctc_config()
    config["scheduler"]["optimizer"]["kwargs"]["lr"] = 0.1
    assert "unknown key 'lr'" in error_message(config)


@pytest.mark.parametrize("change", ["ctc_without_weight", "weight_without_rnnt", "neither",
                                    "only_decoder"])
def test_model_kind_must_be_unambiguous(change):
    config = rnnt_config()
    if change == "ctc_without_weight":
        config["ctc"] = {}
        expected = "ctc.weight: in an RNN-T model ('decoder' and 'joiner') the 'ctc' section " \
            "is an auxiliary CTC head and needs its weight"
    elif change == "weight_without_rnnt":
        config = ctc_config()
        config["ctc"]["weight"] = 0.3
        expected = "ctc.weight: only for the auxiliary CTC head of an RNN-T model"
    elif change == "neither":
        del config["decoder"], config["joiner"]
        expected = "the model kind is undefined"
    else:
        del config["joiner"]
        expected = "an RNN-T model needs both 'decoder' and 'joiner'; found only 'decoder'"
    assert expected in error_message(config)


def test_load_config_reports_file_and_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "encoder": {,\n}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"config\.json:2:\d+: invalid JSON"):
        load_config(path)
    config = ctc_config()
    config["trainer"]["loss_norm"] = "token"
    path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: trainer: unknown key 'loss_norm'")):
        load_config(path)
    path.write_text(json.dumps(ctc_config()), encoding="utf-8")
    assert load_config(path) == ctc_config()


def test_constructor_errors_become_config_errors():
    config = ctc_config()
    config["encoder"]["kwargs"]["num_heads"] = 3
    with pytest.raises(ConfigError, match=r"encoder\.kwargs: .*divisible by num_heads=3"):
        build_model(config, num_classes=5)


def _constructor_defaults(cls, skip: int) -> dict:
    parameters = list(inspect.signature(cls).parameters.values())[skip:]
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def test_schema_defaults_match_constructor_defaults():
    defs = load_schema()["$defs"]

    def schema_defaults(name: str) -> dict:
        return {key: value["default"] for key, value in defs[name]["properties"].items()
                if "default" in value}

    assert schema_defaults("ConformerNet") == _constructor_defaults(ConformerNet, 0)
    assert schema_defaults("LSTMPredictor") == _constructor_defaults(LSTMPredictor, 1)
    assert schema_defaults("StatelessPredictor") == _constructor_defaults(StatelessPredictor, 1)
    assert schema_defaults("JointNet") == _constructor_defaults(JointNet, 3)
    assert schema_defaults("specaug") == _constructor_defaults(SpecAugment, 0)
    ctc_defaults = _constructor_defaults(CTCHead, 2)
    assert schema_defaults("ctc") == {key: ctc_defaults[key]
                                      for key in ("dropout", "blank_init_prob")}
    from cat.crf.model import CRFHead
    from cat.graph.den_graph import build_for_tokenizer

    graph = inspect.signature(build_for_tokenizer).parameters
    cuside = _constructor_defaults(ContextChunking, 2)
    assert schema_defaults("trainer") == {
        **{key: cuside[key] for key in ("context_size_left", "context_size_right",
                                        "jitter_range", "simu", "simu_loss_weight", "simu_hdim",
                                        "simu_layers")},
        "loss_normalization": _constructor_defaults(AsrModel, 3)["loss_normalization"],
        "use_crf": False, "lamb": _constructor_defaults(CRFHead, 2)["lamb"],
        "simple_loss_scale": _constructor_defaults(TransducerHead, 3)["simple_loss_scale"],
        "den_lm_order": graph["order"].default,
        "den_lm_extra_states": graph["extra_states"].default,
        "den_lm_estimator": graph["estimator"].default}
    assert schema_defaults("SchedulerWarmupCosine") == _constructor_defaults(
        SCHEDULERS["SchedulerWarmupCosine"], 1)
    # Every kwarg the schema allows is a constructor parameter.
    for name, cls, skip in [("ConformerNet", ConformerNet, 0), ("JointNet", JointNet, 3),
                            ("LSTMPredictor", LSTMPredictor, 1), ("specaug", SpecAugment, 0),
                            ("StatelessPredictor", StatelessPredictor, 1)]:
        accepted = list(inspect.signature(cls).parameters)[skip:]
        assert set(defs[name]["properties"]) <= set(accepted), name


def test_schema_type_enums_match_registries():
    defs = load_schema()["$defs"]
    assert defs["encoder"]["properties"]["type"]["enum"] == sorted(ENCODERS)
    assert sorted(defs["decoder"]["properties"]["type"]["enum"]) == sorted(PREDICTORS)
    assert defs["joiner"]["properties"]["type"]["enum"] == sorted(JOINERS)
    assert sorted(defs["scheduler"]["properties"]["type"]["enum"]) == sorted(SCHEDULERS)


def make_task(num_utts: int = 4, num_classes: int = 6, seed: int = 0):
    """Random features and label sequences (no adjacent repeats) of a tiny overfitting task."""
    generator = torch.Generator().manual_seed(seed)
    feat_lens = torch.tensor([48, 44, 40, 36][:num_utts])
    feats = torch.randn(num_utts, 48, 16, generator=generator)
    for index, length in enumerate(feat_lens.tolist()):
        feats[index, length:] = 0.0
    label_lens = torch.tensor([4, 3, 4, 2][:num_utts])
    labels = torch.zeros(num_utts, 4, dtype=torch.long)
    for index, length in enumerate(label_lens.tolist()):
        sequence = [int(torch.randint(1, num_classes, (1,), generator=generator))]
        while len(sequence) < length:
            token = int(torch.randint(1, num_classes, (1,), generator=generator))
            if token != sequence[-1]:
                sequence.append(token)
        labels[index, :length] = torch.tensor(sequence)
    return feats, feat_lens, labels, label_lens


def overfit(config: dict, task: tuple, steps: int) -> tuple[torch.nn.Module, list[dict]]:
    """The model of `config` (6 classes) trained `steps` updates on one batch `task`
    (`make_task`) with its scheduler; the stats of every update."""
    model = build_model(config, num_classes=6)
    scheduler = build_scheduler(config["scheduler"], model.parameters())
    model.train()
    history = []
    for _ in range(steps):
        loss, stats = model(*task)
        loss.backward()
        scheduler.optimizer.step()
        scheduler.optimizer.zero_grad()
        scheduler.step()
        history.append(stats)
    return model, history


def test_ctc_model_overfits_and_greedy_decoding_reproduces_labels():
    torch.manual_seed(0)
    config = ctc_config()
    del config["specaug"]
    feats, feat_lens, labels, label_lens = task = make_task()
    model, history = overfit(config, task, 100)
    losses = [stats["loss"] for stats in history]
    for stats in history:
        assert stats["num_utts"] == 4
        assert stats["num_tokens"] == 13
        assert stats["num_infeasible"] == 0
        assert stats["loss"] == pytest.approx(stats["loss_sum"] / stats["normalizer"])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.05 * losses[0]
    model.eval()
    expected = [labels[i, :n].tolist() for i, n in enumerate(label_lens.tolist())]
    assert model.decode(feats, feat_lens, method="greedy") == expected
    assert model.decode(feats, feat_lens, method="beam", beam_size=4) == expected


def test_ctc_loss_normalization_and_stats():
    torch.manual_seed(0)
    config = ctc_config()
    model = build_model(config, num_classes=6).eval()
    feats, feat_lens, labels, label_lens = make_task()
    loss, stats = model(feats, feat_lens, labels, label_lens)
    assert stats["normalizer"] == 4
    token_config = copy.deepcopy(config)
    token_config["trainer"]["loss_normalization"] = "token"
    torch.manual_seed(0)
    token_model = build_model(token_config, num_classes=6).eval()
    token_loss, token_stats = token_model(feats, feat_lens, labels, label_lens)
    assert token_stats["normalizer"] == 13
    assert token_stats["loss_sum"] == pytest.approx(stats["loss_sum"])
    assert token_loss.item() == pytest.approx(loss.item() * 4 / 13)
    lengths = model.encoder.output_lengths(feat_lens)
    assert stats["num_frames"] == float(lengths.sum())


def test_ctc_infeasible_utterances_are_counted_and_get_no_loss():
    torch.manual_seed(0)
    model = build_model(ctc_config(), num_classes=6).eval()
    feats = torch.randn(2, 40, 16)
    feat_lens = torch.tensor([40, 12])  # 12 frames -> 2 encoder frames
    labels = torch.tensor([[1, 2, 3], [1, 1, 2]])  # needs 4 frames (repeat)
    loss, stats = model(feats, feat_lens, labels, torch.tensor([3, 3]))
    assert stats["num_infeasible"] == 1
    assert torch.isfinite(loss)
    alone, _ = model(feats[:1], feat_lens[:1], labels[:1], torch.tensor([3]))
    assert stats["loss_sum"] == pytest.approx(alone.item())


def test_specaug_runs_only_in_training_mode():
    torch.manual_seed(0)
    config = ctc_config()
    config["specaug"] = {"num_freq_masks": 2, "max_freq_mask_width": 16,
                         "max_freq_mask_ratio": None, "num_time_masks": 0}
    model = build_model(config, num_classes=6)
    calls = []
    model.specaug.register_forward_hook(lambda *args: calls.append(1))
    feats, feat_lens, labels, label_lens = make_task()
    model.eval()
    model(feats, feat_lens, labels, label_lens)
    assert calls == []
    model.train()
    model(feats, feat_lens, labels, label_lens)
    assert calls == [1]


@pytest.mark.parametrize(("labels", "message"), [
    ([[1, 0, 2]], "outside"),
    ([[1, 6, 2]], "outside"),
])
def test_invalid_labels_raise(labels, message):
    model = build_model(ctc_config(), num_classes=6)
    with pytest.raises(ValueError, match=message):
        model(torch.randn(1, 40, 16), torch.tensor([40]), torch.tensor(labels),
              torch.tensor([3]))


def test_padding_beyond_label_lengths_is_ignored():
    model = build_model(ctc_config(), num_classes=6).eval()
    feats = torch.randn(1, 40, 16)
    loss, _ = model(feats, torch.tensor([40]), torch.tensor([[1, 2, 0, 0]]), torch.tensor([2]))
    same, _ = model(feats, torch.tensor([40]), torch.tensor([[1, 2, 5, 3]]), torch.tensor([2]))
    assert loss.item() == pytest.approx(same.item())


def test_unknown_decoding_method_raises():
    model = build_model(ctc_config(), num_classes=6).eval()
    with pytest.raises(ValueError, match="allowed: greedy, beam"):
        model.decode(torch.randn(1, 40, 16), torch.tensor([40]), method="viterbi")


def test_ctc_batch_without_any_encoder_frame():
    model = build_model(ctc_config(), num_classes=6)
    feats, feat_lens = torch.randn(2, 6, 16), torch.tensor([6, 4])
    loss, stats = model(feats, feat_lens, torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 1]))
    assert loss.item() == 0.0
    assert stats["num_infeasible"] == 2
    loss.backward()
    assert model.eval().decode(feats, feat_lens, method="beam") == [[], []]


@pytest.mark.parametrize("blank_prob", [0.5, 0.9])
def test_blank_init_prob_sets_the_initial_blank_probability(blank_prob):
    config = ctc_config()
    config["ctc"]["blank_init_prob"] = blank_prob
    model = build_model(config, 30)
    # With a zero hidden state the output is the bias alone: blank_prob, the rest uniform.
    probs = torch.softmax(model.ctc.bias.detach(), dim=0)
    assert float(probs[0]) == pytest.approx(blank_prob, abs=1e-6)
    assert torch.allclose(probs[1:], torch.full((29,), (1 - blank_prob) / 29))
    config["ctc"]["blank_init_prob"] = 0.0  # PyTorch's default initialisation
    torch.manual_seed(0)
    default = build_model(config, 30)
    assert float(torch.softmax(default.ctc.bias.detach(), dim=0)[0]) < 0.1


def test_global_cmvn_normalises_with_stats_held_in_the_model():
    config = ctc_config()
    config["encoder"]["kwargs"]["global_cmvn"] = True
    model = build_model(config, 30)
    normalizer = model.encoder.normalizer
    dim = config["encoder"]["kwargs"]["idim"]
    assert not bool(normalizer.initialized)
    normalizer.set_stats(torch.full((dim,), 3.0), torch.full((dim,), 2.0))
    feats = torch.full((1, 5, dim), 7.0)
    assert torch.allclose(normalizer(feats), torch.full((1, 5, dim), 2.0))
    state = model.state_dict()
    assert bool(state["encoder.normalizer.initialized"])
    restored = build_model(config, 30)
    restored.load_state_dict(state)
    assert torch.allclose(restored.encoder.normalizer.inv_std, torch.full((dim,), 0.5))


@pytest.mark.parametrize("command, kind, message", [
    ("cat.train", "rnnt", None),
    ("cat.decode", "crf", None),
    ("cat.ctc.train", "crf", None),
    ("cat.ctc.decode", "ctc", None),
    ("cat.rnnt.export", "rnnt", None),
    ("cat.rnnt.train", "ctc", "x: describes a ctc model, but cat.rnnt.train handles rnnt "
                              "models; run python -m cat.train"),
    ("cat.ctc.stream", "rnnt", "handles ctc and crf models; run python -m cat.stream"),
    ("cat.crf.train", "crf", "cat.crf.train is not a command of this toolkit; the verbs are "
                             "cat.train, cat.decode, cat.stream, cat.export"),
    ("cat.score", "ctc", "cat.score is not a command"),
])
def test_commands_and_their_aliases_accept_their_kinds(command, kind, message):
    if message is None:
        check_command(command, kind, "x")
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_command(command, kind, "x")


def test_a_built_encoder_must_be_an_encoder(monkeypatch):
    from cat.models import registry

    class Bare(torch.nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.output_dim = 32

    monkeypatch.setattr(registry, "ENCODERS", {"ConformerNet": Bare})
    with pytest.raises(TypeError, match=r"config.json: encoder: ConformerNet \(Bare\) is not an "
                                        r"Encoder: it lacks __call__|config.json: encoder: "
                                        r"ConformerNet \(Bare\) is not an Encoder: it lacks "
                                        r"compile_blocks, frame_rate_factor"):
        build_model(ctc_config(), num_classes=6)


def test_a_family_part_is_looked_up_only_among_the_parts_the_registry_declares():
    """The architecture test counts `family`'s loads as the registry's imports: it loads
    only `FAMILY_PARTS`, and a CTC-CRF model's are the CTC family's."""
    assert family("crf", "stream").__name__ == "cat.ctc.stream"
    with pytest.raises(ValueError, match="'head' is not a family's part; the parts are "
                                         "stream, export"):
        family("ctc", "head")
