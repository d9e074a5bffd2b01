"""How a subcommand shows its result: one JSON object on stdout with ``--json``, else tables for a person."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any


def show(result: Any, as_json: bool, table: Callable[[Any], None], *, indent: int = 2) -> None:
    """``result`` as one JSON object on stdout with ``--json``, else ``table(result)``."""
    if as_json:
        print(json.dumps(result, indent=indent, default=str))
    else:
        table(result)


@contextlib.contextmanager
def stdout_to_stderr():
    """Send this process's stdout, and that of every process started meanwhile, to stderr.

    vLLM and its worker processes log to file descriptor 1; ``--json`` keeps stdout for the
    JSON alone.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_live(work: Callable[..., dict], as_json: bool, table: Callable[[dict], None], failed: str, *,
             quiet: Callable[[], contextlib.AbstractContextManager] = stdout_to_stderr,
             aside: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
             preface: str | None = None, file=None) -> dict | None:
    """``work()`` as a long command shows it; its result, or None when it raised a ``RefitError``.

    With ``--json`` it runs under ``quiet()`` (what the fleet prints goes to stderr) and the
    result follows as JSON; else ``preface`` is printed, ``work(progress=...)`` runs under a
    live status line it updates and under ``aside()`` (where what others print on stdout
    goes instead of the terminal), and ``table(result)`` follows. The error is printed as
    ``failed: <type>: <message>`` on ``file``.
    """
    from refit.errors import RefitError

    try:
        if as_json:
            with quiet():
                result = work()
        else:
            from rich.console import Console

            console = Console(file=sys.stdout, width=None if Console().is_terminal else 150)
            if preface:
                console.print(preface)
            with console.status("starting") as status, aside():
                result = work(progress=lambda text: status.update(text))
    except RefitError as e:
        print(f"{failed}: {type(e).__name__}: {e}", file=file)
        return None
    show(result, as_json, table)
    return result
