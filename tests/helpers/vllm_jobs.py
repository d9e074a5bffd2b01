"""Processes of the weight-transfer API tests: a trainer rank that also runs a vLLM engine, and one that does not.

Both trainer ranks build the same HF model (same seed) and keep their half of every
tensor's rows, as a TP trainer holds them; only those halves are handed to refit. Rank 0
also owns an ``LLM`` with ``WeightTransferConfig(backend="refit")`` and drives it through
vLLM's own protocol. The test drives each rank over a pipe, one ``Command`` at a time, so
it can kill a rank or a vLLM worker at a known point of a send.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import torch

from refit.layout import Shard, chunk_bounds

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _model(config_dict: dict, step: int):
    from refit.testing.hf import build_model

    model = build_model(config_dict, seed=0)
    with torch.no_grad():  # a different "optimizer step" each refit
        g = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def _shards(model, rank: int, world: int) -> dict:
    out = {}
    for name, p in model.named_parameters():
        lo, hi = chunk_bounds(p.shape[0], world, rank)
        out[name] = (p.detach()[lo:hi].clone(), tuple(p.shape), list(range(world)), (Shard(0),))
    return out


@dataclass(frozen=True)
class Command:
    """What the test asks a trainer rank to do next.

    ``op``: ``"init"`` (``trainer_init`` with ``timeout_s``), ``"send"`` (``send_weights`` of the
    weights of model step ``step``), ``"check"`` (rank 0: the engine's log-probabilities
    against HF at model step ``step``) or ``"stop"``. ``fault`` for a send: ``"corrupt"`` (one
    byte of this rank's next bucket), ``"die"`` (this rank says ``in-transfer`` on the pipe
    and waits to be killed) or ``"pause"`` (it says ``in-transfer`` and waits for ``go``).
    """

    op: str
    step: int = 0
    timeout_s: float = 0.0
    fault: str | None = None


@dataclass
class Reply:
    """What a trainer rank answers: whether the call raised, how long it ran, and whom it named."""

    op: str
    ok: bool
    seconds: float = 0.0
    error_type: str | None = None
    error: str | None = None
    timed_out: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    data: dict = field(default_factory=dict)


def _failed(op: str, e: BaseException, seconds: float) -> Reply:
    import traceback

    return Reply(op, False, seconds, type(e).__name__, f"{e}\n{''.join(getattr(e, '__notes__', []))}\n"
                 f"{traceback.format_exc()}", list(getattr(e, "timed_out", [])), dict(getattr(e, "failures", {})))


def _check(llm, config_dict: dict, step: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = _model(config_dict, step)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                       SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
    got = [lp[t].logprob for t, lp in zip(PROMPT[1:], out.prompt_logprobs[1:])]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT])).logits[0].log_softmax(-1)
        ids = torch.tensor([PROMPT])
        for _ in range(4):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    want = [float(ref[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    return {"diff": max(abs(a - b) for a, b in zip(got, want)), "tokens": list(out.outputs[0].token_ids),
            "ref_tokens": ids[0, len(PROMPT):].tolist()}


def _start_llm(model_dir: str, tp: int):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return LLM(model=model_dir, load_format="dummy", dtype="float32", tensor_parallel_size=tp,
               skip_tokenizer_init=True, max_model_len=128, enforce_eager=True, max_num_seqs=4,
               weight_transfer_config=WeightTransferConfig(backend="refit"))


def trainer_rank(conn, rank: int, world: int, port: int, config_dict: dict, model_dir: str, tp: int, secret: str):
    """One trainer rank of vLLM's weight-transfer API, driven command by command over ``conn``.

    Rank 0 also owns the ``LLM`` (started before it says ``ready``, with the start-up time,
    its worker pids and every process under it) and drives it through vLLM's protocol.
    """
    torch.set_num_threads(1)
    import psutil

    from refit.engines.vllm.transfer_engine import RefitTrainerInitInfo, RefitWeightSource

    current: dict = {"shards": {}, "fault": None}

    def shards() -> dict:
        fault, current["fault"] = current["fault"], None  # the first read of a send is inside its transfer
        if fault in ("die", "pause"):
            conn.send(Reply("in-transfer", True, data={"pid": os.getpid()}))
            conn.recv()  # "die": never answered, the test kills this process; "pause": "go"
        return current["shards"]

    llm = engine = None
    ready: dict = {"pid": os.getpid()}
    try:
        if rank == 0:
            t0 = time.monotonic()
            llm = _start_llm(model_dir, tp)
            ready["startup_s"] = time.monotonic() - t0
            children = psutil.Process().children(recursive=True)
            ready["children"] = [p.pid for p in children]
            ready["worker_pids"] = _worker_pids(children, tp)
        conn.send(Reply("ready", True, data=ready))
    except BaseException as e:  # reported to the test
        conn.send(_failed("ready", e, 0.0))
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from refit.engines.vllm.plugin import register
    from refit.engines.vllm.transfer_engine import LLMWeightSyncClient

    register()
    while True:
        cmd: Command = conn.recv()
        t0 = time.monotonic()
        try:
            data: dict = {}
            if cmd.op == "init":
                current["shards"] = _shards(_model(config_dict, 0), rank, world)
                info = RefitTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port,
                                            trainer_world_size=world, engine_world_size=tp, timeout_s=cmd.timeout_s,
                                            secret=secret)
                client = LLMWeightSyncClient(llm) if llm is not None else None
                engine = WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                                   source=RefitWeightSource(shards))
            elif cmd.op == "send":
                current["shards"] = _shards(_model(config_dict, cmd.step), rank, world)
                if cmd.fault == "corrupt":
                    engine.endpoint.refit_inject_fault(byte=12345)
                current["fault"] = cmd.fault
                engine.send_weights()
            elif cmd.op == "check":
                data = _check(llm, config_dict, cmd.step)
            elif cmd.op == "stop":
                if engine is not None:
                    engine.shutdown()
                if llm is not None:
                    llm.llm_engine.engine_core.shutdown()  # the engine core would outlive this process
            conn.send(Reply(cmd.op, True, time.monotonic() - t0, data=data))
        except BaseException as e:  # reported to the test
            conn.send(_failed(cmd.op, e, time.monotonic() - t0))
        if cmd.op == "stop":
            return


def _worker_pids(children: list, tp: int) -> list[int]:
    """The pids of the engine's workers in TP order, found by the titles vLLM gives them (``VLLM::Worker_TP1``)."""
    pids = {}
    for p in children:
        title = " ".join(p.cmdline())
        for i in range(tp):
            if re.search(rf"Worker_TP{i}\b", title):
                pids[i] = p.pid
    if sorted(pids) != list(range(tp)):
        raise RuntimeError(f"could not find the engine's {tp} workers among {[(p.pid, p.cmdline()) for p in children]}")
    return [pids[i] for i in range(tp)]


class ChildSpawner:
    """An endpoint that starts a long-lived child process, as a vLLM host starts its engine."""

    def __init__(self):
        import subprocess

        self.child = subprocess.Popen(["sleep", "600"])

    def refit_ping(self) -> dict:
        return {"pid": os.getpid(), "child": self.child.pid}


class FailingSpawner:
    """An endpoint that starts a non-daemon multiprocessing child (as vLLM starts its engine core) and then fails."""

    def __init__(self):
        import multiprocessing as mp
        import time

        child = mp.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=False)
        child.start()
        raise RuntimeError(f"the engine did not attach; its core is pid {child.pid}")
