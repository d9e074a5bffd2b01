"""refit as a backend of vLLM's weight-transfer API, registered as ``"refit"``.

A framework that drives vLLM through ``vllm.distributed.weight_transfer`` switches to
shard-to-shard refits with one config value on the engine,
``WeightTransferConfig(backend="refit")``, and refit's trainer engine on every trainer rank::

    source = RefitWeightSource(lambda: trainer.refit_sources())   # {name: (local, shape, mesh, placements)}
    engine = WeightTransferTrainerFactory.trainer_init(
        RefitTrainerInitInfo(rank=rank, master_address=addr, master_port=port, secret=secret_hex,
                             trainer_world_size=world, engine_world_size=tp * engines, timeout_s=60),
        client=RayVLLMWeightSyncClient(llm_actor), source=source)
    engine.send_weights()            # every step, on every trainer rank

Every trainer rank and every vLLM worker joins one refit communicator; each builds its
own plan from the gathered rosters, so each worker receives exactly its TP shard straight
from the trainer ranks that hold it. ``update_weights`` moves the bytes, checks every
bucket's checksum on every rank, and only then loads (loader mode) or keeps (direct mode)
them; the start and finish calls of vLLM's protocol do nothing, so the engine is never
left between the two with ``meta`` weights.

**Deadlines.** Every call (``trainer_init`` / ``init_weight_transfer_engine``,
``send_weights``, ``update_weights``) does its communication within ``timeout_s`` of its
start on that rank: the rendezvous, the roster exchange and the transfer each get what is
left of it, the transfer under ``RefitAbortWatchdog``. A dead or frozen peer can hold a
rank in none of them, and a store or a gloo wait does not outlive the deadline. Then each
rank tells the others how the call ended, through a store that outlives communicators
(the *hub*, hosted by trainer rank 0 on ``master_port``), and waits at most
``SETTLE_S`` past its deadline for their answers. A rank that did not answer is named
("trainer rank 1", "vLLM worker 0") as dead or late in the ``RefitWorkerError`` every rank
reaches (``timed_out``; ``failures`` holds what the others raised). Trainer ranks raise it;
a vLLM worker logs it and hands it to trainer rank 0 on the hub, which raises it with its
own, because an error raised through vLLM's executor leaves the other workers' answers
queued for the next call. The sender waits for vLLM's answer at most ``ENGINE_GRACE_S``
past its deadline, so no call runs past ``timeout_s + 10`` s. A vLLM worker's load of
verified weights runs after its exchange and is not cut short: stopping it half way would
tear the served weights.

**Recovery.** A failed call leaves loader-mode engines serving the weights of the last
call that verified (the bytes land in side buffers, loaded only once every checksum
matched). The next ``send_weights`` rebuilds what the failure broke, with nothing to call
in between: trainer rank 0 announces every call on the hub with the build it runs over,
and after a failure that build is a new one (a new epoch, a new rendezvous port, a new
secret derived from the caller's and a fresh nonce), so nothing written for an earlier
build verifies in a later one. The engines get the build in ``update_weights`` itself. A
call whose checksums did not match broke no communicator and reuses the build.

* A dead **trainer rank** other than 0: the others raise naming it; restart it and call
  ``trainer_init`` in it with the same init info; it joins the next ``send_weights`` that
  trainer rank 0 starts after that, rebuilt with every rank. Trainer rank 0 hosts the hub
  and drives the engines: if it dies, every trainer rank and every engine re-initialises.
* A dead **vLLM worker**: the trainer ranks raise naming it. vLLM stops an engine that
  lost a worker (its executor fails every later call), so the caller starts a new engine
  and calls ``trainer_init`` again on every trainer rank (after ``shutdown``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refit.comm import wire
from refit.comm.base import free_port
from refit.comm.rendezvous import OpenStore, RendezvousTampered, SealedStore, bind_listener, resolve_secret
from refit.control.errors import RefitWorkerError
from refit.control.verify import RankChecksums, verify_checksums
from refit.engines.vllm.worker import VllmWorkerEndpoint, check_parallel_layout
from refit.errors import RefitError, error_summary
from refit.plan import DEFAULT_BUCKET_BYTES
from refit.runtime.build import PlanOptions, connect_and_prepare
from refit.runtime.endpoint import TrainerEndpoint
from refit.runtime.protocol import EndpointCall
from refit.runtime.shards import ConnectSpec, as_local_shard

__all__ = ["ENGINE_GRACE_S", "SETTLE_S", "LLMWeightSyncClient", "RefitBuild", "RefitInitInfo",
           "RefitTrainerInitInfo", "RefitTrainerWeightTransferEngine", "RefitUpdateInfo", "RefitWeightSource",
           "RefitWeightTransferEngine"]

BACKEND = "refit"
logger = logging.getLogger(__name__)
# past its deadline, how long a rank waits for the others to say how the call ended: a rank
# released by its own deadline needs a moment to report, and one that never does is named
SETTLE_S = 3.0
# past its deadline, how long the sender waits for vLLM's answer: the workers' own settle,
# vLLM's RPC round trip and the load of verified weights, within the promised ten seconds
ENGINE_GRACE_S = 8.0
HUB_HOST = "trainer rank 0 (it hosts the rendezvous)"


@dataclass(frozen=True)
class RefitBuild:
    """One build of the refit communicator: its epoch, where its rendezvous meets, and its nonce.

    Every build meets on a fresh port under a secret of its own (the caller's, keyed with the
    epoch and the nonce): a value recorded from an earlier build, or from an earlier run
    under the same secret, never verifies in this one.
    """

    epoch: int
    port: int
    nonce: str  # hex

    @classmethod
    def fresh(cls, epoch: int, address: str) -> RefitBuild:
        return cls(epoch, free_port("" if address != "127.0.0.1" else address), secrets.token_hex(16))

    def secret(self, base: bytes | None) -> bytes | None:
        if base is None:
            return None
        return hmac.new(base, f"refit build {self.epoch} {self.nonce}".encode(), hashlib.sha256).digest()


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """What a vLLM worker needs to join: the hub, its rank offset, the first build, the deadline and the options."""

    master_address: str
    master_port: int  # the hub, hosted by trainer rank 0
    rank_offset: int
    world_size: int
    timeout_s: float = 60.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    verify: bool = True
    receive_mode: str = "auto"
    secret: str | None = None  # hex; authenticates the rendezvous (see RefitTrainerInitInfo)
    epoch: int = 1
    port: int = 0  # where the first build's communicator meets
    nonce: str = ""
    hub_nonce: str = ""  # hex: binds the hub's values to this init (drawn by trainer rank 0)


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """One refit: its sequence number and the build it runs over (a new one after a failure)."""

    step: int
    epoch: int = 1
    port: int = 0
    nonce: str = ""


@dataclass
class RefitTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the hub (hosted by trainer rank 0 on ``master_port``) and the sizes of both sides.

    ``secret`` (hex, e.g. ``refit.comm.rendezvous.new_secret().hex()``, the same on every
    trainer rank) authenticates every value of the rendezvous; it reaches the engines
    through vLLM's own ``init_weight_transfer_engine`` call. Without one, the
    ``REFIT_RENDEZVOUS_SECRET`` environment variable of each process is used, if set.
    ``timeout_s`` bounds every call on every rank (see the module's docstring).
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
    vLLM's executor is told to stop waiting for its workers ``timeout_s + 2 * ENGINE_GRACE_S``
    after a call (``timeout_s`` of the init info): the trainer gave up on the call well
    before, and without a limit the thread that made it would wait for ever on an engine
    that hangs. A worker that answers after that leaves its answer queued in vLLM ahead of
    the next call's, so an engine that missed it is restarted, not reused.
    """

    def __init__(self, llm: Any):
        self.llm = llm
        self.rpc_timeout_s: float | None = None

    def _rpc(self, method: str, **kwargs: Any) -> None:
        self.llm.collective_rpc(method, timeout=self.rpc_timeout_s, kwargs=kwargs or None)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if init_info.get("timeout_s") is not None:
            self.rpc_timeout_s = float(init_info["timeout_s"]) + 2 * ENGINE_GRACE_S
        self._rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self._rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._rpc("finish_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        self._rpc("shutdown_weight_transfer_engine")


class _SourceEndpoint(TrainerEndpoint):
    def __init__(self, source: RefitWeightSource):
        self.source = source

    def refit_sources(self) -> Mapping[str, Any]:
        return self.source.shards()



def _call_key(step: int) -> str:
    return f"refit-api/call/{step}"


def _outcome_key(step: int, rank: int) -> str:
    return f"refit-api/call/{step}/rank/{rank}"


def _ended_key(step: int, rank: int) -> str:
    return f"refit-api/call/{step}/ended/{rank}"


def _closed_key(step: int) -> str:
    return f"refit-api/call/{step}/closed"


_CALLS = "refit-api/calls"
_HUB_NONCE_KEY = "refit-api/hub-nonce"


class _HubLost(RefitError):
    """The hub's host (trainer rank 0) cannot be reached any more."""


class TransferHub:
    """The store through which every call is announced and every rank says how it ended.

    A communicator is aborted on any failure and its store goes with it, yet the ranks
    must still learn how the call ended on the others (a rank that never says is the one
    to name), and a trainer rank restarted later must still find where the next build
    meets. So trainer rank 0 hosts this store on ``master_port`` for the engine's whole
    life, and every build's communicator meets on a fresh port announced here. Values
    are sealed with the caller's secret and decoded as data only, as in every refit store.
    """

    def __init__(self, address: str, port: int, *, host: bool, secret: bytes | None, deadline: float,
                 nonce: bytes | None = None):
        listener = bind_listener(address, port) if host else None
        try:
            extra = {"master_listen_fd": listener.fileno()} if listener is not None else {}
            # a client retries its connect until this timeout: a trainer rank 0 still starting is waited for
            tcp = dist.TCPStore(address, port, None, host, timeout=timedelta(seconds=max(deadline - time.monotonic(),
                                                                                          0.1)),
                                wait_for_workers=False, **extra)
        except Exception as e:  # torch raises several kinds; named below
            if listener is not None:
                listener.close()
            raise RefitWorkerError(f"refit weight transfer: cannot {'host' if host else 'reach'} the hub at "
                                   f"{address}:{port}: {error_summary(e, 400)}", phase="init",
                                   timed_out=[] if host else [HUB_HOST]) from None
        if listener is not None:
            listener.detach()  # the store owns the socket now
        self.nonce = nonce or b""
        self.store: SealedStore | None = OpenStore(tcp)
        if secret is not None:
            self.store, self.nonce = self._bound(tcp, secret, host, nonce, deadline)

    @staticmethod
    def _bound(tcp: dist.Store, secret: bytes, host: bool, nonce: bytes | None,
               deadline: float) -> tuple[SealedStore, bytes]:
        """The hub's store with its values bound to this init: a nonce trainer rank 0 draws.

        The hub outlives builds and its port and secret stay the same over a re-init, so a
        value recorded from an earlier init (an old announcement of where a build meets)
        would verify again; bound to the nonce, it does not. vLLM workers get the nonce
        with their init info; other trainer ranks read it here.
        """
        boot = SealedStore(tcp, secret, b"refit hub")
        if host:
            if tcp.check([_HUB_NONCE_KEY]):
                raise RendezvousTampered(f"the hub's key {_HUB_NONCE_KEY!r} held a value before its host wrote "
                                         "one: something else writes to this port", key=_HUB_NONCE_KEY, rank=0)
            nonce = secrets.token_bytes(16)
            boot.set(_HUB_NONCE_KEY, nonce)
        elif not nonce:
            while not tcp.check([_HUB_NONCE_KEY]):
                if time.monotonic() >= deadline:
                    raise RefitWorkerError(f"refit weight transfer: {HUB_HOST} published no hub nonce in time",
                                           phase="init", timed_out=[HUB_HOST])
                time.sleep(0.02)
            nonce = boot.get(_HUB_NONCE_KEY)
        return SealedStore(tcp, secret, b"refit hub\0" + nonce), nonce

    def _live(self) -> SealedStore:
        if self.store is None:
            raise _HubLost("the hub was shut down")
        return self.store

    def publish(self, key: str, value: Any) -> None:
        try:
            self._live().set(key, wire.pack(value))
        except _HubLost:
            raise
        except Exception as e:  # the host is gone
            raise _HubLost(error_summary(e, 400)) from None

    def read(self, key: str) -> Any:
        try:
            return wire.unpack(self._live().get(key))
        except RendezvousTampered:
            raise
        except Exception as e:
            raise _HubLost(error_summary(e, 400)) from None

    def add(self, key: str, amount: int) -> int:
        try:
            return self._live().add(key, amount)
        except Exception as e:
            raise _HubLost(error_summary(e, 400)) from None

    def present(self, keys: list[str]) -> bool:
        try:
            return self._live().check(keys)
        except Exception as e:
            raise _HubLost(error_summary(e, 400)) from None

    def wait_for(self, keys: list[str], until: float) -> bool:
        """Whether every key is there by ``until`` (polled: a store wait that times out is not cancellable)."""
        while not self.present(keys):
            if time.monotonic() >= until:
                return False
            time.sleep(0.02)
        return True

    def collect(self, keys: Mapping[int, str], until: float) -> tuple[dict[int, Any], list[int]]:
        """The values present by ``until``, and the ranks whose key is still missing then."""
        self.wait_for(list(keys.values()), until)
        there = {r: k for r, k in keys.items() if self.present([k])}
        values = {}
        for r, k in there.items():
            values[r] = self.read(k)
        return values, sorted(set(keys) - set(there))

    def forget(self, keys: list[str]) -> None:
        try:
            for k in keys:
                self._live().delete_key(k)
        except Exception:  # only a leak if the host is gone
            pass

    def close(self) -> None:
        self.store = None  # the last reference: a hosting store stops listening


@dataclass(frozen=True)
class _Seat:
    """Where one rank sits in the communicator: its rank, and how its meshes map into it."""

    rank: int
    world_size: int
    trainers: int
    mesh_offset: int = 0
    mesh_size: int | None = None


def _labels(trainers: int, world: int) -> dict[int, tuple[str, int | None]]:
    out: dict[int, tuple[str, int | None]] = {r: (f"trainer rank {r}", None) for r in range(trainers)}
    out.update({r: (f"vLLM worker {r - trainers}", 0) for r in range(trainers, world)})
    return out


class _Party:
    """One rank's part in every call: the build it holds, its share of the call, and how the call ended.

    Trainer ranks and vLLM workers run the same steps, so that every rank of a call
    reaches the same verdict from the same outcomes, and a rank that never reported is
    named the same way everywhere.
    """

    def __init__(self, endpoint: Any, hub: TransferHub, seat: _Seat, *, address: str, secret: bytes | None,
                 timeout_s: float, bucket_bytes: int, verify: bool):
        self.endpoint = endpoint
        self.hub = hub
        self.seat = seat
        self.address = address
        self.secret = secret
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self.labels = _labels(seat.trainers, seat.world_size)
        self.label = self.labels[seat.rank][0]
        self.build: RefitBuild | None = None
        self.params: dict = {}
        # every rank reported and every rank's communicator survived the last call: the next may reuse it
        self.intact = False

    def _has_group(self) -> bool:
        return self.endpoint.refit_connected()

    def run(self, step: int, build: RefitBuild, *, transfer: bool, deadline: float) -> None:
        """This rank's share of call ``step`` over ``build``, then the verdict every rank reaches alike."""
        failure: Exception | None = None
        report = None
        try:
            if self.build != build:
                self._connect(build, deadline)
            elif not self._has_group():  # a failure dropped it, and trainer rank 0 announced no new build
                raise RefitError(f"{self.label}'s communicator of epoch {build.epoch} is gone; a call after a "
                                 "failure runs over a new build")
            if transfer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RefitError(f"no time left for the transfer within {self.timeout_s:g}s")
                done = self.endpoint.refit_transfer(build.epoch, timeout_s=left, verify=self.verify)
                report = {"sent": done.sent, "received": done.received, **self.params}
        except Exception as e:  # reported to every rank, then raised below
            failure = e
        what = "weight update" if transfer else "init"
        outcome = {"epoch": build.epoch, "intact": self._has_group(), "report": report,
                   "error": None if failure is None else error_summary(failure, 400)}
        keys = {r: _outcome_key(step, r) for r in range(self.seat.world_size)}
        try:
            self.hub.publish(keys[self.seat.rank], outcome)
            outcomes, missing = self.hub.collect(keys, deadline + SETTLE_S)
        except _HubLost as e:
            self.intact = False
            raise RefitWorkerError(f"refit {what} (step {step}, epoch {build.epoch}) on {self.label}: {HUB_HOST} "
                                   f"is gone ({e})", phase=what, timed_out=[HUB_HOST],
                                   failures={self.label: outcome["error"]} if failure else {}) from failure
        self.intact = not missing and all(o["intact"] for o in outcomes.values())
        late = [self.labels[r][0] for r in missing]
        failures = {self.labels[r][0]: o["error"] for r, o in sorted(outcomes.items()) if o["error"]}
        epochs = {o["epoch"] for o in outcomes.values()}
        if len(epochs) > 1:
            failures["epochs"] = f"ranks are in different builds {sorted(epochs)}"
        if late or failures:
            parts = [f"{', '.join(late)} did not report within {self.timeout_s:g}s (dead or late)"] if late else []
            parts += [f"{label}: {msg}" for label, msg in failures.items()]
            raise RefitWorkerError(f"refit {what} (step {step}, epoch {build.epoch}) failed, seen from {self.label}: "
                                   + "; ".join(parts), phase=what, failures=failures, timed_out=late) from failure
        if transfer and self.verify:
            verify_checksums({r: RankChecksums(**o["report"]) for r, o in outcomes.items()}, self.labels)

    def _connect(self, build: RefitBuild, deadline: float) -> None:
        """Join ``build`` and plan over it: the controller's build sequence, run by every rank for itself."""
        self.build = None
        seat = self.seat
        spec = ConnectSpec(self.address, build.port, seat.rank, seat.world_size, build.epoch,
                           max(deadline - time.monotonic(), 0.1), mesh_offset=seat.mesh_offset,
                           mesh_size=seat.mesh_size, label=self.label, secret=build.secret(self.secret))

        def run(calls: Mapping[int, EndpointCall], phase: str) -> dict[int, Any]:
            reply = calls[seat.rank].apply(self.endpoint)
            if phase != "connect":
                return {seat.rank: reply}
            # no controller gathers the rosters: the ranks swap them over the communicator they joined
            return dict(enumerate(self.endpoint.refit_all_gather(reply, deadline - time.monotonic())))

        try:
            prepared_by_rank = connect_and_prepare(
                run, {seat.rank: spec}, PlanOptions(bucket_bytes=self.bucket_bytes),
                labels={r: label for r, (label, _) in self.labels.items()})
        except Exception:
            self.endpoint.refit_teardown()  # releases the peers blocked on this rank
            raise
        prepared = prepared_by_rank[seat.rank]
        self.params = {"send_params": prepared.send_params, "recv_params": prepared.recv_params}
        self.build = build

    def close(self) -> None:
        self.endpoint.refit_teardown()
        self.hub.close()


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """vLLM worker side: one ``VllmWorkerEndpoint`` in the communicator that trainer rank 0 announces."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        deadline = time.monotonic() + init_info.timeout_s
        check_parallel_layout(self.parallel_config)
        self.shutdown()  # a second init (a restarted trainer) replaces the first
        self.info = init_info
        tp_rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        pc = self.parallel_config
        first = init_info.rank_offset + pc.data_parallel_index * pc.world_size
        self.endpoint = VllmWorkerEndpoint(self.model, self.model_config, tp_rank=tp_rank, tp_size=tp,
                                           device=self.device, receive_mode=init_info.receive_mode,
                                           quantized=self.model_config.quantization is not None)
        secret = resolve_secret(init_info.secret)
        hub = TransferHub(init_info.master_address, init_info.master_port, host=False, secret=secret, deadline=deadline,
                   nonce=bytes.fromhex(init_info.hub_nonce) if init_info.hub_nonce else None)
        seat = _Seat(first + tp_rank, init_info.world_size, init_info.rank_offset, mesh_offset=first, mesh_size=tp)
        self.party = _Party(self.endpoint, hub, seat, address=init_info.master_address, secret=secret,
                            timeout_s=init_info.timeout_s, bucket_bytes=init_info.bucket_bytes,
                            verify=init_info.verify)
        build = RefitBuild(init_info.epoch, init_info.port, init_info.nonce)
        self._say_how_it_ended(0, lambda: self.party.run(0, build, transfer=False, deadline=deadline))

    def start_weight_update(self) -> None:
        """Nothing: the live weights are only touched once every byte arrived and was checked."""

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        party = getattr(self, "party", None)
        if party is None:
            raise RefitError("refit weight transfer: init_weight_transfer_engine first")
        deadline = time.monotonic() + self.info.timeout_s
        build = RefitBuild(update_info.epoch, update_info.port, update_info.nonce)

        def call() -> None:
            party.run(update_info.step, build, transfer=True, deadline=deadline)
            self.endpoint.refit_commit(build.epoch)  # loads (loader mode) and marks the weights whole again

        self._say_how_it_ended(update_info.step, call)

    def _say_how_it_ended(self, step: int, call: Callable[[], None]) -> None:
        """Run this worker's part of call ``step``; its error goes to the hub and the log, not through vLLM.

        vLLM's executor raises at the first worker whose answer is an error and leaves the
        other workers' answers queued, where the next call reads them as its own: after a
        refit that failed on every worker, the next one would fail on a stale answer. So a
        worker's refit error is logged here and handed to trainer rank 0 on the hub (which
        raises it, with every other rank's), and vLLM's call itself returns.
        """
        error = None
        try:
            call()
        except Exception as e:  # said on the hub and raised by the trainer ranks
            error = error_summary(e, 2000)
            logger.error("refit weight transfer, %s: %s", self.party.label, e)
        self.last_error = error
        try:
            self.party.hub.publish(_ended_key(step, self.party.seat.rank), {"error": error})
        except _HubLost as e:
            logger.error("refit weight transfer, %s: cannot say how call %d ended: %s", self.party.label, step, e)

    def weights_state(self) -> dict:
        """This worker's ``refit_weights_state()``: whether its live weights are whole, and why not."""
        endpoint = getattr(self, "endpoint", None)
        if endpoint is None:
            return {"consistent": True, "epoch": -1, "commits": 0, "reason": None, "label": "vLLM worker"}
        return endpoint.refit_weights_state()

    def finish_weight_update(self) -> None:
        """Nothing: ``update_weights`` loaded the weights already."""

    def shutdown(self) -> None:
        party = getattr(self, "party", None)
        if party is not None:
            party.close()
            self.party = None
        self.endpoint = None


class RefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
    """Trainer side, on every trainer rank: each sends its own shards; rank 0 hosts the hub and drives the engine."""

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
        deadline = time.monotonic() + info.timeout_s
        engine = cls(client=client, source=source, is_sender=info.is_sender)
        engine.info = info
        engine.world_size = info.trainer_world_size + info.engine_world_size
        engine.endpoint = _SourceEndpoint(source)
        engine.steps = 0
        # the last epoch trainer rank 0 announced: every init counts from a base of its own, so no two
        # inits of one engine (which share the hub's port and the caller's secret) ever reuse an epoch
        engine.epochs = secrets.randbits(40) << 20
        engine.engines_failed = False  # vLLM failed or did not answer the last call: rebuild the next
        engine.remote = None  # the thread of a call vLLM has not answered yet
        secret = resolve_secret(info.secret)
        hub = TransferHub(info.master_address, info.master_port, host=info.is_sender, secret=secret, deadline=deadline)
        engine.party = _Party(engine.endpoint, hub, _Seat(info.rank, engine.world_size, info.trainer_world_size),
                              address=info.master_address, secret=secret, timeout_s=info.timeout_s,
                              bucket_bytes=info.bucket_bytes, verify=info.verify)
        try:
            engine._init(deadline)
        except BaseException:
            engine.shutdown()  # a failed init leaves nothing listening
            raise
        return engine

    def _init(self, deadline: float) -> None:
        info, hub = self.info, self.party.hub
        if self.is_sender:
            build = self._announce(0, None)
            worker_info = RefitInitInfo(info.master_address, info.master_port, info.trainer_world_size,
                                        self.world_size, info.timeout_s, info.bucket_bytes, info.verify,
                                        info.receive_mode, info.secret, epoch=build.epoch, port=build.port,
                                        nonce=build.nonce, hub_nonce=hub.nonce.hex())
            try:
                self._with_engines(0, [lambda: self.client.init_weight_transfer_engine(asdict(worker_info))],
                                   lambda: self.party.run(0, build, transfer=False, deadline=deadline), deadline)
            finally:
                hub.publish(_closed_key(0), True)
            return
        # the count of calls trainer rank 0 announced, set after each announcement (old ones are dropped)
        if not hub.wait_for([_CALLS], deadline):
            raise RefitWorkerError(f"refit init on trainer rank {info.rank}: {HUB_HOST} announced no build within "
                                   f"{info.timeout_s:g}s", phase="init", timed_out=[HUB_HOST])
        latest = hub.add(_CALLS, 0) - 1
        if latest == 0 and not hub.present([_closed_key(0)]):
            self.party.run(0, self._build_of(hub.read(_call_key(0))), transfer=False, deadline=deadline)
        else:
            # a restarted rank: the others are past their init; it joins the next call trainer rank 0 starts
            self.steps = max(latest, 0)

    @staticmethod
    def _build_of(announcement: Mapping[str, Any]) -> RefitBuild:
        return RefitBuild(int(announcement["epoch"]), int(announcement["port"]), str(announcement["nonce"]))

    def _announce(self, step: int, build: RefitBuild | None) -> RefitBuild:
        """Trainer rank 0: say which build call ``step`` runs over (a new one unless given), and drop old calls."""
        if build is None:
            self.epochs += 1
            build = RefitBuild.fresh(self.epochs, self.info.master_address)
        hub = self.party.hub
        hub.publish(_call_key(step), {"step": step, **asdict(build)})
        hub.add(_CALLS, 1)
        old = step - 2
        if old >= 0:
            hub.forget([_call_key(old), _closed_key(old)] + [_outcome_key(old, r) for r in range(self.world_size)]
                       + [_ended_key(old, r) for r in range(self.world_size)])
        return build

    def _with_engines(self, step: int, engine_calls: list[Callable[[], Any]], local: Callable[[], Any],
                      deadline: float) -> Any:
        """Run the engines' side of a call (sender only) beside this rank's own, waiting for them within the bound.

        The engines are always waited for, failure or not, up to ``ENGINE_GRACE_S`` past
        the deadline: their own exchange ends by then, and a caller that uses the engine
        next (to generate) must not find vLLM still inside this call.
        """
        failure: list[BaseException] = []

        def remote() -> None:
            try:
                for call in engine_calls:
                    call()
            except BaseException as e:  # raised below on the sender
                failure.append(e)

        t = threading.Thread(target=remote, name="refit-vllm-client", daemon=True)
        t.start()
        self.remote = t
        local_error: Exception | None = None
        out = None
        try:
            out = local()
        except Exception as e:  # raised below, with what the engines said
            local_error = e
        t.join(max(0.0, deadline + ENGINE_GRACE_S - time.monotonic()))
        engine_error, said = None, {}
        if t.is_alive():
            engine_error = (f"the vLLM engines did not answer within {self.info.timeout_s + ENGINE_GRACE_S:g}s; "
                            "restart the engine if they never do")
        elif failure:
            engine_error = f"the vLLM engines failed: {error_summary(failure[0], 2000)}"
        else:  # vLLM answered: every worker said on the hub how its part ended
            said = self._workers_said(step)
            if said:
                engine_error = "the vLLM workers said: " + "; ".join(f"{w}: {m}" for w, m in said.items())
        if not t.is_alive():
            self.remote = None
        self.engines_failed = t.is_alive() or bool(failure)
        if local_error is not None:
            if engine_error is not None:
                local_error.add_note(engine_error)
                if isinstance(local_error, RefitWorkerError):
                    local_error.failures.setdefault("vLLM engines", engine_error)
            raise local_error
        if engine_error is not None:
            raise RefitWorkerError(engine_error, phase="engines", failures=said or {"vLLM engines": engine_error},
                                   timed_out=["vLLM engines"] if t.is_alive() else [])
        return out

    def _workers_said(self, step: int) -> dict[str, str]:
        """What each vLLM worker that failed call ``step`` said (read once vLLM answered the call)."""
        trainers = self.info.trainer_world_size
        keys = {r: _ended_key(step, r) for r in range(trainers, self.world_size)}
        ended, missing = self.party.hub.collect(keys, time.monotonic())
        out = {self.party.labels[r][0]: "said nothing of how its part ended" for r in missing}
        out.update({self.party.labels[r][0]: e["error"] for r, e in sorted(ended.items()) if e["error"]})
        return out

    def send_weights(self) -> None:
        deadline = time.monotonic() + self.info.timeout_s
        self.steps += 1
        step = self.steps
        if not self.is_sender:
            hub = self.party.hub
            try:
                announced = hub.wait_for([_call_key(step)], deadline)
                build = self._build_of(hub.read(_call_key(step))) if announced else None
            except _HubLost as e:
                raise RefitWorkerError(f"refit weight update (step {step}) on trainer rank {self.info.rank}: "
                                       f"{HUB_HOST} is gone ({e})", phase="weight update",
                                       timed_out=[HUB_HOST]) from None
            if build is None:
                raise RefitWorkerError(f"refit weight update (step {step}) on trainer rank {self.info.rank}: "
                                       f"{HUB_HOST} did not start it within {self.info.timeout_s:g}s",
                                       phase="weight update", timed_out=[HUB_HOST])
            self.party.run(step, build, transfer=True, deadline=deadline)
            return
        if self.remote is not None:  # vLLM is still inside the last call: wait for it within this one's bound
            self.remote.join(max(0.0, deadline - time.monotonic()))
            if self.remote.is_alive():
                raise RefitWorkerError("the vLLM engines have not answered the previous call yet",
                                       phase="engines", timed_out=["vLLM engines"])
            self.remote = None
        reuse = self.party.intact and self.party.build is not None and not self.engines_failed
        build = self._announce(step, self.party.build if reuse else None)
        update = RefitUpdateInfo(step, build.epoch, build.port, build.nonce)
        calls = [self.client.start_weight_update, lambda: self.client.update_weights(asdict(update)),
                 self.client.finish_weight_update]
        try:
            self._with_engines(step, calls,
                               lambda: self.party.run(step, build, transfer=True, deadline=deadline), deadline)
        finally:
            self.party.hub.publish(_closed_key(step), True)

    def shutdown(self) -> None:
        self.party.close()
