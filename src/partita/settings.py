"""The PARTITA_* environment variables: every one partita reads is read and checked here, nowhere else.

A value partita cannot use is a SettingsError that names the variable, the value, what it takes and an example,
never a default taken in its place. `check()` reads them all: `partita.init()` calls it first, so a bad value stops
every rank at start, before any collective, with the same message; the `partita` command calls it before any
subcommand. An empty value is an error too (unset the variable for the default): `PARTITA_CACHE_DIR=` would
otherwise mean the current directory, and `PARTITA_MEMORY_LIMIT=` no limit.

This module imports neither torch nor the rest of partita, so that the planner side can read settings.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Callable, Literal

from partita.errors import SettingsError

ProfileMode = Literal["measure", "estimate"]

DEFAULT_TIMEOUT_S = 300.0
# a timedelta (what torch's process groups take) holds at most about 8.6e13 s; no job waits 30 years for a peer
MAX_TIMEOUT_S = 1e9
PREFIX = "PARTITA_"

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}
_SIZE_UNITS = "KiB, MiB, GiB, TiB; KB, MB, GB, TB count in 1024s too"


def parse_bytes(text: str) -> int:
    """'512MiB', '40GB', '1e9' -> bytes (binary units either way). ValueError for text that is no size.

    >>> parse_bytes("512MiB"), parse_bytes("1.5 GB"), parse_bytes("1e3")
    (536870912, 1610612736, 1000)
    """
    t = text.strip().lower().replace(" ", "")
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 512MiB or 40GB")
    try:
        return int(float(number) * _UNITS[unit])
    except (ValueError, OverflowError):  # no number, or nan / inf
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 512MiB or 40GB") from None


def _raw(name: str) -> str | None:
    """The variable's text, None when unset; an empty value is refused (see the module's docstring)."""
    value = os.environ.get(name)
    if value is not None and not value.strip():
        takes, example = _ALLOWED[name]
        raise SettingsError(f"{name} is set but empty: unset it for the default, or set it to {takes}, for example "
                            f"{name}={example}")
    return value


def _invalid(name: str, value: str) -> SettingsError:
    takes, example = _ALLOWED[name]
    return SettingsError(f"{name}={value!r} is not valid: {name} takes {takes}, for example {name}={example}")


def memory_limit() -> int | None:
    """PARTITA_MEMORY_LIMIT in bytes: plan as if each rank had at most this much memory. None when unset."""
    text = _raw("PARTITA_MEMORY_LIMIT")
    if text is None:
        return None
    try:
        limit = parse_bytes(text)
    except ValueError:
        raise _invalid("PARTITA_MEMORY_LIMIT", text) from None
    if limit <= 0:
        raise _invalid("PARTITA_MEMORY_LIMIT", text)
    return limit


def profile_mode() -> ProfileMode:
    """PARTITA_PROFILE: 'measure' each block on the job's devices (the default), or 'estimate' from the device
    preset (faster, less exact)."""
    text = _raw("PARTITA_PROFILE")
    if text is None:
        return "measure"
    mode = text.strip().lower()
    if mode == "measure":
        return "measure"
    if mode == "estimate":
        return "estimate"
    raise _invalid("PARTITA_PROFILE", text)


def timeout_s() -> float:
    """PARTITA_TIMEOUT_S: how long a rank waits for the others (joining, and in each collective), in seconds."""
    text = _raw("PARTITA_TIMEOUT_S")
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        raise _invalid("PARTITA_TIMEOUT_S", text) from None
    if not 0 < seconds <= MAX_TIMEOUT_S:  # also refuses nan
        raise _invalid("PARTITA_TIMEOUT_S", text)
    return seconds


def log_enabled() -> bool:
    """PARTITA_LOG: 'on' (the default) or 'off' for partita's INFO lines on rank 0."""
    return _switch("PARTITA_LOG")


def overlap_enabled() -> bool:
    """PARTITA_OVERLAP: 'on' (the default): a pipeline stage's replicas start summing its gradients during its
    last backward, bucket by bucket; 'off': after the pipeline, to measure what the overlap gains (the plan's
    estimates assume it on)."""
    return _switch("PARTITA_OVERLAP")


def switch_layout_enabled() -> bool:
    """PARTITA_SWITCH_LAYOUT: 'on' (the default): when the measured step shows another layout at least 10 % faster,
    the job moves to it, once (`planning.agreed_switch`); 'off': it keeps its layout and rank 0 names the faster one."""
    return _switch("PARTITA_SWITCH_LAYOUT")


