"""A synthetic alignment set: utterances whose word boundaries are known to the sample, for
measuring the times a model gives its words (`python -m cat.decode --format ctm`).

espeak-ng does not say where the words of a sentence it speaks begin and end, so the
generator speaks them one at a time: each word of a synthetic AISHELL-1 corpus's sentence
is synthesised alone, with the utterance's own speaker (voice variant, pitch, rate), its
leading and trailing silence trimmed (`ONSET_AMPLITUDE`), and the words are laid end to
end with pauses the generator draws (`PAUSE_SECONDS`), between a leading and a trailing
silence, with the speaker's noise. The start and end sample of each word are then known
and written as a Kaldi CTM of reference words (`words.ctm`). The corpus itself is not
touched: its audio stays what `cat.data.synth` wrote.

Output directory: `wav/<utt>.wav` (16 kHz, 16-bit), `wav.scp` (absolute paths), `text`
(the sentence without spaces, as stage 0 writes transcripts), `words.ctm`
(`<utt> 1 <start> <duration> <word>`, seconds) and `alignment.json` (the parameters;
generating again with the same ones is a no-op).

`boundary_errors` compares hypothesis word times (a CTM of `cat.decode --format ctm`,
one CJK character per word) with the reference: the characters of each utterance are
matched with `difflib` and a reference word whose characters all match has its start
(the first character's start) and end (the last character's end) compared.

Usage:
    python -m cat.data.alignment corpus/synthetic exp/alignment/test --set test \
        --num-utts 60
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import soundfile as sf

from cat.core.io import atomic_write, setup_logging
from cat.data.voices import SAMPLE_RATE, Speaker, add_noise, synthesize, to_int16

logger = logging.getLogger(__name__)

#: A word's speech starts at its first sample of this amplitude (of 1) and ends at its last.
ONSET_AMPLITUDE = 0.01
#: Pauses drawn between words, and the silence before the first and after the last (s).
PAUSE_SECONDS = (0.05, 0.25)
EDGE_SECONDS = (0.1, 0.4)


@dataclasses.dataclass(frozen=True)
class Word:
    """A reference or hypothesis word of an utterance, seconds from its start."""

    text: str
    start: float
    end: float


def _corpus_utterances(corpus_dir: Path, set_name: str
                       ) -> tuple[list[tuple[str, str, list[str]]], dict, str]:
    """(utt, speaker id, words) of a set with audio and transcript, the corpus's speakers
    and voice."""
    meta_path = corpus_dir / "synthetic.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} does not exist: {corpus_dir} is not a "
                                "synthetic corpus")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta["params"].get("layout") != "aishell":
        raise ValueError(f"{meta_path}: an alignment set is made of an AISHELL-1 layout")
    root = corpus_dir / "data_aishell"
    transcript = {}
    with open(root / "transcript" / "aishell_transcript_v0.8.txt", encoding="utf-8") as f:
        for line in f:
            utt, _, words = line.strip().partition(" ")
            transcript[utt] = words.split()
    wavs = sorted((root / "wav" / set_name).glob("*/*.wav"))
    if not wavs:
        raise FileNotFoundError(f"{root / 'wav' / set_name}: no audio of set {set_name!r}")
    utterances = [(wav.stem, wav.parent.name, transcript[wav.stem]) for wav in wavs
                  if wav.stem in transcript]
    return utterances, meta["speakers"], meta["params"]["voice"]


def _trimmed(samples: np.ndarray) -> np.ndarray:
    loud = np.nonzero(np.abs(samples) >= ONSET_AMPLITUDE)[0]
    return samples[loud[0]:loud[-1] + 1] if loud.size else samples[:0]


def render_words(words: Sequence[str], speaker: Speaker, voice: str,
                 rng: np.random.Generator) -> tuple[np.ndarray, list[Word]]:
    """int16 samples of `words` spoken one at a time with drawn pauses, and where each is."""
    pieces = [np.zeros(int(SAMPLE_RATE * rng.uniform(*EDGE_SECONDS)), np.float32)]
    position = len(pieces[0])
    spans = []
    for index, word in enumerate(words):
        if index:
            pause = np.zeros(int(SAMPLE_RATE * rng.uniform(*PAUSE_SECONDS)), np.float32)
            pieces.append(pause)
            position += len(pause)
        speech = _trimmed(synthesize(word, speaker, voice))
        pieces.append(speech)
        spans.append(Word(word, position / SAMPLE_RATE, (position + len(speech)) / SAMPLE_RATE))
        position += len(speech)
    pieces.append(np.zeros(int(SAMPLE_RATE * rng.uniform(*EDGE_SECONDS)), np.float32))
    return to_int16(add_noise(np.concatenate(pieces), speaker.snr_db, rng)), spans


def make_alignment_set(corpus_dir: str | os.PathLike, out_dir: str | os.PathLike,
                       set_name: str = "test", num_utts: int = 60, seed: int = 0) -> Path:
    """Write the alignment set of `num_utts` utterances of `set_name` (spread evenly over
    the set's sorted utterances) into `out_dir`; see the module doc."""
    corpus, out = Path(corpus_dir), Path(out_dir)
    params = {"corpus": str(corpus.resolve()), "set": set_name, "num_utts": num_utts,
              "seed": seed, "pause_seconds": list(PAUSE_SECONDS),
              "edge_seconds": list(EDGE_SECONDS), "onset_amplitude": ONSET_AMPLITUDE}
    meta_path = out / "alignment.json"
    if meta_path.is_file() and json.loads(meta_path.read_text(encoding="utf-8")) == params:
        logger.info("alignment set already complete in %s", out)
        return out
    utterances, speakers, voice = _corpus_utterances(corpus, set_name)
    step = max(1, len(utterances) // num_utts)
    chosen = utterances[::step][:num_utts]
    rows, texts, ctm = [], [], []
    for index, (utt, speaker_id, words) in enumerate(chosen):
        speaker = Speaker(**speakers[speaker_id])
        rng = np.random.default_rng([seed, index, random.Random(utt).randrange(1 << 30)])
        samples, spans = render_words(words, speaker, voice, rng)
        path = (out / "wav" / f"{utt}.wav").resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(path, samples, SAMPLE_RATE, subtype="PCM_16", format="WAV")
        rows.append(f"{utt} {path}\n")
        texts.append(f"{utt} {''.join(words)}\n")
        ctm += [f"{utt} 1 {w.start:.4f} {w.end - w.start:.4f} {w.text}\n" for w in spans]
    for name, lines in (("wav.scp", rows), ("text", texts), ("words.ctm", ctm)):
        with atomic_write(out / name) as f:
            f.writelines(lines)
    with atomic_write(meta_path) as f:
        json.dump(params, f, indent=1)
        f.write("\n")
    logger.info("wrote an alignment set of %d utterances (%d words) of %s to %s",
                len(chosen), len(ctm), set_name, out)
    return out


def read_ctm(path: str | os.PathLike) -> dict[str, list[Word]]:
    """The words of a CTM by utterance, in time order; a line without at least five
    columns or with a non-numeric time is a ValueError naming it."""
    words: dict[str, list[Word]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                start, duration = float(fields[2]), float(fields[3])
                utt, text = fields[0], fields[4]
            except (IndexError, ValueError):
                raise ValueError(f"{path}:{lineno}: not a CTM line "
                                 "(<utt> <channel> <start> <duration> <word> ...): "
                                 f"{line.strip()!r}") from None
            words.setdefault(utt, []).append(Word(text, start, start + duration))
    for utt_words in words.values():
        utt_words.sort(key=lambda word: word.start)
    return words


@dataclasses.dataclass(frozen=True)
class BoundaryErrors:
    """Absolute differences (seconds) of matched words' starts and ends, and counts; the
    signed ones (hypothesis minus reference: negative is early) in `start_shifts` and
    `end_shifts`."""

    starts: list[float]
    ends: list[float]
    num_words: int
    start_shifts: list[float] = dataclasses.field(default_factory=list)
    end_shifts: list[float] = dataclasses.field(default_factory=list)

    @property
    def mean_ms(self) -> float:
        both = self.starts + self.ends
        return 1000 * sum(both) / len(both) if both else float("nan")


def boundary_errors(reference: dict[str, list[Word]],
                    hypothesis: dict[str, list[Word]]) -> BoundaryErrors:
    """Boundary differences of the reference words whose characters the hypothesis
    (one character per word) has, matched per utterance (see the module doc)."""
    start_shifts: list[float] = []
    end_shifts: list[float] = []
    total = 0
    for utt, words in reference.items():
        total += len(words)
        chars = [(word_index, char) for word_index, word in enumerate(words)
                 for char in word.text]
        hyp = [unit for unit in hypothesis.get(utt, []) for _ in unit.text]
        hyp_chars = [char for unit in hypothesis.get(utt, []) for char in unit.text]
        matcher = difflib.SequenceMatcher(None, [c for _, c in chars], hyp_chars,
                                          autojunk=False)
        matched: dict[int, list[Word]] = {}
        for tag, i1, i2, j1, _ in matcher.get_opcodes():
            if tag == "equal":
                for offset in range(i2 - i1):
                    matched.setdefault(chars[i1 + offset][0], []).append(hyp[j1 + offset])
        for word_index, units in matched.items():
            if len(units) == len(words[word_index].text):
                start_shifts.append(units[0].start - words[word_index].start)
                end_shifts.append(units[-1].end - words[word_index].end)
    return BoundaryErrors([abs(shift) for shift in start_shifts],
                          [abs(shift) for shift in end_shifts], total, start_shifts, end_shifts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus_dir", help="a synthetic AISHELL-1 corpus (cat.data.synth)")
    parser.add_argument("out_dir", help="where the alignment set is written")
    parser.add_argument("--set", default="test", help="the corpus's set: train, dev, test")
    parser.add_argument("--num-utts", type=int, default=60, help="utterances to speak")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pauses and noise")
    args = parser.parse_args(argv)
    setup_logging()
    make_alignment_set(args.corpus_dir, args.out_dir, args.set, args.num_utts, args.seed)


if __name__ == "__main__":
    main()
