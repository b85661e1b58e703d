"""Sizes as people write them: ``4MiB``, ``1GiB``, ``512k``, ``1MB``, or plain bytes.

Every command that takes a size (chunk size, capacity, budgets, shard sizes, rates in bytes
per second) parses it here, so ``--capacity 2GiB`` means the same thing everywhere. A unit
without ``B`` or with ``iB`` is binary (``4M`` = ``4MiB`` = 4 * 2**20); ``MB``, ``GB`` and
``kB`` are decimal, because checkpoint sizes are quoted that way ("1 MB to 4 GB per GPU").
"""

from __future__ import annotations

import argparse
import re

from tectonic_py.core.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_UNITS = " kmgt"


def parse_size(text: str) -> int:
    """Bytes in ``text``: '4MiB' / '4M' -> 4 * 2**20, '1MB' -> 10**6, '123' -> 123.

    ConfigError (one line, with examples) for anything else, including negative sizes.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"bad size {text!r}: use e.g. 1048576, 512k, 4MiB, 1MB, 2GiB")
    number, unit, binary, b = float(m.group(1)), m.group(2).lower(), m.group(3), m.group(4)
    if binary and not unit:
        raise ConfigError(f"bad size {text!r}: 'i' needs a unit before it (KiB, MiB, GiB)")
    decimal = unit != "" and b != "" and not binary
    base = 1000 if decimal else 1024
    return int(number * base ** _UNITS.index(unit or " "))


def format_size(n: float) -> str:
    """The short binary form of ``n`` bytes: '512 B', '4.0 MiB', '1.5 GiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def size_arg(text: str) -> int:
    """argparse ``type=`` for sizes: a bad one is argparse's usage error (one line, exit 2).

    A string default (``default="16MiB"``) goes through here too, so help shows the unit.
    """
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: '10m' -> 600, '30s' or '30' -> 30, '1h', '2d', '500ms'.

    ConfigError (one line, with examples) for anything else, including negative ones."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ConfigError(f"bad duration {text!r}: use e.g. 30, 30s, 10m, 1h, 2d")
    return float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]


def duration_arg(text: str) -> float:
    """argparse ``type=`` for durations (a bad one is argparse's usage error)."""
    try:
        return parse_duration(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