def unverified_checkpoints_allowed() -> bool:
    """PARTITA_UNVERIFIED_CHECKPOINTS: 'off' (the default): a checkpoint whose manifest records no checksums is
    refused; 'on': it loads unverified (checkpoints of partita before it recorded them)."""
    return _switch("PARTITA_UNVERIFIED_CHECKPOINTS", default=False)


def _switch(name: str, default: bool = True) -> bool:
    """'on' or 'off'."""
    text = _raw(name)
    if text is None:
        return default
    switch = text.strip().lower()
    if switch not in ("on", "off"):
        raise _invalid(name, text)
    return switch == "on"


def cache_dir() -> Path:
    """PARTITA_CACHE_DIR: where measurements are cached (default ~/.cache/partita)."""
    text = _raw("PARTITA_CACHE_DIR")
    if text is None:
        return Path.home() / ".cache" / "partita"
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise _invalid("PARTITA_CACHE_DIR", text)
    return path


def _file(name: str) -> str | None:
    """A file's path that is not a directory (a directory would always "exist" as a stop request, and could
    never be written as a resume note)."""
    text = _raw(name)
    if text is not None and os.path.isdir(text):
        raise _invalid(name, text)
    return text


def stop_file() -> str | None:
    """PARTITA_STOP_FILE: a file whose appearance asks `partita.elastic` to save and stop at the next step."""
    return _file("PARTITA_STOP_FILE")


def resume_file() -> str | None:
    """PARTITA_RESUME_FILE: where rank 0 notes the checkpoint it saved before stopping to be resumed."""
    return _file("PARTITA_RESUME_FILE")


# what each variable takes and an example value, for its error message; and the function that reads it
_ALLOWED: dict[str, tuple[str, str]] = {
    "PARTITA_MEMORY_LIMIT": (f"a memory size above 0, in bytes or with a unit ({_SIZE_UNITS})", "512MiB"),
    "PARTITA_PROFILE": ("'measure' (the default) or 'estimate'", "estimate"),
    "PARTITA_TIMEOUT_S": ("a number of seconds above 0 and at most 1e9", "600"),
    "PARTITA_LOG": ("'on' (the default) or 'off'", "off"),
    "PARTITA_OVERLAP": ("'on' (the default) or 'off'", "off"),
    "PARTITA_SWITCH_LAYOUT": ("'on' (the default) or 'off'", "off"),
    "PARTITA_CACHE_DIR": ("a directory, or a path where one can be created", "/tmp/partita-cache"),
    "PARTITA_STOP_FILE": ("the path of a file (not a directory)", "/tmp/job.stop"),
    "PARTITA_RESUME_FILE": ("the path of a file (not a directory)", "/tmp/job.resume"),
    "PARTITA_UNVERIFIED_CHECKPOINTS": ("'off' (the default) or 'on'", "on"),
}
READERS: dict[str, Callable[[], object]] = {
    "PARTITA_MEMORY_LIMIT": memory_limit, "PARTITA_PROFILE": profile_mode, "PARTITA_TIMEOUT_S": timeout_s,
    "PARTITA_LOG": log_enabled, "PARTITA_CACHE_DIR": cache_dir, "PARTITA_STOP_FILE": stop_file,
    "PARTITA_RESUME_FILE": resume_file, "PARTITA_OVERLAP": overlap_enabled,
    "PARTITA_SWITCH_LAYOUT": switch_layout_enabled, "PARTITA_UNVERIFIED_CHECKPOINTS": unverified_checkpoints_allowed,
}


def check() -> list[str]:
    """Read every setting: raise one SettingsError naming each bad value. Return a warning for each PARTITA_*
    variable in the environment that partita does not read (a typo would otherwise go unnoticed)."""
    problems = []
    for read in READERS.values():
        try:
            read()
        except SettingsError as e:
            problems.append(str(e))
    if problems:
        raise SettingsError("\n".join(problems))
    return [_unknown(name) for name in sorted(os.environ) if name.startswith(PREFIX) and name not in READERS]


def _unknown(name: str) -> str:
    # matched without the prefix that every name shares, which would make any two names look alike
    close = difflib.get_close_matches(name[len(PREFIX):], [known[len(PREFIX):] for known in READERS], n=1,
                                      cutoff=0.6)
    guess = f"did you mean {PREFIX}{close[0]}? " if close else ""
    return f"{name} is set, but partita reads no such setting: {guess}partita reads {', '.join(sorted(READERS))}"
