"""Streaming decoding of any chunk-trained model: greedy search over encoder chunks, with
latencies (`cat.decoding.online`); the search is the model family's `ChunkSearch`.

CAT's-style `python -m cat.ctc.stream` and `cat.rnnt.stream` are aliases for their kinds.

Usage:
    python -m cat.stream exp/synth-ctc-stream --wav-scp data/test/wav.scp \
        --chunk-size 16 --out exp/synth-ctc-stream/stream-c16/test
"""

import sys

from cat.decoding.online import main

if __name__ == "__main__":
    sys.exit(main("cat.stream"))
