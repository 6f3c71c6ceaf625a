#!/usr/bin/env python3
"""kiln's character GPT in PyTorch, with kiln's module paths, for weight parity.

The module mirrors kiln-models' `Gpt` (models/src/gpt.rs) name for name: `wte`, `wpe`,
`blocks.N.{ln_1, attn.qkv, attn.proj, ln_2, mlp.fc, mlp.proj}`, `ln_f`; no biases, LayerNorm
gains only (eps 1e-5), exact GELU, the head tied to the token embedding. A kiln run exported
with `export.format = "pytorch"` loads into it with `load_state_dict(strict=True)`.

The validation windows are kiln's: the text's last part (split at round(len * fraction)), the
vocabulary of the whole text (or of a run's tokenizer.json), and the window starts drawn by
kiln-datasets' SplitMix64 from the seed 0x0e7a1000 (`eval_starts`). The loss is the mean
token cross-entropy over those windows, as `train eval` reports it.

Commands (one line of JSON each):
    score --weights FILE          the loss of a state dict (.safetensors, or .pt/.pth)
    train --steps N --out DIR     trains the module from scratch (AdamW), writes DIR/model.pt
                                  and DIR/model.safetensors, and scores the result
Common: --data TEXT --n-layer --n-head --n-embd --block-size [--tokenizer tokenizer.json]
        [--train-fraction 0.9] [--eval-windows 240] [--batch 12] [--lr 1e-3] [--seed 1]
Runs on PyTorch 1.13 (Debian's python3-torch) and later; the safetensors files are read and
written here (the format is an 8-byte header length, a JSON header, the raw bytes).
"""
import argparse
import json
import math
import struct

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MASK64 = (1 << 64) - 1
EVAL_SEED = 0x0E7A1000


class SplitMix64:
    """kiln-datasets' generator (datasets/src/rng.rs)."""

    def __init__(self, seed):
        self.state = seed & MASK64

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, bound):
        product = self.next_u64() * bound
        if (product & MASK64) < bound:
            threshold = ((1 << 64) - bound) % bound
            while (product & MASK64) < threshold:
                product = self.next_u64() * bound
        return product >> 64


def eval_starts(length, block, count):
    rng = SplitMix64(EVAL_SEED)
    return [rng.below(length - block) for _ in range(count)]


class LayerNorm(nn.Module):
    """LayerNorm with a gain and no bias (PyTorch 1.13's nn.LayerNorm always has one)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, None, 1e-5)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        h = self.heads
        q, k, v = (
            z.reshape(b, t, h, c // h).transpose(1, 2) for z in self.qkv(x).split(c, dim=2)
        )
        scores = q @ k.transpose(2, 3) / math.sqrt(c // h)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, c))


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = LayerNorm(d)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, vocab, block, layers, heads, d):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                out = name.endswith("proj.weight")
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if out else 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        array = np.frombuffer(data[lo:hi], dtype=DTYPES[meta["dtype"]]).reshape(meta["shape"])
        out[name] = torch.from_numpy(array.astype(np.float32))
    return out


def write_safetensors(state, path):
    header, chunks, offset = {}, [], 0
    for name, t in state.items():
        raw = t.detach().contiguous().numpy().astype(np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for c in chunks:
            f.write(c)


def text_ids(args):
    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    if args.tokenizer:
        with open(args.tokenizer, encoding="utf-8") as f:
            vocab = json.load(f)["vocab"]
        known = set(vocab)
        text = "".join(c for c in text if c in known)
    else:
        vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = min(len(ids), math.floor(len(ids) * args.train_fraction + 0.5))
    return vocab, ids[:cut], ids[cut:]


def windows(ids, starts, block):
    w = torch.stack([ids[s : s + block + 1] for s in starts])
    return w[:, :-1], w[:, 1:]


def score(model, val, args):
    starts = eval_starts(len(val), args.block_size, args.eval_windows)
    x, y = windows(val, starts, args.block_size)
    model.eval()
    with torch.no_grad():
        return model(x, y).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["score", "train"])
    ap.add_argument("--data", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--train-fraction", type=float, default=0.9)
    ap.add_argument("--eval-windows", type=int, default=240)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--weights")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    vocab, train, val = text_ids(args)
    model = Gpt(len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd)
    if args.command == "score":
        if args.weights.endswith(".safetensors"):
            state = read_safetensors(args.weights)
        else:
            state = torch.load(args.weights)
        model.load_state_dict(state, strict=True)
        print(json.dumps({"val_loss": score(model, val, args), "tensors": len(state)}))
        return
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    for _ in range(args.steps):
        starts = torch.randint(0, len(train) - args.block_size - 1, (args.batch,)).tolist()
        loss = model(*windows(train, starts, args.block_size))
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, f"{args.out}/model.pt")
    write_safetensors(state, f"{args.out}/model.safetensors")
    print(json.dumps({"val_loss": score(model, val, args), "train_loss": loss.item()}))


if __name__ == "__main__":
    main()
