#!/usr/bin/env python3
"""The Llama text recipe's step time in PyTorch + transformers (CPU, float32).

Takes the architecture and the tokenizer from a kiln run of configs/llama-text.toml (`RUN/hf/
config.json` and `RUN/tokenizer.json`, which kiln wrote), so both train the same model on the
same token ids: `LlamaForCausalLM` with its default attention (SDPA), random windows of
`context + 1` tokens of the text's first 90%, AdamW (0.9, 0.99), weight decay 0.1 on rank>=2
parameters, gradients clipped to norm 1.0. Prints one line of JSON: the median milliseconds
per optimizer step after a warm-up, and tokens per second.

With `--world N` it times the same step on N processes of one thread each under
DistributedDataParallel (torch.distributed over gloo on this machine), each rank a local batch
of batch/N, the global batch the same; a step's time is the slowest rank's.

Usage (pip install torch transformers tokenizers):
    python3 xtask/reference/llama_text_torch.py --run runs/llama-text \
        --data data/text/moby-dick.txt --batch 12 --context 64 --steps 30 [--threads 2] \
        [--world 2]
"""
import argparse
import json
import os
import statistics
import time

import torch
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from torch_ranks import add_world_args, join, launch, leave, recipe_adamw, slowest


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="a kiln run of configs/llama-text.toml")
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    ap.add_argument("--seed", type=int, default=1)
    add_world_args(ap, port=29521)
    launch(train_run, ap.parse_args())


def train_run(rank, args):
    dist = join(rank, args)
    torch.manual_seed(args.seed)
    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    tok = Tokenizer.from_file(os.path.join(args.run, "tokenizer.json"))
    train = torch.tensor(tok.encode(text[: int(0.9 * len(text))]).ids, dtype=torch.long)

    config = AutoConfig.from_pretrained(os.path.join(args.run, "hf"))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    parameters = sum(p.numel() for p in model.parameters())
    if dist is not None:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        torch.manual_seed(args.seed + rank)  # each rank its own windows
    local = args.batch // args.world
    opt = recipe_adamw(model, lr=1e-3)
    times = []
    for step in range(args.warmup + args.steps):
        starts = torch.randint(0, len(train) - args.context - 1, (local,))
        windows = torch.stack([train[s : s + args.context + 1] for s in starts])
        t0 = time.perf_counter()
        logits = model(windows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = slowest(dist, time.perf_counter() - t0)
        if step >= args.warmup:
            times.append(elapsed)
    leave(dist)
    if rank != 0:
        return
    ms = 1e3 * statistics.median(times)
    print(json.dumps({
        "ms_per_step": ms,
        "tokens_per_s": args.batch * args.context * 1e3 / ms,
        "batch": args.batch,
        "parameters": parameters,
        "world": args.world,
        "attention": config._attn_implementation,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "final_loss": loss.item(),
    }))


if __name__ == "__main__":
    main()
