"""CAT's name of `cat.scoring` (`python -m cat.utils.wer`), re-exported."""

from cat.scoring import *  # noqa: F403
from cat.scoring import main

if __name__ == "__main__":
    raise SystemExit(main())
