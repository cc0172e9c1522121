"""Re-runnable stage steps: a signature of a step's inputs, recorded next to its output.

A step writes `<output>.done` holding the signature of its inputs (their parameters, and
the size and modification time of its input files) once it succeeded; a re-run skips the
step while the signature is the same and redoes it when an input changed.

Usage:
    sig = signature("pack", frame_range, files=[scp, text])
    if not is_done(out, sig):
        write_pack(...)
        mark_done(out, sig)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cat.core.io import PathLike, atomic_write

DONE_SUFFIX = ".done"


def signature(*parts: Any, files: Sequence[PathLike] = ()) -> str:
    """A digest of `parts` and of the size and modification time of `files`."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for path in files:
        stat = os.stat(path)
        digest.update(f"{os.fspath(path)} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _done_path(output: PathLike) -> Path:
    output = Path(output)
    return output.with_name(output.name + DONE_SUFFIX)


def is_done(output: PathLike, sig: str) -> bool:
    """True when `output` exists and was made from inputs with signature `sig`."""
    done = _done_path(output)
    return Path(output).exists() and done.is_file() and done.read_text() == sig


def mark_done(output: PathLike, sig: str) -> None:
    """Record that `output` was made from inputs with signature `sig`."""
    with atomic_write(_done_path(output)) as f:
        f.write(sig)


