"""Batched decoding, `python -m cat.decode` (and CAT's names for it, `cat.ctc.decode` and
`cat.rnnt.decode`): of a Kaldi feature directory (stage 4), or of audio (transcription).

The model is rebuilt from the experiment's `config.json` and tokenizer and loaded from a
checkpoint: `--checkpoint` (a training checkpoint, or an average written by
`cat.decoding.avgmodel`), by default the one stage 4 decodes with
(`cat.decoding.checkpoint.select_checkpoint`: the average `inference.avgmodel` asks for).
Options default to the experiment's `hyper-p.json: inference.infer.option`, as in
stage 4; the command line overrides them. Run from the recipe directory (paths in
`hyper-p.json` are relative to it).

What to decode, one of:

* `--data <feature dir>`: its `feats.scp` (stage 1's features), read lazily, sorted by
  length, grouped into batches of at most `max_frames` padded frames (and `batch_size`
  utterances), the batches dealt to `nj` CPU processes (one torch thread each) or
  decoded on the GPU when one is present;
* audio (`cat.decoding.transcribe`): audio files on the command line (`--audio`, keys
  are the file names without extension), a Kaldi `--wav-scp` (file paths or pipe
  commands ending in `|`; with `--segments`, its segments), or a WeNet `--data-list` (raw
  mode: JSON lines `{"key", "wav", "txt"}`; shard mode: tar shards of `<key>.wav` and
  `<key>.txt` members, one per line). Stage 1's features are computed as the audio is
  read (80-dim fbank, resampled to 16 kHz), across `nj` processes. Unreadable audio is
  skipped and reported with the line of the list that names it.

Outputs: with `--out <dir>`, `hyp` (`<utt> <hypothesis>` lines, sorted; an utterance
whose hypothesis is empty is written as its id alone, so a scorer sees it and counts
deletions) and `decode.log` (the options, the checkpoint, counts, audio and decoding
seconds, and the real-time factor), and for audio `skipped.txt` (`<key> <reason>`).
Without `--out` (audio only), the `<key> <hypothesis>` lines go to standard output in the
order of the list. The real-time factor (decoding time / audio time) is logged to
standard error.

Long recordings (audio): an utterance longer than `--max-segment` (seconds, default 30;
0: decoded whole) is read and decoded a stretch at a time and their timed results
joined into one (`cat.decoding.transcribe`), so a recording of any length is
transcribed in the memory of a few stretches: with `--vad silero` (the default),
voice-activity segments cut in pauses and merged up to `--segment-target` (5 s;
`--vad-threshold`, `--vad-min-silence` tune the detector, `cat.decoding.segments`); with
`--vad none`, windows of `--max-segment` overlapping by `--segment-overlap` (default 2),
which also take speech without a pause longer than `--max-segment`. The segments are
decoded in batches (`--batch-size`, `--max-frames`), and their times and text are in
the `json` results (`segments`) and the `srt` subtitles (a cue per segment). A setting
out of range is an error naming its flag.

Results as data (`--format`, `cat.decoding.results`): `text` (the default: the lines
above, unchanged), `json` (a JSON object per utterance: key, text, tokens, token and word
times, and for beam searches the N-best list with scores), `ctm` (Kaldi's CTM, a line per
word) or `srt` (SubRip subtitles). With `--out` the records go to `hyp.jsonl`, `hyp.ctm`
or `srt/<key>.srt` besides `hyp` (which holds the text format's lines whatever the
format, for scoring), with `--data` too; without it, to standard output (srt: one
utterance only). Times (`cat.decoding.timestamps`) come from the alignment of each
hypothesis to the encoder frames: CTC spikes, transducer emission frames. A format other
than text decodes beam searches through the family's `nbest` (the same best hypothesis)
and, with greedy search, runs the encoder twice.

Options (`hyper-p.json: inference.infer.option`, or the command line):
`method` (greedy | beam), `beam_size`, `nj`, `max_frames`, `batch_size`, `device`
(auto | cpu | cuda); `hotwords` (a file of phrases the beam searches favour, one per line
with an optional trailing ` :<score>`) and `hotwords_score` (their default bonus per
token, 1.5), see `cat.decoding.context_graph`. A hotwords file that cannot be read, or a
score in it that is not a number, is an error naming the file (and line).

With language models (`decode_passes`, used by `cat.stages.driver lm`): beam search
with token-level shallow fusion and LODR (`FusionSpec`, `cat.lm.scorer`), several
first passes (one per fusion setting, e.g. the points of a weight grid) sharing one
network forward per batch, each writing `hyp`, `nbest.jsonl` (`cat.lm.rescore`) and
`decode.log` into its own directory. `--lm` etc. on the command line decode one pass.

On a cluster (`decode_set` / `decode_passes` given a `cat.core.launch.Launcher`, as
`python -m cat.stages.driver decode|lm --cmd "$decode_cmd"` does): the same batches,
dealt round-robin to `nj` shares whatever this machine's device, are the tasks of an
array job (`cat.core.launch.map_calls`, logs `<out>/log/decode.<task>.log`); each task
resolves `device` on its node (auto: cuda when the node has a GPU) and sends its
hypotheses back to this process, which writes the outputs. They are those of the process
pool, hypotheses byte for byte; `decode.log` adds `backend`, names the devices the tasks
used, and its decoding seconds are the array's wall time (time in the queue included).
There is no progress bar (the tasks cannot advance it).

Usage:
    python -m cat.decode exp/synth-ctc --data data/fbank/test \
        --checkpoint exp/synth-ctc/check/avg-best-5.pt --out exp/synth-ctc/decode/test
    python -m cat.decode exp/synth-ctc --data data/fbank/test \
        --checkpoint exp/synth-ctc/check/avg-best-5.pt --out exp/synth-ctc/decode/test-lm \
        --lm exp/synth-lm-char-5gram/lm.arpa --alpha 0.3 --beta 0.5
    python -m cat.decode exp/synth-ctc --audio a.wav b.flac c.opus
    python -m cat.decode exp/synth-ctc --audio a.wav --hotwords hotwords.txt \
        --hotwords-score 2.0
    python -m cat.decode exp/synth-ctc --wav-scp data/test/wav.scp --nj 2 \
        --out exp/synth-ctc/transcribe/test
    python -m cat.decode exp/synth-rnnt --data-list data.list --nj 2 > hyp.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import kaldiio

from cat.audio.vad import VadError
from cat.core.config import CONFIG_NAME, HYPER_NAME, ConfigError, experiment_kind, load_hyper
from cat.core.io import PathLike, atomic_write, setup_logging
from cat.core.launch import Launcher, map_calls
from cat.core.process import process_pool
from cat.core.progress import WorkerProgress, advance
from cat.decoding.audio import (
    SEGMENT_TARGET_SECONDS,
    AudioList,
    AudioListError,
    Segmenting,
    from_data_list,
    from_files,
    from_wav_scp,
)
from cat.decoding.checkpoint import (
    ModelConfigChangedError,
    check_feature_dir,
    select_checkpoint,
)
from cat.decoding.context_graph import HotwordsError
from cat.decoding.results import (
    FORMATS,
    WRITERS,
    Result,
    ResultFormatError,
    check_format,
    format_lines,
    formats_help,
    needs_times,
    write_results,
)
from cat.decoding.searcher import (
    NO_LABEL,
    DecodeOptions,
    DecodeSummary,
    FusionSpec,
    method_options,
    options_schema,
    plan_batches,
    searcher_for,
    write_hyp,
)
from cat.decoding.segments import VADS
from cat.decoding.timestamps import FRAME_SHIFT_SECONDS
from cat.decoding.transcribe import TranscribeError, transcribe, write_outputs
from cat.features.fbank import experiment_front_end
from cat.formats.tables import read_feature_index
from cat.graph.tlg import GraphError
from cat.lm.rescore import NBEST_NAME, write_nbest
from cat.loading.batch import Utterance
from cat.models.registry import check_command
from cat.training.checkpoint import CheckpointMismatchError, read_model_checkpoint

__all__ = ["DecodeOptions", "DecodeSummary", "FusionSpec", "decode_passes", "decode_set",
           "main", "plan_batches", "read_lengths"]

logger = logging.getLogger(__name__)


def read_lengths(data_dir: Path) -> dict[str, int]:
    """Frame counts of the utterances of a feature dir's `feats.scp` (from `utt2num_frames`,
    else from the matrix headers); a malformed scp line is an error naming it."""
    table = read_feature_index(data_dir / "feats.scp")
    return dict(zip(table.keys, table.num_frames.tolist(), strict=True))


def _utterances(features: dict, keys: list[str]) -> list[Utterance]:
    return [Utterance(key, features[key], NO_LABEL) for key in keys]


def _decode_batches(exp_dir: str, checkpoint: str, scp: str, batches: list[list[str]],
                    options: DecodeOptions, device: str, output: str = "text",
                    spec: FusionSpec | None = None) -> list[Result]:
    """Decode `batches` in this process; returns a `Result` per utterance, with times,
    pieces and N-best unless `output` (a format of `cat.decoding.results`) is text."""
    searcher = searcher_for(exp_dir, checkpoint, options, device,
                            [spec] if spec is not None else [])
    features = kaldiio.load_scp(scp)
    results: list[Result] = []
    for keys in batches:
        utterances = _utterances(features, keys)
        if not needs_times(output) and spec is None:
            results += [Result(key, text) for key, text in searcher.best(utterances)]
        else:
            results += searcher.results(utterances, timestamps=needs_times(output))
        advance(len(keys))
    return results


def _search_batches(exp_dir: str, checkpoint: str, scp: str,
                    batches: list[list[str]], options: DecodeOptions, device: str,
                    specs: list[FusionSpec | None]) -> tuple[list[list], float, list[float]]:
    """N-best beam search of `batches` once per fusion spec (one network forward per batch).

    Returns, per spec, (utt, [(text, score), ...]) pairs; the forward seconds; and the
    search seconds per spec.
    """
    searcher = searcher_for(exp_dir, checkpoint, options, device, specs)
    features = kaldiio.load_scp(scp)
    results: list[list] = [[] for _ in specs]
    for keys in batches:
        for index, pairs in enumerate(searcher.nbest(_utterances(features, keys))):
            results[index] += pairs
        advance(len(keys))
    return results, searcher.forward_seconds, searcher.search_seconds


def _decode_task(exp_dir: str, checkpoint: str, scp: str, batches: list[list[str]],
                 options: DecodeOptions, output: str = "text",
                 spec: FusionSpec | None = None) -> tuple[list[Result], str]:
    """A task of `decode_set`'s array: `_decode_batches` on the device of the node it runs
    on; returns the results and that device."""
    device = options.resolved_device()
    return _decode_batches(exp_dir, checkpoint, scp, batches, options, device, output,
                           spec), device


def _search_task(exp_dir: str, checkpoint: str, scp: str, batches: list[list[str]],
                 options: DecodeOptions, specs: list[FusionSpec | None]) -> tuple[tuple, str]:
    """A task of `decode_passes`'s array: `_search_batches` on the device of the node it
    runs on; returns its output and that device."""
    device = options.resolved_device()
    return _search_batches(exp_dir, checkpoint, scp, batches, options, device,
                           specs), device


def _plan_workers(data_dir: Path, options: DecodeOptions, launcher: Launcher | None = None
                  ) -> tuple[Path, dict[str, int], str, list[list[list[str]]]]:
    """The scp, utterance lengths, device and each worker's share of the batches.

    Without a launcher the device is this machine's and a GPU takes every batch; with one,
    each of the `nj` tasks resolves `options.device` on its node (the device returned is
    `options.device` as given)."""
    scp = data_dir / "feats.scp"
    if not scp.is_file():
        raise FileNotFoundError(f"{scp} does not exist (run the feature stage first)")
    device = options.resolved_device() if launcher is None else options.device
    lengths = read_lengths(data_dir)
    batches = plan_batches(lengths, options.max_frames, options.batch_size)
    one = launcher is None and device == "cuda"
    workers = 1 if one else max(1, min(options.nj, len(batches)))
    # Deal the length-sorted batches round-robin so every worker gets a similar load.
    return scp, lengths, device, [batches[i::workers] for i in range(workers)]


def _run_array(launcher: Launcher, function: Callable[..., tuple[Any, str]], calls: list[tuple],
               log_dir: Path) -> tuple[list[Any], str]:
    """The results of `function(*call)` run as the tasks of an array (logs in `log_dir`),
    and the device(s) they ran on."""
    results = map_calls(launcher, "decode", function, calls, log_dir, parallel=len(calls))
    return [result for result, _ in results], ",".join(sorted({dev for _, dev in results}))


def _backend(launcher: Launcher | None) -> dict[str, str]:
    """The note of the backend in `decode.log` (none for the process pool)."""
    return {} if launcher is None else {"backend": launcher.backend}


def _search_shares(exp_dir: PathLike, checkpoint: PathLike, scp: Path,
                   shares: list[list[list[str]]], options: DecodeOptions, device: str,
                   specs: list[FusionSpec | None], launcher: Launcher | None, log_dir: Path,
                   title: str, total: int) -> tuple[list[tuple], str]:
    """`_search_batches` of every share (here, in a process pool, or as array tasks) and
    the device(s) it ran on."""
    args = (str(exp_dir), str(checkpoint), str(scp))
    if launcher is not None:
        return _run_array(launcher, _search_task,
                          [(*args, share, options, specs) for share in shares], log_dir)
    with WorkerProgress(total, title) as progress:
        if len(shares) == 1:
            return [_search_batches(*args, shares[0], options, device, specs)], device
        with process_pool(len(shares), *progress.pool_initializer()) as pool:
            futures = [pool.submit(_search_batches, *args, share, options, device, specs)
                       for share in shares]
            return [future.result() for future in futures], device


def decode_passes(exp_dir: PathLike, data_dir: PathLike, checkpoint: PathLike,
                  options: DecodeOptions, passes: list[tuple[FusionSpec | None, PathLike]],
                  launcher: Launcher | None = None,
                  log_dir: PathLike | None = None) -> list[DecodeSummary]:
    """Beam-search `data_dir` once per (fusion, output dir) pass; each output dir gets
    `hyp`, `nbest.jsonl` and `decode.log`. Decoding seconds of a pass: the wall time of
    the run, shared between the passes in proportion to their search time (the network
    forward, done once, counts for each). With a `launcher` the shares are the tasks of
    an array, their logs in `log_dir` (default: the first pass's dir's `log`)."""
    if options.method != "beam":
        raise ValueError(f"decoding with language models needs method 'beam', got "
                         f"{options.method!r}")
    data_dir = Path(data_dir)
    scp, lengths, device, shares = _plan_workers(data_dir, options, launcher)
    specs = [spec for spec, _ in passes]
    start = time.perf_counter()
    outputs, device = _search_shares(
        exp_dir, checkpoint, scp, shares, options, device, specs, launcher,
        Path(log_dir or Path(passes[0][1]) / "log"),
        f"decoding {data_dir.name} ({len(passes)} pass{'es' * (len(passes) > 1)})",
        len(lengths))
    wall = time.perf_counter() - start
    forward_seconds = sum(out[1] for out in outputs)
    search_seconds = [sum(out[2][i] for out in outputs) for i in range(len(passes))]
    busy = forward_seconds + sum(search_seconds)
    audio = sum(lengths.values()) * FRAME_SHIFT_SECONDS
    summaries = []
    for index, (spec, out_dir) in enumerate(passes):
        out_dir = Path(out_dir)
        nbest = [pair for out in outputs for pair in out[0][index]]
        seconds = wall * (forward_seconds + search_seconds[index]) / busy if busy else wall
        summary = DecodeSummary(len(nbest), audio, seconds)
        write_nbest(out_dir / NBEST_NAME, nbest)
        write_hyp(out_dir / "hyp", ((key, hyps[0][0] if hyps else "") for key, hyps in nbest))
        report = {"data": str(data_dir), "checkpoint": str(checkpoint),
                  **options.record(), "device": device, "workers": len(shares),
                  **_backend(launcher),
                  "fusion": dataclasses.asdict(spec) if spec is not None else None,
                  "num_utts": summary.num_utts, "audio_seconds": round(audio, 2),
                  "decode_seconds": round(seconds, 2), "rtf": round(summary.rtf, 4),
                  "passes_in_run": len(passes)}
        with atomic_write(out_dir / "decode.log") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        summaries.append(summary)
    logger.info("decoded %d utterances (%.1f s of audio) from %s with %d pass%s in %.1f s "
                "(%s, %d worker%s)", len(lengths), audio, data_dir, len(passes),
                "es" * (len(passes) > 1), wall, device, len(shares), "s" * (len(shares) > 1))
    return summaries


def _decode_shares(exp_dir: PathLike, checkpoint: PathLike, scp: Path,
                   shares: list[list[list[str]]], options: DecodeOptions, device: str,
                   launcher: Launcher | None, log_dir: Path, title: str, total: int,
                   output: str = "text", spec: FusionSpec | None = None
                   ) -> tuple[list[Result], str]:
    """`_decode_batches` of every share (here, in a process pool, or as array tasks): the
    results in share order and the device(s) they were decoded on."""
    args = (str(exp_dir), str(checkpoint), str(scp))
    if launcher is not None:
        results, device = _run_array(launcher, _decode_task,
                                     [(*args, share, options, output, spec)
                                      for share in shares], log_dir)
        return [result for share in results for result in share], device
    with WorkerProgress(total, title) as progress:
        if len(shares) == 1:
            return _decode_batches(*args, shares[0], options, device, output, spec), device
        with process_pool(len(shares), *progress.pool_initializer()) as pool:
            futures = [pool.submit(_decode_batches, *args, share, options, device, output,
                                   spec) for share in shares]
            return [result for future in futures for result in future.result()], device


def decode_set(exp_dir: PathLike, data_dir: PathLike, checkpoint: PathLike, out_dir: PathLike,
               options: DecodeOptions,
               launcher: Launcher | None = None, output: str = "text",
               spec: FusionSpec | None = None) -> DecodeSummary:
    """Decode every utterance of `data_dir/feats.scp`; writes `out_dir/{hyp,decode.log}`
    and, for an `output` format other than text, its file (`cat.decoding.results`); with
    `spec`, beam search with that shallow fusion. With a `launcher` the `nj` shares are
    the tasks of an array, logs in `out_dir/log`. Features of another front end than the
    checkpoint's model was trained on are a `ModelConfigChangedError` naming `data_dir`
    (`check_feature_dir`) unless `options.allow_config_change`."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    check_format(output)
    # Features of another front end than the model's decode into wrong text, silently.
    check_feature_dir(data_dir, read_model_checkpoint(checkpoint)[1],
                      experiment_front_end(load_hyper(Path(exp_dir) / HYPER_NAME)), checkpoint,
                      options.allow_config_change)
    scp, lengths, device, shares = _plan_workers(data_dir, options, launcher)
    workers = len(shares)
    start = time.perf_counter()
    results, device = _decode_shares(exp_dir, checkpoint, scp, shares, options, device,
                                     launcher, out_dir / "log", f"decoding {data_dir.name}",
                                     len(lengths), output, spec)
    seconds = time.perf_counter() - start
    summary = DecodeSummary(len(results), sum(lengths.values()) * FRAME_SHIFT_SECONDS, seconds)
    write_hyp(out_dir / "hyp", ((result.key, result.text) for result in results))
    write_results(out_dir, results, output)
    report = {"data": str(data_dir), "checkpoint": str(checkpoint),
              **options.record(), "device": device, "workers": workers,
              **_backend(launcher), "format": output,
              "fusion": dataclasses.asdict(spec) if spec is not None else None,
              "num_utts": summary.num_utts,
              "audio_seconds": round(summary.audio_seconds, 2),
              "decode_seconds": round(summary.decode_seconds, 2), "rtf": round(summary.rtf, 4)}
    with atomic_write(out_dir / "decode.log") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    logger.info("decoded %d utterances (%.1f s of audio) from %s in %.1f s: RTF %.4f "
                "(%s, %d worker%s)", summary.num_utts, summary.audio_seconds, data_dir,
                summary.decode_seconds, summary.rtf, device, workers, "s" * (workers > 1))
    return summary


