"""experts_implementation="moe_xpu" in small randomly initialised transformers models (no
downloads): logits match the eager experts and greedy generation yields the same tokens."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="the experts interface arrived in transformers 5")

import moe_xpu  # noqa: E402
import moe_xpu.integrations.transformers as moe_xpu_hf  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.15,
              tie_word_embeddings=False)

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=8,
                                                  num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=40,
                                                     shared_expert_intermediate_size=32, num_experts=8,
                                                     num_experts_per_tok=2, decoder_sparse_step=1,
                                                     norm_topk_prob=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=40,
                                                     num_experts=8, num_experts_per_tok=2, head_dim=16,
                                                     decoder_sparse_step=1, norm_topk_prob=True),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=40, num_experts=8,
                                              num_experts_per_tok=2),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=40,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16),
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, intermediate_size=48, num_local_experts=8,
                                                 num_experts_per_tok=2, head_dim=16, sliding_window=16),
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    moe_xpu_hf.register()


def build(name: str, implementation: str, dtype=torch.float32):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=implementation,
                                                          dtype=dtype)
    return model.eval()


def experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") or hasattr(m, "up_proj") and hasattr(m, "num_experts")]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_match_eager(name):
    eager = build(name, "eager")
    ours = build(name, "moe_xpu")
    ours.load_state_dict(eager.state_dict())
    assert experts_modules(ours), "the model has no experts module using the interface"
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = eager(ids).logits
        out = ours(ids).logits
        assert ref.abs().max() > 0.05, "logits too small for the comparison to mean anything"
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        gen_ref = eager.generate(ids, max_new_tokens=8, do_sample=False)
        gen_out = ours.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(gen_out, gen_ref)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_experts_module_matches_eager(name):
    """One experts module in bfloat16, same inputs: moe_xpu within twice eager's own error
    against a float64 evaluation of the same module (a whole-model bf16 comparison would mostly
    measure router near-ties flipping on rounding)."""
    model = build(name, "moe_xpu", torch.bfloat16)
    experts = experts_modules(model)[0]
    T, k = 24, 2
    hidden = torch.randn(T, model.config.hidden_size, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts.num_experts)[:k] for _ in range(T)])
    weights = torch.rand(T, k).softmax(-1).to(torch.bfloat16)
    with torch.no_grad():
        out = experts(hidden, ids, weights).double()
        experts.config._experts_implementation = "eager"
        eager = experts(hidden, ids, weights).double()
        exact = experts.double()(hidden.double(), ids, weights.double())
    err, eager_err = (out - exact).abs().max().item(), (eager - exact).abs().max().item()
    assert err <= 2 * eager_err + 1e-2 * exact.abs().max().item(), (err, eager_err)


def test_standard_layout_takes_the_fused_path(monkeypatch):
    calls = []
    real = moe_xpu_hf.fused.fused_moe
    monkeypatch.setattr(moe_xpu_hf.fused, "fused_moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = build("mixtral", "moe_xpu")
    with torch.no_grad():
        model(torch.randint(0, 96, (1, 5)))
    assert calls, "Mixtral's experts should run fused_moe"


def test_unsupported_module_raises_clear_error():
    class NotAnExperts(torch.nn.Module):
        pass

    with pytest.raises(NotImplementedError, match="experts interface"):
        moe_xpu_hf.experts_forward(NotAnExperts(), torch.randn(3, 8), torch.zeros(3, 1, dtype=torch.long),
                                   torch.ones(3, 1))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_gradients_match_eager(name):
    """loss.backward() through a model with experts_implementation="moe_xpu": every parameter's
    gradient (experts, router, attention, embeddings) matches the eager backend's."""
    eager = build(name, "eager").train()
    ours = build(name, "moe_xpu").train()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    eager(ids, labels=ids).loss.backward()
    ours(ids, labels=ids).loss.backward()
    theirs = dict(eager.named_parameters())
    checked = 0
    for pname, p in ours.named_parameters():
        ref = theirs[pname].grad
        if ref is None:
            assert p.grad is None or not p.grad.any(), pname
            continue
        assert p.grad is not None, f"{pname} got no gradient"
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-5, msg=pname)
        checked += "experts" in pname
    assert checked >= 2, "the experts' weights must be among the checked gradients"


