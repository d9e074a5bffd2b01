"""The ``refit`` command line: one subcommand per module, each with ``--help``.

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``, and
keeps its heavy imports inside ``run`` so that ``refit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "demo": ("refit.cli.demo", "train, refit engines every step, kill and re-admit one, and report"),
    "bench": ("refit.cli.bench", "measure a reshard against raw send/recv and the golden broadcast"),
    "plan": ("refit.cli.plan_report", "plan a refit for a model and layouts; per-rank load and simulated time"),
}


def _available() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            out[name] = (module, help_text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="refit", description="Shard-to-shard weight sync for RL post-training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module, help_text) in _available().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        modules[name] = mod
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
