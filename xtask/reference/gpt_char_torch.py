#!/usr/bin/env python3
"""Character-level GPT reference step time in PyTorch (CPU, float32).

The recipe of configs/gpt-text.toml and gpt_char_jax.py: a pre-LN decoder of 4 layers,
d=128, 4 heads, context 64, MLP 512 with exact GELU, no biases, LayerNorm gains only, the head
tied to the token embedding; AdamW (0.9, 0.99), weight decay 0.1 on rank>=2 parameters,
gradients clipped to norm 1.0. It times optimizer steps on random windows of the text and
prints one line of JSON: the median milliseconds per step over the steps after a warm-up.
`--shape gpu` times configs/gpt-text-gpu.toml's model instead (6 layers, d=384, 6 heads,
context 256), `--device cuda` on a GPU (synchronised at each step's end), `--precision
bf16-mixed` under bf16 autocast (`--tf32`: f32 products in TF32 on a card, as CubeCL's tuner
computes kiln's; PyTorch's default does not), `--dropout` with nanoGPT's dropouts (embeddings, attention
weights, both residual branches), where kiln's GPT applies them, `--compile` with the model
under `torch.compile` (one process; its compilation falls in the warm-up steps).

With `--world N --mode ddp|zero2|zero3` it times the same step on N processes of one thread each
(torch.distributed over gloo on this machine, each rank a local batch of batch/N, the global
batch the same): `ddp` wraps the model in DistributedDataParallel, `zero2` shards it with FSDP2
(`fully_shard` per block and the root, reshard_after_forward=False: parameters kept gathered
between forward and backward, gradients and optimizer state sharded) and `zero3` with
reshard_after_forward=True (parameters gathered again for the backward). Rank 0 prints the
median of the ranks' slowest step.

Usage:
    python3 xtask/reference/gpt_char_torch.py --data data/text/moby-dick.txt --batch 24 \
        --steps 30 [--threads 2] [--world 2 --mode ddp]
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_ranks import add_world_args, join, launch, leave, recipe_adamw, slowest

# (context, width, heads, layers): `cpu` is configs/gpt-text.toml's, `gpu` configs/gpt-text-gpu.toml's.
SHAPES = {"cpu": (64, 128, 4, 4), "gpu": (256, 384, 6, 6)}


class Block(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.d, self.n_head, self.dropout = d, n_head, dropout
        self.ln1 = nn.LayerNorm(d, bias=False)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        p = self.dropout if self.training else 0.0
        q, k, v = self.qkv(self.ln1(x)).split(self.d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), p)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), p)


class Gpt(nn.Module):
    def __init__(self, vocab, shape, dropout):
        super().__init__()
        ctx, d, n_head, n_layer = shape
        self.dropout = dropout
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = F.dropout(self.wte(idx) + self.wpe(pos), self.dropout if self.training else 0.0)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def main():
    launch(train, parse())


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    ap.add_argument("--seed", type=int, default=1)
    add_world_args(ap, port=29517)
    ap.add_argument("--mode", choices=["ddp", "zero2", "zero3"], default="ddp")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (one process)")
    ap.add_argument("--precision", choices=["f32", "bf16-mixed"], default="f32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (one process)")
    ap.add_argument("--tf32", action="store_true",
                    help="a card's f32 products in TF32 (as CubeCL's tuner picks them for kiln)")
    args = ap.parse_args()
    if args.device != "cpu" and args.world > 1:
        ap.error("--device cuda runs one process (--world 1)")
    if args.compile and args.world > 1:
        ap.error("--compile runs one process (--world 1)")
    return args


def train(rank, args):
    dist = join(rank, args)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.manual_seed(args.seed)
    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    train_ids = ids[: int(round(0.9 * len(ids)))]

    shape = SHAPES[args.shape]
    ctx = shape[0]
    device = torch.device(args.device)
    model = Gpt(len(chars), shape, args.dropout).to(device)
    if dist is not None and args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif args.compile:
        model = torch.compile(model)
    elif dist is not None:
        from torch.distributed.fsdp import fully_shard

        reshard = args.mode == "zero3"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    opt = recipe_adamw(model, lr=1e-3)
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    torch.manual_seed(args.seed + rank)  # each rank its own windows
    local = args.batch // args.world
    times = []
    for step in range(args.warmup + args.steps):
        starts = torch.randint(0, len(train_ids) - ctx - 1, (local,))
        windows = torch.stack([train_ids[s : s + ctx + 1] for s in starts])
        t0 = time.perf_counter()
        windows = windows.to(device)
        with autocast:
            loss = model(windows[:, :-1], windows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = slowest(dist, time.perf_counter() - t0)
        if step >= args.warmup:
            times.append(elapsed)
    leave(dist)
    if rank != 0:
        return
    print(json.dumps({
        "ms_per_step": 1e3 * statistics.median(times),
        "batch": args.batch,
        "world": args.world,
        "mode": args.mode if args.world > 1 else "one process",
        "threads": torch.get_num_threads(),
        "shape": args.shape,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "precision": args.precision,
        "tokens_per_s": args.batch * ctx / statistics.median(times),
        "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "reserved_memory_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
        "compiled": args.compile,
        "tf32": args.tf32,
        "torch": torch.__version__,
        "final_loss": loss.item(),
    }))


if __name__ == "__main__":
    main()
