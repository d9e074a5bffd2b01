"""Verification of a transfer: every bucket's checksum, as sent and as received."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from refit.control.errors import RefitVerificationError
from refit.transport.broadcast import BROADCAST

__all__ = ["RankChecksums", "verify_checksums"]

BucketKey = tuple[int, int]  # (peer rank, bucket index)


@dataclass(frozen=True)
class RankChecksums:
    """One rank's checksums of a transfer (``sent`` / ``received``, keyed ``(peer, bucket)``) and
    the params each of its buckets carries (from its plan), to name what a mismatch hit."""

    sent: Mapping[BucketKey, int]
    received: Mapping[BucketKey, int]
    send_params: Mapping[BucketKey, list[str]]
    recv_params: Mapping[BucketKey, list[str]]


def verify_checksums(reports: Mapping[int, RankChecksums], labels: Mapping[int, tuple[str, int | None]]) -> None:
    """Compare what every sender checksummed with what its receivers checksummed.

    ``reports`` maps each rank to its checksums; ``labels`` maps a rank to its worker's name
    and generation shard (None for a trainer). A bucket the sender reported and its receiver
    did not, or the other way round, is a mismatch too.
    """
    bad: list[tuple] = []
    for src, rep in reports.items():
        for (peer, idx), value in rep.sent.items():
            receivers = [r for r in reports if r != src] if peer == BROADCAST else [peer]
            for dst in receivers:
                got = reports[dst].received.get((src, idx)) if dst in reports else None
                if got != value:
                    names = rep.send_params.get((peer, idx), [])
                    bad.append((src, dst, idx, names, "missing" if got is None else "checksum"))
    for dst, rep in reports.items():
        for src, idx in rep.received:
            sent = reports[src].sent if src in reports else {}
            if (dst, idx) not in sent and (BROADCAST, idx) not in sent:
                bad.append((src, dst, idx, rep.recv_params.get((src, idx), []), "unexpected"))
    if not bad:
        return

    def name(rank: int) -> str:
        return f"{labels[rank][0]} (rank {rank})" if rank in labels else f"rank {rank}"

    shards = sorted({labels[d][1] for _, d, _, _, _ in bad if d in labels and labels[d][1] is not None})
    parts = [f"bucket {idx} from {name(src)} to {name(dst)} [{why}]: params {names}"
             for src, dst, idx, names, why in bad[:8]]
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    raise RefitVerificationError(
        f"refit verification failed for generation shard(s) {shards}: " + "; ".join(parts) + more
        + ". The engines were not told the weights loaded.", bad, shards)
