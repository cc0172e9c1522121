"""CAT's name for `python -m cat.train` (`cat/train.py`), for RNN-T experiments."""

import sys

from cat.core.commands import run_verb

if __name__ == "__main__":
    sys.exit(run_verb("cat.rnnt.train"))
