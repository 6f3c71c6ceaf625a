#!/usr/bin/env python3
"""Character-level GPT reference run in JAX (CPU, float32).

Usage:
    python3 xtask/reference/gpt_char_jax.py --data data/text/moby-dick.txt --seed 1
"""
import argparse
import math
import time

import numpy as np
import jax
import jax.numpy as jnp

# ---------------------------------------------------------------- recipe
CTX = 64            # model context; windows are CTX+1 chars
D = 128
N_HEAD = 4
HEAD = D // N_HEAD  # 32
N_LAYER = 4
D_FF = 512
LN_EPS = 1e-5
INIT_STD = 0.02
RESID_STD = 0.02 / math.sqrt(2 * N_LAYER)

STEPS = 2000
BATCH = 12
WARMUP = 100
LR_MAX = 1e-3
LR_MIN = 1e-4
BETA1, BETA2, ADAM_EPS = 0.9, 0.99, 1e-8
WEIGHT_DECAY = 0.1
CLIP = 1.0

N_VAL_WINDOWS = 2400
VAL_SEED = 1234
EVAL_BATCH = 200
EVAL_EVERY = 250
LOG_EVERY = 100
TRAIN_TAIL = 50


def lr_at(s):
    if s < WARMUP:
        return LR_MAX * (s + 1) / WARMUP
    t = (s - WARMUP) / (STEPS - WARMUP)
    return LR_MIN + 0.5 * (LR_MAX - LR_MIN) * (1.0 + math.cos(math.pi * t))


# ---------------------------------------------------------------- data
def load(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    idx = {c: i for i, c in enumerate(chars)}
    ids = np.array([idx[c] for c in text], dtype=np.int32)
    n_train = int(round(0.9 * len(ids)))
    return ids[:n_train], ids[n_train:], len(chars), len(text)


def windows(data, starts):
    off = np.arange(CTX + 1)
    w = data[starts[:, None] + off[None, :]]
    return w[:, :-1], w[:, 1:]


# ---------------------------------------------------------------- model
def init_params(key, vocab):
    keys = iter(jax.random.split(key, 2 + 4 * N_LAYER))

    def normal(shape, std):
        return (std * jax.random.normal(next(keys), shape)).astype(jnp.float32)

    p = {
        "wte": normal((vocab, D), INIT_STD),
        "wpe": normal((CTX, D), INIT_STD),
        "ln_f": jnp.ones((D,), jnp.float32),
        "blocks": [],
    }
    for _ in range(N_LAYER):
        p["blocks"].append({
            "ln1": jnp.ones((D,), jnp.float32),
            "w_qkv": normal((D, 3 * D), INIT_STD),
            "w_o": normal((D, D), RESID_STD),
            "ln2": jnp.ones((D,), jnp.float32),
            "w_fc": normal((D, D_FF), INIT_STD),
            "w_proj": normal((D_FF, D), RESID_STD),
        })
    return p


def layer_norm(x, g):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + LN_EPS) * g


def attention(x, w_qkv, w_o):
    B, T, _ = x.shape
    qkv = x @ w_qkv
    q, k, v = jnp.split(qkv, 3, axis=-1)

    def heads(a):
        return a.reshape(B, T, N_HEAD, HEAD).transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    att = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(HEAD)
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))
    att = jnp.where(mask, att, -jnp.inf)
    att = jax.nn.softmax(att, axis=-1)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
    return y @ w_o


def forward(p, idx):
    T = idx.shape[1]
    x = p["wte"][idx] + p["wpe"][:T]
    for b in p["blocks"]:
        x = x + attention(layer_norm(x, b["ln1"]), b["w_qkv"], b["w_o"])
        h = jax.nn.gelu(layer_norm(x, b["ln2"]) @ b["w_fc"], approximate=False)
        x = x + h @ b["w_proj"]
    x = layer_norm(x, p["ln_f"])
    return x @ p["wte"].T


def loss_fn(p, xb, yb):
    logits = forward(p, xb)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, yb[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)


