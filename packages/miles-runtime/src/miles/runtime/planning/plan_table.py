"""A plan as the table `miles recipes plan` prints, and what to change when it does not fit."""

from __future__ import annotations

from miles.runtime.planning.planner import GB, Plan


def format_plan(p: Plan) -> str:
    """The plan as the table `miles recipes plan` prints."""
    run = p.run
    s = p.shape
    params = s.params
    lines = [
        f"model    {p.model} (family {p.family})",
        f"params   {_count(params.language_model)} loaded"
        + (f" (+{_count(params.vision)} vision, not loaded)" if params.vision else "")
        + (
            f"; {_count(params.language_model - params.experts + s.active_expert_params)} "
            "active per token"
            if params.experts
            else ""
        ),
        f"layout   {p.layout.describe()}",
        f"precision {run.precision.name}; train backend {run.train.backend}",
    ]
    train, rollout = p.train, p.rollout
    seq = run.planner.prompt_tokens + run.rollout.max_new_tokens
    rows = [
        ("weights", train.weights, rollout.weights),
        ("gradients", train.gradients, None),
        ("optimizer state", train.optimizer, None),
        (
            f"activations (train {train.micro_batch_tokens} tokens/micro-batch; prefill "
            f"{rollout.prefill_tokens} tokens)",
            train.activations,
            rollout.activations,
        ),
        (
            f"KV cache ({rollout.concurrency} seqs x {seq} tokens)"
            if rollout.cache_tokens is None
            else f"KV cache ({rollout.cache_tokens:,} tokens, allocated whole)",
            None,
            rollout.kv_cache,
        ),
        ("total", p.train_total, p.rollout_total),
    ]
    width = max(len(r[0]) for r in rows) + 2
    lines.append("")
    lines.append(f"{'per GPU (GB)':<{width}}{'train':>10}{'rollout':>10}")
    for label, train_value, rollout_value in rows:
        lines.append(f"{label:<{width}}{_gb(train_value):>10}{_gb(rollout_value):>10}")
    lines.append("")
    if p.usable is None:
        lines.append(f"peak {p.peak / GB:.1f} GB per GPU (no GPU memory given: --gpu-mem 141GB)")
    else:
        verdict = "fits" if p.fits else "DOES NOT FIT"
        lines.append(
            f"peak {p.peak / GB:.1f} GB per GPU of {p.usable / GB:.1f} GB usable "
            f"({p.gpu_mem / GB if p.gpu_mem else 0:.0f} GB x {p.usable_fraction:g}): {verdict}"
        )
        if not p.fits:
            lines.append(advice(p))
    if p.layout.colocated:
        lines.append(
            "colocated hand-over: "
            + (
                "offloads (trainer and engines take turns on the GPU)"
                if p.offloads
                else "keeps trainer and engines on the GPU together (a pause and a resume)"
            )
            + f"; offload: {p.run.offload}"
        )
    lines += [f"note: {n}" for n in p.notes]
    lines.append("note: activations and KV cache are estimates from the model's widths")
    return "\n".join(lines)


# What to change when a row dominates, unless the memory model says better.
_TRAIN_ADVICE = {
    "activations": "use smaller micro-batches or activation checkpointing (see the train "
    "backend's options)",
    "weights": "use more train GPUs or more tensor/pipeline/expert parallelism",
    "gradients": "use more train GPUs or more tensor/pipeline/expert parallelism",
    "optimizer": "use more train GPUs (more data parallelism shards the optimizer)",
}
_ROLLOUT_ADVICE = {
    "weights": "raise rollout.gpus_per_engine (engine tensor parallelism)",
    "kv_cache": "lower the rollout concurrency or raise rollout.gpus_per_engine",
    "activations": "lower the rollout concurrency or planner.prompt_tokens",
}
_LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "kv_cache": "the KV cache",
}


def advice(p: Plan) -> str:
    """What to change when a plan does not fit, from what dominates it."""
    if p.train_total >= p.rollout_total:
        rows, tips, where = p.train.rows, {**_TRAIN_ADVICE, **p.train.advice}, "train"
    else:
        rows, tips, where = p.rollout.rows, {**_ROLLOUT_ADVICE, **p.rollout.advice}, "rollout"
    biggest = max(rows, key=lambda k: rows[k])
    return f"{where} GPUs: most of it is {_LABELS[biggest]}; {tips[biggest]}"


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / GB:.2f}"


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
