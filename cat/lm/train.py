"""Train an n-gram language model experiment: `exp/<name>/lm.json` -> `exp/<name>/lm.arpa`.

`lm.json` (schema `cat/lm/schemas/lm.schema.json`) names the unit (`char`, `word`,
`tokenizer`), the order and the training text; an interpolated modified Kneser-Ney model
is estimated and written as ARPA, by kenlm's `lmplz` (`cat.lm.lmplz`: sorts on disk within
lm.json's `memory`, so text of any size fits) or by `cat.lm.ngram` (in memory, about 200
bytes per n-gram); `estimator` chooses (`lmplz`: built on demand; `ngram`; `auto`). Both
give the same model (`cat.lm.lmplz` says where they differ).

`auto` uses lmplz when it is built. When it is not, the in-memory estimator's memory is
estimated from the text before anything is estimated: at most `order` n-grams per
character of the text and per sentence end (every unit's token spans a character at
least), 200 bytes each, i.e. an upper estimate (2 to 2.5 distinct n-grams per character
were measured on char 5-grams). Within lm.json's `ngram_memory_limit` (default 50 % of
the memory available at the start: the machine's, within the process's cgroup and
address-space limits) the text is estimated in memory; past it, lmplz is built on demand
(`bash tools/build_kenlm_binary.sh lmplz`), and where that fails (no Boost) training stops
with an `EstimatorError` naming the text's size, the estimated memory, the limit and what
to do, instead of a MemoryError after minutes of work.
`exp/<name>/train.json` records the estimator, the n-gram counts, the discounts, the time
taken, and the perplexity of `eval_text` as kenlm scores it (sentence ends included,
out-of-vocabulary tokens counted as `<unk>`).

The decoders load the model with `kenlm.Model`, which parses the ARPA file on every
load. For large models `"binary": "probing" | "trie"` also writes `exp/<name>/lm.bin`
with kenlm's `build_binary` (memory-mapped, loaded in milliseconds; trie is the smaller),
which the decoders then use. `build_binary` is not part of the `kenlm` Python package:
`bash tools/build_kenlm_binary.sh` compiles it from kenlm's source package into
`tools/bin/` (or set `KENLM_BUILD_BINARY`, or put it on `PATH`).

Usage:
    python -m cat.lm.train exp/lm-char-5gram
    python -m cat.lm.train exp/lm-word-3gram
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import re
import resource
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cat.core.config import ConfigError, check_against_schema, read_json
from cat.core.io import PathLike, atomic_write, setup_logging
from cat.lm import lmplz
from cat.lm.ngram import DiscountError, estimate, write_arpa
from cat.lm.text import iter_text, make_splitter

logger = logging.getLogger(__name__)

CONFIG_NAME = "lm.json"
ARPA_NAME = "lm.arpa"
BINARY_NAME = "lm.bin"
REPORT_NAME = "train.json"
SCHEMA_PATH = Path(__file__).with_name("schemas") / "lm.schema.json"
#: Bytes per n-gram of `cat.lm.ngram` (3.23 GB for 15.6 M n-grams, bench/lm_scale.py).
NGRAM_BYTES = 200
_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


class EstimatorError(RuntimeError):
    """No estimator can estimate the model within the machine's memory."""


def load_lm_config(lm_dir: PathLike) -> dict[str, Any]:
    """Read and validate `lm_dir/lm.json` (errors name the file and the key)."""
    path = Path(lm_dir) / CONFIG_NAME
    config = read_json(path)
    check_against_schema(config, read_json(SCHEMA_PATH), str(path))
    if not config.get("text") and not config.get("plain_text"):
        raise ConfigError(f"{path}: give training text in 'text' (Kaldi text files) or "
                          "'plain_text' (one sentence per line)")
    if (config["unit"] == "tokenizer") != ("tokenizer" in config):
        raise ConfigError(f"{path}: tokenizer: required with unit 'tokenizer' and only then")
    return config


def input_files(config: dict[str, Any]) -> list[Path]:
    """Every file the model is estimated from (for up-to-date checks)."""
    files = [*config.get("text", []), *config.get("plain_text", [])]
    if "tokenizer" in config:
        files.append(config["tokenizer"])
    return [Path(p) for p in files]


def model_file(lm_dir: PathLike, config: dict[str, Any]) -> Path:
    """The file the decoders load: `lm.bin` when `binary` is set, else `lm.arpa`."""
    return Path(lm_dir) / (BINARY_NAME if config.get("binary") else ARPA_NAME)


def find_build_binary() -> str:
    """kenlm's build_binary: $KENLM_BUILD_BINARY, on PATH, or in the checkout's tools/bin."""
    found = lmplz.find_program("build_binary")
    if found:
        return found
    raise FileNotFoundError("lm.json sets 'binary', but kenlm's build_binary was not found "
                            "(KENLM_BUILD_BINARY, PATH, tools/bin): run "
                            "bash tools/build_kenlm_binary.sh")


