"""`partita <command> ...`: the registry of subcommands."""

from __future__ import annotations

import argparse
import sys

from partita.cli import run

COMMANDS = [run]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="partita", description="Train unmodified PyTorch models across processes.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
