"""Train several recipes' experiments one after the other in ONE distributed job.

Starting a torchrun job costs seconds; tests that need many small distributed runs (many
seeds, many shard layouts) train them all in one job and one process group. Each
experiment runs as `python -m cat.ctc.train <exp>` would run it from its recipe
directory (the same `Manager`), with a barrier between experiments.

Usage:
    torchrun --standalone --nproc-per-node 3 -m cat.testing.ddp_drill --exp exp/tiny \
        recipes/seed-0 recipes/seed-1
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from cat.core import config as config_module
from cat.core.io import setup_logging
from cat.training.distributed import init_distributed, shutdown_distributed
from cat.training.manager import Manager


def main(argv: Sequence[str] | None = None) -> None:
    """Train the experiment `--exp` of every recipe directory given, in order."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exp", required=True, help="experiment directory in each recipe")
    parser.add_argument("recipes", nargs="+", help="recipe directories")
    args = parser.parse_args(argv)
    setup_logging()
    context = init_distributed()
    try:
        for recipe in args.recipes:
            os.chdir(recipe)
            experiment = config_module.load_experiment(args.exp)
            config_module.apply_env(experiment.hyper)
            manager = Manager(experiment, context)
            try:
                manager.run()
            finally:
                manager.close()
            context.barrier()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
