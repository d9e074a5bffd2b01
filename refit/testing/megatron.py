"""A trainer endpoint over one Megatron-core rank, for checks, demos and as a pattern to copy.

The layout work is ``refit.models.megatron.MegatronLayout`` (pure: names and views); this
endpoint only reads the rank's state when the synchronizer asks, so a refit always sees the
parameters the optimizer last wrote.
"""

from __future__ import annotations

from typing import Any

from refit.models.megatron import Entry, MegatronLayout
from refit.runtime.endpoint import TrainerEndpoint

__all__ = ["MegatronTrainerEndpoint"]


class MegatronTrainerEndpoint(TrainerEndpoint):
    """A ``TrainerEndpoint`` over one Megatron-core rank: its local state dict, exposed as canonical views.

    ``state`` is the rank's local state dict (e.g. the ``named_parameters`` of its model chunk)
    or a callable returning it, read at every build and transfer. ``rank`` is the trainer rank
    (the order of ``MegatronLayout``), which is also its rank in the refit meshes.
    """

    def __init__(self, layout: MegatronLayout, rank: int, state: Any):
        self.layout, self.rank, self.state = layout, rank, state

    def refit_sources(self) -> dict[str, Entry]:
        state = self.state() if callable(self.state) else self.state
        return self.layout.to_canonical(state, self.rank)
