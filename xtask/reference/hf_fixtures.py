"""Makes the Hugging Face fixtures of kiln's tests: a byte-level BPE tokenizer trained with the
`tokenizers` package, and tiny random Llama-family and GPT-2 checkpoints written by
`transformers`, each with its reference outputs (logits, loss, a greedy continuation).

    pip install torch transformers tokenizers safetensors
    python3 xtask/reference/hf_fixtures.py --text data/text/moby-dick.txt --out tests/fixtures/hf

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
each model folder with config.json, tokenizer.json and reference.json: the prompt's token ids,
the logits of the prompt (f32, computed in f32 with eager attention), the mean next-token loss
of the prompt, and the 32 tokens greedy decoding adds to it (`generate`, no sampling). The
smallest gap between the two most likely logits along the greedy path is printed: a fixture
whose continuation could flip on rounding is rejected (a seed is chosen until it is not).

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
                          AutoModelForCausalLM)

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="data/text/moby-dick.txt")
    ap.add_argument("--out", default="tests/fixtures/hf")
    ap.add_argument("--check", help="a Hugging Face directory kiln exported")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.check:
        return check(a.check)
    tok_dir = os.path.join(a.out, "tokenizer")
    tok = train_tokenizer(a.text, tok_dir)

    llama_config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    llama_config._attn_implementation = "eager"
    llama, ref = make("llama", lambda: LlamaForCausalLM(llama_config), tok, tok_dir, a.out)
    save(llama, tok_dir, os.path.join(a.out, "llama"), ref)
    save(llama, tok_dir, os.path.join(a.out, "llama-sharded"), ref, max_shard_size="200KB")

    # The same weights rounded to bf16 and stored so; the reference computes them in f32.
    rounded = LlamaForCausalLM(llama_config)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in llama.state_dict().items()})
    ref16, _ = reference(rounded, tok.encode(PROMPT).ids)
    save(rounded.to(torch.bfloat16), tok_dir, os.path.join(a.out, "llama-bf16"), ref16)

    gpt2_config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                             activation_function="gelu_new", bos_token_id=0, eos_token_id=0,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    gpt2_config._attn_implementation = "eager"
    gpt2, ref = make("gpt2", lambda: GPT2LMHeadModel(gpt2_config), tok, tok_dir, a.out)
    save(gpt2, tok_dir, os.path.join(a.out, "gpt2"), ref)
    legacy = os.path.join(a.out, "gpt2-legacy")
    save(gpt2, tok_dir, legacy, ref)
    from safetensors.torch import save_file
    state = {k[len("transformer."):]: v.contiguous() for k, v in gpt2.state_dict().items()
             if k.startswith("transformer.")}
    n = gpt2_config.n_positions
    for i in range(gpt2_config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
    os.remove(os.path.join(legacy, "model.safetensors"))
    save_file(state, os.path.join(legacy, "model.safetensors"), metadata={"format": "pt"})


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
