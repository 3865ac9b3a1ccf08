"""Standalone prototype of `miles run quickstart`: SFT warm-start + GRPO on the quickstart task.

Pure torch + transformers (no Ray, no framework), to size the task so RL visibly learns on a 2-core
CPU. The tokenizer, model and data come from `miles.recipes.quickstart_task`; the SFT and GRPO
loops here mirror what the framework runs (GRPO advantages, PPO-clip with token-mean, AdamW,
temperature-1 sampling with logprobs = log_softmax(logits / T)).

    PYTHONPATH=packages/miles-recipes/src python tools/bench/quickstart_prototype.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.recipes import quickstart_task


@dataclass
class Settings:
    sft_steps: int = 64  # one epoch of the 16384-row SFT file
    sft_batch: int = 256
    sft_lr: float = 3e-3
    rl_steps: int = 20
    prompts_per_step: int = 64
    group_size: int = 8
    max_new_tokens: int = 4  # the answer and <|im_end|>, plus slack
    rl_lr: float = 3e-3
    clip_eps: float = 0.2
    temperature: float = 1.0
    weight_decay: float = 0.01
    grad_clip: float = 1.0  # 0: off
    # model overrides (0 / "" = module default)
    hidden: int = 0
    layers: int = 0
    init_std: float = 0.0
    tie: str = ""


def read_jsonl(path: str) -> list[dict[str, str]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def encode_prompts(tokenizer, rows: list[dict[str, str]]) -> torch.Tensor:
    """Chat-templated prompt ids, [rows, prompt_len]; every quickstart prompt has the same length."""
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for r in rows
    ]
    assert len({len(x) for x in ids}) == 1, "quickstart prompts are fixed-length"
    return torch.tensor(ids)


@torch.no_grad()
def sample(
    model,
    prompts: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    eos_id: int,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KV-cached sampling. Returns response ids, logprobs, and loss mask (through the eos), [B, T]."""
    out = model(input_ids=prompts, use_cache=True)
    cache, logits = out["cache"], out.logits[:, -1]
    done = torch.zeros(prompts.shape[0], dtype=torch.bool)
    tokens, logprobs, mask = [], [], []
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        tok = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1).squeeze(-1)
        mask.append(~done)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        logprobs.append(logp.gather(-1, tok[:, None]).squeeze(-1))
        done = done | (tok == eos_id)
        if done.all():
            break
        out = model(input_ids=tok[:, None], cache=cache, use_cache=True)
        cache, logits = out["cache"], out.logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(mask, 1).float()


def rewards_of(tokenizer, responses: torch.Tensor, answers: list[str]) -> torch.Tensor:
    """Exact match of the decoded response (special tokens dropped) against the reference."""
    texts = tokenizer.batch_decode(responses.tolist(), skip_special_tokens=True)
    return torch.tensor([float(t.strip() == a) for t, a in zip(texts, answers, strict=True)])


def response_logprobs(model, prompts: torch.Tensor, responses: torch.Tensor, temperature: float):
    seq = torch.cat([prompts, responses], 1)
    logits = model(input_ids=seq).logits[:, prompts.shape[1] - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, responses[..., None]).squeeze(-1)


def sft(model, tokenizer, rows, s: Settings, rng: random.Random, log) -> None:
    prompts = encode_prompts(tokenizer, rows)
    answers = torch.tensor(
        [tokenizer.convert_tokens_to_ids(r["response"]) for r in rows]
    )  # word-level: one token
    targets = torch.stack([answers, torch.full_like(answers, tokenizer.eos_token_id)], 1)
    opt = torch.optim.AdamW(model.parameters(), lr=s.sft_lr, weight_decay=s.weight_decay)
    t0 = time.perf_counter()
    for step in range(s.sft_steps):
        idx = torch.tensor(rng.sample(range(len(rows)), s.sft_batch))
        seq = torch.cat([prompts[idx], targets[idx]], 1)
        logits = model(input_ids=seq).logits[:, prompts.shape[1] - 1 : -1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[idx].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == s.sft_steps - 1:
            log(f"sft step {step:3d} loss {loss.item():.3f} t {time.perf_counter() - t0:.1f}s")


def grpo_step(model, opt, tokenizer, prompts, answers, s: Settings) -> dict[str, float]:
    g = s.group_size
    prompts = prompts.repeat_interleave(g, 0)
    answers = [a for a in answers for _ in range(g)]
    model.eval()
    resp, old_logp, mask = sample(
        model,
        prompts,
        s.max_new_tokens,
        s.temperature,
        False,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    reward = rewards_of(tokenizer, resp, answers)
    grouped = reward.view(-1, g)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    adv = adv.reshape(-1, 1)
    model.train()
    logp = response_logprobs(model, prompts, resp, s.temperature)
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - s.clip_eps, 1 + s.clip_eps) * adv)
    loss = (per_token * mask).sum() / mask.sum()  # token-mean over the whole batch
    opt.zero_grad()
    loss.backward()
    if s.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    opt.step()
    return {
        "reward": reward.mean().item(),
        "solved_groups": (grouped.max(1).values > 0).float().mean().item(),
        "resp_len": mask.sum(1).mean().item(),
    }


