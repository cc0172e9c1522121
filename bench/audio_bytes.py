"""Audio shards against feature shards: bytes per hour, decode speed, speed perturbation.

On synthetic Mandarin speech (espeak-ng voices with a 20-45 dB noise floor, as the
synthetic corpora have) this prints, all measured in the same run:

1. Bytes per hour of audio for 80-dim fbank at 100 frames/s in float32 and float16,
   and for 16-bit 16 kHz WAV, FLAC and Ogg Opus members (`cat.audio.codec`), as the
   payload alone and inside a tar shard with one `.txt` transcript member per utterance
   (512-byte headers, padding); then what WenetSpeech L (10 000 h) takes in each, with
   the recipe's three offline speed-perturbed copies for features and one copy of the
   audio (perturbed online).
2. Decode speed per codec on one core (seconds of audio decoded per second), also with
   the 80-dim fbank of stage 1 after it, against reading float32 features from `.npy`
   bytes.
3. Speed perturbation (0.9 and 1.1) on one core: ours (`cat.audio.speed`, also stage
   1's), torchaudio's default resampling (stage 1's method before) and sox
   (`sox -D in out speed f`, one process per utterance, and one process for all the
   audio in one file).
4. Resampling to 16 kHz from 48, 44.1, 22.05 and 8 kHz: libsoxr (our choice) against
   `torchaudio.functional.resample` with its defaults: speed, and how far a tone above
   8 kHz (it must go) and one at 7 kHz (it must stay) come out.

Speeds are the best of `--repeats` timed loops after a warm-up, with one torch thread.

Usage:
    python bench/audio_bytes.py --utterances 40 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import soundfile
import soxr
import torch
import torchaudio
from timing import best_time

from cat.audio.codec import decode, encode, to_int16
from cat.audio.speed import speed_perturb
from cat.data.voices import Speaker, add_noise, synthesize
from cat.features.fbank import compute_fbank

RATE = 16000
SENTENCES = (
    "今天天气很好我们一起去公园散步", "而对楼市成交抑制作用最大的限购",
    "也成为地方政府的眼中钉", "自六月底呼和浩特市率先宣布取消限购后",
    "这是一个关于语音识别的测试句子", "明天上午九点在会议室开会",
    "他说这件事情需要再讨论一下", "请把窗户打开让新鲜空气进来",
)
VOICES = ("m1", "m3", "f2", "f4", "m5", "f1")
FORMATS = (("wav", {}), ("flac", {}), ("opus 16k", {"opus_bitrate": 16000}),
           ("opus 32k", {"opus_bitrate": 32000}), ("opus 64k", {"opus_bitrate": 64000}))
HOUR = 3600.0


def make_speech(count: int, seed: int) -> list[np.ndarray]:
    """`count` int16 utterances of 16 kHz synthetic Mandarin with silences and noise."""
    rng = np.random.default_rng(seed)
    utterances = []
    for i in range(count):
        speaker = Speaker(VOICES[i % len(VOICES)], int(rng.integers(30, 70)),
                          int(rng.integers(150, 220)), float(rng.uniform(20, 45)))
        voice = synthesize(SENTENCES[i % len(SENTENCES)], speaker)
        pad = [np.zeros(int(RATE * rng.uniform(0.1, 0.4)), np.float32) for _ in range(2)]
        waveform = np.concatenate([pad[0], voice, pad[1]])
        utterances.append(to_int16(add_noise(waveform, speaker.snr_db, rng)))
    return utterances


def tar_bytes(members: list[tuple[str, bytes]]) -> int:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return len(buffer.getvalue())


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def bytes_per_hour(utterances: list[np.ndarray], seconds: float) -> tuple[dict, dict]:
    """Payload and tar-shard bytes/hour per format; also the encoded members."""
    text = "今天天气很好".encode()
    encoded: dict[str, list[bytes]] = {}
    features = [compute_fbank(u.astype(np.float32) / 32768, RATE) for u in utterances]
    encoded["fbank float32 (.npy)"] = [npy_bytes(f) for f in features]
    encoded["fbank float16 (.npy)"] = [npy_bytes(f.astype(np.float16)) for f in features]
    for name, options in FORMATS:
        encoded[name] = [encode(u, RATE, name.split()[0], **options) for u in utterances]
    rows = {}
    for name, members in encoded.items():
        payload = sum(len(m) for m in members)
        extension = name.split()[0] if not name.startswith("fbank") else "npy"
        shard = tar_bytes([item for i, m in enumerate(members)
                           for item in ((f"utt{i:05d}.txt", text), (f"utt{i:05d}.{extension}", m))])
        rows[name] = (payload * HOUR / seconds, shard * HOUR / seconds)
    return rows, encoded


def print_bytes(rows: dict, seconds: float, count: int) -> None:
    print(f"\n## Bytes per hour of audio ({count} utterances, {seconds:.0f} s of speech)\n")
    print("| format | payload MB/h | in a tar shard MB/h | vs float32 features | "
          "WenetSpeech L (10 000 h) |")
    print("|---|---:|---:|---:|---:|")
    base = rows["fbank float32 (.npy)"][1]
    for name, (payload, shard) in rows.items():
        copies = 3 if name.startswith("fbank") else 1  # offline speed perturbation: 3 copies
        total = shard * 10000 * copies
        size = f"{total / 1e12:.2f} TB" if total >= 1e12 else f"{total / 1e9:.0f} GB"
        note = " (x3 speed copies)" if copies == 3 else ""
        print(f"| {name} | {payload / 1e6:.1f} | {shard / 1e6:.1f} | {shard / base:.3f} | "
              f"{size}{note} |")


def print_decode(encoded: dict, seconds: float, repeats: int) -> None:
    print("\n## Decode speed, one core (seconds of audio per second)\n")
    print("| member | decode | decode + 80-dim fbank | decode vs reading float32 .npy |")
    print("|---|---:|---:|---:|")
    npy = encoded["fbank float32 (.npy)"]
    base = seconds / best_time(lambda: [np.load(io.BytesIO(m)) for m in npy], repeats)
    print(f"| fbank float32 (.npy) | {base:,.0f} | - | 1 |")
    for name, _ in FORMATS:
        members = encoded[name]
        alone = seconds / best_time(lambda members=members: [decode(m, "bench") for m in members],
                                    repeats)

        def with_fbank(members=members) -> None:
            for member in members:
                waveform, rate = decode(member, "bench", sample_rate=RATE)
                compute_fbank(waveform, rate)

        full = seconds / best_time(with_fbank, repeats)
        print(f"| {name} | {alone:,.0f} | {full:,.0f} | {alone / base:.3f} |")


def torchaudio_speed(waveform: np.ndarray, factor: float) -> np.ndarray:
    """Speed perturbation with torchaudio's default resampling, as stage 1 had it."""
    return torchaudio.functional.resample(torch.from_numpy(waveform), round(RATE * factor),
                                          RATE).numpy()


