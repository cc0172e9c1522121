"""CAT v3 `config.json` into this toolkit's: SpecAugment, encoder, predictor, joiner,
trainer (CTC-CRF keys included) and scheduler (`cat.migrate`)."""

from __future__ import annotations

import json
import math
from typing import Any

from cat.core.config import CONFIG_NAME, ConfigError, load_config_schema
from cat.migrate.record import Recorder

# Keys of CAT's `trainer` section that only its CTC-CRF loss reads. They are mapped to
# config.json `trainer.<key>` as soon as the config schema defines them there, and
# reported as pending until then: the one place to look when CTC-CRF lands.
CTC_CRF_TRAINER_KEYS = ("use_crf", "lamb", "den_lm")
# Keys of CAT's `trainer` section that CUSIDE reads (`cat/ctc/train_unified.py`,
# `cat/rnnt/train_unified.py`: chunks with a right context simulated by `simu_net.py`):
# config.json `trainer.<key>` here too (`cat.models.cuside`), `chunk_size` turning it on.
CUSIDE_TRAINER_KEYS = ("simu", "chunk_size", "context_size_left", "context_size_right",
                       "jitter_range", "simu_loss_weight", "downsampling_ratio", "mel_dim")
#: CAT's `chunk_size` default (`UnifiedAMTrainer`, `UnifiedTTrainer`).
CAT_CUSIDE_CHUNK = 40


def _migrate_specaug(specaug: dict[str, Any], record: Recorder) -> dict[str, Any]:
    specaug = dict(specaug)
    out: dict[str, Any] = {}
    where = "specaug."
    for axis in ("freq", "time"):
        count = specaug.pop(f"num_{axis}_mask", 2)
        width = specaug.pop(f"{axis}_mask_width_range", 0.15 if axis == "freq" else 0.1)
        if isinstance(width, list):
            if len(width) == 2 and width[0] == 0:
                width = width[1]
            else:
                record.add("not mapped", CONFIG_NAME, f"{where}{axis}_mask_width_range",
                           f"{width}: mask widths here start at 0")
                width = width[-1]
        if not specaug.pop(f"apply_{axis}_mask", True):
            count = 0
            record.add("mapped", CONFIG_NAME, f"{where}apply_{axis}_mask",
                       f"false -> num_{axis}_masks 0")
        out[f"num_{axis}_masks"] = count
        out[f"max_{axis}_mask_ratio"] = width
        record.add("mapped", CONFIG_NAME, f"{where}num_{axis}_mask / {axis}_mask_width_range",
                   f"-> num_{axis}_masks {count}, max_{axis}_mask_ratio {width}")
    window = specaug.pop("time_warp_window", 0.2)
    if not specaug.pop("apply_time_warp", True) or window <= 0:
        out["max_time_warp"] = 0
        record.add("mapped", CONFIG_NAME, where + "apply_time_warp", "false -> max_time_warp 0")
    else:
        record.add("not mapped", CONFIG_NAME, where + "time_warp_window",
                   f"{window}: CAT warps by up to this share of each utterance; "
                   "max_time_warp here is in frames (default 0 = off): set it by hand")
    if specaug.pop("delta_feats", False):
        record.add("not mapped", CONFIG_NAME, where + "delta_feats",
                   "true: features here have no delta channels")
    record.rest(CONFIG_NAME, where, specaug, "no such SpecAugment option here")
    return out


def _component(section: dict[str, Any], name: str, cat_type_here: str, why: str,
               record: Recorder) -> tuple[Any, dict[str, Any]]:
    """(CAT's type, a copy of its kwargs) of config.json's `name` section; its other keys
    are recorded as unknown, a type other than `cat_type_here` as not mapped (`why`)."""
    section = dict(section)
    cat_type = section.pop("type", None)
    kwargs = dict(section.pop("kwargs", {}))
    record.rest(CONFIG_NAME, f"{name}.", section, f"no such {name} key here")
    if cat_type != cat_type_here:
        record.add("not mapped", CONFIG_NAME, f"{name}.type", f"{cat_type!r}: {why}")
    return cat_type, kwargs


