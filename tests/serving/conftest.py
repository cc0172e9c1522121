"""The server tests' tiny streaming model (the tone corpus of `cat.testing.serving`),
trained once per session, and `python -m cat.stream`'s hypotheses of its test audio."""

from __future__ import annotations

import contextlib

import pytest

from cat.core.io import read_table
from cat.decoding.online import main as stream_main
from cat.testing.serving import CHUNK_SIZE, train_tone_experiment


@pytest.fixture(scope="session")
def tone(tmp_path_factory):
    """(the experiment, its checkpoint)."""
    return train_tone_experiment(tmp_path_factory.mktemp("tone"))


def stream_texts(experiment, checkpoint, wav_scp, out) -> dict[str, str]:
    """`python -m cat.stream`'s hypotheses of `wav_scp` (chunks of `CHUNK_SIZE`)."""
    with contextlib.chdir(experiment.root):
        assert stream_main("cat.stream", [experiment.name, "--wav-scp", str(wav_scp),
                                          "--chunk-size", str(CHUNK_SIZE), "--checkpoint",
                                          str(checkpoint), "--out", str(out)]) == 0
    lines = (out / "hyp").read_text(encoding="utf-8").splitlines()
    return {key: text for key, _, text in (line.partition(" ") for line in lines)}


@pytest.fixture(scope="session")
def reference(tone, tmp_path_factory):
    """{utterance: cat.stream's text} of the test set, which are its transcripts."""
    experiment, checkpoint = tone
    texts = stream_texts(experiment, checkpoint, experiment.test_data / "wav.scp",
                         tmp_path_factory.mktemp("stream"))
    assert texts == read_table(experiment.test_data / "text")  # the model recognises tones
    return texts
