"""Former name of `cat.migrate` (`python -m cat.utils.migrate`), re-exported."""

from cat.migrate.experiment import *  # noqa: F403
from cat.migrate.experiment import cli

if __name__ == "__main__":
    cli()
