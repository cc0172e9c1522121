"""Long recordings transcribed with the defaults (voice-activity segments), in windows and
whole, against their parts decoded one by one: errors, errors at seams, memory, speed,
times.

    cd egs/aishell
    python ../../bench/long_recording.py synthetic exp/synth-ctc [--checkpoint CKPT] \
        --wav-scp data/test/wav.scp --text data/test/text [--num-utts 0] [--repeats 1]
    python ../../bench/long_recording.py real --repeats 120 --pause 0.3     # from anywhere
    python ../../bench/long_recording.py real --before ../old-checkout      # and before
    python ../../bench/long_recording.py mixed --count 40 --seed 1 --settings windows-8

Inputs, each one WAV under `bench/out/long/`:

* `synthetic`: the utterances of `--wav-scp` (the first `--num-utts`, 0: all) one after
  the other, the list `--repeats` times over; the parts are the utterances of the list;
* `real`: the real Mandarin recording `tests/decoding/real_speech/BAC009S0724W0121.flac`
  `--repeats` times with `--pause` seconds of silence between (the issue's 9-minute
  loop), transcribed by the tiny model that has learned the real recordings
  (`cat.testing.learned_speech`, trained once into `bench/out/long/learned`: CER 0 on
  each); the part is the recording alone;
* `mixed`: `--count` real utterances, whole or trimmed to their speech, with pauses of 0.1
  to 1 s, none, music or noise between them (`learned_speech.mixed_recording`, `--seed`),
  the same model; the parts are the real recordings.

Each run is a `python -m cat.decode --nj 1 --format json` process, its peak RSS from
`wait4` (its address space limited to `--limit-gb`, 12 GB: a run that needs more, such as
an older revision decoding 1,403 s whole, is reported as out of memory): the parts; then
the long recording with each setting of `--settings` (`defaults`: none given; `windows`:
`--vad none`, windows of the defaults; `windows-<seconds>`: `--vad none --max-segment
<seconds> --segment-overlap <a quarter of it>`; `whole`: `--max-segment 0`;
`target-<seconds>`: `--segment-target <seconds>`; `max-60`: `--max-segment 60
--segment-target 25`). With
`--before DIR` (a checkout of another revision), the settings it has run that revision's
`cat.decode` too, translated to its flags (it has no `--vad`: its windows are
`--max-segment 30 --segment-overlap 2`, or of the length given; its default decodes
whole).

Printed per run: audio seconds, segments decoded alone and their mean length (from
`decode.log`), %CER with insertions / deletions / substitutions, the errors within 1 s of
a seam (the middle of a window overlap, or of the pause between two segments), peak RSS,
wall seconds, the real-time factor `decode.log` reports, and the times: each token the
long recording and the parts share (aligned by edit distance) against the part's token
time moved to where the part lies in the recording (each part decoded alone: the forced
alignment of its own hypothesis), mean signed difference (bias) and mean absolute one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.core.io import read_table, write_table
from cat.scoring import align, score

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "long"
REAL = ROOT / "tests" / "decoding" / "real_speech"
#: Settings of the long recording: (this revision's flags, an older revision's flags).
SETTINGS: dict[str, tuple[list[str], list[str] | None]] = {
    "defaults": ([], []),
    "windows": (["--vad", "none"], ["--max-segment", "30", "--segment-overlap", "2"]),
    "whole": (["--max-segment", "0"], None),  # an older revision's defaults
    "max-60": (["--max-segment", "60", "--segment-target", "25"], None),
}


def setting_flags(name: str) -> tuple[list[str], list[str] | None]:
    """(this revision's flags, an older one's or None) of a setting: one of `SETTINGS`,
    or `target-<seconds>` (`--segment-target <seconds>`)."""
    if name.startswith("target-"):
        return ["--segment-target", name.removeprefix("target-")], None
    if name.startswith("windows-"):
        size = float(name.removeprefix("windows-"))
        windows = ["--max-segment", f"{size:g}", "--segment-overlap", f"{size / 4:g}"]
        return ["--vad", "none", *windows], windows
    return SETTINGS[name]


def setting_name(name: str) -> str:
    """`name` if `setting_flags` knows it (the type of `--settings`)."""
    prefix, _, number = name.rpartition("-")
    try:
        seconds = float(number) if prefix in ("target", "windows") else None
    except ValueError:
        seconds = None
    if name not in SETTINGS and seconds is None:
        raise argparse.ArgumentTypeError(f"{name!r}: expected one of {', '.join(SETTINGS)}, "
                                         "target-<seconds> or windows-<seconds>")
    return name
SEAM_SECONDS = 1.0


def run(command: list[str], code: Path, limit_gb: float = 0) -> tuple[float, float] | None:
    """Run a command with `code` first on the path: its peak RSS (MB) and wall seconds;
    None when it ran out of the `limit_gb` GB of address space it was given (0: none)."""
    def limit() -> None:
        if limit_gb:
            size = int(limit_gb * (1 << 30))
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors,
                                   env=env, preexec_fn=limit)
        _, status, usage = os.wait4(process.pid, 0)
        errors.seek(0)
        text = errors.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status):
        if limit_gb and ("allocate memory" in text or "MemoryError" in text):
            return None
        raise SystemExit(f"{' '.join(command)} failed:\n{text[-3000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start


def records(out: Path) -> dict[str, dict]:
    return {record["key"]: record for record in map(json.loads, (out / "hyp.jsonl").read_text(
        encoding="utf-8").splitlines())}


def timed_tokens(record: dict, offset: float = 0.0) -> list[tuple[str, float]]:
    """(token, start second) of a JSON result, moved by `offset`."""
    return [(token, start + offset) for token, (start, _) in zip(
        record["tokens"], record["timestamps"], strict=True)]


def seams(record: dict, settings: Sequence[str], seconds: float) -> list[float]:
    """Where a long recording's stretches were joined (see the module doc)."""
    if record.get("segments"):
        segments = record["segments"]
        return [(left["end"] + right["start"]) / 2
                for left, right in itertools.pairwise(segments)]
    if "--max-segment" not in settings and "--vad" not in settings:
        return []  # decoded whole
    flags = dict(zip(settings[::2], settings[1::2], strict=False))
    size = float(flags.get("--max-segment", 30))
    overlap = float(flags.get("--segment-overlap", 2))
    if size == 0:
        return []
    return [start + overlap / 2 for start in np.arange(size - overlap, seconds, size - overlap)]


