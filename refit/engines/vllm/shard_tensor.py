"""A checkpoint tensor of which one worker holds only its shard, for vLLM's loaders to narrow.

vLLM's weight loaders take the full checkpoint tensor and narrow it to the worker's slice
(``loaded_weight.narrow(dim, tp_rank * size, size)``), in many loader variants. Handing them
a real full-size tensor would cost every worker the whole model in memory, or a full
transfer. ``CheckpointShard`` has the full shape and no storage: its ``narrow`` to this
worker's slice returns the received shard itself, and any other use of its data raises,
naming the tensor, so a loader that reads outside the shard fails loudly instead of
loading bytes that never arrived. The expert loader first gives a single expert's tensor a
leading expert dim and unbinds it again (``unsqueeze(0).unbind()``); both are served as
reshapes of the shard that keep it a ``CheckpointShard``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refit.errors import LayoutError

__all__ = ["CheckpointShard", "as_checkpoint_tensor"]

_NARROW = {torch.Tensor.narrow, torch.narrow}
_UNSQUEEZE = {torch.Tensor.unsqueeze, torch.unsqueeze}
_UNBIND = {torch.Tensor.unbind, torch.unbind}
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
             torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.layout.__get__,
             torch.Tensor.requires_grad.__get__, torch.Tensor.is_meta.__get__, torch.Tensor.stride,
             torch.Tensor.element_size, torch.Tensor.__format__, torch.Tensor.__repr__}


class CheckpointShard(torch.Tensor):
    """Full checkpoint shape, no storage; ``narrow`` to ``slices`` gives ``shard``."""

    @staticmethod
    def __new__(cls, shard: torch.Tensor, global_shape: Sequence[int], slices: Sequence[slice], name: str):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(global_shape), dtype=shard.dtype, device=shard.device)
        t.shard, t.slices, t.param_name = shard, tuple(slices), name
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"CheckpointShard({self.param_name}, shape={list(self.shape)}, slices={self.slices})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NARROW:
            return args[0]._narrow(*args[1:], **kwargs)
        if func in _UNSQUEEZE:
            return args[0]._unsqueeze(*args[1:], **kwargs)
        if func in _UNBIND:
            return args[0]._unbind(*args[1:], **kwargs)
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = next((a.param_name for a in args if isinstance(a, CheckpointShard)), "?")
        raise LayoutError(f"{name}: vLLM's loader used this checkpoint tensor for {getattr(func, '__name__', func)} "
                          "instead of narrowing it to this worker's shard; refit's vLLM backend cannot load it "
                          "this way (the other shards never arrived here)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise LayoutError(f"a loader read the data of a CheckpointShard ({func}); only narrow() to the shard is served")

    def _narrow(self, dim: int, start, length) -> torch.Tensor:
        dim = dim % self.dim()
        start, length = int(start), int(length)
        want = self.slices[dim]
        empty = length == 0 and want.stop == want.start  # an empty shard sits anywhere
        if ((start, start + length) == (want.start, want.stop) or empty) and all(
                s.start == 0 and s.stop == n for d, (s, n) in enumerate(zip(self.slices, self.shape)) if d != dim):
            return self.shard
        raise LayoutError(f"{self.param_name}: vLLM's loader asked for rows {start}:{start + length} of dim {dim}, "
                          f"but this worker received {[(s.start, s.stop) for s in self.slices]}; the engine's "
                          "layout and refit's disagree")

    def _unsqueeze(self, dim: int) -> CheckpointShard:
        dim = dim % (self.dim() + 1)
        shape = (*self.shape[:dim], 1, *self.shape[dim:])
        slices = (*self.slices[:dim], slice(0, 1), *self.slices[dim:])
        return CheckpointShard(self.shard.unsqueeze(dim), shape, slices, self.param_name)

    def _unbind(self, dim: int = 0) -> tuple[torch.Tensor, ...]:
        dim = dim % self.dim()
        n = self.shape[dim]
        if (self.slices[dim].start, self.slices[dim].stop) != (0, n):
            raise LayoutError(f"{self.param_name}: vLLM's loader unbinds dim {dim}, of which this worker "
                              f"received only {self.slices[dim].start}:{self.slices[dim].stop} of {n}")
        shape = (*self.shape[:dim], *self.shape[dim + 1:])
        slices = (*self.slices[:dim], *self.slices[dim + 1:])
        return tuple(as_checkpoint_tensor(self.shard.select(dim, i), shape, slices, self.param_name)
                     for i in range(n))


def as_checkpoint_tensor(shard: torch.Tensor, global_shape: Sequence[int], slices: Sequence[slice],
                         name: str) -> torch.Tensor:
    """The shard itself when it is the whole tensor, else a ``CheckpointShard`` around it."""
    if tuple(shard.shape) == tuple(global_shape):
        return shard
    return CheckpointShard(shard, global_shape, slices, name)
