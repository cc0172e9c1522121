"""What the families' ONNX export writers share (`cat.ctc.export`, `cat.rnnt.export`): the
metadata a runtime needs, `tokens.txt`, tracing a module into ONNX with metadata, writing
a directory of models atomically with the size and sha256 of every file (`export.json`),
reading an export back with its files checked, `streaming.onnx` (the step of the model's
streaming strategy, `cat.models.streaming`, traced; run back by that strategy's chunk
encoder, `onnx_chunk_encoder`), and the pieces of sherpa-onnx and onnxruntime every
runtime of an export uses.

An export directory (`exp/<name>/export/` by default) holds the ONNX models of a family,
their TorchScript traces (`model.pt`, ...; not for `streaming.onnx`), a `tokens.txt`
(`<piece> <id>` per line, blank `<blk>` = 0, the symbol table sherpa-onnx reads) and
`export.json` (the same metadata as the models carry, for reading without onnx; the size
and sha256 of every file, `files`). Loading an export (`load_export_metadata`) checks its
files against it: a model of another export, or a `tokens.txt` of another size, is an
`ExportError` naming the file.

The module stands below the families (`docs/architecture.md`): it loads no model; the
experiment's model is loaded by `cat.decoding.export`, which hands it to the family's
writer (`export_model`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from cat.core.config import HYPER_NAME, load_hyper
from cat.core.io import PathLike
from cat.features.fbank import FbankOptions, experiment_front_end, front_end_name
from cat.models.encoder import Encoder
from cat.models.streaming import ChunkEncoder, StreamingStep, export_strategy

EXPORT_NAME = "export"
TOKENS_NAME = "tokens.txt"
METADATA_NAME = "export.json"
#: export.json's key of the size and sha256 of each file of the export.
FILES_KEY = "files"
OPSET = 17
BLANK_SYMBOL = "<blk>"
# Kaldi's low end of the mel banks, which every front end keeps.
LOW_FREQ = 20.0


logger = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """An experiment cannot be exported; the message says why."""


def feature_metadata(encoder: Encoder, fbank: FbankOptions | None = None) -> dict[str, Any]:
    """What a runtime needs to compute the encoder's input: the fbank settings of the
    experiment's front end (`fbank`, default Kaldi's), the frame-rate reduction, and where
    CMVN went."""
    fbank = fbank or FbankOptions()
    normalizer = encoder.normalizer
    return {
        "sample_rate": fbank.sample_rate, "feature_dim": fbank.num_mel_bins,
        "frame_length_ms": fbank.frame_length_ms, "frame_shift_ms": fbank.frame_shift_ms,
        "dither": fbank.dither, "snip_edges": int(fbank.snip_edges), "low_freq": LOW_FREQ,
        "high_freq": fbank.high_freq,
        # 0: samples in [-1, 1) scaled to the int16 range before the fbank, as Kaldi does.
        "normalize_samples": int(fbank.normalize_samples),
        "front_end": front_end_name(fbank) or "custom",
        "subsampling_factor": int(encoder.frame_rate_factor),
        "cmvn": "folded" if normalizer is not None else "none",
    }


def experiment_feature_metadata(exp_dir: PathLike, encoder: Encoder) -> dict[str, Any]:
    """`feature_metadata` of the experiment's front end (`hyper-p.json: data.front_end`)."""
    return feature_metadata(encoder, experiment_front_end(load_hyper(Path(exp_dir) /
                                                                     HYPER_NAME)))


def write_tokens(tokenizer: Any, path: PathLike) -> None:
    """sherpa-onnx's symbol table: `<piece> <id>` per line, id 0 named `<blk>`."""
    lines = []
    for index in range(tokenizer.vocab_size):
        piece = BLANK_SYMBOL if index == 0 else tokenizer.id_to_piece(index)
        if not piece or any(c.isspace() for c in piece):
            raise ExportError(f"token {index} ({piece!r}) cannot be written to {TOKENS_NAME}: "
                              "empty or holding white space")
        lines.append(f"{piece} {index}\n")
    Path(path).write_text("".join(lines), encoding="utf-8")


