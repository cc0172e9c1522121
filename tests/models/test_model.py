"""The model of an encoder and heads: loss of weighted heads, decoding methods, key upgrade."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cat.ctc.head import CTCHead
from cat.models.encoder import ConformerNet
from cat.models.heads import Progress, ProgressHead
from cat.models.model import AsrModel, upgrade_state_dict
from cat.models.specaug import SpecAugment


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


class StepCountingHead(ConstantHead):
    """A head that asks for `views` augmented views and reads the step: its loss per row is
    the mean of its hidden input (so each view shows in it) plus the step."""

    def __init__(self, views: int) -> None:
        super().__init__(1.0)
        self.views = views
        self.seen: list[tuple[int, Progress, int]] = []

    def progress_losses(self, hidden, lengths, labels, label_lens, progress):
        self.seen.append((hidden.size(0), progress, labels.size(0)))
        losses = hidden.mean(dim=(1, 2)) + progress.step
        return losses, torch.zeros_like(lengths, dtype=torch.bool), {"rows": hidden.size(0)}


def test_a_head_asks_for_views_and_is_handed_the_step():
    """A `ProgressHead` of 2 views: the batch runs as two SpecAugmented copies in one encoder
    call, every head reads both, and an utterance's loss is the mean over its views; in
    evaluation one view; the step reaches the heads that read it."""
    encoder = _encoder()
    counting = StepCountingHead(views=2)
    assert isinstance(counting, ProgressHead)
    model = AsrModel(encoder, {"ctc": CTCHead(32, 6), "counting": counting},
                     {"ctc": 0.5, "counting": 0.5},
                     specaug=SpecAugment(num_freq_masks=2, num_time_masks=2)).train()
    assert model.views == 2
    feats, feat_lens, labels, label_lens = _batch()
    torch.manual_seed(0)
    _, stats = model(feats, feat_lens, labels, label_lens, step=7)
    assert [(rows, progress, label_rows) for rows, progress, label_rows in counting.seen] == \
        [(6, Progress(step=7, views=2), 6)]
    torch.manual_seed(0)
    views = model.specaug(feats, feat_lens, views=2)
    with torch.no_grad():
        hidden, lengths = encoder(views, feat_lens.repeat(2))
        ctc = model.ctc.losses(hidden, lengths, labels.repeat(2, 1), label_lens.repeat(2))[0]
        own = hidden.mean(dim=(1, 2)) + 7
    assert stats["num_utts"] == 3 and stats["rows"] == 6
    assert stats["num_frames"] == float(lengths[:3].sum())
    assert stats["ctc_loss_sum"] == pytest.approx(float(ctc.sum()) / 2, rel=1e-5)
    assert stats["const_loss_sum"] == pytest.approx(float(own.sum()) / 2, rel=1e-5)
    assert stats["loss_sum"] == pytest.approx(float(0.5 * (ctc + own).sum()) / 2, rel=1e-5)
    model.eval()
    model(feats, feat_lens, labels, label_lens, step=9)
    assert counting.seen[-1] == (3, Progress(step=9, views=1), 3)
    with pytest.raises(ValueError, match="CUSIDE"):
        AsrModel(encoder, {"ctc": CTCHead(32, 6), "counting": counting},
                 {"ctc": 0.5, "counting": 0.5}, chunking=object())


def _tiny_configs() -> dict[str, dict]:
    from cat.testing.training import tiny_model_config

    specaug = {"num_freq_masks": 2, "num_time_masks": 2, "max_time_warp": 3}
    configs = {kind: tiny_model_config(kind, 8) for kind in ("ctc", "rnnt")}
    configs["u2"] = tiny_model_config("ctc", 8)
    configs["u2"]["attention"] = {"num_layers": 1, "num_heads": 2, "ffn_dim": 32,
                                  "dropout": 0.0, "ctc_weight": 0.3}
    configs["cuside"] = tiny_model_config("ctc", 8)
    configs["cuside"]["trainer"] = {"chunk_size": 16, "simu": True}
    for config in configs.values():
        config["specaug"] = dict(specaug)
    return configs


def _one_pass_loss_sum(model, feats, feat_lens, labels, label_lens) -> float:
    """The summed loss as the forward gave it before heads could ask for passes: SpecAugment,
    one encoder call, each head's `losses` weighted, CUSIDE's chunked pass and simulation."""
    augmented = model.specaug(feats, feat_lens)

    def heads_on(hidden, lengths):
        total, infeasible = 0.0, None
        for name, head in model.heads.items():
            losses, bad, _ = head.losses(hidden, lengths, labels, label_lens)
            total = total + (losses if len(model.heads) == 1 else model.weights[name] * losses)
            infeasible = bad if infeasible is None else infeasible
        return total, infeasible

    total, infeasible = heads_on(*model.encoder(augmented, feat_lens))
    if model.chunking is not None:
        hidden, chunk_lengths, simulation = model.chunking.training_pass(
            model.encoder, augmented, feats, feat_lens)
        chunked, chunk_infeasible = heads_on(hidden, chunk_lengths)
        total, infeasible = total + chunked + simulation, infeasible | chunk_infeasible
    return float(total.masked_fill(infeasible, 0.0).sum())


@pytest.mark.parametrize("kind", ["ctc", "rnnt", "u2", "cuside"])
def test_heads_that_ask_for_no_pass_train_on_the_losses_of_one_pass(kind):
    """CTC, RNN-T, U2 and CUSIDE's unified training give, with the same seed, the loss of the
    one-pass forward they had before heads could ask for passes (to 1e-6)."""
    from cat.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(_tiny_configs()[kind], 12).train()
    assert model.views == 1
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(3, 90, 8, generator=generator), torch.tensor([90, 70, 55]),
             torch.randint(1, 12, (3, 6), generator=generator), torch.tensor([6, 4, 3]))
    for step in (0, 5):
        torch.manual_seed(10 + step)
        _, stats = model(*batch, step=step)
        torch.manual_seed(10 + step)
        with torch.no_grad():
            expected = _one_pass_loss_sum(model, *batch)
        assert stats["loss_sum"] == pytest.approx(expected, rel=1e-6, abs=1e-6)
