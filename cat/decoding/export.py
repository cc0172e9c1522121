"""Exporting an experiment to ONNX, and sherpa-onnx and onnxruntime over an export: the
model and checkpoint of an experiment (`load_experiment_model`) handed to its family's
writer (`export`: the family's `export_model`, `cat.ctc.export`, `cat.rnnt.export`), the
sherpa-onnx recognizer of an export (its family's `sherpa_model_config`), and the chunk
encoder of its `streaming.onnx` (`onnx_chunk_encoder`: that of the streaming strategy
`export.json` names, `cat.models.streaming`). What the writers share (`export.json`,
`tokens.txt`, the files' digests, the traces, `streaming.onnx`) is
`cat.models.onnx_export`, whose names this module also offers.

An export directory (`exp/<name>/export/` by default) holds the ONNX models of a family
(`model.onnx` for CTC; `encoder.onnx`, `decoder.onnx`, `joiner.onnx` for RNN-T), their
TorchScript traces (`model.pt`, ...; not for `streaming.onnx`), a `tokens.txt` (`<piece>
<id>` per line, blank `<blk>` = 0, the symbol table sherpa-onnx reads) and `export.json`
(the same metadata as the models carry, for reading without onnx; the size and sha256 of
every file, `files`; for a streaming CTC export the settings a runtime of
`streaming_wenet_ctc.onnx` must use, `wenet_ctc_runtime`). Loading an export
(`load_export_metadata`: the sherpa-onnx recognizers and onnxruntime decoders here)
checks its files against it: a model of another export, or a `tokens.txt` of another
size, is an `ExportError` naming the file. The models take stage 1's features: 80-dim
Kaldi fbank of audio at 16 kHz scaled to the int16 range (`cat.features.fbank`: 25 ms
windows every 10 ms, `snip_edges`, mel bins from 20 Hz to Nyquist, no dither). Global
CMVN, when the model has it, is folded into the encoder graph: the features go in raw.

The model exported is that of `cat.decoding.searcher.load_model`: a `config.json` changed
since the checkpoint was trained (`causal_conv` turned on, a time reduction without
parameters added: the same weights, another model), another front end or another
tokenizer than the checkpoint records, is an error naming the changed keys, and nothing
is written, unless `--allow-config-change` or `hyper-p.json`'s `inference.infer.option.
allow_config_change` accepts it (then the keys are logged).

Usage:
    out = export("exp/synth-ctc")                             # -> exp/synth-ctc/export/
    recognizer = sherpa_recognizer("exp/synth-ctc/export")   # sherpa_onnx.OfflineRecognizer
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cat.core.config import (
    CONFIG_NAME,
    HYPER_NAME,
    experiment_kind,
    load_config,
    load_hyper,
    model_kind,
)
from cat.core.io import PathLike
from cat.decoding.checkpoint import select_checkpoint
from cat.decoding.searcher import load_model
from cat.models.onnx_export import (  # noqa: F401  (offered here to the runtimes and tests)
    BLANK_SYMBOL,
    EXPORT_NAME,
    FILES_KEY,
    LOW_FREQ,
    METADATA_NAME,
    OPSET,
    STREAMING_NAME,
    TOKENS_NAME,
    ExportError,
    check_export_files,
    experiment_feature_metadata,
    export_onnx,
    export_streaming,
    feature_metadata,
    file_digest,
    load_export_metadata,
    onnx_chunk_encoder,
    onnx_session,
    read_metadata,
    sherpa_feature_config,
    sherpa_wrap,
    streaming_metadata,
    streaming_step,
    write_export,
    write_tokens,
)
from cat.models.registry import DECODES_AS, FAMILIES, check_command, family


def load_experiment_model(exp_dir: PathLike, kind: str, checkpoint: PathLike | None = None,
                          allow_config_change: bool | None = None
                          ) -> tuple[torch.nn.Module, Any, Path]:
    """The experiment's model (eval mode, CPU) with the weights stage 4 decodes with
    (`select_checkpoint`) or `checkpoint`, its tokenizer and the checkpoint's path; the
    checkpoint's config is checked as `load_model` does (`allow_config_change` as there)."""
    exp_dir = Path(exp_dir)
    hyper = load_hyper(exp_dir / HYPER_NAME)
    found = model_kind(load_config(exp_dir / CONFIG_NAME))
    if DECODES_AS.get(found, found) != kind:
        raise ExportError(f"{exp_dir / CONFIG_NAME} describes a {found} model; export it "
                          f"with cat.export")
    try:
        path = Path(checkpoint) if checkpoint else select_checkpoint(exp_dir, hyper)
    except FileNotFoundError as error:
        raise ExportError(f"cannot export {exp_dir}: {error}") from None
    if not path.is_file():
        raise ExportError(f"cannot export {exp_dir}: no checkpoint {path}")
    model, tokenizer = load_model(exp_dir, path, torch.device("cpu"),
                                  allow_config_change)
    return model, tokenizer, path


