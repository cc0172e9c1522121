"""CAT's name for `python -m cat.decode` (`cat/decode.py`), for CTC and CTC-CRF experiments."""

import sys

from cat.core.commands import run_verb

if __name__ == "__main__":
    sys.exit(run_verb("cat.ctc.decode"))
