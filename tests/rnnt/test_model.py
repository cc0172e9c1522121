"""Tests of the RNN-T predictors, joiner, loss and training end to end."""

from __future__ import annotations

import pytest
import torch
import torchaudio

from cat.models.encoder import ConformerNet
from cat.models.model import AsrModel
from cat.rnnt import model as rnnt_model
from cat.rnnt.model import (
    JointNet,
    LSTMPredictor,
    StatelessPredictor,
    TransducerHead,
    loss_parts,
)


def tiny_transducer(num_classes: int = 6, predictor: str = "lstm",
                    loss_normalization: str = "utterance") -> AsrModel:
    torch.manual_seed(0)
    encoder = ConformerNet(idim=16, hdim=32, num_cells=1, num_heads=2, kernel_size=3,
                           dropout=0.0, conv_norm="layernorm")
    if predictor == "lstm":
        pred = LSTMPredictor(num_classes, embed_dim=16, hdim=24, dropout=0.0)
    else:
        pred = StatelessPredictor(num_classes, embed_dim=24, context_size=2)
    joiner = JointNet(encoder.output_dim, pred.output_dim, num_classes, hdim=24)
    head = TransducerHead(encoder.output_dim, pred, joiner)
    return AsrModel(encoder, {"transducer": head}, {"transducer": 1.0},
                    loss_normalization=loss_normalization)


def make_task(seed: int = 0, num_classes: int = 6):
    generator = torch.Generator().manual_seed(seed)
    feat_lens = torch.tensor([40, 36, 32, 28])
    feats = torch.randn(4, 40, 16, generator=generator)
    for index, length in enumerate(feat_lens.tolist()):
        feats[index, length:] = 0.0
    label_lens = torch.tensor([4, 3, 4, 2])
    labels = torch.randint(1, num_classes, (4, 4), generator=generator)
    for index, length in enumerate(label_lens.tolist()):
        labels[index, length:] = 0
    return feats, feat_lens, labels, label_lens


@pytest.mark.parametrize("predictor", [
    LSTMPredictor(7, embed_dim=8, hdim=12, num_layers=2, dropout=0.0),
    StatelessPredictor(7, embed_dim=8, context_size=3),
    StatelessPredictor(7, embed_dim=8, context_size=1),
])
def test_predictor_steps_match_full_forward(predictor):
    predictor.eval()
    labels = torch.tensor([[3, 1, 4, 1, 5], [2, 6, 5, 0, 0]])
    with torch.no_grad():
        full = predictor(labels)
        assert full.shape == (2, 6, predictor.output_dim)
        state = predictor.initial_state(2, torch.device("cpu"))
        history = torch.zeros(2, dtype=torch.long)
        for position in range(6):
            out, state = predictor.step(history, state)
            torch.testing.assert_close(out, full[:, position], rtol=1e-5, atol=1e-6)
            if position < 5:
                history = labels[:, position]


def test_joiner_forward_equals_joint_of_projections():
    torch.manual_seed(0)
    joiner = JointNet(encoder_dim=5, predictor_dim=3, num_classes=4, hdim=6)
    encoder_out, predictor_out = torch.randn(2, 7, 5), torch.randn(2, 3, 3)
    logits = joiner(encoder_out, predictor_out)
    assert logits.shape == (2, 7, 3, 4)
    expected = joiner.joint(joiner.project_encoder(encoder_out[1, 4]),
                            joiner.project_predictor(predictor_out[1, 2]))
    torch.testing.assert_close(logits[1, 4, 2], expected)


