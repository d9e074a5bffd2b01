"""The ``refit`` command line: one subcommand per module, each with ``--help``.

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``, and
keeps its heavy imports inside ``run`` so that ``refit --help`` stays fast.

Bad input is answered in one line on stderr, ``refit <command>: <what, naming the flag,
file or key>``, with exit code 2: argparse's own errors, and every ``RefitError`` a
subcommand raises (``ConfigError`` for flags and configs that make no sense together).
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "demo": ("refit.cli.demo", "train, refit engines every step, kill and re-admit one, and report"),
    "bench": ("refit.cli.bench", "measure a reshard against raw send/recv and the golden broadcast"),
    "plan": ("refit.cli.plan_report", "plan a refit for a model and layouts; per-rank load and simulated time"),
    "clean-ipc": ("refit.cli.clean_ipc", "remove the /dev/shm segments of IPC ranks whose process is gone"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in refit's one-line form (the usage is one ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _available() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            out[name] = (module, help_text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="refit", description="Shard-to-shard weight sync for RL post-training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules, parsers = {}, {}
    for name, (module, help_text) in _available().items():
        p = parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        modules[name] = mod
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}" if unknown
                     else f"give a command: {', '.join(modules)}")
    if unknown:  # said by the subcommand's parser, so that the line names the command
        parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return _run(args.command, modules[args.command], args)


def _run(command: str, module, args) -> int:
    from refit.errors import RefitError

    try:
        return int(module.run(args) or 0)
    except RefitError as e:
        print(f"refit {command}: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
