"""Decode a Kaldi feature directory with a trained RNN-T model (see cat.decoding.inference).

Usage:
    python -m cat.rnnt.decode exp/<name> --data data/fbank/test \
        --checkpoint exp/<name>/check/avg-best-5.pt --out exp/<name>/decode/test --nj 2
"""

import sys

from cat.decoding.inference import main

if __name__ == "__main__":
    sys.exit(main("rnnt"))
