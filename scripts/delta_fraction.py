"""How many bf16 weights change in one RL optimizer step: the figure a delta refit is designed from.

    python scripts/delta_fraction.py [--lrs 1e-6,3e-6,1e-5] [--steps 4] [--json]

A Qwen2.5-0.5B-shaped model (its real config: 24 layers, hidden 896, 151,936 tokens, tied
embeddings; random init) keeps fp32 master weights and exports bf16, as a trainer does for
its engines. For each learning rate it starts from the same weights and takes real AdamW
steps (betas 0.9/0.95, weight decay 0.01) on next-token loss over token batches whose ids
follow Zipf's law, as natural-language token frequencies do: rare tokens' embedding rows
see no gradient in a step, which is what makes embeddings sparser than the rest.

After every step it counts the bf16 elements that differ from the previous export, by kind
of tensor (attention, MLP, embeddings, norms), and prints them. The first step is reported
apart: Adam's first update is ``lr * sign(grad)`` for every element with a gradient, the
largest it ever makes, and RL runs far past it.

Why the fraction is small at all: an element's bf16 export changes only when its fp32 master
crosses a rounding boundary, and AdamW moves it by at most about ``lr`` a step against a
bf16 step of ``|w| * 2**-8`` (8 bits of mantissa). Sharding (FSDP2, TP) does not change
this: AdamW is elementwise, so a rank's shard changes exactly as the same slice of the
whole tensor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

KINDS = ("attention", "mlp", "embeddings", "norms")


def kind_of(name: str) -> str:
    if "embed_tokens" in name or "lm_head" in name:
        return "embeddings"
    if "norm" in name:
        return "norms"
    if "self_attn" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    raise ValueError(f"no kind for {name}")


def qwen_05b_config(layers: int | None):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers or 24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def zipf_batch(gen: torch.Generator, vocab: int, batch: int, seq: int, device) -> torch.Tensor:
    """Token ids with Zipf frequencies (rank r drawn with weight 1/r), the ranks shuffled over the vocabulary."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    ranks = torch.multinomial(weights, batch * seq, replacement=True, generator=gen)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))
    return perm[ranks].view(batch, seq).to(device)


def changed_by_kind(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, dict]:
    out = {k: {"changed": 0, "elements": 0} for k in KINDS}
    for name, b in before.items():
        k = out[kind_of(name)]
        k["changed"] += int((b != after[name]).sum())
        k["elements"] += b.numel()
    total = {"changed": sum(v["changed"] for v in out.values()), "elements": sum(v["elements"] for v in out.values())}
    out["all"] = total
    return {k: {**v, "fraction": v["changed"] / v["elements"]} for k, v in out.items()}


def run_lr(lr: float, args, device) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen_05b_config(args.layers), torch_dtype=torch.float32).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(2)
    params = dict(model.named_parameters())
    export = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
    steps = []
    for step in range(args.steps):
        ids = zipf_batch(gen, model.config.vocab_size, args.batch, args.seq, device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        fresh = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
        steps.append({"step": step + 1, "loss": float(loss.detach()), "seconds": time.perf_counter() - t0,
                      "changed": changed_by_kind(export, fresh)})
        export = fresh
    later = steps[1:] or steps
    return {"lr": lr, "params": sum(p.numel() for p in params.values()), "steps": steps,
            "median_after_first": {k: statistics.median(s["changed"][k]["fraction"] for s in later)
                                   for k in (*KINDS, "all")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    p.add_argument("--steps", type=int, default=4, help="AdamW steps per learning rate (the first reported apart)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the model's 24 (a quicker look)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = [run_lr(float(lr), args, device) for lr in args.lrs.split(",")]
    report = {"model": "Qwen2.5-0.5B config, random init", "device": device, "batch": args.batch, "seq": args.seq,
              "layers": args.layers or 24, "results": results}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['model']}, {results[0]['params'] / 1e6:.0f}M params, {report['layers']} layers, "
          f"AdamW, batch {args.batch} x {args.seq} Zipf tokens, on {device}")
    print(f"{'lr':>7} {'step':>4} " + " ".join(f"{k:>10}" for k in (*KINDS, "all")) + "   (bf16 elements changed)")
    for r in results:
        for s in r["steps"]:
            print(f"{r['lr']:7.0e} {s['step']:4} " + " ".join(f"{s['changed'][k]['fraction']:10.2%}"
                                                            for k in (*KINDS, "all")))
        print(f"{r['lr']:7.0e} {'med':>4} " + " ".join(f"{r['median_after_first'][k]:10.2%}"
                                                       for k in (*KINDS, "all")) + "   (steps after the first)")


if __name__ == "__main__":
    main()
