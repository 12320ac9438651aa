"""One log format for the API process and the engine-core process (vLLM-like lines)."""

from __future__ import annotations

import logging
import os
import sys


class _Stderr(logging.StreamHandler):
    """A handler on whatever sys.stderr is when a record comes, not the one it was made with (a redirect, or a
    test's capture, may replace and close that one), as logging's own last-resort handler does."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging(level: int | str = logging.INFO, prefix: str | None = None) -> None:
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    tag = f"({prefix} pid={os.getpid()}) " if prefix else ""
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(f"{tag}%(levelname)s %(asctime)s [%(name)s] %(message)s",
                                           datefmt="%m-%d %H:%M:%S"))
    root = logging.getLogger("xlaserve")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
