"""What the stores share: the objects of several patterns, each object once.

Usage:
    urls = expand_each(["s3://b/a-*.tar", "s3://b/c-{0..3}.tar"], store._expand_one)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def expand_each(patterns: str | Sequence[str], expand_one: Callable[[str], list[str]]
                ) -> list[str]:
    """The URLs `expand_one` gives for each pattern, in order; an object two patterns
    both name is an error naming them (it would be trained twice per epoch)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    urls: list[str] = []
    origin: dict[str, str] = {}
    for pattern in patterns:
        for url in expand_one(pattern):
            if url in origin:
                raise ValueError(f"shard {url} is listed twice (patterns "
                                 f"{origin[url]!r} and {pattern!r})")
            origin[url] = pattern
            urls.append(url)
    return urls
