"""refit as a backend of vLLM's weight-transfer API, registered as ``"refit"``.

A framework that drives vLLM through ``vllm.distributed.weight_transfer`` switches to
shard-to-shard refits with one config value on the engine,
``WeightTransferConfig(backend="refit")``, and refit's trainer engine on every trainer rank::

    source = RefitWeightSource(lambda: trainer.refit_sources())   # {name: (local, shape, mesh, placements)}
    engine = WeightTransferTrainerFactory.trainer_init(
        RefitTrainerInitInfo(rank=rank, master_address=addr, master_port=port, secret=secret_hex,
                             trainer_world_size=world, engine_world_size=tp * engines),
        client=RayVLLMWeightSyncClient(llm_actor), source=source)
    engine.send_weights()            # every step, on every trainer rank

Every trainer rank and every vLLM worker joins one refit communicator at init; each
builds its own plan from the gathered rosters, so each worker receives exactly its TP
shard straight from the trainer ranks that hold it. ``update_weights`` moves the bytes,
checks every bucket's checksum on every rank, and only then loads (loader mode) or
keeps (direct mode) them; the start and finish calls of vLLM's protocol do nothing, so
the engine is never left between the two with ``meta`` weights. A transfer that fails
raises on every rank and leaves loader-mode engines on their previous weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refit.comm.rendezvous import resolve_secret
from refit.control.verify import verify_checksums
from refit.engines.vllm.worker import VllmWorkerEndpoint, check_parallel_layout
from refit.errors import RefitError
from refit.plan import DEFAULT_BUCKET_BYTES, merge_rosters
from refit.runtime.endpoint import ConnectSpec, TrainerEndpoint, as_local_shard

__all__ = ["LLMWeightSyncClient", "RefitInitInfo", "RefitTrainerInitInfo", "RefitTrainerWeightTransferEngine",
           "RefitUpdateInfo", "RefitWeightSource", "RefitWeightTransferEngine"]

BACKEND = "refit"


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """What a vLLM worker needs to join: the rendezvous, its rank offset, the deadline and the options."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 60.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    verify: bool = True
    receive_mode: str = "auto"
    secret: str | None = None  # hex; authenticates the rendezvous (see RefitTrainerInitInfo)


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """One refit: its sequence number (every rank checks that it agrees)."""

    step: int


