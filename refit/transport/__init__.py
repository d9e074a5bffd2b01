"""Executors that move a rank's plan over a communicator, and the single-tensor entry points.

One contract (``Executor``: prepare, run, close), one factory (``make_executor``), one
executor per file; see docs/architecture.md.
"""

from refit.transport.base import Executor, TransferStats
from refit.transport.factory import make_executor

__all__ = ["Executor", "TransferStats", "make_executor"]
