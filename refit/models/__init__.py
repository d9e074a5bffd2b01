"""Model shapes and parallel layouts, for planning a refit without loading a model.

``refit.models.specs`` knows every tensor of a few reference models (and reads a Hugging
Face ``config.json`` for others); ``refit.models.parallel`` turns short layout strings such
as ``tp=8,pp=4,ep=8`` into the mesh and placements of every tensor on the training and the
engine side, and from there into the planner's ``ParamIndex``.
"""

from refit.models.parallel import (
    EngineParallel,
    TrainParallel,
    build_index,
    build_roster_groups,
    build_rosters,
    parse_engine,
    parse_train,
)
from refit.models.specs import DTYPES, MODELS, ModelSpec, ParamShape, dtype_name, get_model, load_hf_config

__all__ = [
    "DTYPES",
    "EngineParallel",
    "MODELS",
    "ModelSpec",
    "ParamShape",
    "TrainParallel",
    "build_index",
    "build_roster_groups",
    "build_rosters",
    "dtype_name",
    "get_model",
    "load_hf_config",
    "parse_engine",
    "parse_train",
]
