"""Serve a trained experiment (or its export folder, in sherpa-onnx) over WebSocket, with a
web page: streaming partial and final results, endpoints, hotwords (`cat.serving`).

Usage:
    python -m cat.serve exp/synth-ctc-stream --chunk-size 16 --port 6006
    # then open http://127.0.0.1:6006/
"""

import sys

from cat.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
