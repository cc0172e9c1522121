"""Decode with a trained CTC model: stage 1's features, or audio (see cat.decoding.inference).

Without `--checkpoint`, the model stage 4 decodes with (`inference.avgmodel`); options
default to `hyper-p.json: inference.infer.option`. Audio (files, a Kaldi `wav.scp` with
optional `segments`, a WeNet `data.list`) gets stage 1's 80-dim fbank as it is read;
without `--out`, `<key> <text>` lines go to standard output. Run from the recipe dir.

Usage:
    python -m cat.ctc.decode exp/synth-ctc --data data/fbank/test \
        --checkpoint exp/synth-ctc/check/avg-best-5.pt --out exp/synth-ctc/decode/test --nj 2
    python -m cat.ctc.decode exp/synth-ctc --audio a.wav b.flac c.opus
    python -m cat.ctc.decode exp/synth-ctc --wav-scp data/test/wav.scp \
        --segments data/test/segments --nj 2 --out exp/synth-ctc/transcribe/test
    python -m cat.ctc.decode exp/synth-ctc --data-list data.list --nj 2 > hyp.txt
"""

import sys

from cat.decoding.inference import main

if __name__ == "__main__":
    sys.exit(main("ctc"))
