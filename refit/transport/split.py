"""A plan moved by two transports at once: the pairs inside this node over IPC, the rest over the network.

``SplitExecutor`` cuts the plan by peer (``refit.plan.split_plan``) and runs the node's
pairs on ``near`` (an IPC executor) in a thread of its own while the calling thread runs
the other pairs on ``far`` (the communicator's executor, or NIXL's). Neither waits for the
other: the two parts share no bucket, and every rank runs both, so a part can only wait
for its own peers.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable

from refit.plan import RankPlan
from refit.transport.base import Corruption, Executor, TensorMap, TransferStats


class SplitExecutor(Executor):
    """``plan`` cut into the pairs with ``near_ranks`` (run by ``make_near``) and the rest (``make_far``)."""

    transport = "split"

    def __init__(self, plan: RankPlan, near_plan: RankPlan, far_plan: RankPlan,
                 make_near: Callable[[RankPlan], Executor], make_far: Callable[[RankPlan], Executor]):
        super().__init__(plan, None)
        self.near = make_near(near_plan)
        self.far = make_far(far_plan)
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="refit-near")
        self.last = {"near": TransferStats(), "far": TransferStats()}

    def _bind(self, src: TensorMap, dst: TensorMap) -> None:
        self.near.prepare(src, dst)
        self.far.prepare(src, dst)

    def _run(self, *, verify: bool, corrupt: Corruption | None) -> TransferStats:
        t0 = time.perf_counter()
        near = self._thread.submit(self.near.run, verify=verify, corrupt=corrupt)
        try:
            far = self.far.run(verify=verify, corrupt=corrupt)
        finally:
            # the near part ends on its own (its peers finish, or its deadline passes); its
            # error, if both failed, is the one that names a peer of this node
            got_near = near.result()
        self.last = {"near": got_near, "far": far}
        out = TransferStats()
        for s in (got_near, far):
            out.bytes_sent += s.bytes_sent
            out.bytes_received += s.bytes_received
            out.local_bytes += s.local_bytes
            out.buckets_sent += s.buckets_sent
            out.buckets_received += s.buckets_received
            out.zero_copy_buckets += s.zero_copy_buckets
            out.staging_capacity_bytes += s.staging_capacity_bytes
            out.peak_staging_bytes += s.peak_staging_bytes
            out.checksums_sent.update(s.checksums_sent)
            out.checksums_received.update(s.checksums_received)
        out.seconds = time.perf_counter() - t0
        return out

    def _release(self) -> None:
        self.near.close()
        self.far.close()
        self._thread.shutdown(wait=False)


__all__ = ["SplitExecutor"]