def export_onnx(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: PathLike,
                input_names: list[str], output_names: list[str],
                dynamic_axes: Mapping[str, Mapping[int, str]],
                metadata: Mapping[str, Any], torchscript: bool = True) -> None:
    """Trace `module` on `args` into the ONNX file `path` with `metadata` (values as
    strings, what sherpa-onnx's model readers parse); with `torchscript`, the same trace
    as TorchScript next to it (`model.onnx` -> `model.pt`, `torch.jit.load`; the metadata
    in its extra file `metadata.json`)."""
    import onnx

    with warnings.catch_warnings():
        # The tracer's warnings are about branches on sizes, which the inputs' dynamic
        # axes keep out of the graph (inputs shorter than one subsampling window aside).
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), input_names=input_names,
                          output_names=output_names, dynamic_axes=dict(dynamic_axes),
                          opset_version=OPSET, dynamo=False)
        if torchscript:
            with torch.no_grad():
                traced = torch.jit.trace(module, args, check_trace=False)
            extra = {"metadata.json": json.dumps(dict(metadata), ensure_ascii=False)}
            torch.jit.save(traced, str(Path(path).with_suffix(".pt")), _extra_files=extra)
    model = onnx.load(str(path))
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, str(value)
    onnx.save(model, str(path))


def read_metadata(path: PathLike) -> dict[str, str]:
    """The metadata of an ONNX file."""
    import onnx

    return {entry.key: entry.value for entry in onnx.load(str(path)).metadata_props}