def _migrate_kernel(kwargs: dict[str, Any], record: Recorder) -> int:
    """The depthwise kernel here for CAT's `kernel_size` (32 when not given, CAT's default).

    CAT's ConvModule (`cat/shared/layer.py`) pads `(k - 1) // 2` frames on the left and
    `k - 1 - (k - 1) // 2` on the right, so an even `k` sees one more future frame than past
    ones (32: frames t-15 .. t+16). The convolution here pads symmetrically and takes odd
    kernels only: an even `k` becomes `k + 1` (t-16 .. t+16), whose window holds CAT's, so a
    CAT kernel is this one with a zero first tap; each cell gains `hdim` weights.
    """
    given = "kernel_size" in kwargs
    kernel = kwargs.pop("kernel_size", 32)
    key = "encoder.kwargs.kernel_size"
    shown = json.dumps(kernel) + ("" if given else " (CAT's default)")
    if kernel % 2:
        record.add("mapped", CONFIG_NAME, key, shown)
        return kernel
    left = (kernel - 1) // 2
    record.add("mapped", CONFIG_NAME, key,
               f"{shown} -> {kernel + 1}: CAT pads an even kernel {left} frames left and "
               f"{kernel - 1 - left} right (frames t-{left} .. t+{kernel - 1 - left}); "
               f"kernels here are odd and centred: {kernel + 1} covers t-{left + 1} .. "
               f"t+{kernel - 1 - left}, CAT's window and one more past frame (a CAT kernel is "
               "this one with a zero first tap; hdim more weights per cell)")
    return kernel + 1


def _migrate_encoder(encoder: dict[str, Any], kind: str,
                     record: Recorder) -> tuple[dict[str, Any], int | None]:
    _, kwargs = _component(encoder, "encoder", "ConformerNet",
                           "the encoder here is ConformerNet", record)
    where = "encoder.kwargs."
    out: dict[str, Any] = {}
    for key in ("num_cells", "idim", "hdim", "num_heads", "dropout", "dropout_attn"):
        if key in kwargs:
            out[key] = kwargs.pop(key)
            record.add("mapped", CONFIG_NAME, where + key, json.dumps(out[key]))
    out["kernel_size"] = _migrate_kernel(kwargs, record)
    conv = kwargs.pop("conv", "conv2d")
    subsampling = {"conv2d": "conv2d_padded", "vgg2l": "vgg2l"}.get(conv)
    if subsampling is None:
        record.add("not mapped", CONFIG_NAME, where + "conv",
                   f"{conv!r}: subsamplings here are conv2d and vgg2l")
    else:
        out["subsampling"] = subsampling
        record.add("mapped", CONFIG_NAME, where + "conv", f"{conv!r} -> subsampling "
                   f"{subsampling!r}")
    if "conv_multiplier" in kwargs:
        out["subsampling_channels"] = kwargs.pop("conv_multiplier")
        record.add("mapped", CONFIG_NAME, where + "conv_multiplier",
                   f"-> subsampling_channels {out['subsampling_channels']}")
    factor = kwargs.pop("time_reduction_factor", 1)
    position = kwargs.pop("time_reduction_pos", -1)
    if factor > 1:
        out.update(time_reduction_factor=factor, time_reduction_mode="subsample",
                   time_reduction_position=out.get("num_cells", 1) if position < 0 else position)
        record.add("mapped", CONFIG_NAME, where + "time_reduction_factor / time_reduction_pos",
                   f"{factor} at {position} -> time_reduction_factor {factor}, "
                   f"time_reduction_position {out['time_reduction_position']}, "
                   "time_reduction_mode 'subsample'")
    with_head = kwargs.pop("with_head", True)
    if with_head != (kind == "ctc"):
        record.add("not mapped", CONFIG_NAME, where + "with_head",
                   f"{json.dumps(with_head)}: a {kind.upper()} encoder here has "
                   f"{'a' if kind == 'ctc' else 'no'} classifier")
    else:
        record.add("mapped", CONFIG_NAME, where + "with_head",
                   f"{json.dumps(with_head)} -> " + ("the 'ctc' section's head" if with_head
                                                     else "no classifier (RNN-T)"))
    num_classes = kwargs.pop("num_classes", None)
    if num_classes is not None:
        record.add("dropped", CONFIG_NAME, where + "num_classes",
                   f"{num_classes}: the tokenizer sets the number of classes")
    for key, default, why in (("res_factor", 0.5, "half-step feed-forward residuals"),
                              ("d_head", -1, "head size hdim / num_heads"),
                              ("multiplier", 1, "depthwise convolution multiplier 1"),
                              ("subsample_norm", "none", "no normalisation in subsampling"),
                              ("delta_feats", False, "no delta features")):
        if key in kwargs:
            value = kwargs.pop(key)
            status = "dropped" if value == default else "not mapped"
            record.add(status, CONFIG_NAME, where + key, f"{json.dumps(value)}: always {why} "
                       "here")
    if "dropout_in" in kwargs:
        record.add("not mapped", CONFIG_NAME, where + "dropout_in",
                   f"{kwargs.pop('dropout_in')}: the subsampled input uses 'dropout' here")
    record.rest(CONFIG_NAME, where, kwargs, "no such ConformerNet option here")
    return {"type": "ConformerNet", "kwargs": out}, num_classes