# ----------------------------------------------------------------------------- command line


def build_parser(command: str) -> argparse.ArgumentParser:
    """Command line of `command` (`cat.decode`, or an alias such as `cat.ctc.decode`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {command}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("exp_dir", help="experiment directory (hyper-p.json, config.json)")
    inputs = parser.add_argument_group("what to decode (one of)").add_mutually_exclusive_group(
        required=True)
    inputs.add_argument("--data", help="Kaldi feature dir (feats.scp) to decode")
    inputs.add_argument("--audio", nargs="+", metavar="FILE",
                        help="audio files (wav, flac, opus ...); keys: names without extension")
    inputs.add_argument("--wav-scp", help="Kaldi wav.scp (paths or commands ending in '|')")
    inputs.add_argument("--data-list", help="WeNet data.list (raw JSON lines or tar shards)")
    parser.add_argument("--segments", help="Kaldi segments of the --wav-scp recordings")
    parser.add_argument("--checkpoint",
                        help="checkpoint or averaged model (default: what stage 4 decodes with)")
    parser.add_argument("--out", help="output directory (hyp, decode.log; required with "
                                      "--data; audio: else key/text lines on stdout)")
    parser.add_argument("--format", default="text",
                        help=f"what the results hold and how they are written (default text): "
                             f"{formats_help()}")
    long = parser.add_argument_group("long recordings (audio)")
    segmenting = Segmenting()
    long.add_argument("--max-segment", type=float, default=segmenting.max_segment,
                      help="seconds: the longest stretch decoded at once; an utterance "
                           "longer than this is cut into segments, decoded in batches and "
                           "their results joined (default %(default)g; 0: every utterance "
                           "whole, up to the transcription window)")
    long.add_argument("--vad", choices=VADS, default=segmenting.vad,
                      help="where to cut: silero (Silero VAD's pauses, segments merged to "
                           "--segment-target) or none (windows of --max-segment overlapping "
                           "by --segment-overlap); default %(default)s")
    long.add_argument("--segment-target", type=float, default=segmenting.segment_target,
                      help="seconds: speech between pauses is merged into segments up to "
                           f"this long (default {SEGMENT_TARGET_SECONDS:g}, or --max-segment "
                           "when shorter)")
    long.add_argument("--vad-threshold", type=float, default=segmenting.vad_threshold,
                      help="speech probability from which a frame is speech (default "
                           "%(default)g)")
    long.add_argument("--vad-min-silence", type=float, default=segmenting.vad_min_silence,
                      help="seconds below the threshold that make a pause to cut at "
                           "(default %(default)g)")
    long.add_argument("--segment-overlap", type=float, default=segmenting.overlap,
                      help="seconds each window overlaps the next (less than half of "
                           "--max-segment); the windows are cut between tokens near the "
                           "middle of the overlap (default %(default)g)")
    options = parser.add_argument_group("options (default: hyper-p.json inference.infer.option)")
    methods = parser.add_argument_group(
        "options of the decoding methods, each method's meaning as its head declares it "
        "(default: hyper-p.json inference.infer.option)")
    # Help and choices come from the option schema, the one definition of these options.
    defaults, declared = DecodeOptions(), method_options()
    for name, spec in options_schema()["properties"].items():
        kind = {"integer": int, "number": float}.get(spec.get("type"), str)
        default = declared[name].default if name in declared else getattr(defaults, name)
        (methods if name in declared else options).add_argument(
            "--" + name.replace("_", "-"), type=kind, choices=spec.get("enum"),
            help=f"{spec['description']} (built-in default: {default})")
    options.add_argument("--allow-config-change", action="store_true",
                         help="decode although config.json changed since the checkpoint was "
                              "trained (the changed keys are logged)")
    lm = parser.add_argument_group("shallow fusion (beam search; also writes nbest.jsonl)")
    lm.add_argument("--lm", help="token-level n-gram (ARPA or kenlm binary)")
    lm.add_argument("--alpha", type=float, default=0.3, help="LM weight")
    lm.add_argument("--beta", type=float, default=0.0, help="bonus per token")
    lm.add_argument("--lodr", help="low-order n-gram of the training transcripts (LODR)")
    lm.add_argument("--lodr-weight", type=float, default=0.0, help="weight of the LODR LM")
    return parser


#: The flags of `Segmenting` (long recordings), as argparse names them.
LONG_FLAGS = ("max_segment", "vad", "segment_target", "vad_threshold", "vad_min_silence",
              "segment_overlap")


def _audio_list(args: argparse.Namespace) -> AudioList:
    if args.audio:
        return from_files(args.audio)
    if args.wav_scp:
        return from_wav_scp(args.wav_scp, args.segments)
    return from_data_list(args.data_list)


def _decode_features(args: argparse.Namespace, checkpoint: Path,
                     options: DecodeOptions, spec: FusionSpec | None) -> DecodeSummary:
    if spec is not None and args.format == "text":
        return decode_passes(args.exp_dir, args.data, checkpoint, options,
                             [(spec, args.out)])[0]
    return decode_set(args.exp_dir, args.data, checkpoint, args.out, options,
                      output=args.format, spec=spec)


def _segmenting(args: argparse.Namespace) -> Segmenting | None:
    """The command line's `Segmenting` (None with --max-segment 0); a ValueError naming
    a flag out of range."""
    if args.max_segment == 0:
        return None
    return Segmenting(args.max_segment, args.segment_overlap, args.vad, args.vad_threshold,
                      args.vad_min_silence, args.segment_target)


def _transcribe(args: argparse.Namespace, checkpoint: Path, options: DecodeOptions,
                spec: FusionSpec | None) -> DecodeSummary:
    audio = _audio_list(args)
    segmenting = _segmenting(args)
    transcript = transcribe(args.exp_dir, audio, checkpoint, options, spec,
                            output=args.format, segmenting=segmenting)
    if args.out:
        write_outputs(transcript, args.out)
    elif (document := WRITERS[args.format].document) is not None:
        if len(transcript.results) != 1:
            raise ResultFormatError(
                f"--format {args.format} without --out writes the document of one utterance, "
                f"{audio.name} has {len(transcript.results)}: give --out "
                f"({WRITERS[args.format].file}/<key>.{args.format} each)")
        sys.stdout.write(document(transcript.results[0]))
    else:
        for line in format_lines(transcript.results, args.format):
            print(line)
    sys.stdout.flush()
    return transcript.summary


def main(command: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of `cat.decode` and its aliases `cat.ctc.decode` / `cat.rnnt.decode`
    (`command`); the model kind is `config.json`'s."""
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.data and not args.out:
        parser.error("--data needs --out")
    if args.segments and not args.wav_scp:
        parser.error("--segments goes with --wav-scp")
    if args.data:
        given = [flag for flag in LONG_FLAGS if getattr(args, flag) != parser.get_default(flag)]
        if given:
            parser.error(f"--{given[0].replace('_', '-')} is for audio: --data decodes stage "
                         "1's features of each utterance whole")
    else:
        try:
            _segmenting(args)
        except ValueError as error:
            parser.error(str(error))
    if args.format not in FORMATS:
        parser.error(f"--format {args.format!r}: unknown output format; allowed: "
                     f"{', '.join(FORMATS)}")
    setup_logging()
    try:
        check_command(command, experiment_kind(args.exp_dir),
                      str(Path(args.exp_dir) / CONFIG_NAME))
    except ConfigError as error:
        logger.error("%s", error)
        return 1
    hyper_path = Path(args.exp_dir) / HYPER_NAME
    hyper = load_hyper(hyper_path)
    try:
        options = DecodeOptions.of_experiment(hyper, str(hyper_path), {
            **{name: getattr(args, name) for name in options_schema()["properties"]},
            "allow_config_change": args.allow_config_change or None})
    except ConfigError as error:
        logger.error("%s", error)
        return 1
    spec = FusionSpec(args.lm, args.alpha, args.beta, args.lodr, args.lodr_weight) \
        if args.lm else None
    try:
        checkpoint = Path(args.checkpoint) if args.checkpoint \
            else select_checkpoint(args.exp_dir, hyper)
        if args.data:
            summary = _decode_features(args, checkpoint, options, spec)
        else:
            summary = _transcribe(args, checkpoint, options, spec)
    except (AudioListError, TranscribeError, FileNotFoundError, ModelConfigChangedError,
            CheckpointMismatchError, HotwordsError, ResultFormatError, VadError,
            GraphError) as error:
        logger.error("%s", error)
        return 1
    skipped = f", {summary.num_skipped} skipped" if summary.num_skipped else ""
    print(f"RTF {summary.rtf:.4f} ({summary.num_utts} utterances, "
          f"{summary.audio_seconds:.1f} s of audio{skipped})", file=sys.stderr)
    return 0
