"""The ``refit`` command line."""

from refit.cli.main import main

__all__ = ["main"]
