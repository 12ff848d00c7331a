"""What the serving command lines share: defaults, the user error, the parser that raises it, address checks.

`workers/cli.py` (worker, gateway, llm) and `workers/launcher.py` (`llm up`, which starts the
others as processes) both read these; keeping them here lets the command lines import the
launcher and never the other way round.
"""
from __future__ import annotations

import argparse

DEFAULT_BLOCK_TOKENS = 64
DEFAULT_STORE = "127.0.0.1:6380"
DEFAULT_GATEWAY_PORT = 8000


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


class CommandLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageError (one line, exit 2) instead of its own exit."""

    def error(self, message: str) -> None:
        raise UsageError(message)


def address(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{flag} must be HOST:PORT, got '{text}'")
    return host, int(port)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return int(text)
