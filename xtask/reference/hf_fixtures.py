"""Makes the Hugging Face fixtures of kiln's tests: a byte-level BPE tokenizer trained with the
`tokenizers` package, and tiny random Llama-family and GPT-2 checkpoints written by
`transformers`, each with its reference outputs (logits, loss, a greedy continuation).

    pip install torch transformers tokenizers safetensors peft
    python3 xtask/reference/hf_fixtures.py --text data/text/moby-dick.txt --out tests/fixtures/hf
    python3 xtask/reference/hf_fixtures.py --only qwen2,mistral --out tests/fixtures/hf

writes, under --out:
    tokenizer/tokenizer.json              the BPE tokenizer (vocabulary 384)
    llama/                                LlamaForCausalLM: GQA (4 heads, 2 key/value heads),
                                          attention and MLP biases, untied head, f32,
                                          one model.safetensors
    llama-sharded/                        the same weights in shards with their index
    llama-bf16/                           the same weights rounded to bf16, stored in bf16
    gpt2/                                 GPT2LMHeadModel (tied head, gelu_new), f32
    gpt2-legacy/                          the same weights as the original GPT-2 checkpoints
                                          name them (no `transformer.` prefix) with their
                                          `h.N.attn.bias` mask buffers
    qwen2/                                Qwen2ForCausalLM: GQA, biases on q/k/v only, untied
    mistral/                              MistralForCausalLM: GQA, sliding_window 8 (shorter than
                                          the 34-token prompt); transformers 5.x applies the window
                                          in eager attention through its sliding-window causal
                                          mask, so eager is used (the script checks that the
                                          logits differ from the same weights without a window)
    llama-tied/                           LlamaForCausalLM, tied head (no lm_head.weight), no biases
    llama3-rope/                          LlamaForCausalLM, rope_type llama3 (factor 8, low/high
                                          frequency factors 1/4, original context 32; head dim 16,
                                          so its 8 frequencies fall in all three regimes)
    llama-linear-rope/                    LlamaForCausalLM, rope_type linear (factor 2)
    phi3/                                 Phi3ForCausalLM: GQA, the fused qkv_proj and
                                          gate_up_proj, partial_rotary_factor 0.75 (12 of a
                                          head's 16 dimensions rotate, as in Phi-4-mini), tied
                                          head, sliding_window 8 (eager, as for mistral; the
                                          script checks that the window and the partial factor
                                          each change the logits)
each model folder with config.json, tokenizer.json and reference.json: the prompt's token ids,
the logits of the prompt (f32, computed in f32 with eager attention), the mean next-token loss
of the prompt, and the 32 tokens greedy decoding adds to it (`generate`, no sampling). The
smallest gap between the two most likely logits along the greedy path is printed: a fixture
whose continuation could flip on rounding is rejected (a seed is chosen until it is not).

`--only NAME[,NAME...]` makes only the named fixtures (any of the folders above, but
tokenizer, llama-sharded, llama-bf16 and gpt2-legacy come with llama and gpt2), reusing the
tokenizer at <out>/tokenizer/tokenizer.json instead of training one, and leaves the other
folders alone.

`--check DIR` instead loads a Hugging Face directory kiln exported into `transformers` (strict:
no missing or unexpected key) and prints its logits of the reference prompt beside kiln's
(`reference.json` that kiln wrote there), failing when they differ by more than 1e-5; a PEFT
adapter directory (`hf-adapter/`) is loaded by `peft` onto the checkpoint it names instead.
"""

import argparse
import json
import math
import os
import shutil
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, AutoModelForCausalLM)

VOCAB = 384
PROMPT = "Call me Ishmael. Some years ago, never mind how long"
NEW_TOKENS = 32


