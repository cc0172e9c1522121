"""Former name of `cat.stages.driver` (`python -m cat.utils.stage_driver`), re-exported."""

from cat.stages.driver import *  # noqa: F403
from cat.stages.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
