"""The main job: a small MoE language model from a transformers config (random weights, no
download) generates greedily with experts_implementation="moe_xpu" and with "eager"; prints
whether the tokens agree and the time of each.

    python examples/hf_generate.py                       # built-in small Qwen3-MoE config
    python examples/hf_generate.py --family mixtral      # or: qwen2_moe, olmoe, deepseek_v3, gpt_oss
    python examples/hf_generate.py --config path/or/name # your own config (config.json only,
                                                          # from a local folder or the hub cache)
    python examples/hf_generate.py --quant int4          # quantized experts (int8, int4, fp8, mxfp4)
                                                          # against the unquantized model

With --quant the experts' weights are quantized in place (moe_xpu.integrations.transformers.
quantize_experts) and the quantized model generates; the unquantized model then reads the same
tokens, and the script prints how often the two agree on the next token over the generated
positions (top-1 agreement) and the largest logit difference: quantization changes the logits, so
the tokens are not expected to be identical.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers

import moe_xpu.integrations.transformers as moe_xpu_hf

SMALL = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.5)

FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, intermediate_size=1024, moe_intermediate_size=256,
                                                     num_experts=32, num_experts_per_tok=4, head_dim=64),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, intermediate_size=512, num_local_experts=8,
                                                  num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, intermediate_size=1024, moe_intermediate_size=256,
                                                     shared_expert_intermediate_size=512, num_experts=32,
                                                     num_experts_per_tok=4),
    "olmoe": lambda: transformers.OlmoeConfig(**SMALL, intermediate_size=256, num_experts=32, num_experts_per_tok=4),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": 8}, intermediate_size=1024, moe_intermediate_size=256,
        n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=1,
        topk_group=1, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64),
    "gpt_oss": lambda: transformers.GptOssConfig(**SMALL, intermediate_size=256, num_local_experts=32,
                                                 num_experts_per_tok=4, head_dim=64, sliding_window=128),
}


def build(config, implementation: str, dtype):
    torch.manual_seed(0)  # same random weights for every model built
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=implementation, dtype=dtype)
    return model.eval()


def generate(model, prompt: torch.Tensor, new_tokens: int):
    with torch.no_grad():
        start = time.perf_counter()
        tokens = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    return tokens, time.perf_counter() - start


def generate_both(ours, eager, prompt: torch.Tensor, new_tokens: int, runs: int = 3):
    """Each model's tokens and median generation time over ``runs`` runs, the two models
    alternating (a slow spell of the machine falls on both alike), after a warm-up each."""
    models = (ours, eager)
    for model in models:
        generate(model, prompt, 2)  # warm-up (and kernel build)
    tokens, times = [None, None], [[], []]
    for _ in range(runs):
        for i, model in enumerate(models):
            tokens[i], seconds = generate(model, prompt, new_tokens)
            times[i].append(seconds)
    return tokens[0], statistics.median(times[0]), tokens[1], statistics.median(times[1])


def compare_quantized(config, args, prompt, dtype) -> None:
    """Generates with quantized experts; reports agreement with the unquantized model."""
    quantized = build(config, moe_xpu_hf.NAME, dtype)
    count = moe_xpu_hf.quantize_experts(quantized, args.quant, group_size=args.group_size)
    generate(quantized, prompt, 2)  # warm-up (and kernel build)
    tokens, seconds = generate(quantized, prompt, args.new_tokens)
    reference = build(config, moe_xpu_hf.NAME, dtype)
    with torch.no_grad():  # both models read the quantized model's sequence (teacher forcing)
        positions = slice(args.prompt_tokens - 1, tokens.shape[1] - 1)  # the logits that chose each new token
        ours = quantized(tokens).logits[0, positions].float()
        theirs = reference(tokens).logits[0, positions].float()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"quantized experts: {args.quant} ({count} experts modules), {seconds:.2f} s for "
          f"{args.new_tokens} tokens")
    print(f"tokens: {tokens[0, args.prompt_tokens:].tolist()}")
    print(f"top-1 agreement with the unquantized model: {agree:.1%} of {ours.shape[0]} generated positions")
    print(f"max logit difference: {(ours - theirs).abs().max().item():.4f} "
          f"(logits up to {theirs.abs().max().item():.2f})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    parser.add_argument("--config", help="a model name or folder whose config.json to use instead")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--quant", choices=["int8", "int4", "fp8", "mxfp4"],
                        help="quantize the experts and compare with the unquantized model")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size along K (32, 64, 128)")
    args = parser.parse_args(argv)

    moe_xpu_hf.register()
    config = transformers.AutoConfig.from_pretrained(args.config) if args.config else FAMILIES[args.family]()
    dtype = getattr(torch, args.dtype)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    print(f"model: {type(config).__name__} ({config.num_hidden_layers} layers, hidden {config.hidden_size}), "
          f"random weights, {args.dtype}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new")

    if args.quant:
        compare_quantized(config, args, prompt, dtype)
        return
    # Each model gets a config of its own: the experts implementation is read from it at call time.
    ours_model = build(copy.deepcopy(config), moe_xpu_hf.NAME, dtype)
    eager_model = build(copy.deepcopy(config), "eager", dtype)
    ours, t_ours, eager, t_eager = generate_both(ours_model, eager_model, prompt, args.new_tokens)
    new = slice(args.prompt_tokens, None)
    print(f"moe_xpu tokens: {ours[0, new].tolist()}")
    print(f"eager tokens:   {eager[0, new].tolist()}")
    print(f"moe_xpu {t_ours:.3f} s, eager {t_eager:.3f} s ({t_eager / t_ours:.2f}x; medians of 3 runs each, alternating)")
    if torch.equal(ours, eager):
        print("tokens agree")
    else:
        print("tokens DIFFER")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
