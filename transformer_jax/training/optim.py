"""Optax optimiser and learning-rate schedules from the `opt` config group."""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import optax

from transformer_jax.config import checks


def learning_rate_schedule(opt: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
    """The learning rate at each optimizer step (0-based; the paper's step_num is step + 1).

    paper:    lrate = learning_rate * min(step_num^-0.5, step_num * warmup^-1.5), learning_rate = d_model^-0.5 (5.3)
    rsqrt:    linear warmup to learning_rate, then learning_rate * sqrt(warmup / step_num)
    cosine:   linear warmup to learning_rate, then cosine decay to 0 at num_steps
    constant: linear warmup to learning_rate, then constant
    """
    checks.check_opt(opt)  # the rules of checks.RULES, as validate() applies them
    peak, warmup = float(opt.learning_rate), max(int(opt.warmup_steps), 1)
    if opt.schedule == "paper":
        return lambda step: peak * jnp.minimum((step + 1.0) ** -0.5, (step + 1.0) * warmup**-1.5)
    # Linear warmup: peak * step_num / warmup, reaching peak at step warmup - 1; the decay starts from there.
    ramp = optax.linear_schedule(peak / warmup, peak, transition_steps=warmup - 1)
    after = {
        "rsqrt": lambda count: peak * jnp.sqrt(warmup / (count + warmup)),  # count = step_num - warmup
        "cosine": optax.cosine_decay_schedule(peak, decay_steps=max(num_steps - warmup, 1)),
        "constant": optax.constant_schedule(peak),
    }[opt.schedule]
    return optax.join_schedules([ramp, after], boundaries=[warmup - 1])


def make_optimizer(opt: ml_collections.ConfigDict, num_steps: int) -> optax.GradientTransformation:
    """Adam (b1, b2, eps from the config; paper: 0.9, 0.98, 1e-9) or AdamW, with optional global-norm clipping."""
    schedule = learning_rate_schedule(opt, num_steps)  # checks the opt group
    if opt.optimizer == "adam":
        tx = optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps)
    else:
        tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay)
    if opt.clip_grad_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(opt.clip_grad_norm), tx)
    return tx