def _migrate_decoder(decoder: dict[str, Any],
                     record: Recorder) -> tuple[dict[str, Any], int | None]:
    cat_type, kwargs = _component(decoder, "decoder", "LSTM",
                                  "the migrated predictor is LSTMPredictor (CAT's LSTM)",
                                  record)
    record.add("mapped", CONFIG_NAME, "decoder.type", f"{cat_type!r} -> 'LSTMPredictor'")
    where = "decoder.kwargs."
    out: dict[str, Any] = {"dropout": 0.0}
    if "hdim" in kwargs:
        hdim = kwargs.pop("hdim")
        out.update(embed_dim=hdim, hdim=hdim)
        record.add("mapped", CONFIG_NAME, where + "hdim", f"-> embed_dim {hdim}, hdim {hdim}")
    if "num_layers" in kwargs:
        out["num_layers"] = kwargs.pop("num_layers")
        record.add("mapped", CONFIG_NAME, where + "num_layers", str(out["num_layers"]))
    if "dropout" in kwargs:
        record.add("not mapped", CONFIG_NAME, where + "dropout",
                   f"{kwargs.pop('dropout')}: CAT's is between LSTM layers; ours is on the "
                   "embedding (set to 0.0)")
    num_classes = kwargs.pop("num_classes", None)
    if num_classes is not None:
        record.add("dropped", CONFIG_NAME, where + "num_classes",
                   f"{num_classes}: the tokenizer sets the number of classes")
    if kwargs.pop("with_head", False):
        record.add("not mapped", CONFIG_NAME, where + "with_head",
                   "true: the predictor here has no classifier")
    for key in ("variational_noise", "norm", "padding_idx"):
        if key in kwargs:
            record.add("not mapped", CONFIG_NAME, where + key,
                       f"{json.dumps(kwargs.pop(key))}: LSTMPredictor has no such option")
    record.rest(CONFIG_NAME, where, kwargs, "no such LSTMPredictor option here")
    return {"type": "LSTMPredictor", "kwargs": out}, num_classes


def _migrate_joiner(joiner: dict[str, Any], encoder_dim: int | None, predictor_dim: int | None,
                    record: Recorder) -> tuple[dict[str, Any], int | None]:
    _, kwargs = _component(joiner, "joiner", "JointNet", "the joiner here is JointNet",
                           record)
    where = "joiner.kwargs."
    out: dict[str, Any] = {}
    hdim = kwargs.pop("hdim", -1)
    for key, expected in (("odim_enc", encoder_dim), ("odim_pred", predictor_dim)):
        if key in kwargs:
            value = kwargs.pop(key)
            status = "dropped" if value == expected else "not mapped"
            record.add(status, CONFIG_NAME, where + key, f"{value}: the joiner's input sizes "
                       f"come from the encoder and the predictor ({expected})")
    if hdim == -1:
        hdim = max(d for d in (encoder_dim, predictor_dim, 1) if d is not None)
    out["hdim"] = hdim
    record.add("mapped", CONFIG_NAME, where + "hdim", str(hdim))
    if "act" in kwargs:
        out["activation"] = kwargs.pop("act")
        record.add("mapped", CONFIG_NAME, where + "act", f"-> activation {out['activation']!r}")
    for key, default in (("join_mode", "add"), ("pre_project", True)):
        if key in kwargs:
            value = kwargs.pop(key)
            record.add("dropped" if value == default else "not mapped", CONFIG_NAME,
                       where + key, f"{json.dumps(value)}: always {json.dumps(default)} here")
    if "compact" in kwargs:
        record.add("dropped", CONFIG_NAME, where + "compact",
                   f"{json.dumps(kwargs.pop('compact'))}: a memory layout of CAT's loss")
    num_classes = kwargs.pop("num_classes", None)
    if num_classes is not None:
        record.add("dropped", CONFIG_NAME, where + "num_classes",
                   f"{num_classes}: the tokenizer sets the number of classes")
    record.rest(CONFIG_NAME, where, kwargs, "no such JointNet option here")
    return {"type": "JointNet", "kwargs": out}, num_classes


