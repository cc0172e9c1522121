"""The command line of training: `python -m cat.train EXP` for every model, and CAT's
`cat.ctc.train` / `cat.rnnt.train` (aliases for their kinds, `cat.models.registry.ALIASES`).

`train(exp_dir, command)` runs stage 3 for one experiment in this process (one rank of a
torchrun job, or alone): it loads and checks `hyper-p.json` and `config.json` (the model
kind is `config.json`'s; `command` and `train.bin` must be able to train it), joins the
process group, and runs the `Manager`.

The job holds the experiment's lock (`exp/<name>/train.lock`, `cat.training.lock`) from
before it touches its checkpoints and logs to its end: a second training of the same
experiment is refused, naming the first (host, pid, since when).

SIGTERM, SIGUSR1 and SIGINT save a checkpoint after the update in flight and end the
process with status 75 (`cat.training.preemption`), the lock released; `--resume`
continues exactly there.

Usage:
    python -m cat.train exp/ctc-v1 [--resume | --resume-restart-epoch |
                                    --resume-allow-config-change]
    torchrun --nproc-per-node 2 -m cat.train exp/ctc-v1
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path

from cat.core import config as config_module
from cat.core.io import setup_logging
from cat.core.process import die_with_parent
from cat.models.registry import check_command
from cat.training.distributed import init_distributed, shutdown_distributed
from cat.training.lock import experiment_lock
from cat.training.manager import Manager
from cat.training.preemption import STOPPED_EXIT_STATUS, StopRequest, TrainingStopped

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- entry


def train(exp_dir: str | os.PathLike, command: str = "cat.train", resume: bool = False,
          restart_epoch: bool = False, allow_config_change: bool = False) -> None:
    """Stage 3 for `exp_dir` (see the module docstring); call once per process."""
    experiment = config_module.load_experiment(exp_dir)
    kind = experiment.kind
    check_command(command, kind, str(Path(exp_dir) / config_module.CONFIG_NAME))
    check_command(experiment.train_bin, kind,
                  f"{Path(exp_dir) / config_module.HYPER_NAME}: train.bin")
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


def run_cli(command: str, argv: list[str] | None = None) -> None:
    """Command line of `command`: `cat.train` or an alias (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=f"python -m {command}",
                                     description="Train the model of exp/<name>/config.json "
                                                 "with the settings of hyper-p.json")
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
        train(args.exp_dir, command, args.resume, args.resume_restart_epoch,
              args.resume_allow_config_change)
    except TrainingStopped as stopped:
        logger.warning("%s (exit status %d); resume with: python -m %s %s --resume", stopped,
                       STOPPED_EXIT_STATUS, command, args.exp_dir)
        sys.exit(STOPPED_EXIT_STATUS)
