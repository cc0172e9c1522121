"""Decode with any trained model: stage 1's features, or audio (`cat.decoding.inference`).

The model kind comes from `exp/<name>/config.json`; CAT's `python -m cat.ctc.decode` and
`cat.rnnt.decode` are aliases for their kinds. Without `--checkpoint`, the model stage 4
decodes with; options default to `hyper-p.json: inference.infer.option`.

Usage:
    python -m cat.decode exp/synth-u2 --data data/fbank/test --out exp/synth-u2/decode/test \
        --method attention_rescoring --beam-size 5
    python -m cat.decode exp/synth-ctc --audio a.wav b.flac c.opus
    python -m cat.decode exp/synth-rnnt --wav-scp data/test/wav.scp --nj 2 > hyp.txt
"""

import sys

from cat.decoding.inference import main

if __name__ == "__main__":
    sys.exit(main("cat.decode"))