def write_binary(arpa: Path, out: Path, structure: str) -> None:
    """Convert `arpa` to a kenlm binary `out` (atomically) with build_binary."""
    tmp = out.with_name(out.name + ".tmp")
    command = [find_build_binary(), *(["trie"] if structure == "trie" else []), str(arpa),
               str(tmp)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(command)} failed: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)


def perplexity(arpa: PathLike, sentences: Sequence[list[str]]) -> dict[str, float]:
    """kenlm's perplexity of token lists (with `</s>`), and the out-of-vocabulary rate."""
    import kenlm

    model = kenlm.Model(str(arpa))
    total = 0.0
    tokens = oov = 0
    for sentence in sentences:
        text = " ".join(sentence)
        total += model.score(text, bos=True, eos=True)
        tokens += len(sentence) + 1
        oov += sum(1 for token in sentence if token not in model)
    return {"perplexity": 10 ** (-total / tokens) if tokens else math.nan,
            "tokens": tokens, "oov_rate": oov / tokens if tokens else 0.0}


@functools.cache
def schema_default(key: str) -> Any:
    """The default of an lm.json key, as the schema defines it."""
    return read_json(SCHEMA_PATH)["properties"][key]["default"]


@dataclasses.dataclass(frozen=True)
class TextSize:
    """The training text's size, read before estimating."""

    sentences: int
    characters: int

    def ngram_memory(self, order: int) -> int:
        """Upper estimate of `cat.lm.ngram`'s bytes for an `order`-gram model (module doc)."""
        return NGRAM_BYTES * order * (self.characters + self.sentences)


