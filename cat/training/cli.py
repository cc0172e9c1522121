"""The command line of the training entry points (`cat.ctc.train`, `cat.rnnt.train`).

`train(exp_dir, expected_bin)` runs stage 3 for one experiment in this process (one rank
of a torchrun job, or alone): it loads and checks `hyper-p.json` and `config.json`,
joins the process group, and runs the `Manager`.

The job holds the experiment's lock (`exp/<name>/train.lock`, `cat.training.lock`) from
before it touches its checkpoints and logs to its end: a second training of the same
experiment is refused, naming the first (host, pid, since when).

SIGTERM, SIGUSR1 and SIGINT save a checkpoint after the update in flight and end the
process with status 75 (`cat.training.preemption`), the lock released; `--resume`
continues exactly there.

Usage:
    python -m cat.ctc.train exp/ctc-v1 [--resume | --resume-restart-epoch |
                                        --resume-allow-config-change]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path

from cat.core import config as config_module
from cat.core.config import model_kind
from cat.core.io import setup_logging
from cat.core.process import die_with_parent
from cat.training.distributed import init_distributed, shutdown_distributed
from cat.training.lock import experiment_lock
from cat.training.manager import Manager
from cat.training.preemption import STOPPED_EXIT_STATUS, StopRequest, TrainingStopped

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- entry


MODEL_KINDS = {"cat.ctc.train": "ctc", "cat.rnnt.train": "rnnt"}
MODEL_NAMES = {"cat.ctc.train": "CTC", "cat.rnnt.train": "RNN-T"}


def train(exp_dir: str | os.PathLike, expected_bin: str, resume: bool = False,
          restart_epoch: bool = False, allow_config_change: bool = False) -> None:
    """Stage 3 for `exp_dir` (see the module docstring); call once per process."""
    experiment = config_module.load_experiment(exp_dir, expected_bin)
    kind = model_kind(experiment.config)
    kind = "ctc" if kind == "crf" else kind  # CTC-CRF trains with cat.ctc.train, as in CAT
    if MODEL_KINDS.get(expected_bin, kind) != kind:
        raise config_module.ConfigError(
            f"{Path(exp_dir) / config_module.CONFIG_NAME}: describes a {kind} model, but "
            f"{expected_bin} trains {MODEL_KINDS[expected_bin]} models")
    config_module.apply_env(experiment.hyper)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank started by torchrun: end with it
        die_with_parent(os.getppid())
    context = init_distributed(
        datetime.timedelta(seconds=experiment.options.dist_timeout_seconds))
    if not context.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        with experiment_lock(experiment.directory, context), StopRequest() as stop:
            manager = Manager(experiment, context, resume or restart_epoch or allow_config_change,
                              restart_epoch, allow_config_change, stop)
            try:
                manager.run()
            finally:
                manager.close()
    finally:
        shutdown_distributed()


def run_cli(train_bin: str, argv: list[str] | None = None) -> None:
    """Command line of the training entry points (`cat.ctc.train`, `cat.rnnt.train`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {train_bin}",
                                     description=f"Train a {MODEL_NAMES[train_bin]} model "
                                                 "from exp/<name>/hyper-p.json and config.json")
    parser.add_argument("exp_dir", help="experiment directory, e.g. exp/ctc-v1")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in exp_dir/check")
    parser.add_argument("--resume-restart-epoch", action="store_true",
                        help="continue from the latest checkpoint, but start its epoch again "
                             "from the beginning (when the data or its settings changed)")
    parser.add_argument("--resume-allow-config-change", action="store_true",
                        help="continue from the latest checkpoint although config.json or "
                             "the update settings of hyper-p.json (grad_accum, grad_norm, amp) "
                             "changed since it was written (the changes are logged)")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        train(args.exp_dir, train_bin, args.resume, args.resume_restart_epoch,
              args.resume_allow_config_change)
    except TrainingStopped as stopped:
        logger.warning("%s (exit status %d)", stopped, STOPPED_EXIT_STATUS)
        sys.exit(STOPPED_EXIT_STATUS)
