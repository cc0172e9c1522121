"""The server's page in a real browser: headless Chromium opens it with a fake microphone
playing a test wav; the page's final text is `python -m cat.stream`'s for that wav, and so
is the text of the same wav uploaded as a file. The page's screenshot is kept
(`$CAT_TEST_ARTEFACTS`, default `tests/out/`, as `serve-page.png`)."""

from __future__ import annotations

import os
from itertools import pairwise
from pathlib import Path

import pytest
import soundfile

from cat.testing.browser import Chromium, find_chromium
from cat.testing.processes import PROC, command_line
from cat.testing.serving import CHUNK_SIZE, ServerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_chromium() is None, reason=(
        "no Chromium on PATH: Debian's chromium package (tools/install.sh --dev installs it) "
        "runs the page test")),
]

ARTEFACTS = Path(os.environ.get("CAT_TEST_ARTEFACTS",
                                Path(__file__).resolve().parents[2] / "tests/out"))


def _processes_naming(text: str) -> list[str]:
    return [command_line(int(entry.name)) for entry in PROC.iterdir()
            if entry.name.isdigit() and text in command_line(int(entry.name))]


def test_the_page_in_chromium_gives_cat_streams_text(tone, reference, tmp_path):
    experiment, checkpoint = tone
    key = next(iter(sorted(reference)))
    wav = experiment.test_audio()[key]
    seconds = soundfile.info(str(wav)).duration + 1.5  # the wav, then the fake's silence
    profile = tmp_path / "chromium-profile"
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = ARTEFACTS / "serve-page.png"
    screenshot.unlink(missing_ok=True)
    with ServerProcess([experiment.name, "--chunk-size", str(CHUNK_SIZE), "--checkpoint",
                        str(checkpoint)], cwd=experiment.root) as server:
        with Chromium(f"{server.url}?autostart={seconds:.2f}", wav, profile) as browser:
            browser.wait_until("['done', 'error'].includes(document.body.dataset.state)", 120)
            state = browser.evaluate("document.body.dataset.state + ': ' + "
                                     "document.getElementById('status').textContent")
            text = browser.evaluate("document.getElementById('final-text').textContent")
            messages = browser.evaluate("window.catMessages")
            shown = browser.evaluate("document.getElementById('finals').textContent")
            rate = browser.evaluate("document.getElementById('mic-state').textContent")
            browser.screenshot(screenshot)
            # The same wav as a file: the browser decodes and resamples it, the page sends it.
            browser.choose_file("#file", wav)
            browser.evaluate("document.getElementById('upload').click()")
            browser.wait_until("document.body.dataset.state === 'uploading'", 30)
            browser.wait_until("['done', 'error'].includes(document.body.dataset.state)", 120)
            uploaded = browser.evaluate("document.getElementById('final-text').textContent")
        server.wait_for(lambda s: s["streams"] == 0, 30, "the page's stream freed")
    assert state == "done: done: the server sent the final results"
    assert "sending 16 kHz" in rate
    assert text == reference[key]  # cat.stream's text for the wav the microphone played
    assert uploaded == reference[key]
    partials = [m["text"] for m in messages if m["type"] == "partial"]
    assert len(partials) >= 2 and all(b.startswith(a) for a, b in pairwise(partials))
    final = next(m for m in messages if m["type"] == "final")
    for token in final["tokens"]:  # the page shows each token with its times
        assert f"{token['text']} {token['start']:.2f}-{token['end']:.2f}" in shown
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not _processes_naming(str(profile))  # Chromium and its children are gone
