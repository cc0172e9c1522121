"""CR-CTC (`cat.ctc.crctc`): two SpecAugmented views in one encoder call, CTC on both, a
consistency loss between their frame posteriors with a detached target, warmed up with the
step the trainer hands the model; a tiny experiment trains, resumes exactly and decodes as
CTC."""

from __future__ import annotations

import json

import pytest
import torch

from cat.core.config import ConfigError
from cat.ctc.crctc import CRCTCHead, consistency_losses
from cat.ctc.head import CTCHead
from cat.models.heads import ProgressHead
from cat.models.registry import build_model
from cat.testing.training import tiny_model_config, write_tiny_experiment
from cat.training.checkpoint import CheckpointManager, load_checkpoint
from cat.training.cli import train

VOCAB = 12
NAME = "exp/tiny"
SPECAUG = {"num_freq_masks": 2, "num_time_masks": 3, "max_time_warp": 3}


def crctc_config(specaug: dict | None = SPECAUG, **cr_ctc) -> dict:
    config = tiny_model_config("ctc", 8)
    config["ctc"]["cr_ctc"] = cr_ctc
    if specaug is not None:
        config["specaug"] = dict(specaug)
    return config


def model_of(config: dict):
    torch.manual_seed(0)
    return build_model(config, VOCAB)


def _batch():
    generator = torch.Generator().manual_seed(1)
    feats = torch.randn(3, 90, 8, generator=generator)
    labels = torch.randint(1, VOCAB, (3, 6), generator=generator)
    return feats, torch.tensor([90, 70, 55]), labels, torch.tensor([6, 4, 3])


def test_the_config_builds_a_ctc_head_with_two_views():
    model = model_of(crctc_config(cr_loss_scale=0.5, warmup_steps=100))
    head = model.first_head
    assert isinstance(head, CRCTCHead) and isinstance(head, ProgressHead)
    assert (head.cr_loss_scale, head.warmup_steps, model.views) == (0.5, 100, 2)
    assert model_of(crctc_config()).first_head.cr_loss_scale == 0.2  # icefall's default
    plain = model_of(tiny_model_config("ctc", 8))
    assert plain.views == 1 and not isinstance(plain.first_head, ProgressHead)


def test_the_consistency_loss_is_the_kl_divergence_between_the_views():
    generator = torch.Generator().manual_seed(0)
    log_probs = torch.log_softmax(torch.randn(4, 7, 5, generator=generator), dim=-1)
    lengths = torch.tensor([7, 5, 7, 5])
    losses = consistency_losses(log_probs, lengths, views=2)
    for row, other in ((0, 2), (1, 3), (2, 0), (3, 1)):
        frames = int(lengths[row])
        target, own = log_probs[other, :frames], log_probs[row, :frames]
        expected = (target.exp() * (target - own)).sum()
        assert float(losses[row]) == pytest.approx(float(expected), rel=1e-5)
    assert torch.all(losses > 0)
    assert torch.equal(consistency_losses(log_probs[[0, 1, 0, 1]], lengths[[0, 1, 0, 1]], 2),
                       torch.zeros(4))
    with pytest.raises(ValueError, match="2 views"):
        consistency_losses(log_probs[:3], lengths[:3], views=2)


def test_no_gradient_flows_into_the_detached_target():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 5, generator=generator, requires_grad=True)
    losses = consistency_losses(torch.log_softmax(logits, dim=-1), torch.tensor([6, 6, 4, 4]), 2)
    losses[0].backward()  # view 0 of utterance 0 against view 1 (row 2)
    assert logits.grad[0].abs().sum() > 0
    assert torch.equal(logits.grad[[1, 2, 3]], torch.zeros(3, 6, 5))


def test_identical_views_have_no_consistency_loss_and_the_ctc_loss_of_one_view():
    """Without SpecAugment the two views are the same batch: the consistency term is 0 and
    the loss is the CTC model's; with it, the views differ and the term is > 0."""
    feats, lengths, labels, label_lens = _batch()
    loss, stats = model_of(crctc_config(specaug=None)).train()(feats, lengths, labels,
                                                               label_lens)
    ctc_loss, ctc_stats = model_of(tiny_model_config("ctc", 8)).train()(feats, lengths,
                                                                       labels, label_lens)
    assert stats["cr_loss_sum"] == pytest.approx(0.0, abs=1e-5)
    assert float(loss.detach()) == pytest.approx(float(ctc_loss.detach()), rel=1e-6)
    assert stats["num_frames"] == ctc_stats["num_frames"] and stats["num_utts"] == 3

    model = model_of(crctc_config()).train()
    torch.manual_seed(3)
    loss, stats = model(feats, lengths, labels, label_lens)
    assert stats["cr_loss_sum"] > 0.01 and stats["num_utts"] == 3
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_the_views_share_the_time_warp_and_draw_their_own_masks():
    feats, lengths, _, _ = _batch()
    warp_only = model_of(crctc_config(specaug={"num_freq_masks": 0, "num_time_masks": 0,
                                               "max_time_warp": 5})).specaug
    torch.manual_seed(0)
    views = warp_only(feats, lengths, views=2)
    assert views.shape == (6, 90, 8) and not torch.equal(views[:3], feats)
    assert torch.equal(views[:3], views[3:])
    masks_only = model_of(crctc_config(specaug={**SPECAUG, "max_time_warp": 0})).specaug
    torch.manual_seed(0)
    views = masks_only(feats, lengths, views=2)
    assert not torch.equal(views[:3], views[3:])


