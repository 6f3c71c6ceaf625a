#!/usr/bin/env python3
"""The MNIST ConvNet recipe's step time in PyTorch (CPU, float32), the twin of
configs/mnist-convnet.toml.

Two blocks of 5×5 convolution (1→16, 16→32 channels, padded to keep the size, with bias),
BatchNorm, ReLU and 2×2 max-pooling, then one linear layer to the 10 classes; AdamW at lr
0.002; batches of 64 images scaled to [0, 1], drawn at random from the training set. It times
optimizer steps, taking the batch out of the loaded set inside the timed part as kiln's step
time does, and prints one line of JSON: the median milliseconds per step after a warm-up.

With `--world N` it times the same step on N processes of one thread each under
DistributedDataParallel (torch.distributed over gloo on this machine), each rank a local batch
of batch/N, the global batch the same; each rank's BatchNorm takes its own batch's statistics
(PyTorch's default, and kiln's ddp without `ddp.sync_batchnorm`); a step's time is the slowest
rank's.

Usage:
    python3 xtask/reference/convnet_mnist_torch.py --data data/mnist --batch 64 --steps 30 \
        [--threads 2] [--world 2]
"""
import argparse
import gzip
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_ranks import add_world_args, join, launch, leave, slowest


def read_idx(path):
    """An IDX file (optionally gzipped) as a numpy array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def find(folder, name):
    for candidate in (name, name + ".gz"):
        path = os.path.join(folder, candidate)
        if os.path.exists(path):
            return path
    raise SystemExit(f"{folder}: no {name} (run `cargo xtask fetch-data mnist`)")


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList()
        c = 1
        for out in (16, 32):
            self.blocks.append(nn.ModuleDict({
                "conv": nn.Conv2d(c, out, 5, padding=2),
                "norm": nn.BatchNorm2d(out),
            }))
            c = out
        self.head = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        for b in self.blocks:
            x = F.max_pool2d(F.relu(b["norm"](b["conv"](x))), 2)
        return self.head(x.flatten(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    ap.add_argument("--seed", type=int, default=1)
    add_world_args(ap, port=29519)
    launch(train, ap.parse_args())


def train(rank, args):
    dist = join(rank, args)
    torch.manual_seed(args.seed)
    images = torch.from_numpy(read_idx(find(args.data, "train-images-idx3-ubyte")).copy())
    labels = torch.from_numpy(read_idx(find(args.data, "train-labels-idx1-ubyte")).astype(np.int64))
    images = images.float().div_(255.0).unsqueeze(1)
    model = ConvNet()
    if dist is not None:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.002)
    if dist is not None:
        torch.manual_seed(args.seed + rank)  # each rank its own samples
    local = args.batch // args.world
    times = []
    for step in range(args.warmup + args.steps):
        picks = torch.randint(0, len(images), (local,))
        t0 = time.perf_counter()
        x, y = images[picks], labels[picks]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
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
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "final_loss": loss.item(),
    }))


if __name__ == "__main__":
    main()
