"""The data-only format of everything ranks exchange through a rendezvous store.

Values a rank reads from the store were written by whoever could reach the store's
port. Read with ``pickle.loads``, one such value runs arbitrary code in the reader, and
that is how a client that merely connected to the port made a rank execute its payload.
So the exchange is decoded from msgpack, which yields only data: numbers, strings,
bytes, lists, dicts, tuples, numpy arrays, and the frozen records registered here
(placements, roster entries, a transport's handshake record). An unregistered type is
refused when it is sent, with its name, instead of travelling as code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import torch

from refit.errors import RefitError
from refit.layout import Replicate, Shard, StridedShard
from refit.plan import RosterEntry, RosterGroup


class WireFormatError(RefitError):
    """A value cannot be sent as data, or what arrived is not a value of this format."""


_TUPLE = 1
_NDARRAY = 2
_RECORD = 3

_records_by_name: dict[str, type] = {}
_names_by_record: dict[type, str] = {}
_NUMERIC_KINDS = frozenset("biuf")


def register_record(cls: type, name: str | None = None) -> type:
    """Allow the frozen dataclass ``cls`` on the wire, under ``name`` (default: its qualified name).

    Its fields travel as data and are checked again when it is rebuilt (every field is
    passed to the constructor by name), so a record is never more than its fields.
    """
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise WireFormatError(f"register_record: {cls.__name__} must be a frozen dataclass")
    key = name or f"{cls.__module__}.{cls.__qualname__}"
    known = _records_by_name.get(key)
    if known is not None and known is not cls:
        raise WireFormatError(f"register_record: {key!r} already names {known.__qualname__}")
    _records_by_name[key] = cls
    _names_by_record[cls] = key
    return cls


for _cls in (Shard, Replicate, StridedShard, RosterEntry, RosterGroup):
    register_record(_cls)


def _encode(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, pack(list(obj)))
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _NUMERIC_KINDS:
            raise WireFormatError(f"only numeric arrays travel as data, got dtype {obj.dtype}")
        return msgpack.ExtType(_NDARRAY, pack([obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()]))
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.requires_grad:
        return _encode(obj.numpy())  # a mesh given as a tensor of ranks
    if isinstance(obj, np.generic) and obj.dtype.kind in _NUMERIC_KINDS:
        return obj.item()
    name = _names_by_record.get(type(obj))
    if name is not None:
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(_RECORD, pack([name, fields]))
    raise WireFormatError(f"a {type(obj).__module__}.{type(obj).__qualname__} cannot be sent: only data "
                          "(numbers, strings, bytes, lists, tuples, dicts, numeric arrays, registered records)")


def _decode(code: int, payload: bytes) -> Any:
    if code == _TUPLE:
        return tuple(unpack(payload))
    if code == _NDARRAY:
        dtype, shape, raw = unpack(payload)
        dt = np.dtype(dtype)
        if dt.kind not in _NUMERIC_KINDS:
            raise WireFormatError(f"an array of dtype {dt} is not data of this format")
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    if code == _RECORD:
        name, fields = unpack(payload)
        cls = _records_by_name.get(name)
        if cls is None:
            raise WireFormatError(f"record {name!r} is not registered on this rank")
        try:
            return cls(**fields)
        except TypeError as e:
            raise WireFormatError(f"record {name!r} arrived with fields {sorted(fields)}: {e}") from None
    raise WireFormatError(f"unknown extension type {code}")


def pack(obj: Any) -> bytes:
    """``obj`` as bytes of this format; raises ``WireFormatError`` naming a type that is not data."""
    try:
        return msgpack.packb(obj, default=_encode, strict_types=True, use_bin_type=True)
    except WireFormatError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise WireFormatError(f"cannot be sent as data: {e}") from None


def unpack(data: bytes) -> Any:
    """The value ``pack`` made; raises ``WireFormatError`` on anything else."""
    try:
        return msgpack.unpackb(data, ext_hook=_decode, raw=False, strict_map_key=False, use_list=True)
    except WireFormatError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise WireFormatError(f"not a value of refit's exchange format: {type(e).__name__}: {e}") from None


__all__ = ["WireFormatError", "pack", "register_record", "unpack"]