def file_digest(path: PathLike) -> str:
    """The sha256 of a file, read 1 MB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_export(out_dir: PathLike, write: Callable[[Path], dict[str, Any]]) -> Path:
    """Run `write(tmp_dir)` (which writes the models and returns the metadata) into a
    temporary directory, add `export.json` (the metadata, and under `files` the size and
    sha256 of every file written), then put it in place of `out_dir`."""
    out_dir = Path(out_dir)
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    metadata = write(tmp_dir)
    metadata = {**metadata, FILES_KEY: {
        path.name: {"bytes": path.stat().st_size, "sha256": file_digest(path)}
        for path in sorted(tmp_dir.iterdir()) if path.is_file()}}
    (tmp_dir / METADATA_NAME).write_text(json.dumps(metadata, indent=1, ensure_ascii=False),
                                         encoding="utf-8")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp_dir, out_dir)
    return out_dir


def load_export_metadata(export_dir: PathLike) -> dict[str, Any]:
    """`export.json` of an export directory, its files checked against it
    (`check_export_files`)."""
    path = Path(export_dir) / METADATA_NAME
    if not path.is_file():
        raise ExportError(f"{export_dir}: no {METADATA_NAME} (not an export directory)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ExportError(f"{path}: not an export's metadata ({error})") from None
    if not isinstance(meta, dict):
        raise ExportError(f"{path}: not an export's metadata (not a JSON object)")
    check_export_files(export_dir, meta)
    return meta


def check_export_files(export_dir: PathLike, meta: Mapping[str, Any]) -> None:
    """ExportError naming the file when a file `export.json` lists is missing, or is not
    the one the export wrote (another size or sha256: another model's, or changed since);
    when `tokens.txt` holds another number of tokens than the model's vocabulary. An export
    written before exports recorded their files is read with a warning."""
    export_dir = Path(export_dir)
    tokens = export_dir / TOKENS_NAME
    if tokens.is_file() and "vocab_size" in meta:
        with open(tokens, encoding="utf-8", errors="replace") as f:
            count = sum(1 for line in f if line.strip())
        if count != int(meta["vocab_size"]):
            raise ExportError(f"{tokens}: {count} tokens, but the model's vocabulary "
                              f"({METADATA_NAME} vocab_size) is {meta['vocab_size']}: it is "
                              "not this model's symbol table (a runtime would fail on, or "
                              "misname, the ids it lacks); export again")
    files = meta.get(FILES_KEY)
    if not isinstance(files, dict):
        logger.warning("%s: %s records no files (written before exports recorded them): "
                       "they are not checked", export_dir, METADATA_NAME)
        return
    for name, record in files.items():
        path = export_dir / name
        if not path.is_file():
            raise ExportError(f"{path}: missing ({METADATA_NAME} lists it); export again")
        size, digest = path.stat().st_size, None
        if size == record.get("bytes"):
            digest = file_digest(path)
            if digest == record.get("sha256"):
                continue
        found = f"{size} bytes" if digest is None else f"sha256 {digest[:16]}"
        recorded = (f"{record.get('bytes')} bytes" if digest is None
                    else f"{str(record.get('sha256'))[:16]}")
        raise ExportError(f"{path}: not the file this export wrote ({found}, {METADATA_NAME} "
                          f"records {recorded}): another model's, or changed since; export "
                          "again (python -m cat.export EXP --out DIR)")


def sherpa_feature_config(meta: Mapping[str, Any]) -> Any:
    """sherpa-onnx's fbank settings of an export's metadata (`feature_metadata`): its
    recognizers' defaults differ (high_freq -400, samples in [-1, 1), snip_edges false)."""
    import sherpa_onnx

    return sherpa_onnx.FeatureExtractorConfig(
        sampling_rate=int(meta["sample_rate"]), feature_dim=int(meta["feature_dim"]),
        low_freq=float(meta["low_freq"]), high_freq=float(meta["high_freq"]),
        dither=float(meta["dither"]), normalize_samples=bool(int(meta["normalize_samples"])),
        snip_edges=bool(int(meta["snip_edges"])))


def sherpa_wrap(cls: type, native: type, config: Any) -> Any:
    """An instance of sherpa-onnx's Python recognizer class `cls` over `native(config)`: what
    the class's own factory methods do, with a config of our settings (its fbank)."""
    recognizer = cls.__new__(cls)
    recognizer.recognizer = native(config)
    recognizer.config = config
    return recognizer


def onnx_session(path: PathLike, num_threads: int = 1) -> Any:
    """An onnxruntime CPU session of `path` using `num_threads` threads."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


STREAMING_NAME = "streaming.onnx"


def streaming_step(model: torch.nn.Module, chunk_size: int,
                   right_context: str | None = None) -> StreamingStep:
    """What `streaming.onnx` traces for chunks of `chunk_size` encoder frames: the step of
    the model's streaming strategy (`AsrModel.streaming`), with `right_context`."""
    return model.streaming.step(chunk_size, right_context)


def streaming_metadata(step: StreamingStep) -> dict[str, Any]:
    """What a runtime needs to cut features into chunks for `streaming.onnx` (the step's
    `metadata`, its strategy's name under `streaming` first)."""
    return step.metadata()


def export_streaming(head: torch.nn.Module, step: StreamingStep, path: PathLike,
                     output_name: str, metadata: Mapping[str, Any]) -> None:
    """`streaming.onnx`: the step with `head` on its output (`output_name`), its inputs,
    outputs and example as its strategy gives them (`StreamingStep.onnx_graph`)."""
    graph = step.onnx_graph(head, output_name, int(metadata["feature_dim"]))
    export_onnx(graph.module, graph.example, path, graph.input_names, graph.output_names,
                graph.dynamic_axes, metadata, torchscript=False)


def onnx_chunk_encoder(export_dir: PathLike, num_threads: int = 1) -> ChunkEncoder:
    """The chunk encoder of an export's `streaming.onnx` in onnxruntime, that of the
    strategy `export.json` names (`cat.models.streaming.export_strategy`)."""
    meta = load_export_metadata(export_dir)
    if "chunk_size" not in meta:
        raise ExportError(f"{export_dir}: no {STREAMING_NAME} (export with --chunk-size)")
    try:
        strategy = export_strategy(meta)
    except ValueError as error:
        raise ExportError(f"{Path(export_dir) / METADATA_NAME}: {error}; export again") from None
    return strategy.onnx_chunk_encoder(export_dir, num_threads)


# sherpa-onnx's online `wenet_ctc` layout (WeNet's `forward_chunk`): a step's inputs and
# outputs (after its head's, first), matched by position, and what refuses a runtime of
# other settings.
WENET_INPUTS = ["x", "offset", "required_cache_size", "attn_cache", "conv_cache", "attn_mask"]
WENET_OUTPUTS = ["next_att_cache", "next_conv_cache"]


class Refusal(torch.nn.Module):
    """Zero when `ok`; else a lookup out of range, which stops onnxruntime with an error
    naming the node, whose scope is the name this module is given (what a runtime must
    set): sherpa-onnx's factories do not read the settings from the metadata, and other
    settings give wrong text, not an error."""

    def forward(self, ok: torch.Tensor) -> torch.Tensor:
        index = (1 - ok.to(torch.int64)).reshape(1)
        return torch.index_select(torch.zeros(1), 0, index).sum()


def runtime_sizes(attn_cache: torch.Tensor, attn_mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's cache frames `chunk_size x num_left_chunks` and its `chunk_size`, as
    tensors the graph computes from its inputs' sizes (not constants of the trace)."""
    cached = torch.ones_like(attn_cache[0, 0, :, 0]).sum()
    return cached, torch.ones_like(attn_mask[0, 0], dtype=attn_cache.dtype).sum() - cached


def refusal_name(settings: dict[str, Any]) -> str:
    """The name of the graph's `Refusal`: the runtime settings (`wenet_runtime`) it
    refuses others than, as onnxruntime's error will show it."""
    least = "_at_least" if settings["num_left_chunks_is"] == "minimum" else ""
    return (f"run_with_chunk_size_{settings['chunk_size']}_and_num_left_chunks{least}_"
            f"{settings['num_left_chunks']}")
