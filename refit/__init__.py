"""refit: shard-to-shard weight sync from a training fleet to inference engines."""

from refit.comm.group import StatelessProcessGroup
from refit.errors import LayoutError, PlanError, RefitError, TransportError
from refit.layout import DTensorRef, Replicate, Shard, StridedShard, shard_region, shard_slices
from refit.transport.xfer import xferdtensor, xferdtensor_golden

# the control plane (issue 4); Ray stays out of this import, it is loaded by refit.runtime.ray only
from refit.control import (
    CollectiveWeightSynchronizer,
    RefitVerificationError,
    ReshardWeightSynchronizer,
    SyncResult,
    WeightSynchronizer,
)
from refit.runtime.watchdog import RefitAborted, RefitAbortWatchdog
from refit.runtime.endpoint import EngineEndpoint, TrainerEndpoint

__version__ = "0.1.0"

__all__ = [
    "CollectiveWeightSynchronizer",
    "DTensorRef",
    "EngineEndpoint",
    "LayoutError",
    "PlanError",
    "RefitAbortWatchdog",
    "RefitAborted",
    "RefitError",
    "RefitVerificationError",
    "Replicate",
    "ReshardWeightSynchronizer",
    "Shard",
    "StatelessProcessGroup",
    "StridedShard",
    "SyncResult",
    "TrainerEndpoint",
    "TransportError",
    "WeightSynchronizer",
    "shard_region",
    "shard_slices",
    "xferdtensor",
    "xferdtensor_golden",
]
