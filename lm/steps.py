"""The train state and the jitted steps: what one optimizer update and one evaluation compute (the loss: lm/loss.py).

    trainer, state = Trainer.create(cfg, mesh, n_vocab, frozen=None)
    state, metrics = trainer.train_step(state, batch, trainer.frozen)
    state, metrics = trainer.train_steps(state, (batch, batch2, ...), trainer.frozen)  # metrics: [n] each
    sums, count = trainer.eval_step(state.params, batch, trainer.frozen)   # {"loss": ...} summed, and what to divide by

train.objective=dpo trains on preference pairs (lm/data/preference.py): each batch array is [P, 2, T], pair p's
chosen response at [p, 0] and its rejected one at [p, 1]. Both go through the model in one batch of 2P rows
(the pair axis folded into the batch axis, so that each device's pairs stay on it), and so does the reference
model: `frozen`, which is the LoRA base (the same parameters with the adapters off, no second copy) or, in a full
fine-tune, a frozen copy of the starting weights (lm/train.py).
"""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lm import lora, platform, sharding
from lm.config import Config, TrainConfig
from lm.errors import fits_in_memory
from lm.loss import chunked_loss_sums, chunked_token_losses, chunked_token_scores, dpo_loss, real_ids, token_losses
from lm.model import Transformer, count_params, flops_per_token, head_kernel, init_params
from lm.optim import make_optimizer, schedule


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates done
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2]: the run's key; step keys are fold_in(rng, step)


def _model_inputs(batch: dict) -> dict:
    """The model's packing inputs present in a batch (fine-tune examples carry them, pretraining does not)."""
    return {f"{k}_BT": batch[k] for k in ("positions", "segment_ids") if k in batch}


def _loss_mask(batch: dict) -> jax.Array:
    mask = batch.get("loss_mask")
    return jnp.ones(batch["targets"].shape, jnp.float32) if mask is None else mask.astype(jnp.float32)


def model_params(cfg: Config, trained: Any, frozen: Any) -> Any:
    """The model's parameters: the trained ones, or with LoRA the frozen base plus the trained adapters."""
    return lora.merge(frozen, trained, cfg.lora.alpha, cfg.lora.rank, cfg.model.dtype) if cfg.lora.rank else trained


def _loss_way(model: Transformer) -> dict:
    """How the loss is computed on the model's platform (lm.platform): token_losses' grad and log_z, and the dtype
    of the chunked loss's logits."""
    p = model.platform or platform.current()
    return {"grad": p.loss_grad, "log_z": p.log_z, "logits": p.logits}


def loss_sums(cfg: Config, model: Transformer, params: Any, batch: dict, rngs=None, **losses) -> tuple:
    """(sum of the objective, sum of the cross-entropy) over the batch's loss-masked tokens. With
    train.loss_chunk the head and the loss run a chunk of positions at a time (lm/loss.py); 0 takes the
    model's whole float32 logits. `losses`: label_smoothing, z_loss, n_vocab (see token_losses)."""
    inputs = {**_model_inputs(batch), "rngs": rngs or {}}
    mask = _loss_mask(batch)
    way = _loss_way(model)
    if cfg.train.loss_chunk:
        x_BTD = model.apply(params, batch["inputs"], **inputs, head=False)
        w_DV = head_kernel(params, cfg.model)
        args = (x_BTD, w_DV, batch["targets"], mask, cfg.train.loss_chunk, cfg.model.dtype)
        return chunked_loss_sums(*args, **losses, **way)
    logits_BTV = model.apply(params, batch["inputs"], **inputs)
    objective_BT, ce_BT = token_losses(logits_BTV, batch["targets"], **losses, grad=way["grad"], log_z=way["log_z"])
    return (objective_BT * mask).sum(), (ce_BT * mask).sum()


