"""The trainer's half of weight sync, for any torch train backend.

What engines receive is the trainer's full weights under Hugging Face names, converted by the
run's precision (its quantized format, or its dtype), with LoRA either merged in or sent alone
(`lora.sync`). They travel over a broadcast group (rank 0 sends; the other ranks help gather each
full tensor) or, colocated, bucket by bucket in place. The checksum is of the weights as an
engine holding a given dtype must hold them after the sync. After an in-place sync whose buckets
are exactly that (the engine's dtype, nothing decoded or applied on arrival), it is taken from
the buckets as they are sent, so verification does not materialise the weights a second time;
any change to the weights (`weights_changed`) drops it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal

import torch

from miles.core.contracts.backends import BucketDelivery, TrainSetup
from miles.core.contracts.weight_sync import SyncPlan, plan_buckets
from miles.precision.lora import fold_adapters
from miles.torch.sync import ipc
from miles.torch.sync.checksum import Checksum, tensors_checksum
from miles.torch.sync.group import SyncGroup, meta_of

# "sync": what `lora.sync` says engines get; "merged": base + adapters under the base names;
# "base": the frozen base alone (without LoRA, all three are the weights).
WeightView = Literal["sync", "merged", "base"]
NamedWeights = Callable[[WeightView], Iterator[tuple[str, torch.Tensor]]]


class WeightSender:
    """`named_weights(view)` yields every full tensor, collectively on every rank (each is
    gathered from the ranks' shards)."""

    def __init__(self, named_weights: NamedWeights, setup: TrainSetup, device: torch.device):
        self.named_weights, self.setup, self.device = named_weights, setup, device
        self.precision = setup.precision
        self._group: SyncGroup | None = None
        # The last in-place sync's buckets hashed as they went: (their dtypes, the checksum).
        self._sent: tuple[set[str], Checksum] | None = None

    def weights_changed(self) -> None:
        """The trainer's weights are about to change: the last sync's checksum is stale."""
        self._sent = None

    def rollout_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.precision.convert_for_rollout(self.named_weights("sync"))

    def plan(self, bucket_bytes: int) -> SyncPlan:
        """Names, shapes and dtypes of what engines receive (collective)."""
        return plan_buckets((meta_of(n, t) for n, t in self.rollout_weights()), bucket_bytes)

    def join(self, host: str, port: int, world_size: int) -> None:
        """Rank 0 joins a new sync group as its rank 0; the other ranks have nothing to join."""
        if self.setup.rank != 0:
            return
        self.close()
        self._group = SyncGroup(
            host, port, world_size, 0, device=str(self.device), timeout_s=self.setup.sync_timeout_s
        )

    def send(self, plan: SyncPlan) -> int:
        """Rank 0 broadcasts in plan order; the others join the gathers that materialise each
        full tensor."""
        if self.setup.rank == 0:
            if self._group is None:
                raise RuntimeError("weight sync: join a sync group before sending")
            return self._group.send(plan, self.rollout_weights())
        for _ in self.rollout_weights():
            pass
        return 0

    def send_in_place(self, plan: SyncPlan, deliver: BucketDelivery | None) -> int:
        """Packs each bucket into one flat tensor and hands `deliver` a handle to it (CUDA IPC
        on a GPU; the tensor itself on CPU); `deliver` returns once the engine copied it. With
        no `deliver` (no engine on this rank's GPU) the buckets are only packed: every rank
        takes part in the gathers."""
        tensors = iter(self.rollout_weights())
        self._sent = None
        dtypes = {b.dtype for b in plan.buckets}
        checksum = Checksum() if self._checksum_from_buckets(dtypes) else None
        sent = 0
        for index, bucket in enumerate(plan.buckets):
            flat = ipc.pack_bucket(bucket, tensors, self.device)
            if checksum is not None:
                # Queued before the engine's copy, in one launch; only sums stay.
                checksum.add_all(ipc.unpack_bucket(bucket, flat))
            if deliver is not None:
                handle = ipc.share(flat)
                try:
                    deliver(index, handle)
                finally:
                    ipc.release(handle)
                sent += flat.numel() * flat.element_size()
            del flat  # only now: the engine has copied out of it
        if next(tensors, None) is not None:
            raise RuntimeError("weight sync: the trainer has more tensors than the sync plan")
        if checksum is not None:
            self._sent = (dtypes, checksum)
        return sent

    def _checksum_from_buckets(self, dtypes: set[str]) -> bool:
        """Whether the buckets' own checksum is what `checksum` will be asked for: verification
        is on, and the engine keeps exactly the buckets' bytes (one dtype, nothing decoded on
        arrival, not adapters applied to a base)."""
        lora = self.setup.lora
        return (
            self.setup.verify_weights
            and len(dtypes) == 1
            and not (lora is not None and lora.sync == "adapters")
            and self.precision.rollout_decoder(getattr(torch, next(iter(dtypes)))) is None
        )

    def checksum(self, dtype: str | None) -> str:
        """Hash of the weights as an engine holding `dtype` holds them after a sync (collective;
        rank 0's is the one compared)."""
        engine_dtype = getattr(torch, dtype or "float32")
        decoder = self.precision.rollout_decoder(engine_dtype)
        lora = self.setup.lora
        adapters_only = lora is not None and lora.sync == "adapters"
        if self._sent is not None and self._sent[0] == {dtype or "float32"}:
            return self._sent[1].hexdigest()  # the engine holds exactly the buckets' bytes
        if adapters_only and decoder is not None:
            assert lora is not None
            # The engine converted its own base to the format and adds the adapters to it.
            base = decoder(self.precision.convert_for_rollout(self.named_weights("base")))
            adapters = dict(self.rollout_weights())  # as sent: in the engines' dtype
            weights = fold_adapters(base, adapters, lora.scaling)
        else:
            # What engines hold: with LoRA adapters synced alone, base + adapters.
            weights = self.precision.convert_for_rollout(self.named_weights("merged"))
            if decoder is not None:
                weights = decoder(weights)
        if dtype is not None:
            weights = ((n, t.to(engine_dtype) if t.is_floating_point() else t) for n, t in weights)
        return tensors_checksum(weights)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
