"""Benchmark: Megatron-core parallel parity. The same weights and batch at each parallel layout
against TP=PP=EP=1: token logprobs, one optimizer step's update, and a `dist_checkpointing`
checkpoint saved at one layout and loaded at the next.

Every layout runs on the same `--world` ranks (one per GPU, NCCL; or gloo CPU ranks with
`--device cpu`, fp32, for checking this script without GPUs). The reference layout (tp1) gives
every rank the whole batch, each counting its tokens once, so its step is one rank's step on the
whole batch; `dp2` splits the batch between two data-parallel ranks. The step goes through
megatron-core's own machinery: `DistributedDataParallel`, `get_megatron_optimizer` (Adam; the
distributed optimizer on CUDA), `get_forward_backward_func` (the 1F1B pipeline schedule at
PP > 1) and `finalize_model_grads`, with a per-token loss (`calculate_per_token_loss`) over
packed micro-batches: two sequences and a padding segment in each THD row. The loss is what an RL
loss reads: -advantage x logprob - 0.01 x entropy, summed over the batch's tokens and divided by
their count. Reported per layout: max abs logprob difference against the reference (and the
reference against transformers' forward), the relative difference of the update
(||d - d_ref|| / ||d_ref|| over all weights, under Hugging Face names), and whether the weights
loaded from the previous layout's checkpoint equal the weights it saved.

    python tools/bench/megatron_parity.py --model qwen3 --layouts tp2,pp2,dp2 --out /tmp/p.md
    python tools/bench/megatron_parity.py --model qwen3_moe --layouts ep2,tp2xep1 --out /tmp/m.md
    python tools/bench/megatron_parity.py --model qwen3@Qwen/Qwen3-0.6B --layouts tp2,pp2,dp2
    python tools/bench/megatron_parity.py --device cpu --model qwen3 --layouts tp2,pp2,dp2

A layout is `tpN`, `ppN`, `epN`, `dpN` or a product of them (`tp2xep1`); data parallelism is what
is left of the world. MODEL is a family's tiny twin, or FAMILY@HUB_ID for that checkpoint's
stored config.json with random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))  # sync.py's engine process

ENTROPY_COEF, TEMPERATURE = 0.01, 1.0


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int | None = None  # None: all that the world leaves

    @staticmethod
    def parse(name: str) -> Layout:
        sizes: dict[str, int] = {}
        for part in name.split("x"):
            kind, size = part[:2], part[2:]
            if kind not in ("tp", "pp", "ep", "dp") or not size.isdigit():
                raise SystemExit(
                    f"error: layout {name!r}: write parts like tp2, pp2, ep2, dp2, joined by x "
                    "(tp2xep1)"
                )
            sizes[kind] = int(size)
        return Layout(name, **sizes)


@dataclass
class MicroBatch:
    ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    targets: torch.Tensor  # [1, T]: the token each position predicts
    weights: torch.Tensor  # [1, T]: the advantage; 0 on the last token of a sequence and padding
    mask: torch.Tensor  # [1, T]: 1 where a loss is taken
    cu_seqlens: torch.Tensor
    max_len: int
    seqs: list[torch.Tensor]  # the real sequences, for transformers' forward


def make_batch(vocab: int, count: int, longest: int, seed: int = 1) -> list[MicroBatch]:
    """`count` micro-batches, each two random sequences (8 to `longest` tokens) and a padding
    segment in one row of 2 x `longest` tokens."""
    g = torch.Generator().manual_seed(seed)
    width = 2 * longest
    out = []
    for _ in range(count):
        lengths = torch.randint(8, longest + 1, (2,), generator=g).tolist()
        seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
        pad = width - sum(lengths)
        ids = torch.cat([*seqs, torch.zeros(pad, dtype=torch.long)])
        positions = torch.cat([torch.arange(n) for n in [*lengths, pad] if n])
        targets = torch.cat([torch.cat([s[1:], s[:1]]) for s in seqs] + [torch.zeros(pad).long()])
        mask = torch.cat([torch.cat([torch.ones(n - 1), torch.zeros(1)]) for n in lengths])
        mask = torch.cat([mask, torch.zeros(pad)])
        advantages = torch.cat(
            [torch.full((n,), torch.randn(1, generator=g).item()) for n in lengths]
        )
        weights = torch.cat([advantages, torch.zeros(pad)]) * mask
        bounds = [0, *torch.tensor([*lengths, pad] if pad else lengths).cumsum(0).tolist()]
        out.append(
            MicroBatch(
                ids=ids[None],
                positions=positions[None],
                targets=targets[None],
                weights=weights[None],
                mask=mask[None],
                cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
                max_len=max([*lengths, pad]),
                seqs=seqs,
            )
        )
    return out


def _model_config(model: str, overrides: list[str]) -> dict[str, Any]:
    from miles.core.registry.families import family_named

    name, _, hub_id = model.partition("@")
    family = family_named(name)
    if hub_id:
        assert family.config_for is not None, f"{name} has no stored configs"
        config = family.config_for(hub_id)
        if config is None:
            raise SystemExit(f"error: no stored config.json for {hub_id}")
    else:
        assert family.tiny is not None, f"{name} has no tiny twin"
        config = {**family.tiny(), "vocab_size": 300}  # not a multiple of 128: padding exercised
    for item in overrides:
        key, value = item.split("=", 1)
        config[key] = json.loads(value)
    return dict(config)


class Rank:
    """One process: the same weights, batch and checks at each layout in turn."""

    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        self.rank, self.args = rank, args
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        if self.cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if self.cuda else "gloo", rank=rank, world_size=args.world)
        from transformers import AutoConfig, AutoModelForCausalLM

        from miles.core.registry.families import family_named

        self.config = _model_config(args.model, args.set)
        family = family_named(args.model.partition("@")[0])
        assert family.megatron is not None, f"{family.name} declares no Megatron mapping"
        self.mapping = family.megatron(self.config)
        torch.manual_seed(0)
        hf_config = {k: v for k, v in self.config.items() if k != "model_type"}
        self.hf = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(self.config["model_type"], **hf_config), dtype=self.dtype
        ).eval()
        self.weights = dict(self.hf.state_dict())
        self.vocab = int(self.config["vocab_size"])
        self.batch = make_batch(self.vocab, args.micro_batches, args.longest)

    # --- one layout ---------------------------------------------------------------------------

    def setup(self, layout: Layout) -> None:
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            expert_model_parallel_size=layout.ep,
        )
        if self.cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(0)
        else:
            from miles.megatron.testing import run_megatron_on_cpu

            run_megatron_on_cpu()

    def build(self, layout: Layout) -> tuple[Any, Any, Any]:
        """(DDP-wrapped model, its optimizer, this rank's coordinates), unfilled."""
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from miles.megatron.head import bypass_output_layer
        from miles.megatron.layout import ParallelLayout
        from miles.megatron.layout import Rank as Coordinates
        from miles.megatron.model import build_gpt_model, transformer_config

        playout = ParallelLayout(tp=layout.tp, pp=layout.pp, ep=layout.ep)
        dispatcher = "alltoall" if self.cuda else "allgather"  # alltoall makes CUDA streams
        tconfig = transformer_config(
            self.mapping,
            playout,
            self.dtype,
            token_dispatcher=dispatcher,
            calculate_per_token_loss=True,
        )
        module = build_gpt_model(self.mapping, playout, tconfig)
        bypass_output_layer(module)
        distributed = self.cuda  # megatron-core's distributed optimizer allocates on CUDA
        ddp = DistributedDataParallel(
            tconfig,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=distributed
            ),
            module,
        )
        here = Coordinates(
            pp=parallel_state.get_pipeline_model_parallel_rank(),
            tp=parallel_state.get_tensor_model_parallel_rank(),
            ep=parallel_state.get_expert_model_parallel_rank(),
            etp=parallel_state.get_expert_tensor_parallel_rank(),
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=self.args.lr,
                weight_decay=0.0,
                bf16=self.dtype == torch.bfloat16,
                params_dtype=self.dtype,
                use_distributed_optimizer=distributed,
                clip_grad=0.0,
            ),
            [ddp],
        )
        return ddp, optimizer, (playout, here)

    def fill(self, ddp: Any, where: tuple[Any, Any]) -> None:
        from miles.megatron.convert import shard

        playout, here = where
        shards = shard(self.weights, self.mapping, playout, here)
        with torch.no_grad():
            ddp.module.load_state_dict(shards, strict=False)
        ddp.broadcast_params()  # no-op for equal copies; what Megatron-LM does after loading

    def my_micro_batches(self, layout: Layout) -> list[int]:
        """Indices of this rank's micro-batches: all of them in the reference, else its data-
        parallel share."""
        from megatron.core import parallel_state

        if layout.name == "reference":
            return list(range(len(self.batch)))
        dp = parallel_state.get_data_parallel_world_size()
        me = parallel_state.get_data_parallel_rank()
        return [i for i in range(len(self.batch)) if i % dp == me]

    def forward_backward(self, ddp: Any, layout: Layout, forward_only: bool) -> dict[int, Any]:
        """Runs the micro-batches through Megatron's schedule; returns {index: logprobs} on the
        last stage's ranks."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from miles.megatron.head import output_weight
        from miles.megatron.logprobs import vocab_parallel_logprobs

        mine = self.my_micro_batches(layout)
        # The reference's ranks each run the whole batch: each takes 1/world of the loss and
        # only the first counts the tokens, so the gradients' sum over the data-parallel ranks
        # divided by the tokens' sum is one rank's step on the whole batch.
        reference = layout.name == "reference"
        share = 1.0 / dist.get_world_size() if reference else 1.0
        counts = not reference or self.rank == 0
        config = ddp.config
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = None
        dev = self.device

        def step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
            index = next(data)
            mb = self.batch[index]
            packed = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=mb.cu_seqlens.to(dev),
                cu_seqlens_kv=mb.cu_seqlens.to(dev),
                max_seqlen_q=mb.max_len,
                max_seqlen_kv=mb.max_len,
            )
            out = model(mb.ids.to(dev), mb.positions.to(dev), None, packed_seq_params=packed)
            if not model.module.post_process:
                return out, None
            from megatron.core import parallel_state

            weight = output_weight(model.module)
            lp, ent = vocab_parallel_logprobs(
                out.reshape(-1, out.shape[-1]),
                weight,
                mb.targets.to(dev).reshape(-1),
                vocab_start=parallel_state.get_tensor_model_parallel_rank() * weight.shape[0],
                vocab_size=self.vocab,
                temperature=TEMPERATURE,
                group=parallel_state.get_tensor_model_parallel_group(),
            )
            return torch.stack([lp, ent]), partial(self._loss, mb, index, share, counts)

        out = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(mine),
            model=[ddp],
            num_microbatches=len(mine),
            seq_length=mb_width(self.batch),
            micro_batch_size=1,
            forward_only=forward_only,
        )
        return {int(r["index"]): r["logprobs"] for r in out} if out else {}

    def _loss(
        self, mb: MicroBatch, index: int, share: float, counts: bool, out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        lp, ent = out[0], out[1]
        mask, weights = mb.mask.to(lp.device).reshape(-1), mb.weights.to(lp.device).reshape(-1)
        loss = (-(weights * lp) - ENTROPY_COEF * ent * mask).sum() * share
        tokens = mask.sum().to(torch.int) * int(counts)
        reported = {"index": index, "logprobs": (lp * mask).detach().float().cpu()}
        return loss, tokens, reported

    def hf_weights(self, ddp: Any, where: tuple[Any, Any]) -> dict[str, torch.Tensor] | None:
        """The model's weights under Hugging Face names, on rank 0 (collective)."""
        from miles.megatron.convert import gather

        playout, here = where
        mine = {
            k: v.detach().float().cpu()
            for k, v in ddp.module.state_dict().items()
            if not k.endswith("_extra_state")
        }
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (here, mine))
        if self.rank != 0:
            return None
        return gather(dict(everyone), self.mapping, playout)

    def logprobs_of(self, found: dict[int, Any]) -> dict[int, torch.Tensor] | None:
        """Every micro-batch's logprobs, on rank 0 (collective; the tensor ranks of the last
        stage hold the same values)."""
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        if self.rank != 0:
            return None
        merged: dict[int, torch.Tensor] = {}
        for part in everyone:
            merged.update(part)
        return merged

    def transformers_logprobs(self) -> dict[int, torch.Tensor]:
        """transformers' forward of each sequence on its own: the reference's reference."""
        hf = self.hf.to(self.device)
        out = {}
        with torch.no_grad():
            for i, mb in enumerate(self.batch):
                parts = []
                for s in mb.seqs:
                    logits = hf(s[None].to(self.device)).logits[0].float() / TEMPERATURE
                    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, s[1:, None].to(self.device))
                    parts += [lp[:, 0].cpu(), torch.zeros(1)]
                flat = torch.cat(parts)
                out[i] = torch.cat([flat, torch.zeros(mb_width(self.batch) - len(flat))])
        self.hf.cpu()
        return out

    def sync_to_engine(self, ddp: Any, where: tuple[Any, Any], work: str) -> dict[str, Any]:
        """The sharded trainer's weights, gathered under Hugging Face names, cast to bf16 and
        broadcast bucket by bucket over a weight-sync group (the transport of a disaggregated
        run) to the native engine in a process of its own, on the last GPU; then both sides'
        weight checksums (collective; the result on rank 0)."""
        from sync import engine_side

        from miles.core.contracts.weight_sync import plan_buckets
        from miles.torch.sync.checksum import tensors_checksum
        from miles.torch.sync.group import SyncGroup, meta_of

        weights = self.hf_weights(ddp, where)
        if weights is None:
            return {}
        model_dir = os.path.join(work, "engine_model")
        self.hf.save_pretrained(model_dir)  # the engine starts from the initial weights
        device = f"cuda:{self.args.world - 1}" if self.cuda else "cpu"
        ctx = mp.get_context("spawn")
        requests, replies = ctx.Queue(), ctx.Queue()
        engine = ctx.Process(target=engine_side, args=(model_dir, requests, replies, device))
        engine.start()
        assert replies.get()[0] == "ready"
        requests.put(("join", ("127.0.0.1", self.args.port + 1)))
        group = SyncGroup("127.0.0.1", self.args.port + 1, 2, 0, device=str(self.device))
        assert replies.get()[0] == "joined"
        named = [(k, v.to(self.device, torch.bfloat16)) for k, v in weights.items()]
        plan = plan_buckets((meta_of(n, t) for n, t in named), self.args.sync_bucket_mb << 20)
        requests.put(("receive", (plan, 1)))
        sent = group.send(plan, iter(named))
        assert replies.get()[0] == "received"
        requests.put(("checksum", None))
        _, (theirs, _) = replies.get()
        requests.put(("stop", None))
        engine.join(timeout=60)
        group.close()
        return {
            "sync_bytes": sent,
            "sync_buckets": len(plan.buckets),
            "sync_checksum_equal": tensors_checksum(named) == theirs,
        }

    def run(self, layouts: list[Layout], ckpt_root: str) -> list[dict[str, Any]] | None:
        from megatron.core import dist_checkpointing

        rows: list[dict[str, Any]] = []
        reference: tuple[Any, Any] | None = None  # (logprobs, update) of the reference
        saved: tuple[str, Any] | None = None  # the last checkpoint and the weights it holds
        hf_lp = self.transformers_logprobs() if self.rank == 0 else None
        for i, layout in enumerate([Layout("reference"), *layouts]):
            self.setup(layout)
            ddp, optimizer, where = self.build(layout)
            row: dict[str, Any] = {"layout": layout.name}
            if saved is not None:  # the last checkpoint, loaded at this layout
                state = dist_checkpointing.load(ddp.module.sharded_state_dict(), saved[0])
                ddp.module.load_state_dict(state, strict=False)
                loaded = self.hf_weights(ddp, where)
                if loaded is not None:
                    row["checkpoint"] = _equal(loaded, saved[1])
            self.fill(ddp, where)
            # With bf16 weights the optimizer steps fp32 copies, made when it was built: they
            # must be taken again from the weights just loaded (Megatron-LM does the same after
            # a checkpoint load without optimizer state).
            optimizer.reload_model_params()
            before = self.hf_weights(ddp, where)
            ddp.eval()
            with torch.no_grad():
                lp = self.logprobs_of(self.forward_backward(ddp, layout, forward_only=True))
            ddp.train()
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            try:
                self.forward_backward(ddp, layout, forward_only=False)
            except ValueError as refused:  # raised alike on every rank, before any collective
                row["refused"] = str(refused)
                after = None
            else:
                ok, grad_norm, _ = optimizer.step()
                assert ok, "the optimizer skipped its step"
                row["grad_norm"] = float(grad_norm)
                after = self.hf_weights(ddp, where)
                path = os.path.join(ckpt_root, f"{i}")
                os.makedirs(path, exist_ok=True)
                dist_checkpointing.save(ddp.module.sharded_state_dict(), path)
                saved = (path, after)
                if layout.name == self.args.sync_at:
                    row.update(self.sync_to_engine(ddp, where, ckpt_root))
            if self.rank == 0:
                assert lp is not None and before is not None and hf_lp is not None
                update = None if after is None else {k: after[k] - before[k] for k in after}
                if update is not None:
                    # One Adam step moves a weight by about lr: a step from other weights than
                    # the ones loaded (stale optimizer copies) moves them by their own size.
                    row["update_over_weights"] = _norm(update) / _norm(before)
                    if row["update_over_weights"] > 0.5:
                        raise SystemExit(
                            f"error: {layout.name}: one step changed the weights by "
                            f"{row['update_over_weights']:.2f} of their norm; the optimizer "
                            "did not start from the weights loaded"
                        )
                if reference is None:
                    assert update is not None, row.get("refused")
                    reference = (lp, update)
                    row["logprob_vs_transformers"] = _max_diff(lp, hf_lp)
                else:
                    row["logprob_max_abs_diff"] = _max_diff(lp, reference[0])
                if update is not None and reference[1] is not update:
                    ref_update = reference[1]
                    row["update_rel_diff"] = _rel(update, ref_update)
                    row["worst_tensor"] = max(
                        ((k, _rel({k: update[k]}, {k: ref_update[k]})) for k in ref_update),
                        key=lambda kv: kv[1],
                    )
                rows.append(row)
                print(json.dumps(row), flush=True)
            dist.barrier()
        return rows if self.rank == 0 else None


