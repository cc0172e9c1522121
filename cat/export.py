"""Export any trained model to ONNX (+ `tokens.txt`, `export.json`) with its family's
`export` (`cat.ctc.export`: one model; `cat.rnnt.export`: encoder, decoder, joiner).

`python -m cat.ctc.export` and `cat.rnnt.export` are aliases for their kinds.

Usage:
    python -m cat.export exp/synth-ctc                  # -> exp/synth-ctc/export/
    python -m cat.export exp/synth-ctc-stream --chunk-size 16   # + streaming.onnx
"""

import sys

from cat.decoding.export import export_main as main

if __name__ == "__main__":
    sys.exit(main("cat.export"))
