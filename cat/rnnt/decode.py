"""CAT's name for `python -m cat.decode` (`cat/decode.py`), for RNN-T experiments."""

import sys

from cat.decoding.inference import main

if __name__ == "__main__":
    sys.exit(main("cat.rnnt.decode"))
