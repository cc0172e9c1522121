"""CAT v3 experiments migrate: every key mapped or named, CAT's models rebuilt."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cat.core import config as config_module
from cat.core.config import ConfigError
from cat.migrate import config as migrate_config
from cat.migrate import experiment as migrate_module
from cat.migrate.experiment import count_model_parameters, main, migrate
from cat.migrate.hyper import data_dir

CAT_EXPS = Path(__file__).with_name("cat_v3")
# Parameter counts CAT published in each experiment's readme.md (millions).
PUBLISHED = {"aishell-ctc-v1": 79.50, "aishell-rnnt-v1": 84.30,
             "wenetspeech-train_l-rnnt-v1": 91.67, "wenetspeech-train_m-ctc-v1": 86.01,
             "wenetspeech-train_m-rnnt-v1": 91.27, "wenetspeech-train_m-crf-v1": 83.45,
             "wenetspeech-train_l-crf-v1": 83.44}
# CAT's CUSIDE experiments: their published counts include the simulation network.
PUBLISHED_CUSIDE = {"aishell-ctc-crf-cuside": 117.07, "aishell-rnnt-cuside": 86.00}
# The vocabulary CAT's trained tokenizer had (config.json num_classes, written by CAT's
# stage 3; train_l's 5536 characters, not its hyper-p.json's 5147, give the 91.67 M).
VOCAB = {"aishell-ctc-v1": 4232, "aishell-rnnt-v1": 4232, "wenetspeech-train_l-rnnt-v1": 5536,
         "wenetspeech-train_m-ctc-v1": 5147, "wenetspeech-train_m-rnnt-v1": 5147,
         "wenetspeech-train_m-crf-v1": 162, "wenetspeech-train_l-crf-v1": 143,
         "aishell-ctc-crf-cuside": 217, "aishell-rnnt-cuside": 4232}
RECIPES = Path(__file__).parents[2] / "egs"


def _load(name: str) -> tuple[dict, dict]:
    folder = CAT_EXPS / name
    return (json.loads((folder / "hyper-p.json").read_text(encoding="utf-8")),
            json.loads((folder / "config.json").read_text(encoding="utf-8")))


def _entries(migration, status: str) -> dict[str, str]:
    return {f"{e.file}: {e.key}": e.detail for e in migration.by_status(status)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_cat_experiments_build_cats_models(name):
    hyper, cat_config = _load(name)
    migration = migrate(hyper, cat_config, f"exp/{name}")
    assert migration.num_classes == VOCAB[name]
    parameters = count_model_parameters(migration.config, migration.num_classes)
    assert abs(parameters / 1e6 - PUBLISHED[name]) / PUBLISHED[name] < 0.005, parameters


def cuside_simulation_parameters(config: dict) -> int:
    """Parameters of CAT's CUSIDE simulation network for its `config.json` (CAT's
    `cat/shared/simu_net.py` as `cat/ctc/train_unified.py` builds it: GRUs of 256 over
    `mel_dim` features, 3 layers, and a linear postnet to `context_size_right` frames)."""
    import torch

    trainer = config["trainer"]
    mel_dim, frames = trainer.get("mel_dim", 80), trainer["context_size_right"]
    layers = [torch.nn.GRU(mel_dim, 256), torch.nn.GRU(256, 256), torch.nn.GRU(256, 256),
              torch.nn.Linear(256, frames * mel_dim)]
    return sum(p.numel() for layer in layers for p in layer.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED_CUSIDE))
def test_cuside_experiments_build_cats_models_with_the_simulation_network(name):
    hyper, cat_config = _load(name)
    migration = migrate(hyper, cat_config, f"exp/{name}")
    assert migration.num_classes == VOCAB[name]
    parameters = count_model_parameters(migration.config, migration.num_classes)
    published = PUBLISHED_CUSIDE[name] * 1e6
    assert abs(parameters - published) / published < 0.005, parameters
    # The simulation network is in the count: CAT's, built from its layer shapes.
    trainer = migration.config["trainer"]
    without = dict(migration.config, trainer={
        k: v for k, v in trainer.items() if k not in ("simu", "simu_loss_weight")})
    assert parameters - count_model_parameters(without, migration.num_classes) == \
        cuside_simulation_parameters(cat_config)
    mapped = _entries(migration, "mapped")
    for key in ("simu", "chunk_size", "context_size_left", "context_size_right",
                "jitter_range", "simu_loss_weight"):
        assert trainer[key] == cat_config["trainer"][key], key
        assert "CUSIDE" in mapped[f"config.json: trainer.{key}"], key
    assert "CUSIDE" in mapped["hyper-p.json: train.bin"]
    # CAT's streaming decoding: stage 4 in the trained chunks (encoder frames).
    rate = 4 * migration.config["encoder"]["kwargs"].get("time_reduction_factor", 1)
    assert migration.hyper["inference"]["infer"]["option"]["chunk_size"] == \
        cat_config["trainer"]["chunk_size"] // rate


def test_unified_training_without_cuside_keys_gets_cats_default_chunk():
    hyper, cat_config = _load("aishell-rnnt-cuside")
    for key in ("chunk_size", "context_size_left", "context_size_right", "jitter_range",
                "simu", "simu_loss_weight", "downsampling_ratio", "mel_dim"):
        del cat_config["trainer"][key]
    migration = migrate(hyper, cat_config, "exp/x")
    assert migration.config["trainer"]["chunk_size"] == 40
    assert migration.hyper["inference"]["infer"]["option"]["chunk_size"] == 5


def test_even_kernel_becomes_the_odd_one_holding_cats_window():
    import torch

    from cat.models.layer import ConvolutionModule

    hyper, cat_config = _load("aishell-ctc-crf-cuside")
    migration = migrate(hyper, cat_config, "exp/x")
    assert migration.config["encoder"]["kwargs"]["kernel_size"] == 33
    assert "-> 33" in _entries(migration, "mapped")["config.json: encoder.kwargs.kernel_size"]
    # CAT's ConvModule pads 15 frames left and 16 right for a kernel of 32; the kernel of 33
    # with a zero first tap computes the same.
    torch.manual_seed(0)
    dim, frames = 4, 50
    cat_weight, bias = torch.randn(dim, 1, 32), torch.randn(dim)
    x = torch.randn(2, dim, frames)
    cat_out = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (15, 16)), cat_weight,
                                         bias, groups=dim)
    depthwise = ConvolutionModule(dim, 33, 0.0).depthwise
    with torch.no_grad():
        depthwise.weight.copy_(torch.nn.functional.pad(cat_weight, (1, 0)))
        depthwise.bias.copy_(bias)
    assert torch.allclose(depthwise(x), cat_out, atol=1e-5)
    # Without a kernel_size, CAT's default 32 is meant.
    del cat_config["encoder"]["kwargs"]["kernel_size"]
    assert migrate(hyper, cat_config, "exp/x").config["encoder"]["kwargs"]["kernel_size"] == 33


def test_jieba_compose_lexicon_tokenizer_is_the_lexicon_tokenizer():
    hyper, cat_config = _load("aishell-ctc-crf-cuside")
    migration = migrate(hyper, cat_config, "exp/ctc-crf-cuside")
    assert migration.hyper["tokenizer"] == {
        "type": "lexicon", "file": "exp/ctc-crf-cuside/tokenizer.tknz",
        "option-train": {"lexicon": "exp/ctc-crf-cuside/prepare_lexicon/lexicon.txt"}}
    mapped = _entries(migration, "mapped")
    assert "'JiebaComposeLexiconTokenizer' -> 'lexicon'" in mapped["hyper-p.json: tokenizer.type"]
    assert "userdict" in "".join(_entries(migration, "not mapped"))
    # CAT's L-subset file names no lexicon: the recipe's; its M-subset file no tokenizer.
    for name in ("wenetspeech-train_l-crf-v1", "wenetspeech-train_m-crf-v1"):
        migration = migrate(*_load(name), "exp/crf")
        assert migration.hyper["tokenizer"]["type"] == "lexicon"
        assert migration.hyper["tokenizer"]["option-train"] == {
            "lexicon": "data/local/lexicon.txt"}


def test_noam_early_stop_stops_at_its_min_step():
    hyper, cat_config = _load("wenetspeech-train_l-crf-v1")
    migration = migrate(hyper, cat_config, "exp/crf")
    assert migration.config["scheduler"]["kwargs"] == {
        "peak_lr": pytest.approx(5 / (512 * 25000) ** 0.5, rel=1e-5), "warmup_steps": 25000,
        "stop_step": 100000}
    assert "early stopping" in _entries(migration, "not mapped")[
        "config.json: scheduler.kwargs.n_tol"]


@pytest.mark.parametrize(("exp", "name"), [
    ("aishell/exp/ctc-v1", "aishell-ctc-v1"), ("aishell/exp/rnnt-v1", "aishell-rnnt-v1"),
    ("wenetspeech/exp/train_l/rnnt-v1", "wenetspeech-train_l-rnnt-v1"),
    ("wenetspeech/exp/train_m/ctc-v1", "wenetspeech-train_m-ctc-v1"),
])
def test_shipped_experiments_are_cats_models(exp, name):
    shipped = config_module.load_config(RECIPES / exp / "config.json")
    parameters = count_model_parameters(shipped, VOCAB[name])
    assert abs(parameters / 1e6 - PUBLISHED[name]) / PUBLISHED[name] < 0.005, parameters


@pytest.mark.parametrize("name", sorted(PUBLISHED) + sorted(PUBLISHED_CUSIDE))
def test_migrated_experiment_loads_and_names_every_key(name, tmp_path):
    hyper, cat_config = _load(name)
    new_exp = tmp_path / "exp" / name
    assert main([str(CAT_EXPS / name), str(new_exp), "--no-count"]) == 0
    experiment = config_module.load_experiment(new_exp)
    # CAT's train_m/ctc-v1 names cat.rnnt.train for its CTC model; the model decides.
    assert experiment.train_bin == ("cat.rnnt.train" if "joiner" in cat_config
                                    else "cat.ctc.train")
    report = (new_exp / "migration.txt").read_text(encoding="utf-8")
    # Every CAT train.option key appears in the report as CAT's file spells it.
    for key in hyper["train"]["option"]:
        assert f"hyper-p.json: train.option.{key}: " in report, key
    for key in cat_config["encoder"]["kwargs"]:
        assert f"encoder.kwargs.{key}" in report, key
    with pytest.raises(FileExistsError, match="exists"):
        main([str(CAT_EXPS / name), str(new_exp), "--no-count"])


def test_tokenizer_and_batching_keys_are_mapped_or_reported():
    hyper, cat_config = _load("aishell-ctc-v1")
    migration = migrate(hyper, cat_config, "exp/ctc-v1")
    assert migration.hyper["tokenizer"] == {
        "type": "sentencepiece", "file": "exp/ctc-v1/tokenizer.tknz",
        "option-train": {"model_type": "char", "vocab_size": 0, "add_dummy_prefix": False}}
    mapped = _entries(migration, "mapped")
    assert mapped["hyper-p.json: tokenizer.type"] == "'SentencePieceTokenizer' -> 'sentencepiece'"
    assert "vocab_size 0" in mapped["hyper-p.json: tokenizer.option-train.use_all_vocab"]
    assert "hyper-p.json: tokenizer.option-train.add_dummy_prefix" in mapped
    assert "max_frames 0" in mapped["hyper-p.json: train.option.dynamic_batch_mode"]
    assert migration.hyper["train"]["option"]["max_frames"] == 0
    dropped = _entries(migration, "dropped")
    assert "tokenizer.file" in dropped["hyper-p.json: tokenizer.option-train.model_prefix"]
    assert migration.hyper["data"] == {"train": ["data/fbank/train_sp"], "dev": "data/fbank/dev",
                                       "test": ["data/fbank/dev", "data/fbank/test"],
                                       "filter": "10:2001"}
    encoder = migration.config["encoder"]["kwargs"]
    assert (encoder["subsampling"], "ctc" in migration.config) == ("vgg2l", True)
    assert migration.config["scheduler"]["kwargs"] == {
        "peak_lr": pytest.approx(1 / (512 * 25000) ** 0.5, rel=1e-5),
        "warmup_steps": 25000, "stop_step": 500000}
    assert migration.config["specaug"]["max_time_warp"] == 0
    assert "config.json: trainer.decoder" in _entries(migration, "not mapped")


def test_unknown_keys_are_named_in_both_files():
    hyper, cat_config = _load("aishell-rnnt-v1")
    hyper["train"]["option"]["dynamic-batch-modes"] = 1
    hyper["tokenizer"]["option-train"]["split_digits"] = True
    cat_config["encoder"]["kwargs"]["hidden_dim"] = 3
    cat_config["decoder"]["kwargs"]["variational_noise"] = [0.0, 0.1]
    migration = migrate(hyper, cat_config, "exp/x")
    unmapped = _entries(migration, "not mapped")
    assert "no such training option" in unmapped["hyper-p.json: train.option.dynamic-batch-modes"]
    assert "hyper-p.json: tokenizer.option-train.split_digits" in unmapped
    assert "config.json: encoder.kwargs.hidden_dim" in unmapped
    assert "config.json: decoder.kwargs.variational_noise" in unmapped
    report = migration.report()
    assert "not mapped  hyper-p.json: train.option.dynamic-batch-modes: 1: no such training" \
        in report
    # The worst comes first: every 'not mapped' line precedes every 'mapped' line.
    statuses = [line.split("  ")[0].strip() for line in report.splitlines()[2:]]
    assert statuses == sorted(statuses, key=migrate_module.STATUS_ORDER.index)


def test_ctc_crf_keys_map_to_the_trainer_and_were_pending_without_it(monkeypatch):
    hyper, cat_config = _load("aishell-ctc-v1")
    cat_config["trainer"] = {"use_crf": True, "lamb": 0.01, "den_lm": "exp/den_lm.fst"}
    migration = migrate(hyper, copy.deepcopy(cat_config), "exp/crf")
    assert not migration.by_status("pending")
    # CAT's FST is rebuilt by stage 2 into the new experiment.
    assert migration.config["trainer"] == {"use_crf": True, "lamb": 0.01,
                                           "den_lm": "exp/crf/den_lm.npz"}
    # A schema without the CTC-CRF keys (as before the family existed): pending, not unknown.
    schema = config_module.load_config_schema()
    for key in ("use_crf", "lamb", "den_lm"):
        del schema["$defs"]["trainer"]["properties"][key]
    monkeypatch.setattr(config_module, "load_config_schema", lambda: schema)
    monkeypatch.setattr(migrate_config, "load_config_schema", lambda: schema)
    migration = migrate(hyper, copy.deepcopy(cat_config), "exp/crf")
    pending = _entries(migration, "pending")
    assert set(pending) == {f"config.json: trainer.{k}" for k in ("use_crf", "lamb", "den_lm")}
    assert "use_crf" not in migration.config.get("trainer", {})


def test_data_names_by_metainfo_or_by_rule(tmp_path):
    metainfo = {"train-3sp": {"scp": "/data/src/train-3sp/feats.scp",
                              "trans": "/data/src/train-3sp/text"}}
    assert data_dir("train-3sp", metainfo) == ("/data/src/train-3sp", "data/metainfo.json")
    assert data_dir("train-3sp", None)[0] == "data/fbank/train_sp"
    assert data_dir("train-sp0.9", None)[0] == "data/fbank/train_sp"
    assert data_dir("thaudio-test", None)[0] == "data/fbank/test"
    assert data_dir("test_net", None)[0] == "data/fbank/test_net"
    # main finds <recipe>/data/metainfo.json next to the experiment's exp folder.
    recipe = tmp_path / "aishell"
    old = recipe / "exp" / "ctc-v1"
    old.mkdir(parents=True)
    for name in ("hyper-p.json", "config.json"):
        (old / name).write_bytes((CAT_EXPS / "aishell-ctc-v1" / name).read_bytes())
    (recipe / "data").mkdir()
    (recipe / "data" / "metainfo.json").write_text(json.dumps(metainfo), encoding="utf-8")
    main([str(old), str(tmp_path / "new"), "--no-count"])
    hyper = json.loads((tmp_path / "new" / "hyper-p.json").read_text(encoding="utf-8"))
    assert hyper["data"]["train"] == ["/data/src/train-3sp"]


def test_large_dataset_gets_shards_and_a_trset():
    hyper, cat_config = _load("wenetspeech-train_l-rnnt-v1")
    migration = migrate(hyper, cat_config, "exp/train_l/rnnt-v1")
    assert migration.hyper["data"]["shards"] == {"dir": "data/wds/train_l",
                                                 "filter_group": ["10:1001"]}
    option = migration.hyper["train"]["option"]
    assert (option["large_dataset"], option["trset"], option["grad_accum"]) == \
        (True, "data/wds/train_l/10_1001/data-*.tar", 6)


def test_unsupported_scheduler_is_an_error():
    hyper, cat_config = _load("aishell-ctc-v1")
    cat_config["scheduler"]["type"] = "SchedulerCosineAnnealing"
    with pytest.raises(ConfigError, match=r"scheduler\.type: 'SchedulerCosineAnnealing'"):
        migrate(hyper, cat_config, "exp/x")


def _copy_cat_exp(directory: Path, name: str = "aishell-ctc-v1") -> Path:
    directory.mkdir(parents=True)
    for file in ("hyper-p.json", "config.json"):
        (directory / file).write_bytes((CAT_EXPS / name / file).read_bytes())
    return directory


@pytest.mark.parametrize(("part", "names", "message"), [
    ("test", ["dev", "../../../../etc"], "hyper-p.json: data.test[1]: data name "
     "'../../../../etc' holds '..'"),
    ("dev", "/abs/dev", "hyper-p.json: data.dev: data name '/abs/dev' is an absolute path"),
    ("train", ["train/../../x"], "hyper-p.json: data.train[0]: data name 'train/../../x' "
     "holds '..'"),
])
def test_data_names_leaving_the_data_tree_are_refused(tmp_path, part, names, message):
    hyper, cat_config = _load("aishell-ctc-v1")
    hyper["data"][part] = names
    with pytest.raises(ConfigError) as error:
        migrate(hyper, cat_config, "exp/x")
    assert str(error.value) == (f"{message}: it would leave the data tree; CAT's data names "
                                "are names of its data/metainfo.json (e.g. 'train_sp', "
                                "'dev'), not paths")
    # Through the command, nothing is written.
    old = _copy_cat_exp(tmp_path / "old")
    (old / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(message)):
        main([str(old), str(tmp_path / "new"), "--no-count"])
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.tmp").exists()


@pytest.mark.parametrize(("new", "message"), [
    ("old", "NEW_EXP {new} is OLD_EXP {old} (resolved: {old_r}, {old_r}): the migration "
            "would be written over CAT's experiment; choose a NEW_EXP outside it"),
    ("old/sub", "NEW_EXP {new} is inside OLD_EXP {old} (resolved: {new_r}, {old_r}): the "
                "migration would be written over CAT's experiment; choose a NEW_EXP "
                "outside it"),
    ("link/sub", "NEW_EXP {new} is inside OLD_EXP {old} (resolved: {new_r}, {old_r}): the "
                 "migration would be written over CAT's experiment; choose a NEW_EXP "
                 "outside it"),
    (".", "OLD_EXP {old} is inside NEW_EXP {new} (resolved: {old_r}, {new_r}): writing "
          "NEW_EXP (--force replaces it) would delete CAT's experiment; choose a NEW_EXP "
          "outside it"),
])
def test_new_exp_in_or_over_old_exp_is_refused(tmp_path, new, message):
    old = _copy_cat_exp(tmp_path / "old")
    (tmp_path / "link").symlink_to(old)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    new_exp = tmp_path / new
    with pytest.raises(migrate_module.MigrationError) as error:
        main([str(old), str(new_exp), "--force", "--no-count"])
    assert str(error.value) == message.format(
        new=new_exp, old=old, old_r=old.resolve(),
        new_r=new_exp.resolve())
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert not (tmp_path / "old" / "sub").exists()


def test_migrate_command_refuses_to_overwrite_old_exp(tmp_path):
    old = _copy_cat_exp(tmp_path / "old")
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    proc = subprocess.run([sys.executable, "-m", "cat.migrate", str(old), str(old),
                           "--force", "--no-count"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"error: NEW_EXP {old} is OLD_EXP {old} (resolved: {old}, "
                                   f"{old}): the migration would be written over CAT's "
                                   "experiment; choose a NEW_EXP outside it")
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before


def test_duplicate_keys_in_cat_files_and_metainfo_are_named(tmp_path):
    recipe = tmp_path / "aishell"
    old = _copy_cat_exp(recipe / "exp" / "ctc-v1")
    (recipe / "data").mkdir()
    metainfo = recipe / "data" / "metainfo.json"
    metainfo.write_text('{"dev": {"scp": "/d/dev/feats.scp"},\n'
                        ' "dev": {"scp": "/d/other/feats.scp"}}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        main([str(old), str(tmp_path / "new"), "--no-count"])
    assert str(error.value) == (f"{metainfo}:2: (top level): duplicate key 'dev' (first on "
                                "line 1); JSON keeps only the last: remove one")
    metainfo.unlink()
    text = (old / "config.json").read_text(encoding="utf-8")
    line = text.count("\n", 0, text.index('"num_classes"')) + 1
    text = text.replace('"num_classes"', '"num_classes": 1,\n"num_classes"', 1)
    (old / "config.json").write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(
            f"config.json:{line + 1}: trainer.decoder: duplicate key 'num_classes' (first on "
            f"line {line})")):
        main([str(old), str(tmp_path / "new"), "--no-count"])
    assert not (tmp_path / "new").exists()
