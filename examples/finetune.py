"""Fine-tunes a small randomly initialised MoE language model (Qwen3-MoE or OLMoE config, no
download) with experts_implementation="moe_xpu" on a synthetic task, and the same model with the
eager backend from the same seed, side by side: prints both losses every few steps and whether
they agree within the tolerance, and with --plot writes the loss curves.

The task: sequences of random tokens whose second half repeats the first (the model learns to
copy), so the loss falls well below log(vocab) within a few hundred AdamW steps.

    python examples/finetune.py                      # Qwen3-MoE config, 300 steps
    python examples/finetune.py --family olmoe --steps 200 --plot loss.png
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import moe_xpu.integrations.transformers as moe_xpu_hf

SMALL = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.05)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, intermediate_size=128, moe_intermediate_size=32,
                                                     num_experts=8, num_experts_per_tok=2, head_dim=16,
                                                     norm_topk_prob=True),
    "olmoe": lambda: transformers.OlmoeConfig(**SMALL, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
}
# The two runs use the same kernels' semantics in a different summation order, so their losses
# drift apart by rounding that training amplifies; this is the agreement the example checks.
TOLERANCE = 0.05  # relative, on the mean loss of the last 20 steps


def batches(steps: int, batch: int, length: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        half = torch.randint(1, vocab, (batch, length // 2), generator=gen)
        yield torch.cat([half, half], dim=1)


def train(family: str, implementation: str, steps: int, seed: int) -> tuple[list[float], float]:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](),
                                                          experts_implementation=implementation)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    start = time.perf_counter()
    for ids in batches(steps, batch=8, length=32, vocab=SMALL["vocab_size"], seed=seed):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PNG", help="write the two loss curves")
    args = parser.parse_args(argv)

    moe_xpu_hf.register()
    ours, ours_s = train(args.family, "moe_xpu", args.steps, args.seed)
    eager, eager_s = train(args.family, "eager", args.steps, args.seed)
    print(f"{args.family}, {args.steps} AdamW steps, seed {args.seed}")
    print(f"{'step':>6} {'moe_xpu loss':>13} {'eager loss':>11}")
    for step in sorted(set(range(0, args.steps, max(1, args.steps // 10))) | {args.steps - 1}):
        print(f"{step:>6} {ours[step]:>13.4f} {eager[step]:>11.4f}")
    tail = min(20, args.steps)
    mean_ours, mean_eager = sum(ours[-tail:]) / tail, sum(eager[-tail:]) / tail
    gap = abs(mean_ours - mean_eager) / mean_eager
    agree = gap <= TOLERANCE
    print(f"mean loss of the last {tail} steps: moe_xpu {mean_ours:.4f}, eager {mean_eager:.4f} "
          f"(relative gap {gap:.2%}, tolerance {TOLERANCE:.0%}: {'agree' if agree else 'DIFFER'})")
    print(f"training time: moe_xpu {ours_s:.1f} s, eager {eager_s:.1f} s")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(ours, label='experts_implementation="moe_xpu"')
        ax.plot(eager, label='experts_implementation="eager"', linestyle="--")
        ax.set_xlabel("AdamW step")
        ax.set_ylabel("training loss")
        ax.set_title(f"{args.family}: fine-tuning, same seed")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
