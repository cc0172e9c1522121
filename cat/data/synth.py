"""Synthetic Mandarin corpora spoken by espeak-ng, laid out like the real releases.

The toolkit's recipes, tests and CI run on these corpora: they exercise every
real code path (release layout parsing, features, packing, training, decoding)
without the real data. Two layouts are produced:

* AISHELL-1: ``data_aishell/wav/{train,dev,test}/S0002/BAC009S0002W0001.wav``
  (16 kHz 16-bit mono) and ``data_aishell/transcript/aishell_transcript_v0.8.txt``
  with word-segmented transcripts. As in the real release, a few audio files
  have no transcript line and a few transcript lines have no audio.
* WenetSpeech: ``WenetSpeech.json`` (``audios[]`` with ``segments[]`` carrying
  ``subsets`` tags S within M within L, DEV, TEST_NET, TEST_MEETING) and long Ogg
  Opus recordings ``audio/<set>/podcast/B00000/<aid>.opus`` made of several
  utterances separated by pauses.

Text: sentences assembled from words of jieba's bundled dictionary, restricted
to a character inventory of ``--num-chars`` frequent characters. With
``--distinct-sounds syllable`` (default) the inventory keeps, in frequency
order, only characters whose espeak-ng syllable differs from that of every
character already chosen, tone ignored: espeak-ng realises Mandarin tones
weakly, so characters differing only in tone are close to homophones, which no
acoustic model can tell apart without a language model. ``tone`` keeps
characters whose syllable or tone differs; ``none`` takes the most frequent
characters as they come. Speakers are espeak-ng voice variants with their own pitch,
speaking rate and noise level; speaker profiles are disjoint across
train/dev/test, and dev/test sentences never occur in train.

Everything is deterministic for a given seed and espeak-ng version. A corpus
directory records its parameters in ``synthetic.json`` (outside the release
layout); generating again with the same parameters is a no-op, and an
interrupted generation resumes.

Language-model text (`lm-text`): more sentences from the same generator and inventory,
none of them in the corpus's train, dev or test sets, so that the effect of a language
model trained on text alone can be measured.

Usage:
    python -m cat.data.synth aishell corpus/aishell --num-utts 3000 --seed 0
    python -m cat.data.synth wenetspeech corpus/wenetspeech --hours 0.5 --nj 2
    python -m cat.data.synth lm-text corpus/aishell data/lm_text/text --num-sentences 50000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import soundfile as sf

from cat.audio.codec import set_ogg_serial
from cat.core.io import atomic_write, setup_logging
from cat.data.sentences import (
    DISTINCT_SOUNDS,
    Lexicon,
    build_lexicon,
    sample_sentence,
    sample_sentences,
    spoken_lexicon,
)
from cat.data.voices import (
    DEFAULT_VOICE,
    SAMPLE_RATE,
    SynthesisError,
    add_noise,
    make_speakers,
    render_utterance,
    synthesize,
    to_int16,
)
from cat.text.lexicon import format_lexicon

logger = logging.getLogger(__name__)
AISHELL_SPEAKER_BASE = {"train": 2, "dev": 724, "test": 764}  # first speaker number, as released
WENET_SETS = {"train": None, "dev": "DEV", "test_net": "TEST_NET", "test_meeting": "TEST_MEETING"}


# ------------------------------------------------------------------ corpus driver


def _run_parallel(jobs: Sequence[Callable[[], None]], nj: int, what: str) -> None:
    """Run independent jobs on `nj` threads (they wait on subprocesses); stop at the first error."""
    from tqdm import tqdm

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, nj)) as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            for future in tqdm(concurrent.futures.as_completed(futures), total=len(futures),
                               desc=what, unit="file", mininterval=2.0, leave=False):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _write_wav(path: Path, samples: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    sf.write(tmp, samples, SAMPLE_RATE, subtype="PCM_16", format="WAV")
    os.replace(tmp, path)


def _write_opus(path: Path, samples: np.ndarray, serial: int) -> None:
    buffer = io.BytesIO()
    sf.write(buffer, samples, SAMPLE_RATE, format="OGG", subtype="OPUS")
    with atomic_write(path, "wb") as f:
        f.write(set_ogg_serial(buffer.getvalue(), serial))


def _start_corpus(out_dir: Path, params: dict) -> bool:
    """Return True if `out_dir` already holds this corpus; refuse a different one."""
    meta_path = out_dir / "synthetic.json"
    if meta_path.exists():
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("params") != params:
            raise SynthesisError(
                f"{out_dir} holds a synthetic corpus made with other parameters "
                f"({meta.get('params')}); remove it or choose another directory"
            )
        if meta.get("complete"):
            return True
    out_dir.mkdir(parents=True, exist_ok=True)
    return False


def _finish_corpus(out_dir: Path, params: dict, info: dict) -> None:
    with atomic_write(out_dir / "synthetic.json") as f:
        json.dump({"params": params, "complete": True, **info}, f, ensure_ascii=False, indent=1)
        f.write("\n")


def _pilot_seconds_per_char(lexicon: Lexicon, voice: str, seed: int) -> float:
    """Average speech duration per character, from a small deterministic pilot."""
    rng = random.Random(f"pilot-{seed}")
    speakers = make_speakers(rng, 8, set())
    chars = seconds = 0.0
    for i in range(24):
        text = "".join(sample_sentence(rng, lexicon, 8, 12))
        chars += len(text)
        seconds += synthesize(text, speakers[i % len(speakers)], voice).shape[0] / SAMPLE_RATE
    return seconds / chars


def _split_counts(total: int, ratios: Sequence[float]) -> list[int]:
    if total < len(ratios):
        raise SynthesisError(f"need at least {len(ratios)} utterances, got {total}")
    counts = [max(1, round(total * r / sum(ratios))) for r in ratios]
    counts[0] = total - sum(counts[1:])
    return counts


def make_aishell(
    out_dir: str | os.PathLike,
    num_utts: int | None = None,
    hours: float | None = None,
    seed: int = 0,
    num_chars: int = 350,
    distinct_sounds: str = "syllable",
    min_chars: int = 6,
    max_chars: int = 14,
    utts_per_speaker: int = 25,
    split: Sequence[float] = (0.9, 0.05, 0.05),
    num_missing_transcripts: int | None = None,
    num_missing_audio: int | None = None,
    voice: str = DEFAULT_VOICE,
    nj: int = 2,
) -> Path:
    """Write a synthetic AISHELL-1 release under `out_dir/data_aishell`; returns that path.

    Give the size as `num_utts` (all sets together) or `hours` (estimated from a
    pilot synthesis). `num_missing_transcripts` audio files get no transcript
    line and `num_missing_audio` transcript lines get no audio, as in the real
    release (default: 0.2% of the utterances, at least one each).
    """
    if (num_utts is None) == (hours is None):
        raise ValueError("give exactly one of num_utts and hours")
    if not 0 < utts_per_speaker < 9000:  # ids W9000 and up hold the transcript-only lines
        raise ValueError(f"utts_per_speaker must be in 1..8999, got {utts_per_speaker}")
    out = Path(out_dir)
    params = {
        "layout": "aishell", "num_utts": num_utts, "hours": hours, "seed": seed,
        "num_chars": num_chars, "distinct_sounds": distinct_sounds, "min_chars": min_chars,
        "max_chars": max_chars, "utts_per_speaker": utts_per_speaker, "split": list(split),
        "num_missing_transcripts": num_missing_transcripts,
        "num_missing_audio": num_missing_audio, "voice": voice,
    }
    root = out / "data_aishell"
    if _start_corpus(out, params):
        logger.info("synthetic AISHELL-1 corpus already complete in %s", root)
        write_release_lexicon(out, build_lexicon(num_chars, distinct_sounds, voice), voice)
        return root

    lexicon = build_lexicon(num_chars, distinct_sounds, voice)
    write_release_lexicon(out, lexicon, voice)
    if num_utts is None:
        per_char = _pilot_seconds_per_char(lexicon, voice, seed)
        seconds_per_utt = per_char * (min_chars + max_chars) / 2 + 0.5  # + leading/trailing silence
        num_utts = max(len(split), math.ceil(hours * 3600 / seconds_per_utt))
    rng = random.Random(seed)
    counts = _split_counts(num_utts, split)
    extra = max(1, round(0.002 * num_utts))
    missing_transcripts = extra if num_missing_transcripts is None else num_missing_transcripts
    missing_audio = extra if num_missing_audio is None else num_missing_audio

    taken_profiles: set[tuple[str, int, int]] = set()
    seen_sentences: set[str] = set()
    utterances = []  # (set, speaker id, utt id, words, Speaker)
    for name, count in zip(("train", "dev", "test"), counts, strict=True):
        num_speakers = max(1, math.ceil(count / utts_per_speaker))
        first = AISHELL_SPEAKER_BASE[name]
        if first + num_speakers > 10000:
            raise SynthesisError(f"{num_speakers} {name} speakers do not fit 4-digit speaker ids")
        speakers = make_speakers(rng, num_speakers, taken_profiles)
        sentences = sample_sentences(rng, lexicon, count, min_chars, max_chars, seen_sentences)
        for i, words in enumerate(sentences):
            spk_index = i % num_speakers
            spk = f"S{first + spk_index:04d}"
            utt = f"BAC009{spk}W{i // num_speakers + 1:04d}"
            utterances.append((name, spk, utt, words, speakers[spk_index]))
    # Transcript lines without audio: extra ids on existing train speakers.
    orphan_lines = []
    train_utts = [u for u in utterances if u[0] == "train"]
    for j in range(missing_audio):
        _, spk, _, _, _ = train_utts[j % len(train_utts)]
        words = sample_sentences(rng, lexicon, 1, min_chars, max_chars, seen_sentences)[0]
        orphan_lines.append((f"BAC009{spk}W{9000 + j:04d}", words))
    chosen = rng.sample(utterances, min(missing_transcripts, len(utterances)))
    no_transcript = {u[2] for u in chosen}

    jobs = []
    for index, (name, spk, utt, words, speaker) in enumerate(utterances):
        path = root / "wav" / name / spk / f"{utt}.wav"
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)

        def job(path=path, words=words, speaker=speaker, index=index) -> None:
            _write_wav(path, render_utterance("".join(words), speaker, (seed, index), voice))

        jobs.append(job)
    _run_parallel(jobs, nj, "synthesising AISHELL-1")

    lines = [(utt, words) for _, _, utt, words, _ in utterances if utt not in no_transcript]
    lines += orphan_lines
    lines.sort()
    with atomic_write(root / "transcript" / "aishell_transcript_v0.8.txt") as f:
        for utt, words in lines:
            f.write(f"{utt} {' '.join(words)}\n")

    _finish_corpus(out, params, {
        "num_utts": {name: c for name, c in zip(("train", "dev", "test"), counts, strict=True)},
        "audio_without_transcript": sorted(no_transcript),
        "transcript_without_audio": [utt for utt, _ in orphan_lines],
        "num_chars": len(lexicon.chars),
        "characters": "".join(lexicon.chars),
        "speakers": {spk: dataclasses.asdict(s) for _, spk, _, _, s in utterances},
    })
    logger.info("wrote synthetic AISHELL-1 (%s utterances: train/dev/test %s) to %s",
                num_utts, counts, root)
    return root


def write_release_lexicon(out: Path, lexicon: Lexicon, voice: str) -> Path:
    """`resource_aishell/lexicon.txt` beside `data_aishell`, as the real release ships it:
    every word the sentences are drawn from, pronounced as the voice says it
    (`sentences.spoken_lexicon`). Kept when it exists."""
    path = out / "resource_aishell" / "lexicon.txt"
    if path.is_file():
        return path
    entries, unmatched = spoken_lexicon(lexicon.words, voice)
    if unmatched:
        logger.info("lexicon: %d syllables of %d words keep pypinyin's reading (no reading "
                    "matched espeak-ng's)", unmatched, len(entries))
    with atomic_write(path) as f:
        f.write("SIL sil\n<SPOKEN_NOISE> sil\n" + format_lexicon(entries))
    return path


def make_wenetspeech(
    out_dir: str | os.PathLike,
    num_audios: int | None = None,
    hours: float | None = None,
    seed: int = 0,
    num_chars: int = 350,
    distinct_sounds: str = "syllable",
    min_chars: int = 6,
    max_chars: int = 14,
    utts_per_audio: tuple[int, int] = (3, 8),
    split: Sequence[float] = (0.85, 0.05, 0.05, 0.05),
    voice: str = DEFAULT_VOICE,
    nj: int = 2,
) -> Path:
    """Write a synthetic WenetSpeech release (`WenetSpeech.json` + Opus audio) under `out_dir`.

    Training segments are tagged L; half of them also M, and half of those
    also S (so S within M within L). Evaluation audios are DEV, TEST_NET and
    TEST_MEETING; meeting recordings alternate two or three speakers.
    """
    if (num_audios is None) == (hours is None):
        raise ValueError("give exactly one of num_audios and hours")
    out = Path(out_dir)
    params = {
        "layout": "wenetspeech", "num_audios": num_audios, "hours": hours, "seed": seed,
        "num_chars": num_chars, "distinct_sounds": distinct_sounds, "min_chars": min_chars,
        "max_chars": max_chars, "utts_per_audio": list(utts_per_audio), "split": list(split),
        "voice": voice,
    }
    if _start_corpus(out, params):
        logger.info("synthetic WenetSpeech corpus already complete in %s", out)
        return out

    lexicon = build_lexicon(num_chars, distinct_sounds, voice)
    if num_audios is None:
        per_char = _pilot_seconds_per_char(lexicon, voice, seed)
        seconds_per_utt = per_char * (min_chars + max_chars) / 2 + 0.8  # + pause
        num_audios = max(len(split), math.ceil(
            hours * 3600 / (seconds_per_utt * sum(utts_per_audio) / 2)))
    rng = random.Random(seed)
    counts = _split_counts(num_audios, split)
    taken_profiles: set[tuple[str, int, int]] = set()
    seen_sentences: set[str] = set()

    audios = []  # dicts for WenetSpeech.json, plus private fields for synthesis
    index = 0
    for (set_name, tag), count in zip(WENET_SETS.items(), counts, strict=True):
        voices_per_audio = 3 if set_name == "test_meeting" else 1
        speakers = make_speakers(rng, max(2, count * voices_per_audio // 2), taken_profiles)
        for k in range(count):
            aid = f"X{index:010d}_{rng.randrange(10**9):09d}"
            num = rng.randint(*utts_per_audio)
            cast = rng.sample(speakers, min(voices_per_audio, len(speakers)))
            sentences = sample_sentences(rng, lexicon, num, min_chars, max_chars, seen_sentences)
            segments = []
            for s, words in enumerate(sentences):
                if tag is None:
                    subsets = ["L"]
                    if rng.random() < 0.5:
                        subsets.insert(0, "M")
                        if rng.random() < 0.5:
                            subsets.insert(0, "S")
                else:
                    subsets = [tag]
                segments.append({
                    "sid": f"{aid}_S{s:05d}", "text": "".join(words),
                    "confidence": round(rng.uniform(0.95, 1.0), 2), "subsets": subsets,
                    "_speaker": cast[s % len(cast)], "_pause": rng.uniform(0.3, 1.2),
                })
            audios.append({
                "aid": aid, "path": f"audio/{set_name}/podcast/B{k // 1000:05d}/{aid}.opus",
                "_index": index, "segments": segments,
            })
            index += 1

    def render(audio: dict) -> dict:
        """Synthesise one recording; returns its JSON entry with times and md5."""
        noise_rng = np.random.default_rng([seed, audio["_index"]])
        pieces = [np.zeros(int(SAMPLE_RATE * noise_rng.uniform(0.2, 1.0)), np.float32)]
        position = pieces[0].shape[0]
        entry_segments = []
        snr = min(seg["_speaker"].snr_db for seg in audio["segments"])
        for seg in audio["segments"]:
            speech = synthesize(seg["text"], seg["_speaker"], voice)
            begin, end = position, position + speech.shape[0]
            pause = np.zeros(int(SAMPLE_RATE * seg["_pause"]), np.float32)
            pieces += [speech, pause]
            position = end + pause.shape[0]
            entry_segments.append({
                "sid": seg["sid"], "confidence": seg["confidence"],
                "begin_time": round(begin / SAMPLE_RATE, 2),
                "end_time": round(end / SAMPLE_RATE, 2),
                "subsets": seg["subsets"], "text": seg["text"],
            })
        samples = to_int16(add_noise(np.concatenate(pieces), snr, noise_rng))
        path = out / audio["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            _write_opus(path, samples, serial=audio["_index"] + 1)
        return {
            "aid": audio["aid"], "duration": round(samples.shape[0] / SAMPLE_RATE, 2),
            "format": "opus", "md5": hashlib.md5(path.read_bytes()).hexdigest(),
            "path": audio["path"], "source": "podcast", "tag": "", "segments": entry_segments,
        }

    entries: list[dict | None] = [None] * len(audios)

    def job_for(i: int) -> Callable[[], None]:
        def job() -> None:
            entries[i] = render(audios[i])
        return job

    _run_parallel([job_for(i) for i in range(len(audios))], nj, "synthesising WenetSpeech")

    # Written entry by entry: the real file describes millions of segments.
    with atomic_write(out / "WenetSpeech.json") as f:
        f.write('{\n "dataset": "WenetSpeech",\n "language": "Mandarin",\n "version": "1.0.0",\n'
                ' "description": "Synthetic Mandarin corpus spoken by espeak-ng in the WenetSpeech'
                ' release layout",\n "url": "",\n "audios": [\n')
        for i, entry in enumerate(entries):
            separator = ",\n" if i + 1 < len(entries) else "\n"
            f.write("  " + json.dumps(entry, ensure_ascii=False) + separator)
        f.write(" ]\n}\n")

    _finish_corpus(out, params, {
        "num_audios": {n: c for n, c in zip(WENET_SETS, counts, strict=True)},
        "num_segments": sum(len(a["segments"]) for a in audios),
        "num_chars": len(lexicon.chars),
        "characters": "".join(lexicon.chars),
    })
    logger.info("wrote synthetic WenetSpeech (%d audios, %d segments) to %s",
                len(audios), sum(len(a["segments"]) for a in audios), out)
    return out


# ------------------------------------------------------------- language-model text


def corpus_sentences(corpus_dir: str | os.PathLike) -> set[str]:
    """Every sentence (spaces removed) of a synthetic AISHELL-1 or WenetSpeech corpus."""
    out = Path(corpus_dir)
    layout = _read_meta(out)["params"]["layout"]
    sentences = set()
    if layout == "aishell":
        transcript = out / "data_aishell" / "transcript" / "aishell_transcript_v0.8.txt"
        with open(transcript, encoding="utf-8") as f:
            for line in f:
                _, _, words = line.strip().partition(" ")
                sentences.add(words.replace(" ", ""))
    else:
        with open(out / "WenetSpeech.json", encoding="utf-8") as f:
            for audio in json.load(f)["audios"]:
                sentences.update(seg["text"].replace(" ", "") for seg in audio["segments"])
    return sentences


def _read_meta(out: Path) -> dict:
    meta_path = out / "synthetic.json"
    if not meta_path.is_file():
        raise SynthesisError(f"{meta_path} does not exist: {out} is not a synthetic corpus")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    if not meta.get("complete"):
        raise SynthesisError(f"{meta_path}: the corpus is incomplete; generate it first")
    return meta


def make_lm_text(corpus_dir: str | os.PathLike, out_path: str | os.PathLike,
                 num_sentences: int, seed: int = 0) -> Path:
    """Write `num_sentences` text-only sentences for language models, drawn like the corpus's
    own (same inventory, words and lengths) but none of them in its train, dev or test sets.

    The output is a Kaldi `text` file (`lm-0000001 <sentence>`, no spaces, as stage 0 writes
    transcripts). The sentences depend on the corpus's parameters and `seed` only.
    """
    out = Path(corpus_dir)
    meta = _read_meta(out)
    params = meta["params"]
    lexicon = build_lexicon(params["num_chars"], params["distinct_sounds"], params["voice"])
    if "".join(lexicon.chars) != meta["characters"]:
        raise SynthesisError(f"{out}: the character inventory rebuilt now differs from the "
                             "corpus's (another espeak-ng version?); regenerate the corpus")
    exclude = corpus_sentences(out)
    rng = random.Random(f"lm-{params['seed']}-{seed}")
    sentences = sample_sentences(rng, lexicon, num_sentences, params["min_chars"],
                                 params["max_chars"], exclude)
    with atomic_write(out_path) as f:
        for index, words in enumerate(sentences, 1):
            f.write(f"lm-{index:07d} {''.join(words)}\n")
    logger.info("wrote %d language-model sentences (none in %s) to %s", num_sentences, out,
                out_path)
    return Path(out_path)


# ----------------------------------------------------------------------------- CLI


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sentences, speakers and voices")
    parser.add_argument("--num-chars", type=int, default=350,
                        help="size of the character inventory")
    parser.add_argument("--distinct-sounds", choices=DISTINCT_SOUNDS, default="syllable",
                        help="keep only characters whose syllables (or syllables with tones) "
                             "differ")
    parser.add_argument("--min-chars", type=int, default=6, help="shortest sentence, in characters")
    parser.add_argument("--max-chars", type=int, default=14, help="longest sentence, in characters")
    parser.add_argument("--voice", default=DEFAULT_VOICE, help="espeak-ng voice (language)")
    parser.add_argument("--nj", type=int, default=2, help="parallel synthesis jobs")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="layout", required=True)
    aishell = sub.add_parser("aishell", help="AISHELL-1 layout")
    aishell.add_argument("out_dir", help="where the release layout is written")
    size = aishell.add_mutually_exclusive_group(required=True)
    size.add_argument("--num-utts", type=int, help="utterances in train+dev+test")
    size.add_argument("--hours", type=float, help="approximate hours in train+dev+test")
    aishell.add_argument("--utts-per-speaker", type=int, default=25,
                         help="utterances each synthetic speaker says")
    aishell.add_argument("--split", default="0.9,0.05,0.05", help="train,dev,test ratios")
    _add_common(aishell)
    wenet = sub.add_parser("wenetspeech", help="WenetSpeech layout")
    wenet.add_argument("out_dir", help="where the release layout is written")
    size = wenet.add_mutually_exclusive_group(required=True)
    size.add_argument("--num-audios", type=int, help="long recordings in all sets")
    size.add_argument("--hours", type=float, help="approximate hours of speech in all sets")
    wenet.add_argument("--split", default="0.85,0.05,0.05,0.05",
                       help="train,dev,test_net,test_meeting ratios")
    _add_common(wenet)
    lm_text = sub.add_parser("lm-text", help="text-only sentences for language models, "
                             "disjoint from a generated corpus")
    lm_text.add_argument("out_dir", help="the synthetic corpus (AISHELL-1 or WenetSpeech)")
    lm_text.add_argument("text", help="output Kaldi text file")
    lm_text.add_argument("--num-sentences", type=int, required=True,
                         help="sentences to write")
    lm_text.add_argument("--seed", type=int, default=0, help="seed of the sentences")
    args = parser.parse_args(argv)
    setup_logging()
    if args.layout == "lm-text":
        make_lm_text(args.out_dir, args.text, args.num_sentences, args.seed)
        return
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        parser.error("espeak-ng and sox are required (bash tools/install.sh installs them)")
    common = dict(seed=args.seed, num_chars=args.num_chars,
                  distinct_sounds=args.distinct_sounds, min_chars=args.min_chars,
                  max_chars=args.max_chars, voice=args.voice, nj=args.nj,
                  split=[float(x) for x in args.split.split(",")])
    if args.layout == "aishell":
        make_aishell(args.out_dir, num_utts=args.num_utts, hours=args.hours,
                     utts_per_speaker=args.utts_per_speaker, **common)
    else:
        make_wenetspeech(args.out_dir, num_audios=args.num_audios, hours=args.hours, **common)


if __name__ == "__main__":
    main()
