"""kenlm's programs for n-gram models: finding (or building) them, and estimating with lmplz.

`lmplz` (kenlm's estimator, lm/builder) sorts the n-grams on disk within a memory budget
(`-S`), so it estimates models of any text size in bounded memory, where
`cat.lm.ngram.estimate` holds every n-gram in memory (about 200 bytes each). Both
estimate the same interpolated modified Kneser-Ney model; `cat.lm.train` uses lmplz when
it is built and `cat.lm.ngram` otherwise (and as the oracle of the tests). lmplz is run
as the fallback's equal:

* tokens go to its standard input one sentence per line, space-separated, checked as the
  fallback checks them (`cat.lm.ngram.check_token`);
* no pruning, unigrams interpolated with the uniform distribution (its default), the
  same `--discount_fallback` or none (then undefined discounts are an error in both);
* `--skip_symbols`: a `<unk>` token in the text (a tokenizer's piece for unknown text) is
  read as whitespace by lmplz, which cannot model it, where the fallback counts it as the
  unknown word; the count of skipped `<unk>` tokens is reported.

The other differences: lmplz writes the never-predicted `<s>` with log10 p = 0 where the
fallback writes -99 (kenlm ignores both); and lmplz's count-of-counts (the discounts'
input) take, for each order below the highest, the last n-gram of its sort order with its
raw count instead of its adjusted count. On real text that n-gram's counts are both
usually 5 or more (outside the count-of-counts) and the models agree to 1e-6; on a dozen
sentences the discounts can differ, or one estimator fall back where the other does not.

kenlm's programs are not in the `kenlm` Python package: `bash tools/build_kenlm_binary.sh
[build_binary] [lmplz]` compiles them from kenlm's source package into `tools/bin/`.

Usage:
    program = find_program("lmplz") or build_program("lmplz")
    result = estimate_arpa(program, sentences, 5, "exp/lm/lm.arpa", memory="1G")
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from cat.core.io import PathLike
from cat.core.process import set_parent_death_signal
from cat.lm.ngram import UNK, DiscountError, check_token

logger = logging.getLogger(__name__)

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"
BUILD_SCRIPT = TOOLS_DIR / "build_kenlm_binary.sh"
#: Environment variables that name a program's path.
PROGRAM_ENV = {"build_binary": "KENLM_BUILD_BINARY", "lmplz": "KENLM_LMPLZ"}
_STATISTICS = re.compile(r"^(\d+) (\d+)(?:/\d+)? D1=(\S+) D2=(\S+) D3\+=(\S+)$")


def find_program(name: str) -> str | None:
    """kenlm's `name` (build_binary, lmplz): `$KENLM_<NAME>`, on PATH, or in the checkout's
    tools/bin; None when none is executable."""
    candidates = [os.environ.get(PROGRAM_ENV[name]), shutil.which(name),
                  str(TOOLS_DIR / "bin" / name)]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def build_program(name: str) -> str:
    """Compile kenlm's `name` into tools/bin (minutes) and return its path."""
    logger.info("building kenlm's %s (bash %s %s)", name, BUILD_SCRIPT, name)
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), name], capture_output=True, text=True,
                          check=False, preexec_fn=set_parent_death_signal)
    found = find_program(name)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"bash {BUILD_SCRIPT} {name} failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    return found


@dataclasses.dataclass
class LmplzResult:
    """What an lmplz run estimated: per order the n-gram count and (D1, D2, D3+)."""

    sentences: int
    tokens: int
    ngrams: list[int]
    discounts: list[tuple[float, float, float]]
    skipped_unk: int


def estimate_arpa(program: str, sentences: Iterable[Sequence[str]], order: int,
                  arpa: PathLike, memory: str,
                  discount_fallback: Sequence[float] | None = None) -> LmplzResult:
    """Estimate `order`-gram model of token lists with lmplz into `arpa` (atomically).

    `memory` is lmplz's `-S` (e.g. "1G", "20%"); its sorted runs go to a temporary folder
    beside `arpa`. Undefined discounts without `discount_fallback` raise DiscountError.
    """
    arpa = Path(arpa)
    tmp_arpa = arpa.with_name(f".{arpa.name}.tmp.{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix=".lmplz-", dir=arpa.parent) as scratch:
        command = [program, "-o", str(order), "-S", memory, "-T", f"{scratch}/",
                   "--skip_symbols", "--arpa", str(tmp_arpa)]
        if discount_fallback is not None:
            command += ["--discount_fallback", *(f"{d:g}" for d in discount_fallback)]
        log_path = Path(scratch) / "lmplz.log"
        with open(log_path, "w+b") as log:
            try:
                counts = _run(command, sentences, log)
            except BaseException:
                tmp_arpa.unlink(missing_ok=True)
                raise
            log.seek(0)
            stderr = log.read().decode("utf-8", "replace")
        if counts[0] != 0:
            tmp_arpa.unlink(missing_ok=True)
            tail = stderr.strip()[-2000:]
            if "--discount_fallback" in stderr:  # lmplz's advice on undefined discounts
                order_of = re.search(r"(\d+)-grams? ", stderr)
                said = " ".join(line.strip() for line in stderr.splitlines()
                                if "discount" in line and "throw" not in line)
                raise DiscountError(f"{order_of[1] if order_of else '?'}-grams: the modified "
                                    f"Kneser-Ney discounts are undefined (lmplz: {said}); the "
                                    "corpus is too small or artificial: use more text or set "
                                    "discount_fallback")
            raise RuntimeError(f"{' '.join(command)} failed (exit {counts[0]}): {tail}")
    os.replace(tmp_arpa, arpa)
    ngrams, discounts = _statistics(stderr, order)
    return LmplzResult(counts[1], counts[2], ngrams, discounts, counts[3])


def _run(command: list[str], sentences: Iterable[Sequence[str]], log) -> list[int]:
    """Feed the sentences to lmplz; [exit status, sentences, tokens, <unk> tokens]."""
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=log, preexec_fn=set_parent_death_signal)
    number = tokens = skipped = 0
    try:
        assert proc.stdin is not None
        for number, sentence in enumerate(sentences, 1):
            for token in sentence:
                check_token(token, number)
            skipped += sum(1 for token in sentence if token == UNK)
            tokens += len(sentence)
            proc.stdin.write((" ".join(sentence) + "\n").encode("utf-8"))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # lmplz stopped reading: its exit status and log say why
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    status = proc.wait()
    return [status, number, tokens - skipped, skipped]


def _statistics(stderr: str, order: int) -> tuple[list[int], list[tuple[float, float, float]]]:
    """N-gram counts and discounts per order from lmplz's `Statistics:` lines."""
    rows = {}
    for line in stderr.splitlines():
        match = _STATISTICS.match(line.strip())
        if match:
            rows[int(match[1])] = (int(match[2]),
                                   (float(match[3]), float(match[4]), float(match[5])))
    if sorted(rows) != list(range(1, order + 1)):
        raise RuntimeError(f"lmplz printed no statistics for orders 1-{order}: "
                           f"{stderr.strip()[-2000:]}")
    return [rows[n][0] for n in sorted(rows)], [rows[n][1] for n in sorted(rows)]
