"""The PyTorch peer: a GPT of the same shape as an lm preset, trained the way a PyTorch user would.

A plain nanoGPT-style model (learned positions, pre-LayerNorm with biases, tanh GELU, tied head,
`F.scaled_dot_product_attention` causal), AdamW with weight decay on matrices only and the global
norm clip, a cosine schedule after warmup, random windows of the same byte corpus. On a CPU in
float32 and eager mode, as nanoGPT runs there; on a GPU bfloat16 autocast, fused AdamW and
`torch.compile` (`--compile`). Needs the `bench` extra (torch).

It runs as a child of benchmarks/versus_torch.py, which passes the shape as JSON:

    python -m benchmarks.peer '{"n_layer": 4, ...}'  ->  one JSON line {"tokens_per_sec": [...], ...}

With `"profile": N` the last N steps run under `torch.profiler` and the line also holds each op's self
time per step (benchmarks/profile.py --peer).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, hidden: int, dropout: float, attn_dropout: float):
        super().__init__()
        self.n_head, self.attn_dropout = n_head, attn_dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_out = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.attn_dropout if self.training else 0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        d = s["n_embd"]
        self.wte, self.wpe = nn.Embedding(s["vocab_size"], d), nn.Embedding(s["max_seq_len"], d)
        self.drop = nn.Dropout(s["dropout"])
        self.blocks = nn.ModuleList(Block(d, s["n_head"], s["hidden"], s["dropout"], s["attn_dropout"]) for _ in range(s["n_layer"]))
        self.ln_f = nn.LayerNorm(d)
        self.n_vocab = s.get("n_vocab") or s["vocab_size"]  # the tokenizer's ids: lm's softmax leaves out padded rows
        for name, p in self.named_parameters():  # GPT-2's initialisation, as lm's
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * s["n_layer"]) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = (self.ln_f(x) @ self.wte.weight.T)[..., : self.n_vocab]  # tied head, over every row as lm's
        return F.cross_entropy(logits.float().reshape(-1, self.n_vocab), targets.reshape(-1))


def optimizer(model: nn.Module, s: dict, fused: bool) -> torch.optim.Optimizer:
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith(("wte", "wpe")))]
    groups = [{"params": matrices, "weight_decay": s["weight_decay"]}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s["lr"], betas=(s["b1"], s["b2"]), eps=s["eps"], fused=fused or None)


def lr_at(step: int, s: dict) -> float:
    if step < s["warmup_steps"]:
        return s["lr"] * (step + 1) / s["warmup_steps"]
    frac = min(1.0, (step - s["warmup_steps"]) / max(1, s["steps"] - s["warmup_steps"]))
    return s["min_lr"] + 0.5 * (1 + math.cos(math.pi * frac)) * (s["lr"] - s["min_lr"])


def train(s: dict) -> dict:
    """Train `s["steps"]` steps; tokens/s of each `log_every` interval (the loss fetched once per interval)."""
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    data = np.fromfile(s["corpus"], dtype=np.uint8)
    rng = np.random.default_rng(0)
    model = GPT(s).to(device)
    opt = optimizer(model, s, fused=cuda)
    step_fn = torch.compile(model) if s.get("compile") else model
    b, t = s["batch_size"], s["block_size"]

    def batch():
        starts = rng.integers(0, len(data) - t - 1, b)
        rows = np.stack([data[i : i + t + 1] for i in starts]).astype(np.int64)
        rows = torch.from_numpy(rows).to(device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    rates, losses = [], []
    profiled = s.get("profile", 0)  # profile the last steps' ops (benchmarks/profile.py --peer)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=activities)
    t0 = time.perf_counter()
    for step in range(s["steps"]):
        if profiled and step == s["steps"] - profiled:
            prof.start()
            t_prof = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        x, y = batch()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = step_fn(x, y)
        loss.backward()
        if s["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % s["log_every"] == 0:
            losses.append(loss.item())  # synchronises, like lm's logged metrics
            now = time.perf_counter()
            rates.append(s["log_every"] * b * t / (now - t0))
            t0 = now
    out = {"tokens_per_sec": rates, "losses": losses, "threads": torch.get_num_threads(), "torch": torch.__version__}
    if profiled:
        out["profiled_step_ms"] = (time.perf_counter() - t_prof) / profiled * 1e3
        prof.stop()
        averages = prof.key_averages()
        ops = {e.key: e.self_cpu_time_total / profiled / 1e3 for e in averages}
        out["ops_ms_per_step"] = {k: v for k, v in ops.items() if v > 0}
        if cuda:  # the kernels' own time on the device, by kernel name
            on_device = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
            out["kernels_ms_per_step"] = {e.key: e.self_device_time_total / profiled / 1e3 for e in on_device}
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].startswith("{"):
        sys.exit("benchmarks.peer is the PyTorch peer's child process, started by benchmarks.versus_torch (and "
                 "time_to_loss) with its settings as one JSON argument; run python -m benchmarks.versus_torch instead")  # fmt: skip
    print(json.dumps(train(json.loads(sys.argv[1]))), flush=True)
    sys.stdout.flush()
    os._exit(0)
