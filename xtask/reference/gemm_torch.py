#!/usr/bin/env python3
"""PyTorch's f32 matrix-product peak on this CPU, the twin of kiln's `examples/gemm_peak.rs`.

`torch.mm` of two random square matrices, on one thread and on every core (PyTorch's own
threads), the best of six products each (as kiln's best of three tries of two); prints one line of JSON:
{"size": 2048, "threads": 16, "gflops_one_thread": ..., "gflops_all_threads": ...}

Usage: python3 xtask/reference/gemm_torch.py [--size 2048]
"""
import argparse
import json
import os
import time

import torch


def gflops(size, threads, reps=6):
    torch.set_num_threads(threads)
    a, b = torch.rand(size, size), torch.rand(size, size)
    torch.mm(a, b)  # warm up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=2048)
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    print(json.dumps({
        "size": args.size,
        "threads": threads,
        "gflops_one_thread": round(gflops(args.size, 1), 1),
        "gflops_all_threads": round(gflops(args.size, threads), 1),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