def sequence_logprobs(
    cfg: Config, model: Transformer, params: Any, batch: dict, rngs=None, grad: bool = True, n_vocab: int = 0
):
    """The log-probability [R] of each row's loss-masked targets: a response's, given its prompt. With
    train.loss_chunk the head runs a chunk of positions at a time, as in loss_sums; `grad`=False for a model
    that is not differentiated (the reference), whose chunks need not be kept for a backward pass. `n_vocab`: the
    tokenizer's ids, the vocabulary's padding beyond them left out of the softmax (the model's distribution over
    tokens, which it samples from and its export computes; 0 = every row)."""
    inputs = {**_model_inputs(batch), "rngs": rngs or {}}
    way = _loss_way(model)
    if cfg.train.loss_chunk:
        x_BTD = model.apply(params, batch["inputs"], **inputs, head=False)
        w_DV = head_kernel(params, cfg.model)
        args = (x_BTD, w_DV, batch["targets"], cfg.train.loss_chunk, cfg.model.dtype)
        if grad:
            ce_BT = chunked_token_losses(*args, **way, n_vocab=n_vocab)
        else:
            ce_BT = chunked_token_scores(*args, n_vocab=n_vocab, log_z=way["log_z"], logits=way["logits"])[0]
    else:
        logits_BTV = real_ids(model.apply(params, batch["inputs"], **inputs), n_vocab)
        _, ce_BT = token_losses(logits_BTV, batch["targets"], grad=way["grad"], log_z=way["log_z"])
    return -(ce_BT * _loss_mask(batch)).sum(axis=-1)


def pair_mask(batch: dict) -> jax.Array:
    """[P] 1.0 for the pairs of a preference batch that hold tokens (a validation set's last batch is filled up
    with empty ones), else 0.0."""
    return (_loss_mask(batch).sum(axis=-1) > 0).all(axis=-1).astype(jnp.float32)


def dpo_sums(
    cfg: Config, model: Transformer, reference_model: Transformer, params, reference, batch: dict, rngs=None, n_vocab=0
):
    """Sums over a batch of preference pairs [P, 2, T] of the DPO loss (lm/loss.py's dpo_loss) and of the rewards:
    {"loss", "reward_margin" (chosen minus rejected), "reward_accuracy" (1 where the chosen reward is the higher,
    1/2 on a tie, as at the start, where both are 0, or within float32 rounding of it), "reward_chosen",
    "reward_rejected"}. The reference model's log-probabilities get no gradient. A full fine-tune's reference may be
    in the weights' narrower stored dtype (lm/train.py): the model casts weights to its compute dtype, so it
    computes as the policy's float32 copy did. Log-probabilities are over the tokenizer's `n_vocab` ids (0: every
    row): a padded vocabulary's rows, never targets nor sampled, would otherwise take probability from both
    replies, and DPO would push mass into them to lower the rejected reply's."""
    rows = {k: v.reshape(-1, *v.shape[2:]) for k, v in batch.items()}  # [2P, T]: chosen at 2p, rejected at 2p+1
    policy_P2 = sequence_logprobs(cfg, model, params, rows, rngs, n_vocab=n_vocab).reshape(-1, 2)
    reference_P2 = sequence_logprobs(cfg, reference_model, reference, rows, grad=False, n_vocab=n_vocab).reshape(-1, 2)
    tc = cfg.train
    loss_P, rewards_P2 = dpo_loss(policy_P2, jax.lax.stop_gradient(reference_P2), tc.dpo_beta, tc.dpo_label_smoothing)
    margin_P = rewards_P2[:, 0] - rewards_P2[:, 1]
    # A tie within float32 rounding of the log-probabilities (the policy's and the reference's are computed by
    # different programs, whose last bits may differ on a GPU even for equal weights, as at the start): 1e-6 of
    # their size, ~8 float32 ulps. (1e-5 counted real wins as ties: margins of 7e-4 on replies of 400 tokens.)
    size_P = (jnp.abs(jax.lax.stop_gradient(policy_P2)) + jnp.abs(reference_P2)).sum(axis=-1)
    tie_P = tc.dpo_beta * 1e-6 * size_P
    accuracy_P = (margin_P > tie_P) + 0.5 * (jnp.abs(margin_P) <= tie_P)
    valid_P = pair_mask(batch)
    total = lambda x_P: (x_P * valid_P).sum()
    return {
        "loss": total(loss_P),
        "reward_margin": total(margin_P),
        "reward_accuracy": total(accuracy_P),
        "reward_chosen": total(rewards_P2[:, 0]),
        "reward_rejected": total(rewards_P2[:, 1]),
    }


