"""CAT's name for `python -m cat.train` (`cat/train.py`), for CTC and CTC-CRF experiments."""

import sys

from cat.core.commands import run_verb

if __name__ == "__main__":
    sys.exit(run_verb("cat.ctc.train"))