def compare(reference: str, record: dict, parts: list[tuple[str, float]],
            joins: list[float]) -> dict:
    """CER, errors near `joins`, and the token times against the parts' (see the doc)."""
    result = score({"long": reference}, {"long": record["text"]})
    tokens = timed_tokens(record)
    alignment = align(list(reference), [token for token, _ in tokens])
    at_seams, position = 0, 0
    for op in alignment.ops:
        when = tokens[min(position, len(tokens) - 1)][1] if tokens else 0.0
        if op != "C" and any(abs(when - join) <= SEAM_SECONDS for join in joins):
            at_seams += 1
        position += op != "D"
    shared = align([token for token, _ in parts], [token for token, _ in tokens])
    differences, left, right = [], 0, 0
    for op in shared.ops:
        if op == "C":
            differences.append(tokens[right][1] - parts[left][1])
        left += op != "I"
        right += op != "D"
    differences = np.array(differences) if differences else np.zeros(1)
    return {"cer": result.error_rate, "ins": result.insertions, "del": result.deletions,
            "sub": result.substitutions, "seams": at_seams,
            "bias_ms": 1000 * differences.mean(), "abs_ms": 1000 * np.abs(differences).mean()}


def write_once(path: Path, pieces: list[np.ndarray]) -> None:
    """The long recording (16-bit WAV of `pieces` one after the other), once."""
    if not path.is_file():
        soundfile.write(path.with_suffix(".tmp.wav"), np.concatenate(pieces), 16000,
                        subtype="PCM_16")
        os.replace(path.with_suffix(".tmp.wav"), path)


