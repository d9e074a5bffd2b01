"""Processes of the native weight-transfer API test: a trainer rank that also runs a vLLM engine, and one that does not.

Both trainer ranks build the same HF model (same seed) and keep their half of every
tensor's rows, as a TP trainer holds them; only those halves are handed to refit. Rank 0
also owns an ``LLM`` with ``WeightTransferConfig(backend="refit")`` and drives it through
vLLM's own protocol.
"""

from __future__ import annotations

import os

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


def trainer_rank(conn, rank: int, world: int, port: int, config_dict: dict, model_dir: str, tp: int, steps: int,
                 secret: str):
    """Run ``steps`` refits through vLLM's API; rank 0 reports the engine against HF after each."""
    torch.set_num_threads(1)
    from refit.engines.vllm.transfer_engine import RefitTrainerInitInfo, RefitWeightSource

    results = []
    try:
        current = {"shards": _shards(_model(config_dict, 0), rank, world)}
        source = RefitWeightSource(lambda: current["shards"])
        info = RefitTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port,
                                    trainer_world_size=world, engine_world_size=tp, timeout_s=120.0, secret=secret)
        llm = client = None
        if rank == 0:
            from vllm import LLM
            from vllm.config import WeightTransferConfig

            from refit.engines.vllm.transfer_engine import LLMWeightSyncClient

            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                          for i in range(tp)))
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            llm = LLM(model=model_dir, load_format="dummy", dtype="float32", tensor_parallel_size=tp,
                      skip_tokenizer_init=True, max_model_len=128, enforce_eager=True, max_num_seqs=4,
                      weight_transfer_config=WeightTransferConfig(backend="refit"))
            client = LLMWeightSyncClient(llm)
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from refit.engines.vllm.plugin import register

        register()
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        for step in range(1, steps + 1):
            model = _model(config_dict, step)
            current["shards"] = _shards(model, rank, world)
            engine.send_weights()
            if rank == 0:
                from vllm import SamplingParams
                from vllm.inputs import TokensPrompt

                out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                                   SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
                got = [lp[t].logprob for t, lp in zip(PROMPT[1:], out.prompt_logprobs[1:])]
                with torch.no_grad():
                    ref = model(input_ids=torch.tensor([PROMPT])).logits[0].log_softmax(-1)
                    ids = torch.tensor([PROMPT])
                    for _ in range(4):
                        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
                want = [float(ref[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
                results.append({"diff": max(abs(a - b) for a, b in zip(got, want)),
                                "tokens": list(out.outputs[0].token_ids), "ref_tokens": ids[0, len(PROMPT):].tolist()})
        engine.shutdown()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # the engine core would outlive this process
        conn.send(("ok", results))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


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