# ---------------------------------------------------------------- optimizer
def adamw_init(p):
    z = jax.tree_util.tree_map(jnp.zeros_like, p)
    return {"m": z, "v": jax.tree_util.tree_map(jnp.zeros_like, p), "t": jnp.zeros((), jnp.int32)}


@jax.jit
def train_step(p, opt, xb, yb, lr):
    loss, g = jax.value_and_grad(loss_fn)(p, xb, yb)
    # global-norm clipping
    gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(g)))
    scale = jnp.minimum(1.0, CLIP / gnorm)
    g = jax.tree_util.tree_map(lambda x: x * scale, g)
    t = opt["t"] + 1
    tf = t.astype(jnp.float32)
    bc1 = 1.0 - BETA1 ** tf
    bc2 = 1.0 - BETA2 ** tf
    m = jax.tree_util.tree_map(lambda m, g: BETA1 * m + (1 - BETA1) * g, opt["m"], g)
    v = jax.tree_util.tree_map(lambda v, g: BETA2 * v + (1 - BETA2) * g * g, opt["v"], g)

    def upd(p, m, v):
        step = (m / bc1) / (jnp.sqrt(v / bc2) + ADAM_EPS)
        if p.ndim >= 2:
            step = step + WEIGHT_DECAY * p
        return p - lr * step

    p = jax.tree_util.tree_map(upd, p, m, v)
    return p, {"m": m, "v": v, "t": t}, loss, gnorm


@jax.jit
def eval_batch(p, xb, yb):
    return loss_fn(p, xb, yb)


def evaluate(p, vx, vy):
    tot = 0.0
    for i in range(0, len(vx), EVAL_BATCH):
        tot += float(eval_batch(p, vx[i:i + EVAL_BATCH], vy[i:i + EVAL_BATCH])) * len(vx[i:i + EVAL_BATCH])
    return tot / len(vx)


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    train, val, vocab, n_chars = load(args.data)
    print(f"chars={n_chars} vocab={vocab} train={len(train)} val={len(val)} "
          f"jax={jax.__version__} backend={jax.default_backend()}")

    vrng = np.random.RandomState(VAL_SEED)
    vx, vy = windows(val, vrng.randint(0, len(val) - (CTX + 1) + 1, size=N_VAL_WINDOWS))
    vx, vy = jnp.asarray(vx), jnp.asarray(vy)

    p = init_params(jax.random.PRNGKey(args.seed), vocab)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(p))
    print(f"params={n_params}")
    opt = adamw_init(p)
    drng = np.random.RandomState(args.seed)

    t0 = time.time()
    val_hist = {0: evaluate(p, vx, vy)}
    print(f"step 0 val {val_hist[0]:.4f}", flush=True)
    eval_time = time.time() - t0
    losses = []
    for s in range(STEPS):
        starts = drng.randint(0, len(train) - (CTX + 1) + 1, size=BATCH)
        xb, yb = windows(train, starts)
        p, opt, loss, gnorm = train_step(p, opt, xb, yb, jnp.float32(lr_at(s)))
        losses.append(float(loss))
        done = s + 1
        if done % LOG_EVERY == 0:
            print(f"step {done} train {np.mean(losses[-LOG_EVERY:]):.4f} "
                  f"gnorm {float(gnorm):.3f} lr {lr_at(s):.2e} t {time.time() - t0:.1f}s", flush=True)
        if done % EVAL_EVERY == 0:
            te = time.time()
            val_hist[done] = evaluate(p, vx, vy)
            eval_time += time.time() - te
            print(f"step {done} val {val_hist[done]:.4f}", flush=True)
    wall = time.time() - t0
    train_tail = float(np.mean(losses[-TRAIN_TAIL:]))
    print("---- summary")
    print(f"seed {args.seed}")
    for k in sorted(val_hist):
        print(f"val@{k}: {val_hist[k]:.4f}")
    print(f"final train loss (mean last {TRAIN_TAIL} steps): {train_tail:.4f}")
    print(f"wall {wall:.1f}s (eval {eval_time:.1f}s), "
          f"train steps/s {STEPS / (wall - eval_time):.2f}, overall steps/s {STEPS / wall:.2f}")


if __name__ == "__main__":
    main()
