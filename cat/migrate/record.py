"""The record of a CAT v3 migration: what happened to each key of CAT's two files
(`cat.migrate`, which writes it as `migration.txt`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class Entry:
    """One line of the report: what happened to `key` of `file`."""

    status: str  # mapped | dropped | not mapped | pending
    file: str
    key: str
    detail: str


STATUS_ORDER = ("not mapped", "pending", "dropped", "mapped")


class Recorder:
    """The entries of a migration, in the order the keys were read."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def add(self, status: str, file: str, key: str, detail: str) -> None:
        self.entries.append(Entry(status, file, key, detail))

    def respell(self, start: int, prefix: str, spellings: dict[str, str]) -> None:
        """Show the keys recorded since entry `start` under `prefix` as CAT's file spells them."""
        for index in range(start, len(self.entries)):
            entry = self.entries[index]
            if entry.key.startswith(prefix):
                name, dot, rest = entry.key[len(prefix):].partition(".")
                key = prefix + spellings.get(name, name) + dot + rest
                self.entries[index] = dataclasses.replace(entry, key=key)

    def rest(self, file: str, prefix: str, section: dict[str, Any], why: str) -> None:
        """Name every key left in `section` as not mapped."""
        for key, value in section.items():
            self.add("not mapped", file, f"{prefix}{key}", f"{json.dumps(value)}: {why}")


def option_key(key: str) -> str:
    """`key` with '_' for '-': CAT's argparse accepts both spellings of an option."""
    return key.replace("-", "_")
