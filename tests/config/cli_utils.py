"""Shared by the config tests: the engine flags on a bare parser, and the EngineConfig a command line gives."""

from __future__ import annotations

import argparse

from tandem.config import EngineConfig
from tandem.engine.args import add_engine_args, engine_config, engine_kwargs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    add_engine_args(p)
    return p


def from_cli(*argv: str) -> EngineConfig:
    return engine_config("m", **engine_kwargs(parser().parse_args(list(argv))))
