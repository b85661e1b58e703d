"""The metadata engines by name, as the cluster file and ``--engine`` name them.

A server opens its engine here (``open_engine``) and knows it only through the interface of
metadata/engine.py; a new engine is one module and one entry in ``ENGINES``. The etcd engine's
module is imported only when it is asked for: it brings httpx, whose import a server on
SQLite, started by every test cluster, would pay for nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from metadata import sqlite_engine
from metadata.engine import Engine, EngineSettings, ShardPlan
from metadata.sqlite_engine import SqliteEngine
from tectonic_py.core.errors import ConfigError


def _etcd_engine(plan: ShardPlan, settings: Any) -> Engine:
    from metadata.etcd_shards import EtcdShards

    return EtcdShards(plan, settings)


def _etcd_settings(args: argparse.Namespace) -> EngineSettings:
    from metadata.etcd_shards import settings_from_args as etcd_settings

    return etcd_settings(args)


# name -> the engine's class, made from the server's plan and the engine's own settings
ENGINES: dict[str, Callable[[ShardPlan, Any], Engine]] = {
    "sqlite": SqliteEngine,
    "etcd": _etcd_engine,
}
# name -> its settings from ``tectonic metadata``'s flags (ConfigError for a missing one)
FLAGS: dict[str, Callable[[argparse.Namespace], EngineSettings]] = {
    "sqlite": sqlite_engine.settings_from_args,
    "etcd": _etcd_settings,
}


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    """The settings of the engine ``--engine`` names."""
    make = FLAGS.get(args.engine)
    if make is None:
        raise ConfigError(f"metadata engine {args.engine!r} is not one of {sorted(FLAGS)}")
    return make(args)


def open_engine(settings: EngineSettings, plan: ShardPlan) -> Engine:
    """The engine ``settings`` name, for a server of ``plan``."""
    make = ENGINES.get(settings.name)
    if make is None:
        raise ConfigError(f"metadata engine {settings.name!r} is not one of {sorted(ENGINES)}")
    return make(plan, settings)
