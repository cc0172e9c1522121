"""CAT's name of `cat.decoding.avgmodel` (`python -m cat.utils.avgmodel`), re-exported."""

from cat.decoding.avgmodel import *  # noqa: F403
from cat.decoding.avgmodel import main

if __name__ == "__main__":
    raise SystemExit(main())