def _migrate_trainer(trainer: dict[str, Any], source_key: str,
                     record: Recorder) -> dict[str, Any]:
    trainer = dict(trainer)
    out: dict[str, Any] = {}
    where = f"{source_key}."
    schema_keys = set(load_config_schema()["$defs"]["trainer"].get("properties", {}))
    for key in CTC_CRF_TRAINER_KEYS:
        if key not in trainer:
            continue
        value = trainer.pop(key)
        if key == "den_lm" and key in schema_keys:
            out[key] = value  # `migrate` points it at the graph stage 2 builds
            record.add("mapped", CONFIG_NAME, where + key,
                       f"{json.dumps(value)} -> trainer.den_lm <NEW_EXP>/den_lm.npz: stage 2 "
                       "builds the denominator graph from the training transcripts "
                       "(cat.graph.den_graph), as CAT's prep_den_lm.sh did")
        elif key in schema_keys:
            out[key] = value
            record.add("mapped", CONFIG_NAME, where + key, f"-> trainer.{key} {json.dumps(value)}")
        else:
            record.add("pending", CONFIG_NAME, where + key,
                       f"{json.dumps(value)}: CTC-CRF only; mapped once config.json "
                       f"trainer.{key} exists")
    cuside = [key for key in CUSIDE_TRAINER_KEYS if key in trainer]
    for key in cuside:
        out[key] = trainer.pop(key)
        record.add("mapped", CONFIG_NAME, where + key,
                   f"-> trainer.{key} {json.dumps(out[key])} (CUSIDE, cat.models.cuside)")
    if cuside and "chunk_size" not in out:
        out["chunk_size"] = CAT_CUSIDE_CHUNK
        record.add("mapped", CONFIG_NAME, where + "chunk_size",
                   f"(absent) -> trainer.chunk_size {CAT_CUSIDE_CHUNK}: CAT's default, "
                   "which turns CUSIDE on here")
    if "compact" in trainer:
        record.add("dropped", CONFIG_NAME, where + "compact",
                   f"{json.dumps(trainer.pop('compact'))}: a memory layout of CAT's loss")
    if "decoder" in trainer:
        record.add("not mapped", CONFIG_NAME, where + "decoder",
                   f"{json.dumps(trainer.pop('decoder'))}: no decoding during training here; "
                   "dev loss selects checkpoints")
    record.rest(CONFIG_NAME, where, trainer, "no such trainer option here")
    return out


def _early_stop(kwargs: dict[str, Any], warmup: int | None, record: Recorder) -> int | None:
    """The stop step for CAT's SchedulerNoamEarlyStop: its `min_step`.

    CAT's schedule (`cat/shared/scheduler.py`) is Noam's until `min_step` (default:
    `warmup_step`); from then on it multiplies the learning rate by `gamma` after `n_tol`
    dev checks without improvement and stops below `stop_lr`. There is no early stopping
    here: training stops at `min_step`, the earliest step CAT could stop at.
    """
    stop = kwargs.pop("min_step", warmup)
    where = "scheduler."
    record.add("mapped", CONFIG_NAME, where + "type",
               f"'SchedulerNoamEarlyStop' -> 'SchedulerNoam' stopping at min_step {stop}")
    for key, default in (("n_tol", 0), ("gamma", 0.1), ("stop_lr", 0.00001)):
        value = kwargs.pop(key, default)
        record.add("not mapped", CONFIG_NAME, f"{where}kwargs.{key}",
                   f"{json.dumps(value)}: no early stopping on the dev loss here; training "
                   f"stops at CAT's min_step {stop}: set stop_step by hand")
    if kwargs.pop("reverse", False):
        record.add("not mapped", CONFIG_NAME, where + "kwargs.reverse",
                   "true: the dev metric is a loss here (lower is better)")
    return stop