def brute_force_rnnt_loss(logits: torch.Tensor, labels: list[int]) -> float:
    """-log P(labels) by the transducer forward recursion on logits [T, U+1, V]."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    frames, positions = log_probs.shape[0], len(labels) + 1
    alpha = torch.full((frames, positions), float("-inf"), dtype=torch.float64)
    alpha[0, 0] = 0.0
    for t in range(frames):
        for u in range(positions):
            terms = []
            if t > 0:
                terms.append(alpha[t - 1, u] + log_probs[t - 1, u, 0])
            if u > 0:
                terms.append(alpha[t, u - 1] + log_probs[t, u - 1, labels[u - 1]])
            if terms:
                alpha[t, u] = torch.logsumexp(torch.stack(terms), 0)
    return -float(alpha[-1, -1] + log_probs[-1, -1, 0])


def test_loss_equals_forward_recursion_and_is_padding_independent():
    model = tiny_transducer().eval()
    feats, feat_lens, labels, label_lens = make_task()
    loss, stats = model(feats, feat_lens, labels, label_lens)
    with torch.no_grad():
        encoder_out, lengths = model.encoder(feats, feat_lens)
        expected = []
        for index in range(4):
            sequence = labels[index, :label_lens[index]]
            logits = model.transducer.joiner(encoder_out[index:index + 1, :lengths[index]],
                                  model.transducer.predictor(sequence[None]))[0]
            expected.append(brute_force_rnnt_loss(logits, sequence.tolist()))
    assert stats["loss_sum"] == pytest.approx(sum(expected), rel=1e-4)
    assert loss.item() == pytest.approx(sum(expected) / 4, rel=1e-4)
    assert stats["num_utts"] == 4
    assert stats["num_tokens"] == 13
    assert stats["num_frames"] == float(lengths.sum())
    for index in range(4):
        alone, _ = model(feats[index:index + 1, :feat_lens[index]], feat_lens[index:index + 1],
                         labels[index:index + 1, :label_lens[index]], label_lens[index:index + 1])
        assert alone.item() == pytest.approx(expected[index], rel=1e-4)


def test_token_normalization():
    feats, feat_lens, labels, label_lens = make_task()
    loss, stats = tiny_transducer(loss_normalization="token").eval()(
        feats, feat_lens, labels, label_lens)
    assert stats["normalizer"] == 13
    assert loss.item() == pytest.approx(stats["loss_sum"] / 13)


def test_utterance_without_encoder_frames_is_counted_and_gets_no_loss():
    model = tiny_transducer().eval()
    feats = torch.randn(2, 40, 16)
    labels = torch.tensor([[1, 2], [3, 0]])
    loss, stats = model(feats, torch.tensor([40, 5]), labels, torch.tensor([2, 1]))
    assert stats["num_infeasible"] == 1
    alone, _ = model(feats[:1], torch.tensor([40]), labels[:1], torch.tensor([2]))
    assert stats["loss_sum"] == pytest.approx(alone.item(), rel=1e-5)
    assert torch.isfinite(loss)


def test_empty_label_sequences_are_valid():
    model = tiny_transducer().eval()
    loss, stats = model(torch.randn(2, 40, 16), torch.tensor([40, 30]),
                        torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 0]))
    assert torch.isfinite(loss)
    assert loss.item() > 0
    assert stats["num_tokens"] == 0


@pytest.mark.parametrize("predictor", ["lstm", "stateless"])
def test_transducer_overfits_and_decoding_reproduces_labels(predictor):
    model = tiny_transducer(predictor=predictor)
    feats, feat_lens, labels, label_lens = make_task()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    losses = []
    for _ in range(120):
        loss, stats = model(feats, feat_lens, labels, label_lens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(stats["loss"])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.05 * losses[0]
    model.eval()
    expected = [labels[i, :n].tolist() for i, n in enumerate(label_lens.tolist())]
    assert model.decode(feats, feat_lens, method="greedy") == expected
    assert model.decode(feats, feat_lens, method="beam", beam_size=4) == expected


def test_invalid_options_raise():
    with pytest.raises(ValueError, match="activation"):
        JointNet(4, 4, 5, activation="gelu")
    with pytest.raises(ValueError, match="context_size"):
        StatelessPredictor(5, context_size=0)
    model = tiny_transducer().eval()
    with pytest.raises(ValueError, match="allowed: greedy, beam"):
        model.decode(torch.randn(1, 40, 16), torch.tensor([40]), method="sample")


def test_batch_without_any_encoder_frame():
    model = tiny_transducer()
    feats, feat_lens = torch.randn(2, 6, 16), torch.tensor([6, 4])
    loss, stats = model(feats, feat_lens, torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 1]))
    assert loss.item() == 0.0
    assert stats["num_infeasible"] == 2
    loss.backward()
    model.eval()
    assert model.decode(feats, feat_lens, method="greedy") == [[], []]
    assert model.decode(feats, feat_lens, method="beam") == [[], []]


def test_loss_parts_bound_every_call_and_cover_the_batch():
    lengths = torch.tensor([10, 9, 3, 8, 2])
    label_lens = torch.tensor([4, 1, 2, 6, 0])
    parts = loss_parts(lengths, label_lens, num_classes=7, limit=700)
    covered = [i for part in parts for i in range(len(lengths))[part]]
    assert covered == list(range(5)) and len(parts) > 1
    for part in parts:
        size = (part.stop - part.start) * int(lengths[part].max()) * \
            (int(label_lens[part].max()) + 1) * 7
        assert size <= 700
    assert loss_parts(lengths, label_lens, 7) == [slice(0, 5)]
    with pytest.raises(ValueError, match="utterance 3 of the batch: 8 encoder frames x 7"):
        loss_parts(lengths, label_lens, 7, limit=360)


def test_a_batch_over_the_kernel_limit_is_split_with_the_same_loss_and_gradients(monkeypatch):
    # The CUDA loss kernel indexes the logits with 32-bit integers: no call may see more
    # than RNNT_LOSS_MAX_ELEMENTS of them (measured: 2.7e9 was an illegal memory access).
    feats, feat_lens, labels, label_lens = make_task()
    model = tiny_transducer().eval()
    whole, _ = model(feats, feat_lens, labels, label_lens)
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sizes = []
    loss_function = torchaudio.functional.rnnt_loss

    def recording(logits, *args, **kwargs):
        sizes.append(logits.numel())
        return loss_function(logits, *args, **kwargs)

    monkeypatch.setattr(torchaudio.functional, "rnnt_loss", recording)
    limit = max(sizes_of_one(model, feats, feat_lens, labels, label_lens))
    monkeypatch.setattr(rnnt_model, "RNNT_LOSS_MAX_ELEMENTS", limit)
    sizes.clear()
    split, _ = model(feats, feat_lens, labels, label_lens)
    split.backward()
    assert len(sizes) > 1 and max(sizes) <= limit
    assert split.item() == pytest.approx(whole.item(), rel=1e-5)
    for grad, reference in zip((p.grad for p in model.parameters()), expected, strict=True):
        assert torch.allclose(grad, reference, atol=1e-6)


def sizes_of_one(model, feats, feat_lens, labels, label_lens) -> list[int]:
    """Logits elements of each utterance alone (the smallest limit that still runs)."""
    _, lengths = model.encoder(feats, feat_lens)
    return [int(t) * (int(u) + 1) * model.num_classes
            for t, u in zip(lengths, label_lens, strict=True)]


def test_an_auxiliary_ctc_head_mixes_its_loss_and_leaves_plain_rnnt_unchanged():
    from cat.models.registry import build_model
    from tests.models.test_registry import rnnt_config

    torch.manual_seed(0)
    plain = build_model(rnnt_config(), num_classes=6)
    assert plain.head_names == ("transducer",)
    assert not any(k.startswith("ctc") for k in plain.state_dict())
    config = rnnt_config()
    config["ctc"] = {"weight": 0.3}
    model = build_model(config, num_classes=6).eval()
    assert model.ctc.out_features == 6
    feats, feat_lens, labels, label_lens = make_task()
    loss, stats = model(feats, feat_lens, labels, label_lens)
    assert stats["loss_sum"] == pytest.approx(0.7 * stats["rnnt_loss_sum"]
                                              + 0.3 * stats["ctc_loss_sum"], rel=1e-5)
    loss.backward()
    assert model.ctc.weight.grad.abs().sum() > 0
    assert model.decode_methods == ("greedy", "beam", "joint_rescoring")


def test_simple_loss_equals_the_full_lattice_loss_of_the_linear_joiner():
    """`simple_losses` (two-class lattice, O(B T U) memory) gives the loss and gradients of
    rnnt_loss over the full [B, T, U+1, V] logits `am[t] + lm[u]`, padded labels included."""
    generator = torch.Generator().manual_seed(3)
    batch, frames, labels_max, classes = 3, 7, 4, 6
    am = torch.randn(batch, frames, classes, generator=generator, requires_grad=True)
    lm = torch.randn(batch, labels_max + 1, classes, generator=generator, requires_grad=True)
    labels = torch.randint(1, classes, (batch, labels_max), generator=generator)
    lengths, label_lens = torch.tensor([7, 5, 6]), torch.tensor([4, 2, 3])
    for index, length in enumerate(label_lens.tolist()):
        labels[index, length:] = 0
    full = torchaudio.functional.rnnt_loss(am[:, :, None] + lm[:, None], labels.int(),
                                           lengths.int(), label_lens.int(), blank=0,
                                           reduction="none")
    expected = torch.autograd.grad(full.sum(), [am, lm])
    simple = rnnt_model.simple_losses(am, lm, labels, lengths, label_lens)
    got = torch.autograd.grad(simple.sum(), [am, lm])
    assert torch.allclose(simple, full, rtol=1e-5)
    for mine, reference in zip(got, expected, strict=True):
        assert torch.allclose(mine, reference, atol=1e-5)


def test_simple_loss_scale_adds_the_simple_loss_and_is_rnnt_only():
    from cat.core.config import ConfigError
    from cat.models.registry import build_model
    from tests.models.test_registry import ctc_config, rnnt_config

    torch.manual_seed(0)
    plain = build_model(rnnt_config(), num_classes=6).eval()
    assert not any(key.startswith("simple") for key in plain.state_dict())
    config = rnnt_config()
    config["trainer"] = {"simple_loss_scale": 0.5}
    torch.manual_seed(0)
    model = build_model(config, num_classes=6).eval()
    feats, feat_lens, labels, label_lens = make_task()
    loss, _ = model(feats, feat_lens, labels, label_lens)
    with torch.no_grad():
        encoder_out, lengths = model.encoder(feats, feat_lens)
        head = model.transducer
        simple = rnnt_model.simple_losses(head.simple_am(encoder_out),
                                          head.simple_lm(head.predictor(labels)), labels,
                                          lengths, label_lens)
    plain_loss, _ = plain(feats, feat_lens, labels, label_lens)
    assert loss.item() == pytest.approx(plain_loss.item() + 0.5 * simple.mean().item(),
                                        rel=1e-5)
    loss.backward()
    assert model.transducer.simple_am.weight.grad.abs().sum() > 0
    assert model.transducer.simple_lm.weight.grad.abs().sum() > 0
    bad = ctc_config()
    bad["trainer"] = {"simple_loss_scale": 0.5}
    with pytest.raises(ConfigError, match=r"trainer\.simple_loss_scale: only used by RNN-T"):
        build_model(bad, num_classes=6)


def test_joint_rescoring_ranks_both_searches_lists_by_the_weighted_log_likelihoods():
    """joint_rescoring (a transducer with an auxiliary CTC head): the union of the
    transducer's and the CTC head's N-best, each scored ctc_weight x CTC + decoder_weight x
    transducer log-likelihood over all alignments, best first; without a CTC head the
    method does not exist."""
    from cat.ctc.search import ctc_prefix_beam_search
    from cat.models.registry import build_model
    from tests.models.test_registry import rnnt_config

    config = rnnt_config()
    config["ctc"] = {"weight": 0.3}
    torch.manual_seed(0)
    model = build_model(config, num_classes=6).eval()
    assert model.decode_methods == ("greedy", "beam", "joint_rescoring")
    feats, feat_lens, _, _ = make_task()
    inputs = model.search_inputs(feats, feat_lens)
    encoder_out, lengths = inputs
    joint = model.nbest(inputs, 3, None, "joint_rescoring", ctc_weight=0.4, decoder_weight=0.7)
    transducer = model.nbest(inputs, 3)
    ctc = ctc_prefix_beam_search(model.ctc.log_probs(encoder_out), lengths, 3)
    for index, hyps in enumerate(joint):
        expected = {tuple(h) for h, _ in transducer[index]} | {tuple(h) for h, _ in ctc[index]}
        assert {tuple(h) for h, _ in hyps} == expected
        scores = [score for _, score in hyps]
        assert scores == sorted(scores, reverse=True)
        frames = encoder_out[index, :lengths[index]]
        for tokens, score in hyps:
            with torch.no_grad():
                history = (torch.tensor([tokens]).long() if tokens
                           else torch.zeros(1, 0).long())
                logits = model.transducer.joiner(frames[None],
                                                 model.transducer.predictor(history))
                rnnt = torchaudio.functional.rnnt_loss(
                    logits, torch.tensor([tokens], dtype=torch.int32).reshape(1, -1),
                    lengths[index:index + 1].int(), torch.tensor([len(tokens)]).int(),
                    blank=0, reduction="none")
                log_probs = model.ctc.log_probs(frames[None])
                ctc_loss = torch.nn.functional.ctc_loss(
                    log_probs.transpose(0, 1), torch.tensor([tokens or [0]]),
                    lengths[index:index + 1], torch.tensor([len(tokens)]), reduction="none")
            assert score == pytest.approx(-0.4 * float(ctc_loss) - 0.7 * float(rnnt), rel=1e-4)
    best = model.decode(feats, feat_lens, "joint_rescoring", 3, ctc_weight=0.4,
                        decoder_weight=0.7)
    assert best == [hyps[0][0] for hyps in joint]
    plain = build_model(rnnt_config(), num_classes=6).eval()
    with pytest.raises(ValueError, match="joint_rescoring a 'ctc' head beside a transducer"):
        plain.decode(feats, feat_lens, "joint_rescoring", 3, ctc_weight=0.4)
