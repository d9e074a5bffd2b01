"""One build sequence: every rank connects, the rosters are merged, every rank prepares its plan.

Two drivers run it. The controller (``refit.control``) sends each step to its workers and
gathers the replies; the vLLM weight-transfer engine has no controller, so each rank runs
its own step and the ranks swap their rosters over the communicator they just joined.
Both go through ``connect_and_prepare``: the merge of the rosters and what a rank's plan
is built with exist once, because two copies of that arithmetic is how a communicator and
a plan come to disagree, silently (a plan for another world still runs, into the wrong
slices).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from refit.errors import RefitError
from refit.plan import DEFAULT_BUCKET_BYTES, ParamIndex, merge_rosters
from refit.runtime.protocol import Connect, EndpointCall, Prepare, Prepared
from refit.runtime.shards import ConnectSpec
from refit.transport.factory import COMMUNICATOR, TransportChoice

__all__ = ["PlanOptions", "RunStep", "connect_and_prepare"]

#: run one step: each rank's call (by rank) and the step's phase -> the replies the driver sees, by rank
RunStep = Callable[[Mapping[int, EndpointCall], str], dict[int, object]]


@dataclass(frozen=True)
class PlanOptions:
    """What every rank's plan is built with, besides the merged rosters."""

    mode: str = "reshard"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    transport: TransportChoice = COMMUNICATOR  # the communicator, unless the controller chose otherwise


def connect_and_prepare(run: RunStep, specs: Mapping[int, ConnectSpec], options: PlanOptions, *,
                        labels: Mapping[int, str] | None = None,
                        check_index: Callable[[ParamIndex], None] | None = None,
                        share: Callable[[ParamIndex], object] | None = None) -> dict[int, Prepared]:
    """Connect the ranks of ``specs``, merge every rank's roster, prepare each rank's plan;
    returns what each rank the driver sees prepared.

    ``run`` must return every rank's roster for the connect step (a peer gathers them over
    its communicator); for the prepare step, the replies of the ranks it ran. ``labels``
    name the ranks in a merge error; ``check_index`` refuses an index before any rank plans
    over it; ``share`` puts the index where every rank fetches it once (Ray's object store).
    """
    first = next(iter(specs.values()))
    world_size, epoch = first.world_size, first.epoch
    rosters = run({rank: Connect(spec) for rank, spec in specs.items()}, "connect")
    try:
        index = merge_rosters(rosters, world_size)
    except RefitError as e:
        if not labels:
            raise
        legend = ", ".join(f"{rank}={label}" for rank, label in sorted(labels.items()))
        raise type(e)(f"{e} [ranks: {legend}]") from None
    if check_index is not None:
        check_index(index)
    shared = index if share is None else share(index)
    prepare = Prepare(shared, epoch=epoch, mode=options.mode, bucket_bytes=options.bucket_bytes,
                      transport=options.transport)
    return dict(run({rank: prepare for rank in specs}, "prepare"))