def _migrate_scheduler(scheduler: dict[str, Any], record: Recorder) -> dict[str, Any]:
    scheduler = dict(scheduler)
    where = "scheduler."
    cat_type = scheduler.pop("type", None)
    kwargs = dict(scheduler.pop("kwargs", {}))
    optimizer = dict(scheduler.pop("optimizer", {}))
    out: dict[str, Any] = {"type": "SchedulerNoam"}
    if cat_type in ("SchedulerNoam", "SchedulerNoamEarlyStop"):
        dim = kwargs.pop("dim_model", None)
        warmup = kwargs.pop("warmup_step", None)
        factor = kwargs.pop("peak_factor", 1.0)
        if cat_type == "SchedulerNoamEarlyStop":
            stop = _early_stop(kwargs, warmup, record)
        else:
            stop = kwargs.pop("stop_step", None)
        if dim is None or warmup is None or stop is None:
            raise ConfigError(f"{CONFIG_NAME}: scheduler.kwargs: {cat_type} needs "
                              "dim_model, warmup_step and " + (
                                  "stop_step" if cat_type == "SchedulerNoam" else "min_step"))
        peak = factor / math.sqrt(dim * warmup)
        out["kwargs"] = {"peak_lr": float(f"{peak:.6g}"), "warmup_steps": warmup,
                         "stop_step": stop}
        record.add("mapped", CONFIG_NAME, where + "kwargs.peak_factor / dim_model",
                   f"{factor} / sqrt({dim} * {warmup}) -> peak_lr {out['kwargs']['peak_lr']}")
        record.add("mapped", CONFIG_NAME, where + "kwargs.warmup_step",
                   f"-> warmup_steps {warmup}")
        if cat_type == "SchedulerNoam":
            record.add("mapped", CONFIG_NAME, where + "kwargs.stop_step", str(stop))
    else:
        raise ConfigError(f"{CONFIG_NAME}: scheduler.type: {cat_type!r} cannot be migrated "
                          "(only SchedulerNoam and SchedulerNoamEarlyStop have an equivalent "
                          "here)")
    record.rest(CONFIG_NAME, where + "kwargs.", kwargs, "no such SchedulerNoam option here")
    opt_type = optimizer.pop("type", "Adam")
    if opt_type not in ("Adam", "AdamW", "SGD"):
        raise ConfigError(f"{CONFIG_NAME}: scheduler.optimizer.type: {opt_type!r} cannot be "
                          "migrated (Adam, AdamW, SGD)")
    opt_kwargs = dict(optimizer.pop("kwargs", {}))
    new_kwargs = {}
    if "lr" in opt_kwargs:
        record.add("dropped", CONFIG_NAME, where + "optimizer.kwargs.lr",
                   f"{opt_kwargs.pop('lr')}: the schedule sets the learning rate")
    allowed = (("betas", "eps", "weight_decay", "amsgrad") if opt_type != "SGD"
               else ("momentum", "dampening", "weight_decay", "nesterov"))
    for key in allowed:
        if key in opt_kwargs:
            new_kwargs[key] = opt_kwargs.pop(key)
            record.add("mapped", CONFIG_NAME, f"{where}optimizer.kwargs.{key}",
                       json.dumps(new_kwargs[key]))
    record.rest(CONFIG_NAME, where + "optimizer.kwargs.", opt_kwargs,
                f"no such {opt_type} option here")
    for key in ("zeroredundancy", "use_zero"):
        if key in optimizer:
            value = optimizer.pop(key)
            why = ("ZeroRedundancyOptimizer is not used here" if key == "zeroredundancy"
                   else "CAT does not read it either (its key is zeroredundancy)")
            record.add("not mapped", CONFIG_NAME, f"{where}optimizer.{key}",
                       f"{json.dumps(value)}: {why}")
    record.rest(CONFIG_NAME, where + "optimizer.", optimizer, "no such optimizer key here")
    record.rest(CONFIG_NAME, where, scheduler, "no such scheduler key here")
    out["optimizer"] = {"type": opt_type, "kwargs": new_kwargs}
    return out


def config_kind(config: dict[str, Any]) -> str:
    """'rnnt' when CAT's config has a predictor and a joiner, else 'ctc'."""
    return "rnnt" if "decoder" in config and "joiner" in config else "ctc"


def migrate_config(config: dict[str, Any],
                   record: Recorder) -> tuple[dict[str, Any], int | None]:
    """This toolkit's config.json of CAT's `config`; and CAT's `num_classes` (or None)."""
    config = dict(config)
    kind = config_kind(config)
    out: dict[str, Any] = {}
    if "specaug" in config:
        out["specaug"] = _migrate_specaug(config.pop("specaug"), record)
    out["encoder"], classes = _migrate_encoder(config.pop("encoder", {}), kind, record)
    if kind == "ctc":
        out["ctc"] = {"dropout": 0.0}
    else:
        hdim = out["encoder"]["kwargs"].get("hdim")
        out["decoder"], predictor_classes = _migrate_decoder(config.pop("decoder"), record)
        out["joiner"], joiner_classes = _migrate_joiner(
            config.pop("joiner"), hdim, out["decoder"]["kwargs"].get("hdim"), record)
        classes = classes or joiner_classes or predictor_classes
    for key in ("trainer", "transducer"):
        if key in config:
            trainer = _migrate_trainer(config.pop(key), key, record)
            if key == "transducer":
                record.add("mapped", CONFIG_NAME, "transducer", "an older name of 'trainer'")
            if trainer:
                out.setdefault("trainer", {}).update(trainer)
    if "scheduler" in config:
        out["scheduler"] = _migrate_scheduler(config.pop("scheduler"), record)
    else:
        raise ConfigError(f"{CONFIG_NAME}: scheduler: missing")
    record.rest(CONFIG_NAME, "", config, "no such top-level key here")
    return out, classes
