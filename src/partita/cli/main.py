"""`partita <command> ...`: the registry of subcommands."""

from __future__ import annotations

import argparse
import sys

from partita import settings
from partita.cli import export_command, plan_command, ray_command, run_command, slurm_command
from partita.errors import PartitaError

COMMANDS = [run_command, plan_command, slurm_command, ray_command, export_command]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="partita", description="Train unmodified PyTorch models across processes.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        # a bad PARTITA_* value fails here once, not in every rank of the job the command would start
        for warning in settings.check():
            print(f"partita {args.command}: warning: {warning}", file=sys.stderr)
        return int(args.func(args) or 0)
    except PartitaError as e:  # a problem the user can fix: the message, not a traceback
        print(f"partita {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
