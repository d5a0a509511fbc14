"""moe_xpu inside Intel Extension for PyTorch models (IPEX 2.8, torch 2.8): a small MoE model from
a transformers config (random weights, no download) is optimized with ``ipex.llm.optimize``; it
generates greedily on IPEX's own MoE kernels, then with ``moe_xpu.integrations.ipex.enabled()``.
Prints whether the tokens agree, the largest logit difference and both times; then the same for
an ``ipex.llm.modules.GatedMLPMOE`` layer. Run it in the IPEX environment: ``make demo-ipex``.

    python examples/ipex_swap.py                     # Mixtral, float32
    python examples/ipex_swap.py --family qwen3_moe  # Qwen3-MoE
    python examples/ipex_swap.py --dtype bfloat16    # where IPEX's bf16 prepacking runs (AVX-512)
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=UserWarning)  # IPEX's and transformers' own notices
warnings.filterwarnings("ignore", category=FutureWarning)

import intel_extension_for_pytorch as ipex  # noqa: E402
import transformers  # noqa: E402

import moe_xpu.integrations.ipex as moe_xpu_ipex  # noqa: E402

SMALL = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.1)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, intermediate_size=512, num_local_experts=8,
                                                  num_experts_per_tok=2, architectures=["MixtralForCausalLM"]),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, intermediate_size=1024, moe_intermediate_size=256,
                                                     num_experts=32, num_experts_per_tok=4, head_dim=64,
                                                     architectures=["Qwen3MoeForCausalLM"]),
}


def timed_generate(model, prompt, new_tokens):
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up, kernel build
        start = time.perf_counter()
        tokens = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
        logits = model(prompt).logits
    return tokens, logits, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="mixtral")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[args.family]()).eval().to(dtype)
    model = ipex.llm.optimize(model, dtype=dtype, inplace=True, deployment_mode=False)
    prompt = torch.randint(0, SMALL["vocab_size"], (1, args.prompt_tokens))
    print(f"{args.family}, {args.dtype}, ipex.llm.optimize'd; IPEX {ipex.__version__}, torch {torch.__version__}")

    ipex_tokens, ipex_logits, ipex_s = timed_generate(model, prompt, args.new_tokens)
    with moe_xpu_ipex.enabled():
        ours_tokens, ours_logits, ours_s = timed_generate(model, prompt, args.new_tokens)
    agree = torch.equal(ipex_tokens, ours_tokens)
    print(f"greedy tokens agree: {agree}; max logit difference {(ipex_logits - ours_logits).abs().max().item():.2e}")
    print(f"generate {args.new_tokens} tokens: IPEX {ipex_s * 1e3:.0f} ms, with moe_xpu {ours_s * 1e3:.0f} ms "
          f"({ipex_s / ours_s:.2f}x)")

    E, H, I, k, T = 32, 512, 256, 4, 16
    layer = ipex.llm.modules.GatedMLPMOE((torch.randn(E, 2 * I, H) * 0.05).to(dtype),
                                         (torch.randn(E, H, I) * 0.05).to(dtype), use_prepack=dtype == torch.float32)
    x, logits = torch.randn(T, H).to(dtype), torch.randn(T, E)
    ipex_out = layer(x, False, k, logits, True)
    with moe_xpu_ipex.enabled():
        ours_out = layer(x, False, k, logits, True)
    print(f"GatedMLPMOE (E={E}, H={H}, I={I}, top-{k}, {T} tokens): max difference "
          f"{(ipex_out.float() - ours_out.float()).abs().max().item():.2e}")
    if not agree:
        raise SystemExit("the greedy tokens differ")


if __name__ == "__main__":
    main()