@dataclass
class RefitTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the rendezvous (hosted by trainer rank 0) and the sizes of both sides.

    ``secret`` (hex, e.g. ``refit.comm.rendezvous.new_secret().hex()``, the same on every
    trainer rank) authenticates every value of the rendezvous; it reaches the engines
    through vLLM's own ``init_weight_transfer_engine`` call. Without one, the
    ``REFIT_RENDEZVOUS_SECRET`` environment variable of each process is used, if set.
    """

    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int
    trainer_world_size: int
    engine_world_size: int
    timeout_s: float = 60.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    verify: bool = True
    receive_mode: str = "auto"
    secret: str | None = None


class RefitWeightSource(WeightSource):
    """The trainer's weights as refit reads them: local shards and their layouts, never gathered.

    ``shards`` is a mapping, or a callable returning one, of ``{checkpoint_name:
    (local_tensor, global_shape, mesh, placements)}`` (or ``(DTensor, mesh, placements)``)
    with meshes in trainer ranks, what ``TrainerEndpoint.refit_sources`` returns. The
    ``WeightSource`` channels vLLM's own backends read (``metadata``, iteration of full
    tensors) are there for compatibility; refit itself never gathers.
    """

    def __init__(self, shards: Mapping[str, Any] | Callable[[], Mapping[str, Any]]):
        self._shards = shards

    def shards(self) -> dict[str, Any]:
        return dict(self._shards() if callable(self._shards) else self._shards)

    def metadata(self) -> list[ParamMeta]:
        out = []
        for name, value in self.shards().items():
            s = as_local_shard(name, value)
            out.append(ParamMeta(name, s.tensor.dtype, s.global_shape))
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise RefitError("refit moves shards and never materializes full tensors; iterate the trainer's own "
                         "state for that")


class LLMWeightSyncClient:
    """vLLM's weight-sync client protocol over an offline ``vllm.LLM`` in this process.

    ``AsyncLLM`` and the HTTP and Ray clients of ``vllm.distributed.weight_transfer.clients``
    serve the other deployments; an ``LLM`` reaches its workers through ``collective_rpc``.
    """

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")


class _SourceEndpoint(TrainerEndpoint):
    def __init__(self, source: RefitWeightSource):
        self.source = source

    def refit_sources(self) -> Mapping[str, Any]:
        return self.source.shards()


def _build(endpoint: Any, spec: ConnectSpec, *, bucket_bytes: int) -> dict:
    """Join, exchange rosters over the new communicator, plan: what the controller does, done by every rank."""
    roster = endpoint.refit_connect(spec)
    group = endpoint._refit_state().group
    gathered = group.all_gather_object(roster)
    index = merge_rosters(dict(enumerate(gathered)), spec.world_size)
    prepared = endpoint.refit_prepare(index, epoch=spec.epoch, bucket_bytes=bucket_bytes)
    return {"send_params": prepared["send_params"], "recv_params": prepared["recv_params"]}


def _transfer(endpoint: Any, params: dict, *, epoch: int, timeout_s: float, verify: bool, step: int,
              labels: dict[int, tuple[str, int | None]]) -> dict:
    """Move this rank's share, then check every bucket of every rank; raises on every rank alike."""
    report = endpoint.refit_transfer(epoch, timeout_s=timeout_s, verify=verify)
    group = endpoint._refit_state().group
    reports = group.all_gather_object({**report, **params, "step": step})
    steps = {r["step"] for r in reports}
    if len(steps) != 1:
        raise RefitError(f"refit update: ranks disagree on the step number ({sorted(steps)})")
    if verify:
        verify_checksums(dict(enumerate(reports)), labels)
    return report


def _labels(trainers: int, world: int) -> dict[int, tuple[str, int | None]]:
    out: dict[int, tuple[str, int | None]] = {r: (f"trainer rank {r}", None) for r in range(trainers)}
    out.update({r: (f"vLLM worker {r - trainers}", 0) for r in range(trainers, world)})
    return out


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """vLLM worker side: one ``VllmWorkerEndpoint`` joined to the trainer's refit communicator."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        check_parallel_layout(self.parallel_config)
        self.info = init_info
        tp_rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        pc = self.parallel_config
        first = init_info.rank_offset + pc.data_parallel_index * pc.world_size
        self.endpoint = VllmWorkerEndpoint(self.model, self.model_config, tp_rank=tp_rank, tp_size=tp,
                                           device=self.device, receive_mode=init_info.receive_mode,
                                           quantized=self.model_config.quantization is not None)
        spec = ConnectSpec(init_info.master_address, init_info.master_port, first + tp_rank, init_info.world_size,
                           1, init_info.timeout_s, mesh_offset=first, mesh_size=tp, label=f"vLLM worker {tp_rank}",
                           secret=resolve_secret(init_info.secret))
        self.params = _build(self.endpoint, spec, bucket_bytes=init_info.bucket_bytes)
        self.labels = _labels(init_info.rank_offset, init_info.world_size)

    def start_weight_update(self) -> None:
        """Nothing: the live weights are only touched once every byte arrived and was checked."""

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        if getattr(self, "endpoint", None) is None:
            raise RefitError("refit weight transfer: init_weight_transfer_engine first")
        _transfer(self.endpoint, self.params, epoch=1, timeout_s=self.info.timeout_s, verify=self.info.verify,
                  step=update_info.step, labels=self.labels)
        self.endpoint.refit_commit(1)  # loads (loader mode) and marks the weights whole again

    def weights_state(self) -> dict:
        """This worker's ``refit_weights_state()``: whether its live weights are whole, and why not."""
        endpoint = getattr(self, "endpoint", None)
        if endpoint is None:
            return {"consistent": True, "epoch": -1, "commits": 0, "reason": None, "label": "vLLM worker"}
        return endpoint.refit_weights_state()

    def finish_weight_update(self) -> None:
        """Nothing: ``update_weights`` loaded the weights already."""

    def shutdown(self) -> None:
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None:
            endpoint.refit_teardown()
            self.endpoint = None


class RefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
    """Trainer side, on every trainer rank: each sends its own shards; rank 0 drives the engine's calls."""

    init_info_cls = RefitTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: RefitTrainerInitInfo, *, client: Any, source: Any = None):
        if not isinstance(source, RefitWeightSource):
            raise RefitError("the refit backend reads the trainer's shards, not full tensors: pass "
                             "source=RefitWeightSource(...) (got "
                             f"{type(source).__name__ if source is not None else None})")
        info = init_info
        if not 0 <= info.rank < info.trainer_world_size:
            raise RefitError(f"RefitTrainerInitInfo: rank {info.rank} is outside trainer_world_size "
                             f"{info.trainer_world_size}")
        if info.engine_world_size < 1:
            raise RefitError(f"RefitTrainerInitInfo: engine_world_size must be >= 1, got {info.engine_world_size}")
        engine = cls(client=client, source=source, is_sender=info.is_sender)
        engine.info = info
        engine.world_size = info.trainer_world_size + info.engine_world_size
        engine.endpoint = _SourceEndpoint(source)
        engine.steps = 0
        spec = ConnectSpec(info.master_address, info.master_port, info.rank, engine.world_size, 1, info.timeout_s,
                           label=f"trainer rank {info.rank}", secret=resolve_secret(info.secret))
        worker_info = RefitInitInfo(info.master_address, info.master_port, info.trainer_world_size,
                                    engine.world_size, info.timeout_s, info.bucket_bytes, info.verify,
                                    info.receive_mode, info.secret)
        engine.params = engine._with_engines(lambda: client.init_weight_transfer_engine(asdict(worker_info)),
                                             lambda: _build(engine.endpoint, spec, bucket_bytes=info.bucket_bytes))
        engine.labels = _labels(info.trainer_world_size, engine.world_size)
        return engine

    def _with_engines(self, engine_call: Callable[[], Any], local: Callable[[], Any]) -> Any:
        """Run the engines' side of a collective step (sender only) beside this rank's own."""
        if not self.is_sender:
            return local()
        failure: list[BaseException] = []

        def remote() -> None:
            try:
                engine_call()
            except BaseException as e:  # noqa: BLE001 - raised below on the sender
                failure.append(e)

        t = threading.Thread(target=remote, name="refit-vllm-client", daemon=True)
        t.start()
        try:
            out = local()
        except BaseException:
            # never wait for the engines here: if this rank failed they may be blocked on it,
            # and its aborted communicator releases them at their own deadline
            raise
        t.join(self.info.timeout_s + 30.0)
        if t.is_alive():
            raise RefitError(f"the vLLM engines did not answer within {self.info.timeout_s + 30.0:.0f}s")
        if failure:
            raise RefitError(f"the vLLM engines failed: {type(failure[0]).__name__}: {failure[0]}") from failure[0]
        return out

    def send_weights(self) -> None:
        self.steps += 1
        step = self.steps
        if self.is_sender:
            self.client.start_weight_update()
        self._with_engines(lambda: self.client.update_weights(asdict(RefitUpdateInfo(step))),
                           lambda: _transfer(self.endpoint, self.params, epoch=1, timeout_s=self.info.timeout_s,
                                             verify=self.info.verify, step=step, labels=self.labels))
        if self.is_sender:
            self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.endpoint.refit_teardown()
