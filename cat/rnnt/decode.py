"""Decode with a trained RNN-T model: stage 1's features, or audio (see cat.decoding.inference).

Without `--checkpoint`, the model stage 4 decodes with (`inference.avgmodel`); options
default to `hyper-p.json: inference.infer.option`. Audio (files, a Kaldi `wav.scp` with
optional `segments`, a WeNet `data.list`) gets stage 1's 80-dim fbank as it is read;
without `--out`, `<key> <text>` lines go to standard output. Run from the recipe dir.

Usage:
    python -m cat.rnnt.decode exp/synth-rnnt --data data/fbank/test \
        --checkpoint exp/synth-rnnt/check/avg-best-5.pt --out exp/synth-rnnt/decode/test --nj 2
    python -m cat.rnnt.decode exp/synth-rnnt --audio a.wav b.flac c.opus
    python -m cat.rnnt.decode exp/synth-rnnt --wav-scp data/test/wav.scp \
        --segments data/test/segments --nj 2 --out exp/synth-rnnt/transcribe/test
    python -m cat.rnnt.decode exp/synth-rnnt --data-list data.list --nj 2 > hyp.txt
"""

import sys

from cat.decoding.inference import main

if __name__ == "__main__":
    sys.exit(main("rnnt"))
