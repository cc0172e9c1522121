"""The command line of `python -m cat.serve`: an experiment, or an export folder, as a
streaming WebSocket server with a web page (`cat.serving.server`).

What is served:

* an experiment with `--chunk-size N`: its chunk-trained model (U2 or CUSIDE) streamed as
  `python -m cat.stream` streams it, in PyTorch (`cat.serving.streaming`);
* an experiment without `--chunk-size`: its model at full context, segment by segment
  (`cat.serving.offline`, stage 4's decoding options);
* an export folder (`export.json`; `python -m cat.export EXP --chunk-size N`): its streaming
  model in sherpa-onnx (`cat.serving.sherpa`).

Usage:
    python -m cat.serve exp/synth-ctc-stream --chunk-size 16 --port 6006
    # then open http://127.0.0.1:6006/ in a browser
    python -m cat.serve exp/synth-ctc-stream/export --port 6006       # sherpa-onnx
    python -m cat.serve exp/synth-ctc --max-segment-seconds 20        # full context
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from cat.serving import endpoint
from cat.serving.engine import Engine
from cat.serving.server import AsrServer, ServerSettings


def build_parser() -> argparse.ArgumentParser:
    defaults = ServerSettings()
    parser = argparse.ArgumentParser(
        prog="python -m cat.serve",
        description="Serve an experiment's model (or an export folder's, in sherpa-onnx) "
                    "over WebSocket, with a web page.")
    parser.add_argument("model", help="experiment directory (hyper-p.json, config.json), or "
                                      "an export folder (export.json)")
    parser.add_argument("--chunk-size", type=int,
                        help="experiments: stream in chunks of this many encoder frames "
                             "(within the trained range); without it the model decodes "
                             "segments at full context")
    parser.add_argument("--right-context", choices=("simulated", "real", "none"),
                        help="CUSIDE models: each chunk's right context (as cat.stream's)")
    parser.add_argument("--checkpoint", help="checkpoint (default: stage 4's)")
    parser.add_argument("--allow-config-change", action="store_true", default=None,
                        help="serve although config.json changed since the checkpoint was "
                             "trained")
    parser.add_argument("--host", default=defaults.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=defaults.port,
                        help="port (0: a free one, printed)")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="connections served at once; more are closed with 1013")
    parser.add_argument("--max-audio-seconds", type=float, default=defaults.max_audio_seconds,
                        help="audio per connection; past it the connection ends (1008)")
    parser.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes,
                        help="largest message; a larger one closes the connection (1009)")
    parser.add_argument("--max-backlog-seconds", type=float,
                        default=defaults.max_backlog_seconds,
                        help="audio of a connection waiting to be decoded before the server "
                             "stops reading it")
    parser.add_argument("--max-queued-results", type=int, default=defaults.max_queued_results,
                        help="final results waiting for a client before it is closed (4002)")
    parser.add_argument("--max-batch", type=int, default=32,
                        help="streams (offline: segments) per model call")
    parser.add_argument("--threads", type=int, default=1, help="threads of the model")
    parser.add_argument("--beam-size", type=int, default=10,
                        help="hotwords: the prefix beam search's beam (streaming)")
    parser.add_argument("--max-segment-seconds", type=float, default=20.0,
                        help="full-context models: the longest segment decoded at once")
    endpoint.add_arguments(parser)
    return parser


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine of the command's model (see the module docstring)."""
    rules = endpoint.EndpointRules.from_args(args)
    path = Path(args.model)
    if (path / "export.json").is_file():
        from cat.serving.sherpa import SherpaEngine

        return SherpaEngine(path, rules, args.threads, args.max_batch)
    import torch

    from cat.core.config import HYPER_NAME, experiment_kind, load_hyper
    from cat.decoding.checkpoint import select_checkpoint
    from cat.decoding.searcher import DecodeOptions, Searcher, load_model
    from cat.features.fbank import experiment_front_end
    from cat.models.registry import family

    torch.set_num_threads(args.threads)
    hyper = load_hyper(path / HYPER_NAME)
    checkpoint = Path(args.checkpoint) if args.checkpoint else select_checkpoint(path, hyper)
    kind = experiment_kind(path)
    fbank = experiment_front_end(hyper)
    if args.chunk_size is None:
        from cat.serving.offline import OfflineEngine

        options = DecodeOptions.of_experiment(
            hyper, str(path / HYPER_NAME), {"allow_config_change": args.allow_config_change})
        searcher = Searcher(path, checkpoint, options, "cpu")
        torch.set_num_threads(args.threads)  # the searcher takes one thread
        return OfflineEngine(searcher, fbank, args.max_segment_seconds, args.max_batch)
    from cat.serving.streaming import StreamingEngine

    model, tokenizer = load_model(path, checkpoint, torch.device("cpu"),
                                  args.allow_config_change)
    return StreamingEngine(model, tokenizer, family(kind, "stream").ChunkSearch,
                           args.chunk_size, fbank, rules, args.right_context, args.max_batch,
                           args.beam_size)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        settings = ServerSettings(args.host, args.port, args.max_connections,
                                  args.max_audio_seconds, args.max_message_bytes,
                                  args.max_backlog_seconds, args.max_queued_results)
        engine = build_engine(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(AsrServer(engine, settings).run())
    return 0