def mb_width(batch: list[MicroBatch]) -> int:
    return int(batch[0].ids.shape[1])


def _max_diff(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> float:
    return max((a[i] - b[i]).abs().max().item() for i in a)


def _norm(d: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().pow(2).sum() for t in d.values()) ** 0.5)


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return _norm({k: a[k] - b[k] for k in b}) / max(_norm(b), 1e-30)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor] | None) -> bool:
    return b is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def _main_rank(rank: int, args: argparse.Namespace, ckpt_root: str, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    layouts = [Layout.parse(x) for x in args.layouts.split(",")]
    rows = Rank(rank, args).run(layouts, ckpt_root)
    if rows is not None:
        Path(results).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3", help="FAMILY or FAMILY@HUB_ID")
    parser.add_argument("--layouts", default="tp2,pp2,dp2")
    parser.add_argument("--world", type=int, default=2, help="ranks (GPUs)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--longest", type=int, default=24, help="longest sequence, tokens")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--set", action="append", default=[], help="config.json key=JSON value")
    parser.add_argument(
        "--sync-at",
        default="",
        help="after this layout's step, sync its weights to a native engine on the last GPU "
        "and compare checksums (e.g. tp2)",
    )
    parser.add_argument("--sync-bucket-mb", type=int, default=512)
    parser.add_argument("--port", type=int, default=29581)
    parser.add_argument("--out", default="/tmp/megatron_parity.md")
    args = parser.parse_args()
    for layout in (Layout.parse(x) for x in args.layouts.split(",")):
        model_parallel = layout.tp * layout.pp
        dp = args.world // model_parallel
        if args.world % model_parallel or (layout.dp is not None and layout.dp != dp):
            raise SystemExit(
                f"error: layout {layout.name} does not fit --world {args.world}: data "
                f"parallelism is what the world leaves of tp x pp = {model_parallel}, so "
                f"{args.world / model_parallel:g} here; set --world to dp x tp x pp"
            )
    if args.sync_at and args.sync_at not in args.layouts.split(","):
        raise SystemExit(f"error: --sync-at {args.sync_at} is not one of --layouts")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        raise SystemExit(
            f"error: --world {args.world} needs {args.world} GPUs; this machine has "
            f"{torch.cuda.device_count()} (use --device cpu to check the script on CPU ranks)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "rows.json")
        mp.spawn(_main_rank, args=(args, os.path.join(tmp, "ckpt"), results), nprocs=args.world)
        rows = json.loads(Path(results).read_text())
    where = (
        f"{torch.cuda.get_device_name()} x {args.world}, bf16"
        if args.device == "cuda"
        else f"{args.world} gloo CPU ranks, fp32"
    )
    lines = [
        f"{args.model}: {args.micro_batches} packed micro-batches of {2 * args.longest} tokens, "
        f"Adam lr {args.lr}, on {where}; megatron-core, torch {torch.__version__}",
        "",
        "| layout | logprob max abs diff | update rel diff | worst tensor's update rel diff "
        "| checkpoint from the previous layout equal | grad norm |",
        "|---|---:|---:|---|---|---:|",
    ]
    notes: list[str] = []
    for row in rows:
        if row["layout"] == "reference":
            lp = f"{row['logprob_vs_transformers']:.2e} (vs transformers)"
        else:
            lp = f"{row['logprob_max_abs_diff']:.2e}"
        rel = f"{row['update_rel_diff']:.2e}" if "update_rel_diff" in row else "-"
        worst = (
            f"{row['worst_tensor'][1]:.2e} `{row['worst_tensor'][0]}`"
            if "worst_tensor" in row
            else "-"
        )
        if "refused" in row:  # megatron-core's check, in its words in the JSON row
            rel, worst = "no step: refused by megatron-core", "-"
            notes.append(
                f"{row['layout']}: megatron-core refused the training step: {row['refused']}"
            )
        ckpt = {True: "yes", False: "**no**"}.get(row.get("checkpoint"), "-")
        norm = f"{row['grad_norm']:.4g}" if "grad_norm" in row else "-"
        lines.append(f"| {row['layout']} | {lp} | {rel} | {worst} | {ckpt} | {norm} |")
    lines += ["", *notes] if notes else []
    for row in rows:
        if "sync_checksum_equal" in row:
            lines += [
                "",
                f"Weight sync after the {row['layout']} step: the trainer's shards gathered under "
                f"Hugging Face names, {row['sync_bytes'] / 1e6:.1f} MB of bf16 in "
                f"{row['sync_buckets']} buckets to the native engine; engine checksum equal to "
                f"the trainer's: {'yes' if row['sync_checksum_equal'] else '**no**'}",
            ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    if any(r.get("sync_checksum_equal") is False for r in rows):
        sys.exit("error: the engine's weights differ from the trainer's after the sync")
    if any(r.get("checkpoint") is False for r in rows):
        sys.exit("error: a checkpoint loaded at another layout differs from what was saved")


if __name__ == "__main__":
    main()