def rows_per_step(cfg: Config) -> int:
    """Sequences in one optimizer step: data.batch_size, or two for each of its pairs (data.format=preference)."""
    return cfg.data.batch_size * (2 if cfg.data.format == "preference" else 1)


def step_flops(cfg: Config) -> float:
    """Model FLOPs of one optimizer step (of a resolved model config), the policy's forward and backward passes
    (not a DPO reference model's forward pass)."""
    return flops_per_token(cfg.model, cfg.data.block_size) * rows_per_step(cfg) * cfg.data.block_size


def make_train_step(cfg: Config, tx: optax.GradientTransformation, n_vocab: int = 0):
    """train_step(state, batch, frozen) -> (state, metrics), to be jitted with the state donated.

    `frozen` is the LoRA base model, or with train.objective=dpo the reference model (None otherwise): an
    argument, not a constant baked into the compiled step, and never differentiated. `n_vocab` is the
    tokenizer's, for label smoothing. The metrics are the step's loss (the cross-entropy, or DPO's loss, with
    its reward statistics: see dpo_sums), gradient norm and learning rate.
    """
    cfg = platform.resolve(cfg, step_flops(cfg), rows_per_step(cfg))
    model = Transformer(cfg.model, deterministic=False)
    reference_model = Transformer(cfg.model, deterministic=True)
    # (the logged lr: AdamW's, or where Muon trains everything, a LoRA run's adapters, the Muon group's)
    all_muon = cfg.lora.rank and cfg.optim.name == "muon"
    lr_at = schedule(cfg.optim, cfg.train.steps, cfg.optim.muon_lr if all_muon else None)
    tc: TrainConfig = cfg.train
    accum = tc.grad_accum
    dpo = tc.objective == "dpo"

    def micro_grads(params, frozen, batch, rng, count):
        # Each sum is divided by the whole step's count (tokens, or pairs), so micro-batch gradients simply add up.
        def objective(params):
            full = model_params(cfg, params, frozen)
            if dpo:
                sums = dpo_sums(cfg, model, reference_model, full, frozen, batch, {"dropout": rng}, n_vocab)
                return sums["loss"] / count, sums
            losses = dict(label_smoothing=tc.label_smoothing, z_loss=tc.z_loss, n_vocab=n_vocab)
            objective_sum, ce_sum = loss_sums(cfg, model, full, batch, {"dropout": rng}, **losses)
            return objective_sum / count, {"loss": ce_sum}  # reported: the plain cross-entropy

        return jax.value_and_grad(objective, has_aux=True)(params)

    def train_step(state: TrainState, batch: dict, frozen: Any = None):
        count = jnp.maximum(pair_mask(batch).sum() if dpo else _loss_mask(batch).sum(), 1.0)
        rng = jax.random.fold_in(state.rng, state.step)
        wide = lambda x: jnp.promote_types(x.dtype, jnp.float32)
        if accum == 1:
            (_, sums), grads = micro_grads(state.params, frozen, batch, rng, count)
        else:
            micro = micro_batches(batch, accum)

            # Summed in float32 (16-bit weights' gradients too, as mixed precision accumulates them), rounded to the
            # weights' dtype once: a bfloat16 sum rounded at every micro-batch, a float32 model's is the same sum.
            def body(grads, xs):
                mb, i = xs
                (_, sums), g = micro_grads(state.params, frozen, mb, jax.random.fold_in(rng, i), count)
                return jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g), sums

            zeros = jax.tree.map(lambda p: jnp.zeros_like(p, wide(p)), state.params)
            grads, sums = jax.lax.scan(body, zeros, (micro, jnp.arange(accum)))
            sums = jax.tree.map(lambda x: x.sum(axis=0), sums)
        # The norm in float32 (of bfloat16 gradients, a bfloat16 norm was rounded to 3 digits, and its sum over
        # the parameters at each addition); the update from gradients in the weights' own dtype.
        grad_norm = optax.tree_utils.tree_norm(jax.tree.map(lambda g: g.astype(wide(g)), grads))
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {k: v / count for k, v in sums.items()}
        metrics.update(grad_norm=grad_norm, lr=lr_at(state.step))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def repeated(train_step):
    """train_steps(state, batches, frozen) -> (state, metrics of each step, stacked): len(batches) optimizer
    steps in one call, a lax.scan of train_step over the batches (train.steps_per_call). Each step is the same
    update as train_step's (its dropout key too: folded from state.step); the call is dispatched once, and on a
    CPU the steps' temporaries are allocated once for all of them (benchmarks/README.md)."""

    def train_steps(state: TrainState, batches: tuple[dict, ...], frozen: Any = None):
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
        return jax.lax.scan(lambda s, batch: train_step(s, batch, frozen), state, stacked)

    return train_steps


