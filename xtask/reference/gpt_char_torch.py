#!/usr/bin/env python3
"""Character-level GPT reference step time in PyTorch (CPU, float32).

The recipe of configs/gpt-text.toml and gpt_char_jax.py: a pre-LN decoder of 4 layers,
d=128, 4 heads, context 64, MLP 512 with exact GELU, no biases, LayerNorm gains only, the head
tied to the token embedding; AdamW (0.9, 0.99), weight decay 0.1 on rank>=2 parameters,
gradients clipped to norm 1.0. It times optimizer steps on random windows of the text and
prints one line of JSON: the median milliseconds per step over the steps after a warm-up.

Usage:
    python3 xtask/reference/gpt_char_torch.py --data data/text/moby-dick.txt --batch 24 \
        --steps 30 [--threads 2]
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CTX, D, N_HEAD, N_LAYER, D_FF = 64, 128, 4, 4, 512


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D, bias=False)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.ln2 = nn.LayerNorm(D, bias=False)
        self.fc = nn.Linear(D, D_FF, bias=False)
        self.out = nn.Linear(D_FF, D, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (z.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, D)
        self.wpe = nn.Embedding(CTX, D)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(D, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * N_LAYER) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    train = ids[: int(round(0.9 * len(ids)))]

    model = Gpt(len(chars))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.99), eps=1e-8,
    )
    times = []
    for step in range(args.warmup + args.steps):
        starts = torch.randint(0, len(train) - CTX - 1, (args.batch,))
        windows = torch.stack([train[s : s + CTX + 1] for s in starts])
        t0 = time.perf_counter()
        loss = model(windows[:, :-1], windows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    print(json.dumps({
        "ms_per_step": 1e3 * statistics.median(times),
        "batch": args.batch,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "final_loss": loss.item(),
    }))


if __name__ == "__main__":
    main()
