"""lm's optimizer (AdamW + Muon) against an independent float64 numpy reference written from the published
formulas (Jordan's Muon: momentum, Nesterov as optax bias-corrects it, the quintic Newton-Schulz iteration on the
Frobenius-normalised matrix, tall matrices transposed, sqrt(max(1, fan_out/fan_in)) or muon_update_rms; AdamW;
global-norm clipping first; warmup + decay), parameters compared after each of several steps."""
import math

import pytest
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.config import ModelConfig, OptimConfig
from lm.model import init_params
from lm.optim import make_optimizer

A, B, C = 3.4445, -4.7750, 2.0315


def ns(m, steps):
    x = m.astype(np.float64)
    t = x.shape[0] > x.shape[1]
    if t:
        x = x.T
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(steps):
        a = x @ x.T
        b = B * a + C * a @ a
        x = A * x + b @ x
    return x.T if t else x


def as_matrices(name, x):
    """(list of 2-D matrices, function rebuilding x from them) per README's reading, or None for AdamW."""
    parts = name.split("/")
    if parts[-1] in ("a", "b"):  # lora
        if x.ndim == 2:
            return [x], lambda ms: ms[0]
        return list(x), lambda ms: np.stack(ms)
    if parts[-1] != "kernel" or not any(p.startswith("h_") or p == "h" for p in parts):
        return None
    mod = parts[-2]
    parent = parts[-3]
    scanned = "h" in parts  # stacked [L, ...]
    layers = list(x) if scanned else [x]
    out = []
    rebuild = []
    for lx in layers:
        if (parent, mod) == ("attn", "qkv"):
            d, k, s, h = lx.shape
            ms = [lx[:, :, j, :].reshape(d, k * h) for j in range(s)]

            def rb(ms, d=d, k=k, s=s, h=h):
                return np.stack([m.reshape(d, k, h) for m in ms], axis=2)
        elif (parent, mod) in (("attn", "q"), ("attn", "k"), ("attn", "v")):
            shp = lx.shape
            ms = [lx.reshape(shp[0], -1)]
            rb = lambda ms, shp=shp: ms[0].reshape(shp)
        elif (parent, mod) == ("attn", "proj"):
            shp = lx.shape
            ms = [lx.reshape(-1, shp[-1])]
            rb = lambda ms, shp=shp: ms[0].reshape(shp)
        elif parent == "mlp":
            ms = [lx]
            rb = lambda ms: ms[0]
        else:
            return None
        rebuild.append((len(out), len(ms), rb))
        out += ms

    def rebuild_all(ms):
        got = [rb(ms[i:i + n]) for i, n, rb in rebuild]
        return np.stack(got) if scanned else got[0]

    return out, rebuild_all


def lr_at(cfg, steps, k, peak):
    floor = cfg.min_lr * peak / cfg.lr
    w = cfg.warmup_steps
    if k < w:
        return peak * (k + 1) / w
    rest = max(steps - w, 1)
    t = k - w
    if cfg.decay == "constant":
        return peak
    if cfg.decay == "cosine":
        frac = min(t, rest) / rest
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * frac))
    if cfg.decay == "linear":
        return peak + (floor - peak) * min(t, rest) / rest
    raise NotImplementedError


class Ref:
    def __init__(self, cfg, steps, params):
        self.cfg, self.steps = cfg, steps
        self.p = {k: v.astype(np.float64) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.t = 0

    def step(self, grads):
        cfg = self.cfg
        g = {k: v.astype(np.float64) for k, v in grads.items()}
        if cfg.grad_clip > 0:
            norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
            if norm > cfg.grad_clip:
                g = {k: x * cfg.grad_clip / norm for k, x in g.items()}
        k = self.t
        self.t += 1
        t = self.t
        lr = lr_at(cfg, self.steps, k, cfg.lr)
        mlr = lr_at(cfg, self.steps, k, cfg.muon_lr)
        for name in self.p:
            p, gr = self.p[name], g[name]
            mats = as_matrices(name, p) if cfg.name == "muon" else None
            if mats is None:
                b1, b2 = cfg.b1, cfg.b2
                self.m[name] = b1 * self.m[name] + (1 - b1) * gr
                self.v[name] = b2 * self.v[name] + (1 - b2) * gr * gr
                mh = self.m[name] / (1 - b1 ** t)
                vh = self.v[name] / (1 - b2 ** t)
                u = mh / (np.sqrt(vh) + cfg.eps)
                leaf = name.split("/")[-1]
                if leaf in ("kernel", "a", "b") or (cfg.decay_embeddings and leaf == "embedding"):
                    u = u + cfg.weight_decay * p
                self.p[name] = p - lr * u
            else:
                beta = cfg.muon_momentum
                self.m[name] = beta * self.m[name] + (1 - beta) * gr
                if cfg.muon_nesterov:
                    mh = beta * self.m[name] / (1 - beta ** (t + 1)) + (1 - beta) * gr / (1 - beta ** t)
                else:
                    mh = self.m[name] / (1 - beta ** t)
                ms, rebuild = as_matrices(name, mh)
                outs = []
                for mm in ms:
                    o = ns(mm, cfg.muon_ns_steps)
                    fan_in, fan_out = mm.shape
                    if cfg.muon_update_rms:
                        o = o * cfg.muon_update_rms * math.sqrt(max(fan_in, fan_out))
                    else:
                        o = o * math.sqrt(max(1.0, fan_out / fan_in))
                    outs.append(o)
                u = rebuild(outs) + cfg.muon_weight_decay * p
                self.p[name] = p - mlr * u


def flat(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def compare(model, cfg, steps=5, total=20, seed=0):
    params = nn.unbox(init_params(model, jax.random.PRNGKey(0)))
    tx = make_optimizer(cfg, total)
    state = tx.init(params)
    upd = jax.jit(tx.update)
    ref = Ref(cfg, total, flat(params))
    rng = np.random.default_rng(seed)
    for s in range(steps):
        leaves, tree = jax.tree.flatten(params)
        grads = jax.tree.unflatten(tree, [jnp.asarray(rng.normal(size=x.shape) * 0.3, jnp.float32) for x in leaves])
        u, state = upd(grads, state, params)
        params = jax.tree.map(lambda p, d: p + d, params, u)
        ref.step(flat(grads))
        got = flat(params)
        for k in got:
            err = float(np.max(np.abs(got[k] - ref.p[k])))
            scale = max(1.0, float(np.max(np.abs(ref.p[k]))))
            assert err <= 2e-5 * scale, (s + 1, k, err)


BASE = dict(vocab_size=64, max_seq_len=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bias=True)


@pytest.mark.parametrize("model, cfg", [
    (ModelConfig(**{**BASE, "scan_layers": True, "tie_embeddings": False}),
     OptimConfig(name="muon", warmup_steps=2, grad_clip=0.5, muon_weight_decay=0.1, decay_embeddings=True)),
    (ModelConfig(**{**BASE, "fused_qkv": False, "mlp": "swiglu", "pos": "rope"}),
     OptimConfig(name="muon", warmup_steps=0, decay="linear", muon_nesterov=False, muon_update_rms=0.2,
                 muon_momentum=0.8, muon_ns_steps=3)),
])  # fmt: skip
def test_muon_matches_an_independent_reference(model, cfg):
    compare(model, cfg, steps=4)