def test_the_step_warms_the_consistency_loss_up():
    head = CRCTCHead(16, VOCAB, cr_loss_scale=0.2, warmup_steps=2000)
    assert [head.scale_at(step) for step in (0, 1000, 2000, 5000)] == \
        pytest.approx([0.0, 0.1, 0.2, 0.2])
    assert CRCTCHead(16, VOCAB, cr_loss_scale=0.2).scale_at(0) == 0.2
    model = model_of(crctc_config(cr_loss_scale=0.5, warmup_steps=10)).train()
    batch = _batch()
    sums = {}
    for step in (0, 4, 10, 30):
        torch.manual_seed(7)  # the same masks at every step
        _, stats = model(*batch, step=step)
        sums[step] = (stats["loss_sum"], stats["cr_loss_sum"])
    ctc_sum, consistency = sums[0]
    for step, fraction in ((4, 0.4), (10, 1.0), (30, 1.0)):
        assert sums[step][0] == pytest.approx(ctc_sum + fraction * 0.5 * consistency,
                                              rel=1e-5)


def test_evaluation_runs_one_view_and_decodes_as_ctc():
    model = model_of(crctc_config()).eval()
    feats, lengths, labels, label_lens = _batch()
    _, stats = model(feats, lengths, labels, label_lens)
    assert "cr_loss_sum" not in stats and stats["num_utts"] == 3
    config = crctc_config()
    del config["ctc"]["cr_ctc"]
    plain = model_of(config).eval()
    plain.load_state_dict(model.state_dict())  # a CR-CTC checkpoint is a CTC model's
    assert type(plain.first_head) is CTCHead
    assert model.decode_methods == plain.decode_methods == ("greedy", "beam")
    for method in ("greedy", "beam"):
        assert model.decode(feats, lengths, method, 4) == plain.decode(feats, lengths, method, 4)
    log_probs, _ = model.log_probs(feats, lengths)
    assert torch.equal(log_probs, plain.log_probs(feats, lengths)[0])


def test_a_transducer_trains_beside_a_cr_ctc_head():
    """icefall's transducer with CR-CTC: every head's loss is the mean over the views."""
    config = tiny_model_config("rnnt", 8)
    config["ctc"] = {"weight": 0.3, "blank_init_prob": 0.0, "cr_ctc": {}}
    config["specaug"] = dict(SPECAUG)
    model = model_of(config).train()
    assert model.views == 2 and isinstance(model.ctc, CRCTCHead)
    torch.manual_seed(0)
    loss, stats = model(*_batch())
    loss.backward()
    assert stats["cr_loss_sum"] > 0 and stats["num_utts"] == 3
    assert stats["loss_sum"] == pytest.approx(
        0.7 * stats["rnnt_loss_sum"] + 0.3 * stats["ctc_loss_sum"], rel=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["trainer"].update(chunk_size=16), "CUSIDE"),
    (lambda c: c["trainer"].update(use_crf=True, den_lm="den_lm.npz"), "ctc.cr_ctc: not for"),
    (lambda c: c["ctc"]["cr_ctc"].update(scale=0.2), "scale"),
    (lambda c: c["ctc"]["cr_ctc"].update(cr_loss_scale=-1), "cr_loss_scale"),
])
def test_settings_that_do_not_fit_are_errors_naming_the_key(change, message):
    config = crctc_config()
    config["trainer"] = {}
    change(config)
    with pytest.raises(ConfigError, match=message):
        build_model(config, VOCAB)


def _train_loss(experiment) -> list[float]:
    lines = (experiment.exp_dir / "log/scalars.jsonl").read_text(encoding="utf-8").splitlines()
    return [r["value"] for r in map(json.loads, lines) if r["tag"] == "loss/train"]


def _crctc_experiment(root, **options):
    experiment = write_tiny_experiment(root, options={"epochs": 2, **options})
    path = experiment.exp_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["ctc"]["cr_ctc"] = {"cr_loss_scale": 0.2, "warmup_steps": 10}
    config["specaug"] = {"num_time_masks": 2, "max_time_mask_width": 4,
                         "num_freq_masks": 1, "max_freq_mask_width": 2}
    path.write_text(json.dumps(config), encoding="utf-8")
    return experiment


@pytest.fixture
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # hyper-p.json:env is exported by training


@pytest.mark.usefixtures("_one_thread")
def test_a_tiny_cr_ctc_experiment_trains_and_resumes_exactly(tmp_path, monkeypatch):
    """The loss goes down, and a run stopped at step 7 (in the warm-up) and resumed ends
    with the model of one that was not: the step comes back with the checkpoint."""
    final = {}
    for run in ("straight", "resumed"):
        experiment = _crctc_experiment(tmp_path / run)
        monkeypatch.chdir(experiment.root)
        if run == "resumed":
            experiment.set_options(max_steps=7)
            train(NAME, "cat.ctc.train")
            experiment.set_options(max_steps=0)
            train(NAME, "cat.ctc.train", resume=True)
        else:
            train(NAME, "cat.ctc.train")
            losses = _train_loss(experiment)
            assert len(losses) == 20 and sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses
        final[run] = load_checkpoint(CheckpointManager(experiment.exp_dir / "check").latest())
    assert final["straight"]["step"] == final["resumed"]["step"] == 20
    for key, value in final["straight"]["model"].items():
        assert torch.equal(value, final["resumed"]["model"][key]), key
