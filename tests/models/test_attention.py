"""Tests of the attention decoder head (U2) and attention rescoring."""

from __future__ import annotations

import pytest
import torch

from cat.core.config import ConfigError, validate_config
from cat.core.config import load_config_schema as load_schema
from cat.ctc.search import ctc_prefix_beam_search
from cat.models.attention import AttentionHead, rescore, teacher_forcing
from cat.models.registry import build_model
from tests.models.test_registry import (
    _constructor_defaults,
    ctc_config,
    make_task,
    overfit,
    rnnt_config,
)


def u2_config(**attention) -> dict:
    config = ctc_config()
    del config["specaug"]
    config["attention"] = {"num_layers": 1, "num_heads": 2, "ffn_dim": 32, "dropout": 0.0,
                           "ctc_weight": 0.3, "label_smoothing": 0.0, **attention}
    return config


def test_teacher_forcing_inputs_and_targets_both_directions():
    labels = torch.tensor([[3, 4, 5], [6, 7, 0]])
    lens = torch.tensor([3, 2])
    inputs, targets = teacher_forcing(labels, lens)
    assert inputs.tolist() == [[0, 3, 4, 5], [0, 6, 7, 0]]
    assert targets.tolist() == [[3, 4, 5, 0], [6, 7, 0, 0]]
    inputs, targets = teacher_forcing(labels, lens, reverse=True)
    assert inputs.tolist() == [[0, 5, 4, 3], [0, 7, 6, 0]]
    assert targets.tolist() == [[5, 4, 3, 0], [7, 6, 0, 0]]


def test_schema_defaults_match_the_head():
    defaults = {key: value["default"]
                for key, value in load_schema()["$defs"]["attention"]["properties"].items()}
    assert defaults == _constructor_defaults(AttentionHead, 2)


@pytest.mark.parametrize("change, message", [
    (lambda c: [c.pop("ctc"), c.update({key: rnnt_config()[key]
                                        for key in ("decoder", "joiner")})],
     "attention: an attention decoder head is trained with a CTC model.s head"),
    (lambda c: c["attention"].update(r2l_layers=1), "r2l_layers=1"),
    (lambda c: c["attention"].update(num_heads=3), "num_heads=3"),
    (lambda c: c["attention"].update(ctc_weight=1.0), "ctc_weight"),
])
def test_bad_attention_sections_name_the_key(change, message):
    config = u2_config()
    change(config)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)
        build_model(config, num_classes=6)


def test_ctc_crf_refuses_an_attention_decoder():
    config = u2_config()
    config["trainer"].update(use_crf=True, den_lm="den_lm.npz")
    with pytest.raises(ConfigError, match="attention: an attention decoder is trained with CTC"):
        build_model(config, num_classes=6)


def test_scores_are_causal_sums_of_next_token_log_probs():
    torch.manual_seed(0)
    model = build_model(u2_config(r2l_layers=1, reverse_weight=0.4), num_classes=6).eval()
    memory = torch.randn(9, 32)
    hyps = [[1, 2, 3], [4], [], [5, 5, 1, 2]]
    scores = model.attention.score(memory, 7, hyps, reverse_weight=0.0)
    for hyp, score in zip(hyps, scores.tolist(), strict=True):
        # One prefix at a time: a decoder that looked ahead would score differently.
        expected = 0.0
        for position, target in enumerate([*hyp, 0]):
            prefix = torch.tensor([[0, *hyp[:position]]])
            log_probs = model.attention.l2r(prefix, torch.tensor([position + 1]),
                                            memory[None, :7], torch.tensor([7]))
            expected += log_probs[0, -1, target].item()
        assert score == pytest.approx(expected, abs=1e-4)
    right_to_left = model.attention.score(memory, 7, hyps, reverse_weight=1.0)
    mixed = model.attention.score(memory, 7, hyps, reverse_weight=0.4)
    assert not torch.allclose(right_to_left, scores)
    assert torch.allclose(mixed, 0.6 * scores + 0.4 * right_to_left, atol=1e-5)


