"""One update over the ranks (`cat.training.update.Updater`): the host waits for the
device once per update, and what it reads stays what it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cat.core.config import ConfigError, TrainOptions, train_option_defaults, validate_hyper
from cat.loading.batch import Batch
from cat.models.registry import build_model
from cat.testing.device_reads import DeviceReads
from cat.testing.training import tiny_model_config
from cat.training.distributed import DistributedContext
from cat.training.update import Updater, amp_dtype, batch_normalizer

VOCAB = 20


def tiny_updater(kind: str, tmp_path, normalization: str = "utterance",
                 device: torch.device | None = None, **options) -> Updater:
    """An Updater of a tiny model of `kind` (ctc, rnnt, crf, crctc) with SpecAugment's time
    warp and delayed start, which read lengths and a counter."""
    config = tiny_model_config("rnnt" if kind == "rnnt" else "ctc", 8)
    if kind == "crctc":
        config["ctc"]["cr_ctc"] = {"warmup_steps": 10}
    config["specaug"] = {"num_freq_masks": 1, "num_time_masks": 1, "max_time_warp": 3,
                         "start_batch": 1}
    config["trainer"] = {"loss_normalization": normalization}
    if kind == "crf":
        from cat.graph.denominator import build_den_graph, save_den_graph

        rng = np.random.default_rng(0)
        save_den_graph(build_den_graph([list(rng.integers(1, VOCAB, 6)) for _ in range(40)],
                                       VOCAB, order=2), tmp_path / "den_lm.npz")
        config["trainer"].update(use_crf=True, den_lm=str(tmp_path / "den_lm.npz"))
    torch.manual_seed(0)
    model = build_model(config, VOCAB)
    options = TrainOptions(**{**train_option_defaults(), "trset": [], "devset": [],
                              "tokenizer": "unused", **options})
    context = DistributedContext(device=device or torch.device("cpu"))
    return Updater(model, config["scheduler"], options, context)


def batch(seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch(["a", "b", "c"], torch.randn(3, 60, 8, generator=generator),
                 torch.tensor([60, 50, 41]),
                 torch.randint(1, VOCAB, (3, 5), generator=generator), torch.tensor([5, 4, 3]))


def host_tensors(batches: list[Batch]) -> list[torch.Tensor]:
    return [t for b in batches for t in (b.feats, b.feat_lens, b.labels, b.label_lens)]


@pytest.mark.parametrize(("kind", "reads_per_batch"), [("ctc", 0), ("rnnt", 1), ("crf", 1),
                                                      ("crctc", 0)])
@pytest.mark.parametrize("normalization", ["utterance", "token"])
def test_an_update_reads_the_device_once(kind, reads_per_batch, normalization, tmp_path):
    """Once for the update's figures; a transducer reads its lengths to trim the logits,
    CTC-CRF its labels for the token LM, once a micro-batch."""
    updater = tiny_updater(kind, tmp_path, normalization, grad_accum=2)
    batches = [batch(0), batch(1)]
    step_normalizer = sum(batch_normalizer(b, normalization) for b in batches)
    updater.update(batches, step_normalizer)  # SpecAugment's counter read, Adam's state
    with DeviceReads(device=updater.model, host=host_tensors(batches)) as reads:
        stats = updater.update(batches, step_normalizer)
    assert len(reads.found) == 1 + reads_per_batch * len(batches), reads.summary()
    assert stats["loss"] > 0 and stats["grad_norm"] > 0 and stats["infeasible"] == 0
    assert isinstance(stats["loss"], float) and isinstance(stats["grad_norm"], float)


def test_update_figures_are_those_of_the_model(tmp_path):
    updater = tiny_updater("ctc", tmp_path)
    updater.model.specaug = None
    batches = [batch(0), batch(1)]
    sums = []
    for b in batches:
        _, stats = updater.model(b.feats, b.feat_lens, b.labels, b.label_lens)
        sums.append(stats["loss_sum"])
    updater.model.zero_grad()
    stats = updater.update(batches, 6.0)
    assert stats["loss"] == pytest.approx(sum(sums) / 6.0, rel=1e-6)
    assert stats["lr"] > 0 and stats["skipped"] is False


def test_the_model_is_handed_the_updates_done(tmp_path, monkeypatch):
    """The step the heads warm up with (`cat.models.heads.Progress`) is the scheduler's count
    of updates done, the same for an update's micro-batches, and evaluation's too."""
    updater = tiny_updater("crctc", tmp_path, grad_accum=2)
    steps = []
    forward = updater.model.forward

    def spy(*args, step, **kwargs):
        steps.append(step)
        return forward(*args, step=step, **kwargs)

    monkeypatch.setattr(updater.model, "forward", spy)
    for _ in range(3):
        updater.update([batch(0), batch(1)], 6.0)
    updater.evaluate([batch(2)])
    assert steps == [0, 0, 1, 1, 2, 2, 3] and updater.scheduler.num_steps == 3


def test_evaluate_reads_the_device_once(tmp_path):
    updater = tiny_updater("ctc", tmp_path)
    batches = [batch(0), batch(1), batch(2)]
    with DeviceReads(device=updater.model, host=host_tensors(batches)) as reads:
        loss = updater.evaluate(batches)
    expected = []
    updater.model.eval()
    with torch.no_grad():
        for b in batches:
            expected.append(updater.model(b.feats, b.feat_lens, b.labels, b.label_lens)[1])
    assert loss == pytest.approx(sum(s["loss_sum"] for s in expected) / 9.0, rel=1e-6)
    assert len(reads.found) == 1, reads.summary()


def test_a_model_normalising_otherwise_than_the_trainer_is_an_error(tmp_path):
    updater = tiny_updater("ctc", tmp_path)
    updater.loss_normalization = "token"
    with pytest.raises(RuntimeError, match=r"the model normalised by 3\.0, the trainer "
                                           r"expected 12\.0"):
        updater.update([batch(0)], 12.0)


def test_a_batch_with_bad_labels_is_refused_before_the_step(tmp_path):
    updater = tiny_updater("ctc", tmp_path)
    bad = batch(0)
    bad.labels[1, 2] = VOCAB
    before = [p.detach().clone() for p in updater.model.parameters()]
    with pytest.raises(ValueError, match=r"labels of utterance 1 in the batch hold ids "
                                         r"outside \[1, 20\)"):
        updater.update([bad], 3.0)
    assert all(torch.equal(a, b) for a, b in zip(before, updater.model.parameters(),
                                                 strict=True))


@pytest.mark.parametrize(("name", "bf16", "expected"), [
    ("auto", True, torch.bfloat16), ("auto", False, torch.float16),
    ("bfloat16", True, torch.bfloat16), ("float16", True, torch.float16),
    ("float16", False, torch.float16)])
def test_amp_dtype_resolution(name, bf16, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert amp_dtype(name, torch.device("cuda", 0)) == expected


def test_bfloat16_on_a_gpu_without_it_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    with pytest.raises(ValueError, match=r"amp_dtype bfloat16: Tesla V100-SXM2-16GB does not "
                                         r"support it .*use float16 or auto"):
        amp_dtype("bfloat16", torch.device("cuda", 0))


def test_amp_dtype_is_an_option_of_the_schema():
    assert train_option_defaults()["amp_dtype"] == "auto"
    hyper = {"train": {"option": {"amp": True, "amp_dtype": "half"}}}
    with pytest.raises(ConfigError, match=r"train\.option\.amp_dtype: 'half' is not one of "
                                          r"\['auto', 'bfloat16', 'float16'\]"):
        validate_hyper(hyper)


@pytest.mark.parametrize(("option", "bf16", "dtype", "scaled"), [
    ("auto", True, torch.bfloat16, False), ("auto", False, torch.float16, True),
    ("float16", True, torch.float16, True), ("bfloat16", True, torch.bfloat16, False)])
def test_float16_trains_with_a_gradient_scaler_and_bfloat16_without(
        option, bf16, dtype, scaled, tmp_path, monkeypatch, caplog):
    """What the Updater builds on a GPU (simulated: the model stays on the CPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    caplog.set_level("INFO", logger="cat.training.update")
    updater = tiny_updater("ctc", tmp_path, device=torch.device("cuda", 0), amp=True,
                           amp_dtype=option)
    assert updater.amp and updater.amp_dtype == dtype
    assert updater.scaler.is_enabled() is scaled
    name = str(dtype).removeprefix("torch.")
    assert [r.getMessage() for r in caplog.records] == [
        f"mixed precision: {name} autocast{' with gradient scaling' if scaled else ''} "
        f"(train.option.amp_dtype {option})"]


def test_without_amp_there_is_no_autocast_dtype_nor_scaler(tmp_path, caplog):
    caplog.set_level("INFO", logger="cat.training.update")
    updater = tiny_updater("ctc", tmp_path, amp=True)  # on the CPU: ignored
    assert not updater.amp and updater.amp_dtype is None
    assert not updater.scaler.is_enabled()
    assert [r.getMessage() for r in caplog.records] == ["train.option.amp is ignored on CPU"]


def test_compile_option_compiles_the_encoder_blocks_in_place(tmp_path, caplog):
    caplog.set_level("INFO", logger="cat.training.update")
    eager = tiny_updater("ctc", tmp_path)
    compiled = tiny_updater("ctc", tmp_path, compile=True)
    assert all(cell._compiled_call_impl is not None for cell in compiled.model.encoder.cells)
    assert all(cell._compiled_call_impl is None for cell in eager.model.encoder.cells)
    # checkpoints keep their keys
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    assert "train.option.compile: the encoder's blocks are compiled" in caplog.text


@pytest.mark.slow  # compiling takes 25-45 s on 2 cores
def test_a_tiny_model_trains_compiled_as_it_does_eagerly(tmp_path):
    eager = tiny_updater("ctc", tmp_path)
    compiled = tiny_updater("ctc", tmp_path, compile=True)
    for updater in (eager, compiled):
        updater.model.specaug = None  # the same input to both
    results = [u.update([batch(0)], 3.0) for u in (eager, compiled)]
    assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-4)
    assert results[1]["grad_norm"] == pytest.approx(results[0]["grad_norm"], rel=1e-3)
    for a, b in zip(eager.model.parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
