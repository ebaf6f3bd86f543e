"""What partita logs, captured for tests."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def partita_log():
    """The messages partita logs while the block runs (at INFO and above), whatever handlers, level or disabling
    earlier tests left on its logger."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("partita")
    level, disabled = logger.level, logger.disabled
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # clears the loggers' cached levels, which assigning `level` would not
    logger.disabled = False
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
