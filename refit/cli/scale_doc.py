"""Keep the figures of docs/scale.md printed by ``refit plan`` itself, so they cannot drift.

Each figure block of the page is what ``refit plan ARGS --markdown`` prints, between two
markers that carry the arguments::

    <!-- refit plan --model llama3-8b --layers 4 ... -->
    | plan | simulated refit | ... |        (the plan figures: pure functions of the layouts)

    | roster groups ... | merge | ... |     (timings: this machine, this run)
    <!-- end refit plan -->

``python -m refit.cli.scale_doc docs/scale.md`` runs every block again and rewrites it
(minutes for the 1T-parameter models). ``--check`` runs only the blocks of at most
``--max-ranks`` ranks and fails when their plan figures differ from the page: the test
suite does that on the page's small model, so a change to the planner or the simulator
that moves a figure fails until the page is regenerated.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass

BEGIN = re.compile(r"^<!-- refit plan (?P<args>.*) -->$", re.M)
END = "<!-- end refit plan -->"


@dataclass(frozen=True)
class Block:
    """One generated block of the page: its arguments and where its body lies in the text."""

    args: tuple[str, ...]
    start: int  # first character of the body (after the opening marker's line)
    end: int  # the closing marker's first character

    def body(self, text: str) -> str:
        return text[self.start:self.end].strip("\n")


def blocks(text: str) -> list[Block]:
    out = []
    for m in BEGIN.finditer(text):
        start = m.end() + 1
        end = text.find(END, start)
        if end < 0:
            raise ValueError(f"<!-- refit plan {m['args']} --> has no {END}")
        out.append(Block(tuple(shlex.split(m["args"])), start, end))
    return out


def world_of(args: tuple[str, ...]) -> int:
    """The block's ranks (training plus engine), from its arguments and the plan defaults."""
    from refit.cli import plan_report

    p = argparse.ArgumentParser()
    plan_report.add_arguments(p)
    ns = p.parse_args(list(args))
    return ns.train_gpus + ns.engine_gpus


def render(args: tuple[str, ...]) -> str:
    """What ``refit plan ARGS --markdown`` prints."""
    from refit.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *args, "--markdown"])
    if code:
        raise RuntimeError(f"refit plan {' '.join(args)} exited with {code}")
    return out.getvalue().strip("\n")


def figures(body: str) -> str:
    """The plan figures of a block: its first table (the timings that follow vary by machine)."""
    return body.strip("\n").split("\n\n")[0]


def update(path: str, max_ranks: int | None = None) -> int:
    """Run the page's blocks again (those of at most ``max_ranks`` ranks) and rewrite them."""
    with open(path) as f:
        text = f.read()
    done = 0
    for b in reversed(blocks(text)):
        if max_ranks is not None and world_of(b.args) > max_ranks:
            continue
        text = text[:b.start] + render(b.args) + "\n" + text[b.end:]
        done += 1
    with open(path, "w") as f:
        f.write(text)
    return done


def check(path: str, max_ranks: int) -> list[str]:
    """The blocks of at most ``max_ranks`` ranks whose plan figures differ from a fresh run."""
    with open(path) as f:
        text = f.read()
    stale = []
    for b in blocks(text):
        if world_of(b.args) <= max_ranks and figures(b.body(text)) != figures(render(b.args)):
            stale.append(" ".join(b.args))
    return stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refit.cli.scale_doc", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="the page, e.g. docs/scale.md")
    p.add_argument("--check", action="store_true", help="compare instead of rewriting")
    p.add_argument("--max-ranks", type=int, default=None, help="only the blocks of at most this many ranks")
    a = p.parse_args(argv)
    if a.check:
        stale = check(a.path, a.max_ranks if a.max_ranks is not None else 1 << 30)
        for s in stale:
            print(f"stale figures: refit plan {s}", file=sys.stderr)
        return 1 if stale else 0
    print(f"{update(a.path, a.max_ranks)} block(s) regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
