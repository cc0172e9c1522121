"""The model of an encoder and heads: loss of weighted heads, decoding methods, key upgrade."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cat.ctc.head import CTCHead
from cat.models.encoder import ConformerNet
from cat.models.model import AsrModel, upgrade_state_dict


class ConstantHead(nn.Module):
    """A head of another kind: a loss per utterance of its own, no search."""

    stat_name = "const"
    ctc_alignment = False

    def __init__(self, value: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(value))

    def losses(self, hidden, lengths, labels, label_lens):
        losses = self.scale * hidden.mean(dim=(1, 2)).abs() + self.scale
        return losses, torch.zeros_like(lengths, dtype=torch.bool), {"const_seen": 1.0}


def _encoder() -> ConformerNet:
    torch.manual_seed(0)
    return ConformerNet(idim=16, hdim=32, num_cells=1, num_heads=2, kernel_size=3,
                        dropout=0.0, conv_norm="layernorm")


def _batch():
    generator = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 40, 16, generator=generator)
    labels = torch.tensor([[1, 2, 3], [2, 2, 0], [4, 0, 0]])
    return feats, torch.tensor([40, 36, 30]), labels, torch.tensor([3, 2, 1])


def test_a_new_kind_of_head_trains_beside_the_ctc_head_without_generic_changes():
    encoder = _encoder()
    ctc = CTCHead(32, 6)
    model = AsrModel(encoder, {"ctc": ctc, "const": ConstantHead(2.0)},
                     {"ctc": 0.25, "const": 0.75}).eval()
    alone = AsrModel(encoder, {"ctc": ctc}, {"ctc": 1.0}).eval()
    loss, stats = model(*_batch())
    _, ctc_stats = alone(*_batch())
    assert stats["ctc_loss_sum"] == pytest.approx(ctc_stats["loss_sum"], rel=1e-6)
    assert stats["loss_sum"] == pytest.approx(0.25 * stats["ctc_loss_sum"]
                                              + 0.75 * stats["const_loss_sum"], rel=1e-6)
    assert stats["const_seen"] == 1.0 and "ctc_loss_sum" not in ctc_stats
    loss.backward()
    assert model.const.scale.grad is not None and model.ctc.weight.grad is not None
    # The first head decodes; a head without a rescoring method adds none.
    assert model.decode_methods == ("greedy", "beam") and model.frame_posteriors
    assert {key.split(".")[0] for key in model.state_dict()} == {"encoder", "ctc", "const"}


def test_the_first_head_must_decode_and_every_head_needs_a_weight():
    with pytest.raises(TypeError, match=r"the first head \(ConstantHead\) must decode"):
        AsrModel(_encoder(), {"const": ConstantHead(1.0)}, {"const": 1.0})
    with pytest.raises(ValueError, match="every head needs a loss weight"):
        AsrModel(_encoder(), {"ctc": CTCHead(32, 6), "const": ConstantHead(1.0)}, {"ctc": 1.0})
    with pytest.raises(TypeError, match=r"head 'x' \(Linear\) is not a Head"):
        AsrModel(_encoder(), {"ctc": CTCHead(32, 6), "x": nn.Linear(2, 2)},
                 {"ctc": 0.5, "x": 0.5})


def test_methods_and_their_settings_are_checked():
    model = AsrModel(_encoder(), {"ctc": CTCHead(32, 6)}, {"ctc": 1.0}).eval()
    feats, feat_lens, _, _ = _batch()
    with pytest.raises(ValueError, match="unknown decoding method 'joint_rescoring' for this "
                                         "model; allowed: greedy, beam"):
        model.decode(feats, feat_lens, "joint_rescoring")
    with pytest.raises(ValueError, match="method 'beam' takes no ctc_weight"):
        model.nbest(model.search_inputs(feats, feat_lens), 3, None, "beam", ctc_weight=0.5)
    best = model.decode(feats, feat_lens, "beam", 3)
    nbest = model.nbest(model.search_inputs(feats, feat_lens), 3)
    assert best == [hyps[0][0] if hyps else [] for hyps in nbest]


def test_keys_of_the_one_class_per_family_layout_are_renamed():
    old = {"encoder.x": 1, "head.weight": 2, "ctc_head.bias": 3, "predictor.embedding.weight": 4,
           "joiner.out.bias": 5, "simple_am.weight": 6, "simple_lm.bias": 7,
           "attention.l2r.x": 8, "specaug.batches_seen": 9}
    assert upgrade_state_dict(old) == {
        "encoder.x": 1, "ctc.weight": 2, "ctc.bias": 3, "transducer.predictor.embedding.weight": 4,
        "transducer.joiner.out.bias": 5, "transducer.simple_am.weight": 6,
        "transducer.simple_lm.bias": 7, "attention.l2r.x": 8, "specaug.batches_seen": 9}
    current = upgrade_state_dict(old)
    assert upgrade_state_dict(current) == current


def test_each_method_takes_the_settings_of_the_heads_that_run_it():
    from cat.models.registry import build_model
    from tests.models.test_attention import u2_config
    from tests.models.test_registry import rnnt_config

    u2 = build_model(u2_config(), num_classes=6)
    assert u2.method_settings("beam") == ()
    assert u2.method_settings("attention_rescoring") == ("ctc_weight", "decoder_weight",
                                                         "reverse_weight")
    config = rnnt_config()
    config["ctc"] = {"weight": 0.3}
    rnnt = build_model(config, num_classes=6)
    assert rnnt.method_settings("greedy") == ("blank_penalty",)
    assert rnnt.method_settings("joint_rescoring") == ("blank_penalty", "ctc_weight",
                                                       "decoder_weight")
    with pytest.raises(ValueError, match="unknown decoding method 'attention_rescoring'"):
        rnnt.method_settings("attention_rescoring")
