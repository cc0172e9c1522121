"""Tests of the synthetic corpus generator: release layouts, determinism, disjoint splits."""

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cat.data import sentences, synth, voices

# Speaking with espeak-ng takes seconds per test: the quick tier leaves these out.
pytestmark = pytest.mark.slow


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def aishell(tmp_path_factory):
    out = tmp_path_factory.mktemp("aishell")
    synth.make_aishell(out, num_utts=80, seed=3, num_chars=300, utts_per_speaker=10, nj=2)
    return out


def _transcripts(root: Path) -> dict[str, str]:
    lines = (root / "data_aishell/transcript/aishell_transcript_v0.8.txt").read_text("utf-8")
    return dict(line.split(" ", 1) for line in lines.splitlines())


def test_aishell_layout(aishell):
    root = aishell / "data_aishell"
    wavs = sorted((root / "wav").rglob("*.wav"))
    assert len(wavs) == 80
    for wav in wavs:
        split, spk, name = wav.relative_to(root / "wav").parts
        assert split in {"train", "dev", "test"}
        assert re.fullmatch(r"S\d{4}", spk)
        assert re.fullmatch(rf"BAC009{spk}W\d{{4}}\.wav", name)
        info = sf.info(wav)
        assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
        assert 0.8 < info.duration < 12
    text = _transcripts(aishell)
    assert list(text) == sorted(text)
    meta = json.loads((aishell / "synthetic.json").read_text("utf-8"))
    ids = {w.stem for w in wavs}
    assert set(meta["audio_without_transcript"]) == ids - set(text)
    assert set(meta["transcript_without_audio"]) == set(text) - ids
    assert meta["audio_without_transcript"] and meta["transcript_without_audio"]
    # word-segmented like the real file: words separated by single spaces
    assert all("  " not in t and " " in t for t in text.values() if len(t) > 6)
    # every character comes from the inventory
    inventory = set(meta["characters"])
    assert len(inventory) == meta["num_chars"] == 300
    assert set("".join(text.values()).replace(" ", "")) <= inventory


def test_aishell_speakers_and_sentences_disjoint(aishell):
    meta = json.loads((aishell / "synthetic.json").read_text("utf-8"))
    root = aishell / "data_aishell/wav"
    text = _transcripts(aishell)
    speakers, sentences = {}, {}
    for split in ("train", "dev", "test"):
        spk_dirs = [p.name for p in (root / split).iterdir()]
        speakers[split] = {tuple(meta["speakers"][s][k] for k in ("variant", "pitch", "rate"))
                           for s in spk_dirs}
        sentences[split] = {text[w.stem].replace(" ", "") for w in (root / split).rglob("*.wav")
                            if w.stem in text}
        assert spk_dirs
    assert not speakers["train"] & (speakers["dev"] | speakers["test"])
    assert not speakers["dev"] & speakers["test"]
    assert not sentences["train"] & (sentences["dev"] | sentences["test"])
    assert int(min((root / "dev").iterdir()).name[1:]) >= 724
    assert int(min((root / "test").iterdir()).name[1:]) >= 764


def test_aishell_deterministic_and_rerun_is_noop(aishell, tmp_path):
    synth.make_aishell(tmp_path, num_utts=80, seed=3, num_chars=300, utts_per_speaker=10, nj=1)
    assert _tree_digest(tmp_path) == _tree_digest(aishell)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.wav")}
    synth.make_aishell(tmp_path, num_utts=80, seed=3, num_chars=300, utts_per_speaker=10)
    assert before == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.wav")}
    with pytest.raises(voices.SynthesisError, match="other parameters"):
        synth.make_aishell(tmp_path, num_utts=81, seed=3, num_chars=300, utts_per_speaker=10)


def test_aishell_resumes_after_interruption(aishell, tmp_path):
    synth.make_aishell(tmp_path, num_utts=80, seed=3, num_chars=300, utts_per_speaker=10)
    meta = tmp_path / "synthetic.json"
    meta.write_text(meta.read_text("utf-8").replace('"complete": true', '"complete": false'))
    victims = sorted(tmp_path.rglob("*.wav"))[::7]
    for wav in victims:
        wav.unlink()
    synth.make_aishell(tmp_path, num_utts=80, seed=3, num_chars=300, utts_per_speaker=10)
    assert _tree_digest(tmp_path) == _tree_digest(aishell)


def test_other_seed_differs(aishell, tmp_path):
    synth.make_aishell(tmp_path, num_utts=80, seed=4, num_chars=300, utts_per_speaker=10)
    assert _transcripts(tmp_path) != _transcripts(aishell)


@pytest.mark.parametrize("mode", ["syllable", "tone"])
def test_distinct_sounds_inventory(mode):
    lexicon = sentences.build_lexicon(200, distinct_sounds=mode)
    sounds = {c: sentences.sound_key(p, mode)
              for c, p in sentences.pronunciations(lexicon.chars).items()}
    assert len(set(sounds.values())) == len(lexicon.chars) == 200
    assert all(set(w) <= set(lexicon.chars) for w in lexicon.words)
    assert set(lexicon.chars) <= set(lexicon.words)  # every character reachable