def text_size(config: dict[str, Any]) -> TextSize:
    """Sentences and characters of lm.json's training text (as `_sentences` reads it)."""
    sentences = characters = 0
    for text in itertools.chain(iter_text(config.get("text", [])),
                                iter_text(config.get("plain_text", []), kaldi=False)):
        sentences += 1
        characters += len(text)
    return TextSize(sentences, characters)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_headroom() -> int | None:
    """Bytes the process's memory cgroup (v2, else v1) still allows; None without a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    own = {kind: path for _, kind, path in (line.split(":", 2) for line in lines
                                             if line.count(":") >= 2)}
    root = Path("/sys/fs/cgroup")
    for folder, limit_name, usage_name in (
            (root / own.get("", "/").lstrip("/"), "memory.max", "memory.current"),
            (root, "memory.max", "memory.current"),
            (root / "memory" / own.get("memory", "/").lstrip("/"), "memory.limit_in_bytes",
             "memory.usage_in_bytes"),
            (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")):
        limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
        if limit is not None and usage is not None and limit < 2 ** 60:
            return max(limit - usage, 0)
    return None


def available_memory() -> int:
    """Bytes this process can still use: the machine's available memory (MemAvailable),
    within its memory cgroup's limit and its address-space limit (RLIMIT_AS)."""
    meminfo = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            meminfo[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    candidates = [meminfo.get("MemAvailable")
                  or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                  _cgroup_headroom()]
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    if address_space != resource.RLIM_INFINITY:
        status = Path("/proc/self/status")
        used = re.search(r"^VmSize:\s+(\d+) kB", status.read_text() if status.exists() else "",
                         re.MULTILINE)
        candidates.append(max(address_space - (int(used[1]) * 1024 if used else 0), 0))
    return min(c for c in candidates if c is not None)


def memory_limit(setting: str) -> tuple[int, str]:
    """Bytes of an lm.json `ngram_memory_limit` ("8G", "512M", "50%" of the available
    memory), and how they were found."""
    number, unit = float(setting[:-1]), setting[-1]
    if unit != "%":
        return int(number * _UNITS[unit]), setting
    available = available_memory()
    return int(available * number / 100), f"{setting} of {_size(available)} available"


def _size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def choose_estimator(config: dict[str, Any], source: PathLike = CONFIG_NAME) -> str | None:
    """lmplz's path when lm.json (`source`) has it estimate the model, else None
    (`cat.lm.ngram`): `lmplz` (built on demand), `ngram`, or `auto` (module doc)."""
    estimator = config.get("estimator", schema_default("estimator"))
    program = None if estimator == "ngram" else lmplz.find_program("lmplz")
    if program is not None:
        return program
    if estimator == "lmplz":
        return lmplz.build_program("lmplz")
    size = text_size(config)
    need = size.ngram_memory(config["order"])
    limit, how = memory_limit(config.get("ngram_memory_limit",
                                         schema_default("ngram_memory_limit")))
    what = (f"the training text ({size.characters} characters in {size.sentences} "
            f"sentences) needs about {_size(need)} to estimate a {config['order']}-gram "
            f"model in memory (cat.lm.ngram: up to {config['order']} n-grams per character "
            f"and sentence end, {NGRAM_BYTES} bytes each)")
    bound = f"ngram_memory_limit {_size(limit)} ({how})"
    if need <= limit:
        logger.info("%s: %s, within %s: estimating in memory", source, what, bound)
        return None
    if estimator == "ngram":
        logger.warning("%s: %s, more than %s: estimating in memory all the same, as "
                       "estimator 'ngram' asks", source, what, bound)
        return None
    return _build_lmplz_for(source, f"{what}, more than {bound}")


def _build_lmplz_for(source: PathLike, why: str) -> str:
    """Build lmplz for text too large to estimate in memory, or say what to do."""
    logger.info("%s: %s: building kenlm's lmplz, which estimates within lm.json's 'memory' "
                "(bash %s lmplz)", source, why, lmplz.BUILD_SCRIPT)
    try:
        return lmplz.build_program("lmplz")
    except (RuntimeError, OSError) as error:
        raise EstimatorError(
            f"{source}: {why}; kenlm's lmplz, which estimates on disk within lm.json's "
            f"'memory', is not built and could not be built ({error}). Install what the "
            "build needs (Boost: apt-get install libboost-program-options-dev "
            "libboost-thread-dev libboost-system-dev) and run bash "
            "tools/build_kenlm_binary.sh lmplz, or train on a machine with the memory "
            "(raise ngram_memory_limit, or set estimator 'ngram' to estimate in memory "
            "anyway)") from None


def train(lm_dir: PathLike) -> Path:
    """Estimate the model of `lm_dir/lm.json`; returns the ARPA path."""
    lm_dir = Path(lm_dir)
    config = load_lm_config(lm_dir)
    for path in input_files(config):
        if not path.is_file():
            raise FileNotFoundError(f"{lm_dir / CONFIG_NAME}: {path} does not exist")
    split = make_splitter(config["unit"], config.get("tokenizer"))
    program = choose_estimator(config, lm_dir / CONFIG_NAME)
    start = time.perf_counter()
    sentences = _sentences(config, split)
    first = next(sentences, None)
    if first is None:
        raise ValueError(f"{lm_dir / CONFIG_NAME}: the training text "
                         f"({', '.join(map(str, input_files(config)))}) holds no sentence")
    sentences = itertools.chain([first], sentences)
    arpa = lm_dir / ARPA_NAME
    fallback = config.get("discount_fallback")
    try:
        if program is None:
            report = _estimate_in_memory(list(sentences), config, arpa)
        else:
            memory = config.get("memory", schema_default("memory"))
            result = lmplz.estimate_arpa(program, sentences, config["order"], arpa, memory,
                                         fallback)
            report = {"estimator": "lmplz", "memory": memory, "sentences": result.sentences,
                      "tokens": result.tokens, "skipped_unk": result.skipped_unk,
                      "vocabulary": result.ngrams[0], "ngrams": result.ngrams,
                      "discounts": [list(d) for d in result.discounts]}
            if result.skipped_unk:
                logger.warning("%s: lmplz read %d <unk> tokens of the text as whitespace",
                               lm_dir / CONFIG_NAME, result.skipped_unk)
    except DiscountError as error:
        raise DiscountError(f"{lm_dir / CONFIG_NAME}: {error}") from None
    if config.get("binary"):
        write_binary(arpa, lm_dir / BINARY_NAME, config["binary"])
    seconds = time.perf_counter() - start
    report = {"unit": config["unit"], "order": config["order"], **report,
              "seconds": round(seconds, 2), "arpa_bytes": arpa.stat().st_size, "eval": {}}
    if config.get("binary"):
        report["binary_bytes"] = (lm_dir / BINARY_NAME).stat().st_size
    for path in config.get("eval_text", []):
        report["eval"][path] = perplexity(model_file(lm_dir, config),
                                          [split(t) for t in iter_text([path])])
    with atomic_write(lm_dir / REPORT_NAME) as f:
        json.dump(report, f, ensure_ascii=False, indent=1)
        f.write("\n")
    logger.info("%s: %d-gram %s model of %d sentences by %s, n-grams %s, in %.1f s; "
                "perplexity %s", arpa, config["order"], config["unit"], report["sentences"],
                report["estimator"], report["ngrams"], seconds,
                ", ".join(f"{k} {v['perplexity']:.2f}" for k, v in report["eval"].items())
                or "(no eval_text)")
    return arpa


def _sentences(config: dict[str, Any], split) -> Iterator[list[str]]:
    """The training text's sentences as tokens (Kaldi `text`, then `plain_text`)."""
    for text in iter_text(config.get("text", [])):
        yield split(text)
    for text in iter_text(config.get("plain_text", []), kaldi=False):
        yield split(text)


def _estimate_in_memory(sentences: list[list[str]], config: dict[str, Any],
                        arpa: Path) -> dict[str, Any]:
    """`cat.lm.ngram`'s model of `sentences` into `arpa`; the report's counts."""
    fallback = config.get("discount_fallback")
    model = estimate(sentences, config["order"], tuple(fallback) if fallback else None)
    write_arpa(model, arpa)
    return {"estimator": "ngram", "sentences": len(sentences),
            "tokens": sum(len(s) for s in sentences), "vocabulary": len(model.vocab),
            "ngrams": [len(g) for g in model.grams],
            "discounts": [list(d) for d in model.discounts]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cat.lm.train",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("lm_dir", help="language-model experiment dir holding lm.json")
    args = parser.parse_args(argv)
    setup_logging()
    train(args.lm_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