def test_loss_mixes_ctc_and_attention_and_ignores_padding():
    torch.manual_seed(0)
    model = build_model(u2_config(), num_classes=6).eval()
    feats, feat_lens, labels, label_lens = make_task()
    loss, stats = model(feats, feat_lens, labels, label_lens)
    assert stats["loss_sum"] == pytest.approx(0.3 * stats["ctc_loss_sum"]
                                              + 0.7 * stats["att_loss_sum"], rel=1e-5)
    assert 0.0 <= stats["att_acc"] <= 1.0
    padded = torch.cat([labels, torch.full((4, 3), 5)], dim=1)
    again, _ = model(feats, feat_lens, padded, label_lens)
    assert again.item() == pytest.approx(loss.item(), rel=1e-6)


def test_u2_model_learns_and_rescoring_recovers_the_labels():
    torch.manual_seed(0)
    feats, feat_lens, labels, label_lens = task = make_task()
    model, history = overfit(u2_config(r2l_layers=1, reverse_weight=0.3), task, 120)
    assert history[-1]["att_loss_sum"] < 0.1 * history[0]["att_loss_sum"]
    assert history[-1]["att_acc"] == 1.0
    model.eval()
    expected = [labels[i, :n].tolist() for i, n in enumerate(label_lens.tolist())]
    assert model.decode(feats, feat_lens, method="attention_rescoring", beam_size=4,
                        ctc_weight=0.0, decoder_weight=1.0) == expected


def test_rescoring_with_decoder_weight_zero_is_the_prefix_beam_result():
    torch.manual_seed(1)
    model = build_model(u2_config(), num_classes=6).eval()  # untrained: the decoder disagrees
    feats, feat_lens, _, _ = make_task()
    hidden, lengths = model.search_inputs(feats, feat_lens)
    beam = ctc_prefix_beam_search(model.ctc.log_probs(hidden), lengths, 4)
    same = model.nbest((hidden, lengths), 4, None, "attention_rescoring", ctc_weight=1.0,
                       decoder_weight=0.0)
    assert [[tokens for tokens, _ in hyps] for hyps in same] == \
        [[tokens for tokens, _ in hyps] for hyps in beam]
    assert model.decode(feats, feat_lens, "attention_rescoring", 4, ctc_weight=1.0,
                        decoder_weight=0.0) == model.decode(feats, feat_lens, "beam", 4)
    decoder_only = rescore(model.attention, hidden, lengths, beam, 0.0, 1.0)
    assert [[t for t, _ in h] for h in decoder_only] != [[t for t, _ in h] for h in beam]


def test_a_model_without_the_head_refuses_attention_rescoring():
    model = build_model(ctc_config(), num_classes=6).eval()
    assert model.decode_methods == ("greedy", "beam")
    with pytest.raises(ValueError, match=r"attention_rescoring needs config\.json's 'attention'"):
        model.decode(torch.randn(1, 40, 16), torch.tensor([40]), method="attention_rescoring")


def test_without_the_section_the_ctc_model_is_unchanged():
    # Checkpoints of CTC models written before the head existed keep loading: the model
    # holds its encoder, SpecAugment's counter and its linear head, nothing else; the
    # head's keys of the one-class-per-family layout (`head.*`) load under `ctc.*`.
    plain = build_model(ctc_config(), num_classes=6)
    assert plain.head_names == ("ctc",) and not hasattr(plain, "attention")
    assert {key for key in plain.state_dict() if not key.startswith("encoder.")} == \
        {"specaug.batches_seen", "ctc.weight", "ctc.bias"}
    old = {("head." + key[4:] if key.startswith("ctc.") else key): torch.randn_like(value)
           if value.is_floating_point() else value for key, value in plain.state_dict().items()}
    plain.load_state_dict(old)
    assert torch.equal(plain.ctc.weight, old["head.weight"])