def print_speed(utterances: list[np.ndarray], seconds: float, repeats: int,
                folder: Path) -> None:
    print("\n## Speed perturbation, one core (seconds of audio per second)\n")
    floats = [u.astype(np.float32) / 32768 for u in utterances]
    paths = []
    for i, samples in enumerate(utterances):
        paths.append(folder / f"utt{i:05d}.wav")
        soundfile.write(paths[-1], samples, RATE, subtype="PCM_16")
    long_path = folder / "all.wav"
    soundfile.write(long_path, np.concatenate(utterances), RATE, subtype="PCM_16")
    print("| factor | ours (soxr) | torchaudio (stage 1 before) | sox per utterance | "
          "sox, one long file | ours / sox per utterance | ours / sox long file |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for factor in (0.9, 1.1):
        ours = seconds / best_time(lambda f=factor: [speed_perturb(u, RATE, f) for u in floats],
                                   repeats)
        offline = seconds / best_time(
            lambda f=factor: [torchaudio_speed(u, f) for u in floats], repeats)

        def sox_each(f=factor) -> None:
            for path in paths:
                subprocess.run(["sox", "-V1", "-D", str(path), str(folder / "out.wav"), "speed",
                                str(f)], check=True)

        def sox_long(f=factor) -> None:
            subprocess.run(["sox", "-V1", "-D", str(long_path), str(folder / "out.wav"), "speed",
                            str(f)], check=True)

        each = seconds / best_time(sox_each, repeats)
        long = seconds / best_time(sox_long, repeats)
        print(f"| {factor} | {ours:,.0f} | {offline:,.0f} | {each:,.0f} | {long:,.0f} | "
              f"{ours / each:.1f} | {ours / long:.2f} |")


def _power_db(waveform: np.ndarray) -> float:
    middle = waveform[len(waveform) // 10: -len(waveform) // 10].astype(np.float64)
    return 10 * np.log10(np.mean(middle ** 2) + 1e-30)


def print_resampling(repeats: int) -> None:
    print("\n## Resampling to 16 kHz, one core\n")
    print("| from | soxr x real time | torchaudio x real time | soxr / torchaudio | "
          "8.5 kHz tone after (dB) soxr / torchaudio | 7 kHz tone change (dB) "
          "soxr / torchaudio |")
    print("|---|---:|---:|---:|---:|---:|")
    methods = {
        "soxr": lambda x, a: soxr.resample(x, a, RATE, quality="HQ"),
        "torchaudio": lambda x, a: torchaudio.functional.resample(
            torch.from_numpy(x), a, RATE).numpy(),
    }
    for rate in (48000, 44100, 22050, 8000):
        noise = (0.1 * np.random.default_rng(0).standard_normal(60 * rate)).astype(np.float32)
        time_axis = np.arange(2 * rate) / rate
        above = np.sin(2 * np.pi * 8500 * time_axis).astype(np.float32)
        inside = np.sin(2 * np.pi * min(7000, 0.45 * rate) * time_axis).astype(np.float32)
        speed, leak, passband = {}, {}, {}
        for name, method in methods.items():
            speed[name] = 60 / best_time(lambda m=method, r=rate, x=noise: m(x, r), repeats)
            leak[name] = (f"{_power_db(method(above, rate)) - _power_db(above):.0f}"
                          if rate > 2 * 8500 else "-")
            passband[name] = f"{_power_db(method(inside, rate)) - _power_db(inside):+.2f}"
        print(f"| {rate} | {speed['soxr']:,.0f} | {speed['torchaudio']:,.0f} | "
              f"{speed['soxr'] / speed['torchaudio']:.2f} | {leak['soxr']} / "
              f"{leak['torchaudio']} | {passband['soxr']} / {passband['torchaudio']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    utterances = make_speech(args.utterances, args.seed)
    seconds = sum(u.size for u in utterances) / RATE
    rows, encoded = bytes_per_hour(utterances, seconds)
    print_bytes(rows, seconds, len(utterances))
    print_decode(encoded, seconds, args.repeats)
    with tempfile.TemporaryDirectory() as folder:
        print_speed(utterances, seconds, args.repeats, Path(folder))
    print_resampling(args.repeats)


if __name__ == "__main__":
    main()