def learned_experiment() -> Path:
    """The recipe directory of the tiny model that has learned the real recordings,
    trained once, in a process of its own (this one stays small: the peak RSS of a child
    counts its parent's pages until it runs its program)."""
    root = OUT / "learned"
    if not (root / "exp/learned/check").is_dir():
        subprocess.run([sys.executable, "-c", "import sys\n"
                        "from cat.testing.learned_speech import read_real_speech, "
                        "train_learned_experiment\n"
                        "train_learned_experiment(sys.argv[1], read_real_speech(sys.argv[2]))",
                        str(root), str(REAL)], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return root


def mixed_recording(count: int, seed: int) -> tuple[Path, list[tuple[str, float]]]:
    """`cat.testing.learned_speech.mixed_recording` (written once, by a process of its
    own): its WAV, and where each utterance lies ((key, seconds its original audio would
    start at: trimmed utterances start before their audio))."""
    long = OUT / f"mixed-{count}-{seed}.wav"
    placement = long.with_suffix(".json")
    if not placement.is_file():
        subprocess.run([sys.executable, "-c", "import json, sys\n"
                        "from cat.testing.learned_speech import mixed_recording, "
                        "read_real_speech\n"
                        "speech = {item.key: item for item in read_real_speech(sys.argv[1])}\n"
                        "mixed = mixed_recording(list(speech.values()), int(sys.argv[2]), "
                        "int(sys.argv[3]))\n"
                        "mixed.write(sys.argv[4])\n"
                        "json.dump([(item.key, item.speech_start - speech[item.key].speech[0] "
                        "/ 16000) for item in mixed.placed], open(sys.argv[5], 'w'))",
                        str(REAL), str(count), str(seed), str(long), str(placement)],
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return long, [tuple(item) for item in json.loads(placement.read_text(encoding="utf-8"))]


def speech_onset(path: Path) -> float:
    """Where the VAD finds speech start in a recording (seconds)."""
    from cat.audio.vad import FRAME_SECONDS, SileroVad

    probabilities = SileroVad().probabilities(soundfile.read(path, dtype="float32")[0])
    return float(np.flatnonzero(probabilities >= 0.5)[0] * FRAME_SECONDS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", choices=["synthetic", "real", "mixed"])
    parser.add_argument("exp_dir", nargs="?", help="synthetic: the experiment")
    parser.add_argument("--checkpoint")
    parser.add_argument("--wav-scp", default="data/test/wav.scp")
    parser.add_argument("--text", default="data/test/text")
    parser.add_argument("--num-utts", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None,
                        help="synthetic: the list this many times (1); real: the recording (120)")
    parser.add_argument("--pause", type=float, default=0.3, help="real: seconds between")
    parser.add_argument("--count", type=int, default=40, help="mixed: utterances")
    parser.add_argument("--seed", type=int, default=1, help="mixed: the recording's seed")
    parser.add_argument("--settings", nargs="+", default=["defaults", "windows", "windows-12"],
                        type=setting_name)
    parser.add_argument("--before", type=Path, help="a checkout of another revision")
    parser.add_argument("--limit-gb", type=float, default=12.0,
                        help="address space of each run of the long recording (0: no limit); "
                             "a run that needs more is reported, not waited for")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.input == "synthetic":
        if not args.exp_dir:
            parser.error("synthetic needs the experiment")
        exp_dir = args.exp_dir
        texts = {utt: "".join(text.split()) for utt, text in read_table(args.text).items()}
        wavs = {utt: str(Path(spec).resolve())
                for utt, spec in read_table(args.wav_scp).items() if utt in texts}
        if args.num_utts:
            wavs = dict(list(wavs.items())[:args.num_utts])
        repeats = args.repeats or 1
        long = OUT / f"long-{len(wavs)}x{repeats}.wav"
        placed, offset, samples = [], 0.0, []
        for utt in list(wavs) * repeats:
            samples.append(soundfile.read(wavs[utt], dtype="float32")[0])
            placed.append((utt, offset))
            offset += len(samples[-1]) / 16000
        write_once(long, samples)
    elif args.input == "real":
        key = "BAC009S0724W0121"
        os.chdir(learned_experiment())
        exp_dir = "exp/learned"
        wavs = {key: str(REAL / f"{key}.flac")}
        texts = {key: "".join(read_table(REAL / "text")[key].split())}
        repeats = args.repeats or 120
        long = OUT / f"loop-{repeats}x{args.pause:g}.wav"
        wav = soundfile.read(wavs[key], dtype="float32")[0]
        pause = np.zeros(round(args.pause * 16000), np.float32)
        placed = [(key, index * (len(wav) + len(pause)) / 16000) for index in range(repeats)]
        write_once(long, [piece for index in range(repeats)
                          for piece in ([pause, wav] if index else [wav])])
    else:
        os.chdir(learned_experiment())
        exp_dir = "exp/learned"
        texts = {key: "".join(text.split()) for key, text in read_table(REAL / "text").items()}
        wavs = {key: str(REAL / f"{key}.flac") for key in texts}
        long, placed = mixed_recording(args.count, args.seed)
    seconds = soundfile.info(long).duration
    decode = [sys.executable, "-m", "cat.decode", exp_dir, "--nj", "1", "--format", "json"]
    if args.checkpoint:
        decode += ["--checkpoint", args.checkpoint]
    print("| revision | input | settings | audio s | segments (mean s) | %CER | ins / del / sub "
          "| errors at seams | peak RSS MB | wall s | RTF | time bias ms (mean abs) |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        write_table(Path(tmp) / "wav.scp", wavs.items(), sort=False)
        peak, wall = run([*decode, "--wav-scp", str(Path(tmp) / "wav.scp"), "--out",
                          f"{tmp}/parts"], ROOT)
        result = score({utt: texts[utt] for utt in wavs},
                       read_table(Path(tmp) / "parts/hyp", allow_empty_value=True))
        print(f"| this | {len(wavs)} parts | - | "
              f"{sum(soundfile.info(spec).duration for spec in wavs.values()):.0f} | - | "
              f"{result.error_rate:.2f} | {result.insertions} / {result.deletions} / "
              f"{result.substitutions} | - | {peak:.0f} | {wall:.1f} | - | - |")
        alone = records(Path(tmp) / "parts")
        parts = [token for utt, start in placed for token in timed_tokens(alone[utt], start)]
        reference = "".join(texts[utt] for utt, _ in placed)
        revisions = [("this", ROOT, 0)] + ([("before", args.before.resolve(), 1)]
                                           if args.before else [])
        for name, code, flags in revisions:
            for setting in args.settings:
                extra = setting_flags(setting)[flags]
                if extra is None:
                    continue  # a setting the older revision does not have
                out = Path(tmp) / f"{name}-{setting}"
                measured = run([*decode, "--audio", str(long), *extra, "--out", str(out)],
                               code, args.limit_gb)
                if measured is None:
                    print(f"| {name} | 1 recording | {setting} {' '.join(extra)} | "
                          f"{seconds:.0f} | out of memory at the {args.limit_gb:g} GB limit |")
                    continue
                peak, wall = measured
                (record,) = records(out).values()
                log = json.loads((out / "decode.log").read_text(encoding="utf-8"))
                found = compare(reference, record, parts, seams(record, extra, seconds))
                segments = (f"{log['segments']} ({log['mean_segment_seconds']:.1f})"
                            if log.get("segments") else "-")
                print(f"| {name} | 1 recording | {setting} {' '.join(extra)} | {seconds:.0f} | "
                      f"{segments} | {found['cer']:.2f} | {found['ins']} / {found['del']} / "
                      f"{found['sub']} | {found['seams']} | {peak:.0f} | {wall:.1f} | "
                      f"{log['rtf']:.4f} | {found['bias_ms']:+.0f} ({found['abs_ms']:.0f}) |")
    if args.input == "real":  # after the runs: this process loads the VAD
        first = alone[key]["timestamps"][0][0] if alone[key]["timestamps"] else None
        onsets = f"first token at {first} s, " if first is not None else ""
        print(f"{key} alone: {onsets}speech from {speech_onset(Path(wavs[key])):g} s by the "
              "VAD (32 ms frames)")


if __name__ == "__main__":
    main()
