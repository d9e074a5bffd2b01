"""refit: shard-to-shard weight sync from a training fleet to inference engines."""

from refit import membership
from refit.comm.group import StatelessProcessGroup

# Ray stays out of this import: only refit.runtime.ray loads it, when Ray actors are handed in
from refit.control import (
    CollectiveWeightSynchronizer,
    RefitVerificationError,
    ReshardWeightSynchronizer,
    SyncResult,
    WeightSynchronizer,
)
from refit.errors import ConfigError, LayoutError, PlanError, RefitAborted, RefitError, TransportError
from refit.layout import DTensorRef, Replicate, Shard, StridedShard, shard_region, shard_slices
from refit.runtime.endpoint import TrainerEndpoint
from refit.runtime.engine_endpoint import EngineEndpoint
from refit.runtime.watchdog import RefitAbortWatchdog
from refit.transport.quantized import xferdtensor_fp8
from refit.transport.xfer import xferdtensor, xferdtensor_golden

__version__ = "0.1.0"

__all__ = [
    "CollectiveWeightSynchronizer",
    "ConfigError",
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
    "membership",
    "shard_region",
    "shard_slices",
    "xferdtensor",
    "xferdtensor_fp8",
    "xferdtensor_golden",
]