def micro_batches(batch, accum: int):
    """The batch as `accum` micro-batches on a leading axis: micro-batch a takes rows a, a+accum, ..., so the
    reshape keeps each device's rows local."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1), batch)


def make_eval_step(cfg: Config, n_vocab: int = 0):
    """eval_step(params, batch, frozen) -> (sums, count): {"loss": summed cross-entropy} and the token count,
    or with train.objective=dpo dpo_sums' sums (over the tokenizer's `n_vocab` ids) and the count of pairs."""
    cfg = platform.resolve(cfg, step_flops(cfg), rows_per_step(cfg))
    model = Transformer(cfg.model, deterministic=True)

    accum = cfg.train.grad_accum

    def sums_of(full, frozen, batch):
        if cfg.train.objective == "dpo":
            return dpo_sums(cfg, model, model, full, frozen, batch, n_vocab=n_vocab), pair_mask(batch).sum()
        _, ce_sum = loss_sums(cfg, model, full, batch, n_vocab=n_vocab)
        return {"loss": ce_sum}, _loss_mask(batch).sum()

    def eval_step(params, batch, frozen=None):
        full = model_params(cfg, params, frozen)
        rows = jax.tree.leaves(batch)[0].shape[0]
        if accum == 1 or rows % accum:
            return sums_of(full, frozen, batch)
        # In the training step's micro-batches, summed: a batch whose training step fits in memory evaluates in
        # it too (the whole batch's forward pass at once did not, after train.grad_accum was raised so that its
        # training step would).
        sums, counts = jax.lax.map(lambda mb: sums_of(full, frozen, mb), micro_batches(batch, accum))
        return jax.tree.map(lambda x: x.sum(axis=0), sums), counts.sum()

    return eval_step


def seed_key(seed: int) -> jax.Array:
    """The PRNG key of a config's seed, a 64-bit integer: jax.random.PRNGKey keeps only its low 32 bits (without
    jax_enable_x64), so seed=2**32 initialised and dropped out as seed=0 did, and -1 as 2**32 - 1, while the data
    order (seeded by all 64) differed. A seed in [0, 2**32) keeps the key it always had; any other folds its high
    half in."""
    low, high = seed % (1 << 32), (seed % (1 << 64)) >> 32
    key = jax.random.PRNGKey(low)
    return jax.random.fold_in(key, high) if high else key


def create_state(
    cfg: Config, tx: optax.GradientTransformation, mesh, frozen: Any = None, params: Any = None, restoring: bool = False
) -> tuple[TrainState, Any]:
    """(state, shardings): the train state initialised directly in its sharded layout.

    With LoRA the trained parameters are adapters on the `frozen` base model; they are small, so
    every device holds them whole. `params` (laid out as the shardings say): the weights a run starts from
    (init_from), of which only the optimizer state is initialised. `restoring`: the state is about to be restored
    from a checkpoint, and is returned abstract (shapes, dtypes and shardings), so that no random state is
    computed, nor held on the devices beside the restored one (twice the state's memory at every resume).
    """
    rng = seed_key(cfg.seed)

    def init(rng, frozen):
        if cfg.lora.rank:
            params = lora.init_adapters(frozen, cfg.lora.rank, cfg.lora.targets, jax.random.fold_in(rng, 0))
        else:
            params = nn.unbox(init_params(cfg.model, jax.random.fold_in(rng, 0)))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng)

    abstract = jax.eval_shape(init, rng, frozen)
    if cfg.lora.rank:
        params_sh = jax.tree.map(lambda _: sharding.replicated(mesh), abstract.params)
    else:
        params_sh = sharding.param_shardings(jax.eval_shape(lambda r: init_params(cfg.model, r), rng), mesh)
    shardings = TrainState(
        step=sharding.replicated(mesh),
        params=params_sh,
        opt_state=sharding.opt_state_shardings(abstract.opt_state, params_sh, mesh),
        rng=sharding.replicated(mesh),
    )
    held = f"the train state ({count_params(abstract.params) / 1e6:,.0f}M parameters and their optimizer state)"
    fix = "make the model smaller (model.n_layer, model.n_embd, model.vocab_size, model.mlp_hidden)"
    if not cfg.lora.rank and mesh.shape["data"] > 1:  # (fsdp and tensor shard it already)
        fix += " or shard it over the devices (mesh.data=1 mesh.fsdp=-1)"
    # Refused at once where one device's share is more than the device has; waited for, so that an allocation
    # that fails says so here, not at the first step as the step's memory.
    with fits_in_memory(held, fix, needed=sharding.bytes_per_device(abstract, shardings)):
        if restoring:  # (refused above all the same where it cannot fit: the restore allocates it)
            return sharding.abstract_like(abstract, shardings), shardings
        if params is None:
            state = jax.jit(init, out_shardings=shardings)(rng, frozen)
        else:  # (the weights themselves, not a copy, which would hold them twice)
            rest = lambda params, rng: (jnp.zeros((), jnp.int32), tx.init(params), rng)
            rest_sh = (shardings.step, shardings.opt_state, shardings.rng)
            step, opt_state, rng = jax.jit(rest, out_shardings=rest_sh)(params, rng)
            state = TrainState(step=step, params=params, opt_state=opt_state, rng=rng)
        state = jax.block_until_ready(state)
    return state, shardings


class Trainer:
    """The optimizer and the jitted, sharded train and eval steps of one run (the state is donated to
    train_step and train_steps). `frozen` is the LoRA base model, or a DPO run's reference model, or None.
    `cfg` has the platform's loss chunk and steps per call filled in (lm.platform.resolve), and `platform` is
    the run's (lm.platform.for_run)."""

    def __init__(self, cfg: Config, mesh, n_vocab: int, tx: optax.GradientTransformation, state_sh: Any, frozen: Any):
        flops = step_flops(cfg)
        rows = rows_per_step(cfg)
        self.platform, cfg = platform.for_run(cfg, flops, rows), platform.resolve(cfg, flops, rows)
        self.cfg, self.mesh, self.tx, self.state_sh, self.frozen = cfg, mesh, tx, state_sh, frozen
        batch_sh = sharding.batch_sharding(mesh)
        frozen_sh = None if frozen is None else jax.tree.map(lambda x: x.sharding, frozen)
        step = make_train_step(cfg, self.tx, n_vocab)
        jitted = lambda fn: jax.jit(
            fn,
            in_shardings=(self.state_sh, batch_sh, frozen_sh),
            out_shardings=(self.state_sh, sharding.replicated(mesh)),
            donate_argnums=0,
        )
        self.train_step, self.train_steps = jitted(step), jitted(repeated(step))
        self.eval_step = jax.jit(make_eval_step(cfg, n_vocab), in_shardings=(self.state_sh.params, batch_sh, frozen_sh))

    @classmethod
    def create(
        cls, cfg: Config, mesh, n_vocab: int, frozen: Any = None, params: Any = None, restoring: bool = False
    ) -> tuple[Trainer, TrainState]:
        """(trainer, the freshly initialised train state, laid out over `mesh`): see create_state for `params`
        and `restoring` (an abstract state)."""
        tx = make_optimizer(cfg.optim, cfg.train.steps)
        state, state_sh = create_state(cfg, tx, mesh, frozen, params, restoring)
        return cls(cfg, mesh, n_vocab, tx, state_sh, frozen), state