@torch.no_grad()
def evaluate(model, tokenizer, prompts, answers, s: Settings) -> dict[str, float]:
    model.eval()
    result = {}
    for name, greedy in (("greedy", True), ("sampled", False)):
        resp, _, _ = sample(
            model,
            prompts,
            s.max_new_tokens,
            s.temperature,
            greedy,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
        result[name] = rewards_of(tokenizer, resp, answers).mean().item()
    return result


def run(seed: int, s: Settings, workdir: Path, verbose: bool) -> dict:
    def log(msg: str) -> None:
        if verbose:
            print(f"[seed {seed}] {msg}", flush=True)

    t0 = time.perf_counter()
    model_dir = workdir / f"model_{seed}"
    overrides: dict = {}
    if s.hidden:
        overrides |= {"hidden_size": s.hidden, "intermediate_size": 3 * s.hidden}
    if s.layers:
        overrides["num_hidden_layers"] = s.layers
    if s.init_std:
        overrides["initializer_range"] = s.init_std
    if s.tie:
        overrides["tie_word_embeddings"] = s.tie == "1"
    quickstart_task.build_model(model_dir, seed, **overrides)
    paths = quickstart_task.write_datasets(workdir / f"data_{seed}", seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    t_setup = time.perf_counter()

    sft(model, tokenizer, read_jsonl(paths["sft"]), s, rng, log)
    t_sft = time.perf_counter()

    rl_rows, eval_rows = read_jsonl(paths["rl_train"]), read_jsonl(paths["eval"])
    rl_prompts = encode_prompts(tokenizer, rl_rows)
    eval_prompts = encode_prompts(tokenizer, eval_rows)
    eval_answers = [r["answer"] for r in eval_rows]
    eval_before = evaluate(model, tokenizer, eval_prompts, eval_answers, s)
    log(f"eval after SFT: {eval_before}")

    opt = torch.optim.AdamW(model.parameters(), lr=s.rl_lr, weight_decay=s.weight_decay)
    curve = []
    order = list(range(len(rl_rows)))
    rng.shuffle(order)
    for step in range(s.rl_steps):
        idx = order[step * s.prompts_per_step : (step + 1) * s.prompts_per_step]
        m = grpo_step(
            model, opt, tokenizer, rl_prompts[idx], [rl_rows[i]["answer"] for i in idx], s
        )
        curve.append(round(m["reward"], 3))
        log(
            f"rl step {step:3d} reward {m['reward']:.3f} solved_groups {m['solved_groups']:.2f} "
            f"resp_len {m['resp_len']:.2f}"
        )
    t_rl = time.perf_counter()

    eval_after = evaluate(model, tokenizer, eval_prompts, eval_answers, s)
    t_end = time.perf_counter()
    log(f"eval after RL: {eval_after}")
    return {
        "seed": seed,
        "reward_curve": curve,
        "step0_reward": curve[0],
        "eval_after_sft": eval_before,
        "eval_final": eval_after,
        "time_s": {
            "setup": round(t_setup - t0, 2),
            "sft": round(t_sft - t_setup, 2),
            "rl": round(t_rl - t_sft, 2),
            "eval": round(t_end - t_rl, 2),
            "total": round(t_end - t0, 2),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", type=str, default=None, help="write the per-seed results here")
    for name, default in asdict(Settings()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    s = Settings(**{k: getattr(args, k) for k in asdict(Settings())})
    print(f"settings: {asdict(s)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            r = run(seed, s, Path(tmp), verbose=not args.quiet)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "reward_curve"}), flush=True)
            print(f"  curve: {r['reward_curve']}", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"settings": asdict(s), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