def test_size_in_hours(tmp_path):
    synth.make_aishell(tmp_path, hours=0.02, seed=0, num_chars=300, utts_per_speaker=10)
    total = sum(sf.info(w).duration for w in tmp_path.rglob("*.wav"))
    assert 0.6 * 72 < total < 1.6 * 72


@pytest.fixture(scope="module")
def wenet(tmp_path_factory):
    out = tmp_path_factory.mktemp("wenet")
    synth.make_wenetspeech(out, num_audios=12, seed=1, num_chars=300, utts_per_audio=(2, 4),
                           split=(0.5, 0.17, 0.17, 0.16))
    return out


def test_wenetspeech_layout(wenet):
    doc = json.loads((wenet / "WenetSpeech.json").read_text("utf-8"))
    assert doc["dataset"] == "WenetSpeech"
    assert len(doc["audios"]) == 12
    tags = set()
    for audio in doc["audios"]:
        path = wenet / audio["path"]
        assert path.suffix == ".opus" and audio["format"] == "opus"
        assert hashlib.md5(path.read_bytes()).hexdigest() == audio["md5"]
        samples, rate = sf.read(path, dtype="float32")
        assert rate == 16000
        assert abs(samples.shape[0] / rate - audio["duration"]) < 0.1
        assert 2 <= len(audio["segments"]) <= 4
        previous_end = 0.0
        for seg in audio["segments"]:
            assert seg["sid"].startswith(audio["aid"] + "_S")
            assert previous_end <= seg["begin_time"] < seg["end_time"] <= audio["duration"]
            previous_end = seg["end_time"]
            assert seg["text"] and " " not in seg["text"]
            assert 0.9 <= seg["confidence"] <= 1.0
            subsets = set(seg["subsets"])
            tags |= subsets
            assert "S" not in subsets or "M" in subsets  # S within M
            assert "M" not in subsets or "L" in subsets  # M within L
            # speech inside the segment, (near) silence in the pause before it
            inside = samples[int(seg["begin_time"] * rate):int(seg["end_time"] * rate)]
            assert np.sqrt(np.mean(inside**2)) > 0.01
    assert {"L", "DEV", "TEST_NET", "TEST_MEETING"} <= tags


def test_wenetspeech_deterministic(wenet, tmp_path):
    synth.make_wenetspeech(tmp_path, num_audios=12, seed=1, num_chars=300, utts_per_audio=(2, 4),
                           split=(0.5, 0.17, 0.17, 0.16), nj=1)
    assert _tree_digest(tmp_path) == _tree_digest(wenet)


def test_ogg_serial_rewrite_keeps_audio(tmp_path):
    samples = (np.sin(np.arange(16000) / 5.0) * 8000).astype(np.int16)
    for serial in (1, 2):
        synth._write_opus(tmp_path / f"{serial}.opus", samples, serial=serial)
    a, _ = sf.read(tmp_path / "1.opus")
    b, _ = sf.read(tmp_path / "2.opus")
    np.testing.assert_array_equal(a, b)
    raw = (tmp_path / "2.opus").read_bytes()
    assert raw[14:18] == (2).to_bytes(4, "little")


@pytest.mark.parametrize("layout", ["aishell", "wenet"])
def test_lm_text_is_disjoint_from_the_corpus_and_deterministic(layout, request, tmp_path):
    corpus = request.getfixturevalue(layout)
    out = synth.make_lm_text(corpus, tmp_path / "text", num_sentences=300)
    lines = out.read_text("utf-8").splitlines()
    ids = [line.split(" ", 1)[0] for line in lines]
    sentences = [line.split(" ", 1)[1] for line in lines]
    assert ids == [f"lm-{i:07d}" for i in range(1, 301)]
    assert len(set(sentences)) == 300 and not set(sentences) & synth.corpus_sentences(corpus)
    characters = set(json.loads((corpus / "synthetic.json").read_text("utf-8"))["characters"])
    assert set("".join(sentences)) <= characters
    assert all(6 <= len(s) <= 14 for s in sentences)
    again = synth.make_lm_text(corpus, tmp_path / "again", num_sentences=300)
    assert again.read_bytes() == out.read_bytes()
    other = synth.make_lm_text(corpus, tmp_path / "other", num_sentences=300, seed=1)
    assert other.read_bytes() != out.read_bytes()


def test_lm_text_needs_a_complete_corpus(tmp_path):
    with pytest.raises(voices.SynthesisError, match=r"synthetic\.json does not exist"):
        synth.make_lm_text(tmp_path, tmp_path / "text", num_sentences=3)


def test_aishell_ships_a_lexicon_of_its_words(aishell):
    from cat.text.lexicon import LexiconTokenizer, read_lexicon

    lexicon = read_lexicon(aishell / "resource_aishell" / "lexicon.txt")
    words = {w for t in _transcripts(aishell).values() for w in t.split()}
    assert words <= set(lexicon)
    # AISHELL phones: an initial (or doubled-vowel pseudo-initial) then a toned final
    assert all(len(p) % 2 == 0 and all(f[-1] in "12345" for f in p[1::2])
               for p in lexicon.values())
    tokenizer = LexiconTokenizer.from_lexicon(lexicon)
    for text in _transcripts(aishell).values():
        assert 1 not in tokenizer.encode(text)
    assert not tokenizer.missing
