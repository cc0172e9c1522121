"""Where chunk training loses accuracy: variants of `exp/synth-ctc-stream` trained beside
`exp/synth-ctc` on the same schedule in one run, each decoded at full context and in chunks.

Each variant is an experiment `exp/gap-<name>` made from a base experiment's
`config.json` and `hyper-p.json` with a few keys changed (`VARIANTS`); all of them go
through the recipe's own stages: `cat.stages.driver prepare`, `train` and `decode`
(3 best checkpoints by dev loss averaged, prefix beam search 5 on dev and test). Then each
is decoded greedily at full context (`python -m cat.decode --method greedy`) and, when it
was chunk-trained, streamed in chunks of 16 and 8 encoder frames from the test audio
(`python -m cat.stream`, which also gives first-token and final latencies). Trainings run
`--jobs` at a time, in the order given; a training still running at `--deadline` seconds
is stopped (it saves; its row says so) so that what finished is decoded and reported.
CUSIDE variants (`trainer.chunk_size`) are streamed with their simulated right context and
with the real one.

One JSON object per variant is appended to `--out` (JSON lines) as soon as it is scored:
name, changes, updates reached, training seconds, dev/test CER of stage 4, greedy CER and
streaming CER and latencies per chunk size.

Usage (from egs/aishell, after stage 1 of exp/synth-ctc):
    python ../../bench/stream_gap.py --out ../../bench/out/stream_gap.jsonl
    python ../../bench/stream_gap.py --variants full stream causal --jobs 3 \
        --set train.option.threads=2 --deadline 1800
    python ../../bench/stream_gap.py --variants full stream --steps 20   # a smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.core.io import read_table
from cat.scoring import score

CHUNK = "encoder.kwargs"
#: name -> (base experiment, config.json changes, hyper-p.json changes); dotted keys.
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # The two experiments as they are: the gap to explain.
    "full": ("exp/synth-ctc", {}, {}),
    "stream": ("exp/synth-ctc-stream", {}, {}),
    # Causal convolution alone (full context in every batch), and with layer norm in the
    # convolution module instead of batch norm (WeNet's U2++ streaming Conformers).
    "causal": ("exp/synth-ctc", {f"{CHUNK}.causal_conv": True}, {}),
    "causal_ln": ("exp/synth-ctc", {f"{CHUNK}.causal_conv": True,
                                    f"{CHUNK}.conv_norm": "layernorm"}, {}),
    "full_ln": ("exp/synth-ctc", {f"{CHUNK}.conv_norm": "layernorm"}, {}),
    "stream_ln": ("exp/synth-ctc-stream", {f"{CHUNK}.conv_norm": "layernorm"}, {}),
    # The chunk-size distribution: more full-context batches, no tiny chunks' share.
    "fcp75": ("exp/synth-ctc-stream", {f"{CHUNK}.full_context_prob": 0.75}, {}),
    "fcp25": ("exp/synth-ctc-stream", {f"{CHUNK}.full_context_prob": 0.25}, {}),
    "min4": ("exp/synth-ctc-stream", {f"{CHUNK}.min_chunk_size": 4}, {}),
    # The learning rate.
    "lr4": ("exp/synth-ctc-stream", {"scheduler.kwargs.peak_lr": 0.004}, {}),
    # Too few updates for a harder task.
    "stream2x": ("exp/synth-ctc-stream", {}, {"train.option.max_steps": 3600}),
    "full2x": ("exp/synth-ctc", {}, {"train.option.max_steps": 3600}),
    # CUSIDE: a full-context encoder on chunks with simulated right context.
    "cuside": ("exp/synth-ctc-cuside", {}, {}),
}
CHUNK_SIZES = (16, 8)


def set_key(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """`tree[a][b][c] = value` for `dotted` "a.b.c" (every level but the last must exist)."""
    *path, last = dotted.split(".")
    node = tree
    for part in path:
        if part not in node:
            raise KeyError(f"{dotted}: no key {part!r}")
        node = node[part]
    node[last] = value


def parse_setting(text: str) -> tuple[str, Any]:
    """`key=value` with a JSON value (a bare word is a string)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected hyper-p key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def make_experiment(name: str, settings: list[tuple[str, Any]], steps: int | None) -> Path:
    """Write `exp/gap-<name>/{config,hyper-p}.json` (unchanged files are left alone, so a
    re-run resumes); returns the directory."""
    base, config_changes, hyper_changes = VARIANTS[name]
    exp = Path(f"exp/gap-{name}")
    config = json.loads((Path(base) / "config.json").read_text())
    hyper = json.loads((Path(base) / "hyper-p.json").read_text())
    for key, value in config_changes.items():
        set_key(config, key, value)
    hyper = copy.deepcopy(hyper)
    for key, value in [*hyper_changes.items(), *settings]:
        set_key(hyper, key, value)
    if steps is not None:
        hyper["train"]["option"]["max_steps"] = steps
        hyper["train"]["option"]["check_freq"] = max(1, steps // 4)
        hyper["inference"]["avgmodel"]["num"] = 1
    hyper["tokenizer"]["file"] = f"{exp}/tokenizer.tknz"
    hyper["data"]["test"] = ["data/fbank/dev", "data/fbank/test"]
    exp.mkdir(parents=True, exist_ok=True)
    for file, content in (("config.json", config), ("hyper-p.json", hyper)):
        text = json.dumps(content, indent=2, ensure_ascii=False) + "\n"
        path = exp / file
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return exp


def run(command: list[str], log: Path) -> None:
    """Run `command`, its output to `log`; RuntimeError naming the log when it fails."""
    with log.open("a") as out:
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    if status:
        raise RuntimeError(f"{' '.join(command)} exited {status} (log: {log})")


def cer(refs: dict[str, str], hyp_file: Path) -> dict[str, Any]:
    result = score(refs, read_table(hyp_file, allow_empty_value=True), "char")
    return {"cer": round(result.error_rate, 2), "errors": result.errors, "chars": result.total,
            "ins": result.insertions, "del": result.deletions, "sub": result.substitutions}


def updates_reached(exp: Path) -> int:
    listing = exp / "check" / "checkpoints.json"
    if not listing.exists():
        return 0
    return max((c["step"] for c in json.loads(listing.read_text())["checkpoints"]), default=0)


def evaluate(exp: Path, python: str) -> dict[str, Any]:
    """Stage 4, greedy full context and streaming of one trained experiment; a step that
    fails is reported under `errors` and the others still run."""
    log = exp / "gap.log"
    row: dict[str, Any] = {"errors": []}

    def step(name: str, command: list[str], result: Any) -> None:
        try:
            run(command, log)
            row[name] = result()
        except (RuntimeError, OSError) as error:
            row["errors"].append(f"{name}: {error}")

    def stage4() -> dict[str, Any]:
        return {part: cer(read_table(f"data/{part}/text"), exp / "decode" / part / "hyp")
                for part in ("dev", "test")}

    step("beam5", [python, "-m", "cat.stages.driver", "decode", str(exp), "--nj", "1"],
         stage4)
    refs = read_table("data/test/text")
    out = exp / "gap" / "greedy-full"
    step("greedy_full_test", [python, "-m", "cat.decode", str(exp), "--data", "data/fbank/test",
                              "--out", str(out), "--method", "greedy", "--nj", "1"],
         lambda: cer(refs, out / "hyp"))
    config = json.loads((exp / "config.json").read_text())
    cuside = "chunk_size" in config.get("trainer", {})
    if config["encoder"]["kwargs"].get("max_chunk_size", 0) or cuside:
        # CUSIDE models also with the real right context (which waits for its frames).
        for chunk, right in [(chunk, None) for chunk in CHUNK_SIZES] + (
                [(chunk, "real") for chunk in CHUNK_SIZES] if cuside else []):
            name = f"stream_c{chunk}" + (f"_{right}" if right else "")
            stream_out = exp / "gap" / name.replace("_", "-")
            step(f"{name}_test",
                 [python, "-m", "cat.stream", str(exp), "--wav-scp", "data/test/wav.scp",
                  "--chunk-size", str(chunk), "--out", str(stream_out),
                  *(["--right-context", right] if right else [])],
                 lambda out=stream_out: {**cer(refs, out / "hyp"),
                                         "stream": json.loads((out / "stream.json").read_text())})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="variants to run, in this order (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at a time")
    parser.add_argument("--set", dest="settings", type=parse_setting, action="append",
                        default=[], metavar="KEY=VALUE",
                        help="hyper-p.json key for every variant (e.g. train.option.threads=2)")
    parser.add_argument("--steps", type=int,
                        help="updates for every variant instead of their schedule (smoke runs)")
    parser.add_argument("--deadline", type=float, default=float("inf"),
                        help="seconds after which running trainings are stopped")
    parser.add_argument("--out", type=Path, default=Path("gap.jsonl"),
                        help="JSON lines, one per variant, appended")
    args = parser.parse_args(argv)
    start = time.monotonic()
    python = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    exps = {name: make_experiment(name, args.settings, args.steps) for name in args.variants}
    for exp in exps.values():  # sequential: the packs and features are shared
        run([python, "-m", "cat.stages.driver", "prepare", str(exp)], exp / "gap.log")
    waiting = list(args.variants)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    trained: dict[str, dict[str, Any]] = {}
    evaluations: dict[str, concurrent.futures.Future] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        while waiting or running:
            while waiting and len(running) < args.jobs:
                name = waiting.pop(0)
                log = (exps[name] / "gap.log").open("a")
                process = subprocess.Popen(
                    [python, "-m", "cat.stages.driver", "train", str(exps[name]),
                     "--nproc", "1"], stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True)
                running[name] = (process, time.monotonic())
                print(f"[{time.monotonic() - start:6.0f} s] training {name}", flush=True)
            time.sleep(2)
            overdue = time.monotonic() - start > args.deadline
            for name, (process, began) in list(running.items()):
                if overdue and process.poll() is None:
                    stop(process)
                if process.poll() is None:
                    continue
                del running[name]
                trained[name] = {"status": process.returncode,
                                 "train_s": round(time.monotonic() - began, 1),
                                 "updates": updates_reached(exps[name])}
                print(f"[{time.monotonic() - start:6.0f} s] {name}: {trained[name]}", flush=True)
                if process.returncode == 0:
                    evaluations[name] = pool.submit(evaluate, exps[name], python)
            if overdue:
                for name in waiting:
                    trained[name] = {"status": "not started", "updates": 0}
                waiting = []
        failures = 0
        for name in args.variants:
            base, config_changes, hyper_changes = VARIANTS[name]
            row: dict[str, Any] = {"variant": name, "base": base, "config": config_changes,
                                   "hyper": hyper_changes, **trained[name]}
            if name in evaluations:
                row.update(evaluations[name].result())
                failures += bool(row["errors"])
            else:
                failures += 1
            with args.out.open("a") as out:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
            print(json.dumps(row, ensure_ascii=False), flush=True)
    return 1 if failures else 0


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the training's process group (it saves and exits), SIGKILL after 60 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


if __name__ == "__main__":
    sys.exit(main())
