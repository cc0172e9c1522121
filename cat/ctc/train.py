"""CAT's name for `python -m cat.train` (`cat/train.py`), for CTC and CTC-CRF experiments."""

from collections.abc import Sequence

from cat.training.cli import run_cli


def main(argv: Sequence[str] | None = None) -> None:
    run_cli("cat.ctc.train", None if argv is None else list(argv))


if __name__ == "__main__":
    main()