def train_tokenizer(text_path, out_dir):
    with open(text_path, encoding="utf-8") as f:
        text = f.read()[:300_000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    lines = [text[i:i + 2000] for i in range(0, len(text), 2000)]
    tok.train_from_iterator(lines, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return tok


def perturb(model, seed, scale):
    """Random weights of a larger scale than the default initialisation, and non-zero biases,
    so that every tensor matters to the logits and the greedy path has clear winners."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_" in name or name.startswith("transformer.ln_f"):
                if name.endswith("weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def reference(model, ids):
    model.eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        out = model(x, labels=x)
        logits = out.logits[0].float()
        generated = model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=0, attention_mask=torch.ones_like(x))
        cont = generated[0, len(ids):].tolist()
        # The smallest margin of the greedy path, from a cache-free forward at each position.
        full = model(generated[:, :-1]).logits[0].float()
        gaps = []
        for pos in range(len(ids) - 1, full.shape[0]):
            top = torch.topk(full[pos], 2).values
            gaps.append(float((top[0] - top[1]) / top.abs().max()))
    return {
        "prompt": PROMPT,
        "ids": ids,
        "logits_shape": list(logits.shape),
        "logits": [round(float(v), 7) for v in logits.flatten()],
        "loss": float(out.loss),
        "continuation": cont,
    }, min(gaps)


def save(model, tok_dir, out, ref, **kw):
    if os.path.exists(out):
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True, **kw)
    shutil.copy(os.path.join(tok_dir, "tokenizer.json"), out)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f)


def make(name, build, tok, tok_dir, out_root):
    ids = tok.encode(PROMPT).ids
    for seed in range(1, 50):
        torch.manual_seed(seed)
        model = build()
        perturb(model, seed, 0.15)
        ref, gap = reference(model, ids)
        if gap > 2e-3:
            break
    print(f"{name}: seed {seed}, {sum(p.numel() for p in model.parameters())} parameters, "
          f"loss {ref['loss']:.5f}, smallest greedy gap {gap:.2e}")
    return model, ref


LLAMA_SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)


def make_llama_family(tok, tok_dir, out_root):
    llama_config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    llama_config._attn_implementation = "eager"
    llama, ref = make("llama", lambda: LlamaForCausalLM(llama_config), tok, tok_dir, out_root)
    save(llama, tok_dir, os.path.join(out_root, "llama"), ref)
    save(llama, tok_dir, os.path.join(out_root, "llama-sharded"), ref, max_shard_size="200KB")

    # The same weights rounded to bf16 and stored so; the reference computes them in f32.
    rounded = LlamaForCausalLM(llama_config)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in llama.state_dict().items()})
    ref16, _ = reference(rounded, tok.encode(PROMPT).ids)
    save(rounded.to(torch.bfloat16), tok_dir, os.path.join(out_root, "llama-bf16"), ref16)


def make_gpt2_family(tok, tok_dir, out_root):
    gpt2_config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                             activation_function="gelu_new", bos_token_id=0, eos_token_id=0,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    gpt2_config._attn_implementation = "eager"
    gpt2, ref = make("gpt2", lambda: GPT2LMHeadModel(gpt2_config), tok, tok_dir, out_root)
    save(gpt2, tok_dir, os.path.join(out_root, "gpt2"), ref)
    legacy = os.path.join(out_root, "gpt2-legacy")
    save(gpt2, tok_dir, legacy, ref)
    from safetensors.torch import save_file
    state = {k[len("transformer."):]: v.contiguous() for k, v in gpt2.state_dict().items()
             if k.startswith("transformer.")}
    n = gpt2_config.n_positions
    for i in range(gpt2_config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
    os.remove(os.path.join(legacy, "model.safetensors"))
    save_file(state, os.path.join(legacy, "model.safetensors"), metadata={"format": "pt"})


def make_simple(name, cls, config, tok, tok_dir, out_root):
    config._attn_implementation = "eager"
    model, ref = make(name, lambda: cls(config), tok, tok_dir, out_root)
    save(model, tok_dir, os.path.join(out_root, name), ref)
    return model, ref


def make_qwen2(tok, tok_dir, out_root):
    config = Qwen2Config(**LLAMA_SIZES, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 10000.0},
                         tie_word_embeddings=False, use_sliding_window=False)
    model, _ = make_simple("qwen2", Qwen2ForCausalLM, config, tok, tok_dir, out_root)
    biases = [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert sorted({n.split(".")[-2] for n in biases}) == ["k_proj", "q_proj", "v_proj"], biases
    assert all(float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if n in biases)


def make_mistral(tok, tok_dir, out_root):
    sizes = dict(**LLAMA_SIZES, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 tie_word_embeddings=False)
    config = MistralConfig(**sizes, sliding_window=8)
    model, ref = make_simple("mistral", MistralForCausalLM, config, tok, tok_dir, out_root)
    ids = torch.tensor([ref["ids"]])
    assert len(ref["ids"]) > config.sliding_window
    # The window must change the logits: the same weights with no window (eager) differ, and
    # the window under sdpa gives the eager logits.
    with torch.no_grad():
        windowed = torch.tensor(ref["logits"]).view(ref["logits_shape"])
        full_config = MistralConfig(**sizes, sliding_window=None)
        full_config._attn_implementation = "eager"
        full = MistralForCausalLM(full_config).eval()
        full.load_state_dict(model.state_dict())
        no_window = full(ids).logits[0]
        sdpa_config = MistralConfig(**sizes, sliding_window=8)
        sdpa_config._attn_implementation = "sdpa"
        sdpa = MistralForCausalLM(sdpa_config).eval()
        sdpa.load_state_dict(model.state_dict())
        by_sdpa = sdpa(ids).logits[0]
        # The greedy continuation (generated with a cache) must be the argmax of a cache-free
        # windowed forward over prompt and continuation.
        seq = torch.tensor([ref["ids"] + ref["continuation"]])
        argmax = model(seq[:, :-1]).logits[0, len(ref["ids"]) - 1:].argmax(-1).tolist()
    scale = float(windowed.abs().max())
    d_none = (no_window - windowed).abs().max(dim=-1).values / scale
    d_sdpa = float((by_sdpa - windowed).abs().max()) / scale
    first = int((d_none > 1e-6).nonzero()[0]) if bool((d_none > 1e-6).any()) else None
    print(f"mistral: logits max |window 8 - no window| / max = {float(d_none.max()):.3e} "
          f"(positions 0..{config.sliding_window - 1}: {float(d_none[:config.sliding_window].max()):.1e}, "
          f"first differing position {first}); |eager - sdpa| / max = {d_sdpa:.1e}; "
          f"greedy continuation = cache-free argmax: {argmax == ref['continuation']}")
    assert float(d_none.max()) > 1e-3 and first == config.sliding_window, "window not applied"
    assert d_sdpa < 1e-5 and argmax == ref["continuation"]


def make_llama_tied(tok, tok_dir, out_root):
    config = LlamaConfig(**LLAMA_SIZES, rope_theta=10000.0, attention_bias=False,
                         mlp_bias=False, tie_word_embeddings=True)
    model, _ = make_simple("llama-tied", LlamaForCausalLM, config, tok, tok_dir, out_root)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    from safetensors import safe_open
    with safe_open(os.path.join(out_root, "llama-tied", "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()


def make_llama3_rope(tok, tok_dir, out_root):
    config = LlamaConfig(**LLAMA_SIZES, attention_bias=False, mlp_bias=False,
                         tie_word_embeddings=False, rope_parameters={
                             "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32})
    model, _ = make_simple("llama3-rope", LlamaForCausalLM, config, tok, tok_dir, out_root)
    inv = model.model.rotary_emb.inv_freq
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    print("llama3-rope: inv_freq", [f"{v:.6e}" for v in inv.tolist()])
    print("llama3-rope: unscaled", [f"{v:.6e}" for v in base.tolist()])
    print("llama3-rope: wavelength 2pi/f", [f"{2 * math.pi / v:.1f}" for v in base.tolist()])


def make_llama_linear_rope(tok, tok_dir, out_root):
    config = LlamaConfig(**LLAMA_SIZES, attention_bias=False, mlp_bias=False,
                         tie_word_embeddings=False, rope_parameters={
                             "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    model, _ = make_simple("llama-linear-rope", LlamaForCausalLM, config, tok, tok_dir,
                           out_root)
    print("llama-linear-rope: inv_freq", [f"{v:.6e}" for v in
                                          model.model.rotary_emb.inv_freq.tolist()])


def make_phi3(tok, tok_dir, out_root):
    def config(**changes):
        kw = dict(**LLAMA_SIZES, tie_word_embeddings=True, sliding_window=8, pad_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.75})
        kw.update(changes)
        c = Phi3Config(**kw)
        c._attn_implementation = "eager"
        return c
    model, ref = make_simple("phi3", Phi3ForCausalLM, config(), tok, tok_dir, out_root)
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("qkv_proj.weight") for n in names) and any(
        n.endswith("gate_up_proj.weight") for n in names), names
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(ref["ids"]) > model.config.sliding_window
    # The window and the partial rotary factor must each change the logits.
    ids = torch.tensor([ref["ids"]])
    logits = torch.tensor(ref["logits"]).view(ref["logits_shape"])
    scale = float(logits.abs().max())
    for what, changes in [("no window", dict(sliding_window=None)),
                          ("every dimension rotating", dict(rope_parameters={
                              "rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 1.0}))]:
        other = Phi3ForCausalLM(config(**changes)).eval()
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            d = float((other(ids).logits[0] - logits).abs().max()) / scale
        print(f"phi3: logits max |as made - {what}| / max = {d:.3e}")
        assert d > 1e-3, what
    seq = torch.tensor([ref["ids"] + ref["continuation"]])
    with torch.no_grad():
        argmax = model(seq[:, :-1]).logits[0, len(ref["ids"]) - 1:].argmax(-1).tolist()
    assert argmax == ref["continuation"], "greedy continuation = cache-free argmax"


FIXTURES = {
    "llama": make_llama_family,
    "gpt2": make_gpt2_family,
    "qwen2": make_qwen2,
    "mistral": make_mistral,
    "llama-tied": make_llama_tied,
    "llama3-rope": make_llama3_rope,
    "llama-linear-rope": make_llama_linear_rope,
    "phi3": make_phi3,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="data/text/moby-dick.txt")
    ap.add_argument("--out", default="tests/fixtures/hf")
    ap.add_argument("--check", help="a Hugging Face directory kiln exported")
    ap.add_argument("--only", help="comma-separated fixtures to make with the existing "
                    f"tokenizer: {', '.join(FIXTURES)}")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.check:
        return check(a.check)
    tok_dir = os.path.join(a.out, "tokenizer")
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in FIXTURES]
        if unknown:
            ap.error(f"unknown fixture(s) {unknown}; known: {', '.join(FIXTURES)}")
        tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    else:
        names = list(FIXTURES)
        tok = train_tokenizer(a.text, tok_dir)
    for name in names:
        FIXTURES[name](tok, tok_dir, a.out)


def check(directory):
    if os.path.exists(os.path.join(directory, "adapter_config.json")):
        return check_adapter(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                 dtype=torch.float32)
    from safetensors.torch import load_file
    files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    names = set()
    for f in files:
        names |= set(load_file(os.path.join(directory, f)).keys())
    expected = set(model.state_dict().keys())
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - names, names - expected
    with open(os.path.join(directory, "reference.json")) as f:
        ref = json.load(f)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ref["ids"]])).logits[0].flatten()
    kiln = torch.tensor(ref["logits"])
    scale = float(kiln.abs().max())
    diff = float((logits - kiln).abs().max()) / scale
    print(f"{directory}: {len(names)} tensors, missing {sorted(missing)}, unexpected "
          f"{sorted(unexpected)}; logits max |transformers - kiln| / max |kiln| = {diff:.2e}")
    if missing or unexpected or diff > 1e-5:
        sys.exit(1)


def check_adapter(directory):
    """A PEFT adapter directory kiln exported: loaded by `peft` onto the checkpoint its
    adapter_config.json names, it must give kiln's logits of the merged model."""
    from peft import PeftModel
    with open(os.path.join(directory, "adapter_config.json")) as f:
        base_dir = json.load(f)["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager",
                                                dtype=torch.float32)
    model = PeftModel.from_pretrained(base, directory)
    adapted = [n for n, _ in model.named_parameters() if "lora_" in n]
    with open(os.path.join(directory, "reference.json")) as f:
        ref = json.load(f)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ref["ids"]])).logits[0].flatten()
    kiln = torch.tensor(ref["logits"])
    diff = float((logits - kiln).abs().max()) / float(kiln.abs().max())
    print(f"{directory}: {len(adapted)} adapter tensors onto {base_dir}; logits max "
          f"|peft - kiln| / max |kiln| = {diff:.2e}")
    if not adapted or diff > 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    main()
