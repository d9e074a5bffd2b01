"""Controller side of a refit: the weight synchronizers, and recovery from lost engines.

One control plane, two data paths. ``ReshardWeightSynchronizer`` moves every param shard
to shard along the per-rank plans of ``refit.plan.rank_plan``; ``CollectiveWeightSynchronizer``
broadcasts every source shard to every rank (the baseline every peer system uses). Both
share the lifecycle below, the membership arithmetic of ``refit.membership``, the
in-worker watchdog, the verification of what arrived, and the recovery.

    sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=60)
    sync.init_communicator()
    for step in ...:
        train_step()
        result = sync.sync_weights()  # moved, verified, engines told

A sync that fails because a worker aborted or died is settled (every rank is let finish
unwinding before anything is rebuilt), the dead generation shards are identified, the
communicator AND the plan are rebuilt over the survivors, and the transfer is retried;
a retry that loses more workers recovers again, each round over fewer shards, until the
sync's deadline (``refit_timeout_s`` from its start; see ``sync_weights``). A rank that
froze is alive and cannot be told apart from a slow one, so it is never excluded: the
sync then fails with ``NoAbsentShard`` instead of hanging. A worker that answered late
but answers now is named as such (``WorkersLate``), and a value in the rendezvous that no
rank of the build wrote fails the sync as ``RefitTampered``; neither excludes anyone, and
the next sync rebuilds.
"""

from refit.control.errors import (
    EveryShardLost,
    NoAbsentShard,
    RecoveryDeadlineExceeded,
    RefitRefused,
    RefitTampered,
    RefitVerificationError,
    RefitWorkerError,
    WorkersLate,
)
from refit.control.result import SyncEvent, SyncResult
from refit.control.synchronizer import (
    CollectiveWeightSynchronizer,
    ReshardWeightSynchronizer,
    WeightSynchronizer,
    as_worker,
)
from refit.control.verify import RankChecksums, verify_checksums
from refit.membership import NoSurvivingShards

__all__ = [
    "CollectiveWeightSynchronizer",
    "EveryShardLost",
    "NoAbsentShard",
    "RecoveryDeadlineExceeded",
    "RefitRefused",
    "RefitTampered",
    "NoSurvivingShards",
    "RefitVerificationError",
    "RefitWorkerError",
    "ReshardWeightSynchronizer",
    "SyncEvent",
    "SyncResult",
    "WeightSynchronizer",
    "WorkersLate",
    "as_worker",
    "RankChecksums",
    "verify_checksums",
]