def export(exp_dir: PathLike, out_dir: PathLike | None = None,
           checkpoint: PathLike | None = None, chunk_size: int | None = None,
           allow_config_change: bool | None = None, kind: str | None = None) -> Path:
    """Export the experiment's model (`load_experiment_model`: stage 4's checkpoint or
    `checkpoint`) with its family's writer (`export_model` of `family(kind, "export")`) to
    `out_dir` (default `EXP/export`); with `chunk_size`, also its streaming models. `kind`
    (default: `config.json`'s) is the family the caller expects: another is an
    `ExportError`."""
    kind = kind or experiment_kind(exp_dir)
    model, tokenizer, path = load_experiment_model(exp_dir, DECODES_AS.get(kind, kind),
                                                   checkpoint, allow_config_change)
    return family(kind, "export").export_model(
        model, tokenizer, path, exp_dir, out_dir or Path(exp_dir) / EXPORT_NAME, chunk_size)


def sherpa_recognizer(export_dir: PathLike, num_threads: int = 1) -> Any:
    """A `sherpa_onnx.OfflineRecognizer` over an export (its family's model type,
    `sherpa_model_config` of `family(export.json's family, "export")`), with the fbank
    settings of `export.json` (the factory methods fix some of them otherwise)."""
    import sherpa_onnx
    from sherpa_onnx.lib._sherpa_onnx import OfflineRecognizer as _Recognizer

    export_dir = Path(export_dir)
    meta = load_export_metadata(export_dir)
    if meta.get("family") not in FAMILIES:
        raise ExportError(f"{export_dir / METADATA_NAME}: family {meta.get('family')!r} is "
                          "not a model family of this toolkit; export again")
    common = {"tokens": str(export_dir / TOKENS_NAME), "num_threads": num_threads,
              "provider": "cpu", "debug": False}
    models = family(meta["family"], "export").sherpa_model_config(export_dir, meta, common)
    config = sherpa_onnx.OfflineRecognizerConfig(feat_config=sherpa_feature_config(meta),
                                                 model_config=models,
                                                 decoding_method="greedy_search")
    return sherpa_wrap(sherpa_onnx.OfflineRecognizer, _Recognizer, config)


def export_main(command: str, argv: list[str] | None = None) -> int:
    """Command line of `python -m cat.export` and its aliases `cat.ctc.export` /
    `cat.rnnt.export` (`command`): `export` of `config.json`'s model kind."""
    import argparse
    import logging
    import sys

    parser = argparse.ArgumentParser(
        prog=f"python -m {command}",
        description="Export the model stage 4 decodes with to ONNX (+ tokens.txt).")
    parser.add_argument("exp_dir", help="experiment directory (hyper-p.json, config.json)")
    parser.add_argument("--checkpoint", help="checkpoint to export (default: stage 4's)")
    parser.add_argument("--out", help=f"output directory (default: EXP/{EXPORT_NAME})")
    parser.add_argument("--chunk-size", type=int,
                        help=f"also write {STREAMING_NAME}, chunk-by-chunk encoding with state "
                             "in and out, for chunks of this many encoder output frames")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="export although config.json changed since the checkpoint was "
                             "trained (the changed keys are logged)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    try:
        kind = experiment_kind(args.exp_dir)
        check_command(command, kind, str(Path(args.exp_dir) / CONFIG_NAME))
        out = export(args.exp_dir, args.out, args.checkpoint, args.chunk_size,
                     args.allow_config_change or None, kind)
    except (ExportError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(out)
    return 0
