#!/usr/bin/env python3
"""The Llama recipe's step time in plain PyTorch, for machines without `transformers`.

The model of `transformers`' `LlamaForCausalLM` written out in PyTorch alone, with its
parameter names: RMSNorm computed in float32, rotary positions with the halves rotated,
grouped-query attention through `scaled_dot_product_attention` with `is_causal` and
`enable_gqa` (as transformers 5 calls it), SwiGLU, the head tied to the token embedding where
the configuration says so. A lent GPU with PyTorch and nothing else can then time kiln's Llama
recipe beside kiln. The architecture comes from a Hugging Face `config.json` (kiln writes one
into `RUN/hf/` when a run of configs/llama-text*.toml ends); without one, it is
configs/llama-text-gpu.toml's shape (8 × 512, 8 query and 4 key/value heads, SwiGLU 1376, a
vocabulary of 1,024). What the twin does not compute (biases, a sliding window, another rotary,
another family) is refused. The token ids are drawn uniformly from the vocabulary (the step's
work does not depend on them). AdamW (0.9, 0.99), weight decay 0.1 on rank>=2 parameters,
gradients clipped to norm 1.0. Prints one line of JSON: the median milliseconds per step after
a warm-up, tokens per second, and the card's peak memory. `--tf32` lets a card compute f32
products in TF32, as CubeCL's tuner does for kiln (PyTorch's default does not).

`--check` (needs `transformers`) builds `LlamaForCausalLM` from the same configuration, loads
this model's parameters into it and compares the logits and every parameter's gradient of the
loss on one batch, in float32 on the CPU: the largest difference relative to each tensor's
largest value must be at most 1e-5.

Usage:
    python3 xtask/reference/llama_torch.py [--config RUN/hf/config.json] --batch 32 \
        --context 256 --device cuda --precision bf16-mixed [--compile]
    python3 xtask/reference/llama_torch.py --check [--config RUN/hf/config.json]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_ranks import recipe_adamw

# SDPA's own grouped-query attention (PyTorch 2.5 and later), which transformers 5 uses.
GQA_IN_SDPA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)

# configs/llama-text-gpu.toml's model, as kiln's Hugging Face export names it.
GPU_SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def settings(path):
    """The model's settings from a Hugging Face config.json (or the GPU shape without one)."""
    if path is None:
        s = dict(GPU_SHAPE)
        s["head_dim"] = s["hidden_size"] // s["num_attention_heads"]
        return s
    with open(path, encoding="utf-8") as f:
        c = json.load(f)
    # What this twin does not compute is refused, not ignored.
    if c.get("model_type", "llama") != "llama":
        raise SystemExit(f"{path}: model_type {c['model_type']!r}: this twin is a Llama only")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise SystemExit(f"{path}: {key} = true: this twin has no biases")
    if c.get("sliding_window") is not None:
        raise SystemExit(f"{path}: sliding_window: this twin attends to every earlier position")
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kind = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise SystemExit(f"{path}: rope type {kind!r}: this twin computes the default rotary only")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in c]
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)}")
    s = {k: c[k] for k in GPU_SHAPE if k in c}
    s["rope_theta"] = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    s.setdefault("num_key_value_heads", s["num_attention_heads"])
    s.setdefault("max_position_embeddings", 2048)
    s.setdefault("rms_norm_eps", 1e-6)
    s.setdefault("tie_word_embeddings", False)
    s["head_dim"] = c.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]
    return s


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, s):
        super().__init__()
        d, hd = s["hidden_size"], s["head_dim"]
        self.heads, self.kv_heads, self.head_dim = s["num_attention_heads"], s["num_key_value_heads"], hd
        self.q_proj = nn.Linear(d, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        gqa = {}
        if self.kv_heads != self.heads:
            if GQA_IN_SDPA:
                # As transformers 5 calls it without a mask: SDPA pairs each key/value head
                # with its heads // kv_heads query heads itself.
                gqa = {"enable_gqa": True}
            else:
                # Older PyTorch: each key/value head repeated for its query heads (repeat_kv).
                k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
                v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, s):
        super().__init__()
        d, f = s["hidden_size"], s["intermediate_size"]
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.input_layernorm = RMSNorm(s["hidden_size"], s["rms_norm_eps"])
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s["hidden_size"], s["rms_norm_eps"])
        self.mlp = Mlp(s)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.embed_tokens = nn.Embedding(s["vocab_size"], s["hidden_size"])
        self.layers = nn.ModuleList(Layer(s) for _ in range(s["num_hidden_layers"]))
        self.norm = RMSNorm(s["hidden_size"], s["rms_norm_eps"])
        hd = s["head_dim"]
        inv = 1.0 / (s["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        # The rotary angles in float32 whatever the autocast, then in the embedding's type
        # (float32 under autocast too), as transformers' LlamaRotaryEmbedding returns them.
        with torch.autocast(ids.device.type, enabled=False):
            pos = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)
            angles = torch.outer(pos, self.inv_freq)
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Llama(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.model = Body(s)
        self.lm_head = nn.Linear(s["hidden_size"], s["vocab_size"], bias=False)
        if s["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# `--check`'s bound: the largest difference relative to each tensor's largest value.
CHECK_TOLERANCE = 1e-5


def check(s, config_path, seed):
    """This model against transformers' LlamaForCausalLM with the same parameters."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    twin = Llama(s)
    if config_path:
        config = LlamaConfig.from_json_file(config_path)
    else:
        config = LlamaConfig(**s)
    config._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(config).float()
    missing, unexpected = hf.load_state_dict(twin.state_dict(), strict=False)
    if missing or unexpected:
        raise SystemExit(f"parameter names differ: missing {missing}, unexpected {unexpected}")
    ids = torch.randint(0, s["vocab_size"], (3, 37))
    runs = {}
    for name, model in (("twin", twin), ("transformers", hf)):
        model.train()
        model.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        logits = logits.logits if hasattr(logits, "logits") else logits
        loss_of(logits, ids[:, 1:]).backward()
        runs[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (a, ga), (b, gb) = runs["twin"], runs["transformers"]

    def rel(x, y):
        return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()

    diffs = {"logits": rel(a, b)}
    for n, g in ga.items():
        diffs[n] = rel(g, gb[n])
    name, largest = max(diffs.items(), key=lambda kv: kv[1])
    print(json.dumps({
        "check": "pass" if largest <= CHECK_TOLERANCE else "FAIL",
        "largest_relative_difference": largest,
        "where": name,
        "tensors_compared": len(diffs),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }))
    if largest > CHECK_TOLERANCE:
        raise SystemExit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", help="a Hugging Face config.json (kiln's RUN/hf/config.json)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--precision", choices=["f32", "bf16-mixed"], default="f32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--tf32", action="store_true",
                    help="a card's f32 products in TF32 (as CubeCL's tuner picks them for kiln)")
    ap.add_argument("--check", action="store_true", help="compare with transformers' Llama")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    s = settings(args.config)
    if args.check:
        return check(s, args.config, args.seed)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = Llama(s).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    step_model = torch.compile(model) if args.compile else model
    opt = recipe_adamw(model, lr=6e-4)
    cuda = device.type == "cuda"
    gqa = s["num_key_value_heads"] != s["num_attention_heads"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    times = []
    for step in range(args.warmup + args.steps):
        windows = torch.randint(0, s["vocab_size"], (args.batch, args.context + 1))
        t0 = time.perf_counter()
        windows = windows.to(device)
        with autocast:
            loss = loss_of(step_model(windows[:, :-1]), windows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    print(json.dumps({
        "ms_per_step": ms,
        "tokens_per_s": args.batch * args.context * 1e3 / ms,
        "batch": args.batch,
        "context": args.context,
        "parameters": parameters,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "precision": args.precision,
        "compiled": args.compile,
        "tf32": args.tf32,
        "attention": "sdpa, enable_gqa" if GQA_IN_SDPA and gqa else "sdpa",
        "adamw": "foreach" if cuda else "for-loop",  # PyTorch's default on each device
        "threads": torch.get_num_threads(),
        "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "reserved_memory_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
        "torch": torch.__version__,
        "final_loss": loss.item(),
    }))


if __name__ == "__main__":
    main()