def test_finetune_example_agrees_with_eager(capsys, tmp_path):
    """examples/finetune.py: a short run trains both backends from one seed, their losses agree
    within the example's tolerance, and it writes the loss plot."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "finetune.py"
    spec = importlib.util.spec_from_file_location("finetune_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    plot = tmp_path / "loss.png"
    assert example.main(["--steps", "40", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "agree" in out and plot.stat().st_size > 0


QUANT_CONFIGS = {  # expert widths the 4-bit group sizes and MXFP4's blocks of 32 divide
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=8,
                                                  num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=64,
                                                     num_experts=8, num_experts_per_tok=2, head_dim=16,
                                                     decoder_sparse_step=1, norm_topk_prob=True),
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, intermediate_size=64, num_local_experts=8,
                                                 num_experts_per_tok=2, head_dim=16, sliding_window=16),
}


def build_quant_family(name: str, implementation: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(QUANT_CONFIGS[name](),
                                                         experts_implementation=implementation).eval()


@pytest.mark.parametrize("fmt,kw", [("int8", {}), ("int4", {"group_size": 32}), ("fp8", {}), ("mxfp4", {})],
                         ids=["int8", "int4", "fp8", "mxfp4"])
@pytest.mark.parametrize("name", list(QUANT_CONFIGS))
def test_quantize_experts_in_place_matches_eager_on_the_dequantized_weights(name, fmt, kw):
    """quantize_experts(model, fmt) converts every experts module (GPT-OSS's transposed,
    interleaved, biased layout included) and the model's logits equal the eager model's with each
    expert weight replaced by the value its quantized form stands for."""
    ours = build_quant_family(name, "eager")
    eager = build_quant_family(name, "eager")
    converted = moe_xpu_hf.quantize_experts(ours, fmt, **kw)
    modules = experts_modules(ours)
    assert converted == len(modules) == ours.config.num_hidden_layers
    assert ours.config._experts_implementation == moe_xpu_hf.NAME
    for module, reference in zip(modules, experts_modules(eager)):
        first = "gate_up_proj" if module.has_gate else "up_proj"
        for attr in (first, "down_proj"):
            q = getattr(module, attr)
            assert isinstance(q, moe_xpu.QuantizedExperts) and q.format == fmt
            assert attr not in dict(module.named_parameters())
            w = q.dequantize()
            getattr(reference, attr).data.copy_(w if module.is_transposed else w.transpose(1, 2))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = eager(ids).logits
        out = ours(ids).logits
    assert ref.abs().max() > 0.05
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_quantize_experts_errors():
    model = build_quant_family("mixtral", "eager")
    with pytest.raises(moe_xpu.MoeXpuInputError, match="group_size"):
        moe_xpu_hf.quantize_experts(model, "int4", group_size=48)
    assert isinstance(experts_modules(model)[0].gate_up_proj, torch.nn.Parameter), "a failed call changes nothing"
    with pytest.raises(moe_xpu_hf.UnsupportedExpertsLayout, match="no experts module"):
        moe_xpu_hf.quantize_experts(torch.nn.Linear(4, 4), "int8")


def test_generate_example_with_quantized_experts(capsys):
    """examples/hf_generate.py --quant: generates with quantized experts and reports the agreement
    with the unquantized model (a rate over the generated positions and a finite logit gap)."""
    import importlib.util
    import pathlib
    import re

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_generate.py"
    spec = importlib.util.spec_from_file_location("hf_generate_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--family", "mixtral", "--quant", "int4", "--group-size", "64", "--prompt-tokens", "6",
                  "--new-tokens", "4"])
    out = capsys.readouterr().out
    rate = re.search(r"top-1 agreement with the unquantized model: ([0-9.]+)% of 4 generated positions", out)
    gap = re.search(r"max logit difference: ([0-9.]+)", out)
    assert rate and 0.0 <= float(rate.group(1)) <= 100.0, out
    assert gap and float(gap.group(1)) > 0.0, out  # quantization changes the logits


def test_shard_experts_refuses_layouts_it_cannot_run():
    """Expert parallelism runs the standard layout; GPT-OSS's own gate is refused before any
    process-group call."""
    model = build_quant_family("gpt_oss", "moe_xpu")
    with pytest.raises(moe_xpu_hf.UnsupportedExpertsLayout, match="standard float experts layout"):
        moe_xpu_hf.shard_experts(model)
