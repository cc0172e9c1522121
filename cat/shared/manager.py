"""The training manager, where users of CAT look for it: `Manager`, `train`, `run_cli`.

The training code itself lives in `cat.training`: `cat.training.manager` (the `Manager`:
the loop, the epoch's end under DDP, checkpoints and resume), `cat.training.train_data`
(map-style and streaming training data), `cat.training.cli` (stage 3's command line,
`python -m cat.ctc.train` / `cat.rnnt.train`). This module only re-exports the names
that recipes and scripts use.

Usage:
    from cat.shared.manager import train
    train("exp/ctc-v1", "cat.ctc.train")
"""

from cat.training.cli import run_cli, train
from cat.training.manager import Manager

__all__ = ["Manager", "run_cli", "train"]
