"""refit: shard-to-shard weight sync from a training fleet to inference engines."""

from refit.comm import StatelessProcessGroup
from refit.errors import LayoutError, PlanError, RefitError, TransportError
from refit.layout import DTensorRef, Replicate, Shard, StridedShard, shard_region, shard_slices
from refit.xfer import xferdtensor, xferdtensor_golden

__version__ = "0.1.0"

__all__ = [
    "DTensorRef",
    "LayoutError",
    "PlanError",
    "RefitError",
    "Replicate",
    "Shard",
    "StatelessProcessGroup",
    "StridedShard",
    "TransportError",
    "shard_region",
    "shard_slices",
    "xferdtensor",
    "xferdtensor_golden",
]
