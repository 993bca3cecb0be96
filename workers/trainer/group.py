"""`TrainerGroup`: the driver's one adapter of the trainer: N data-parallel ranks (TrainerWorker or
VerlTrainerWorker actors, N >= 1) driven as one trainer.

Every method is a plain coroutine (`await trainer.update(order)`); the driver, the checkpointer,
the resume path and the weight sync call it the same way for one rank or many.

- `open_data(data)` gives every rank, once at start, what all train orders share (the buffer's
  handle, the pad id, the advantage setting: `OrderData`), so an order carries only its samples.
- `update(order)` splits a train order by whole groups (workers/trainer/order.py), runs every
  rank's `update` on its shard concurrently (each rank reads its own rows from the trajectory
  buffer: workers/trainer/rows.py) and merges their metrics (`merge_rank_metrics`).
- Collective methods (`export_weights`, `export_adapter`, `probe_logprobs`, `save_hf`, `save_optimizer`, `load_optimizer`,
  `full_state_dict`, `open_weight_group`, `broadcast_weights`, `close`) are called on every rank at
  once (each gathers shards, so every rank must take part) and return rank 0's result, the one
  that wrote the file or sent the weights.
- `run_on_lead(fn, ...)` runs `fn` inside rank 0 (the weight-sync rendezvous asks the trainer's
  node for its address this way).

Invariant: every call reaches all ranks or none (arguments are checked before any rank is called),
so no rank waits in a collective for a peer that was never asked. `start_trainer_ranks` starts the
ranks' rendezvous store in the driver before any rank starts (`host_store` on the driver's node IP,
a port the OS bound and keeps bound: no close-and-reuse race); every rank joins it as a client, and
the group stops serving it at `close`. The store carries only the rendezvous (the collectives
connect rank to rank), so it sitting on the driver's node costs nothing per step.

`TrainerGroup` implements the `Trainer` protocol (workers/trainer/protocol.py) with awaitable results.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from workers.core.calls import PartClient, actor_died, call, count_received, is_actor_method
from workers.core.types import OrderData, TrainOrder
from workers.trainer.order import merge_rank_metrics, shard_order
from workers.weight_sync.rendezvous import StoreAddress, host_store, release_store


PING_TIMEOUT_S = 5.0  # a rank that does not answer a no-op within this many seconds counts as alive


def _noop(_self: Any) -> None:
    return None


class TrainerRankLost(RuntimeError):
    """A trainer rank's actor died (its process is gone: SIGKILL, OOM, preemption); `rank` names
    it. The other ranks may be blocked in a collective until `trainer.collective_timeout_s`; the
    driver does not wait for them (the call fails as soon as the dead rank's does)."""

    def __init__(self, rank: int, cause: BaseException) -> None:
        super().__init__(f"trainer rank {rank} died ({type(cause).__name__}: {str(cause).splitlines()[0][:200]})")
        self.rank = rank


class TrainerGroup:
    """N TrainerWorker ranks (Ray actor handles or plain objects) of one FSDP process group.

    Args:
        ranks: one handle per rank, in rank order (rank 0 first); at least one.
        micro_batch_size, max_tokens_per_micro_batch: the ranks' TrainerSettings values (the
            sharding pads shards so that every rank can run as many micro-batches).
    """

    def __init__(self, ranks: Sequence[Any], *, micro_batch_size: int,
                 max_tokens_per_micro_batch: int | None = None, rendezvous: StoreAddress | None = None) -> None:
        if not ranks:
            raise ValueError("TrainerGroup needs at least one rank")
        self.ranks = list(ranks)
        self._rendezvous = rendezvous  # hosted by this process until close()
        self._mbs = micro_batch_size
        self._max_tokens = max_tokens_per_micro_batch

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(self._on(r, method, *args) for r in range(self.world_size))))

    async def _on(self, rank: int, method: str, *args: Any) -> Any:
        """`method` on one rank; its death raises TrainerRankLost naming the rank at once (asyncio.gather
        passes the first error on without waiting for the other ranks)."""
        try:
            return await call(self.ranks[rank], method, *args)
        except Exception as e:
            if actor_died(e):
                raise TrainerRankLost(rank, e) from e
            # a peer's death often reaches the survivors first, as a broken collective (gloo:
            # "Connection reset by peer"): name the dead rank when there is one
            if (dead := await self._dead_rank()) is not None:
                raise TrainerRankLost(dead, e) from e
            raise

    async def _dead_rank(self) -> int | None:
        """The first rank whose no-op call fails with its actor's death within PING_TIMEOUT_S, else None."""
        actors = [r for r in self.ranks if is_actor_method(getattr(r, "__ray_call__", None))]
        if len(actors) != self.world_size:
            return None
        pings = [asyncio.ensure_future(PartClient(r).ping()) for r in self.ranks]
        await asyncio.wait(pings, timeout=PING_TIMEOUT_S)
        dead = next((i for i, p in enumerate(pings) if p.done() and not p.cancelled() and p.exception() is not None
                     and actor_died(p.exception())), None)
        for p in pings:
            p.cancel()
        return dead

    async def open_data(self, data: OrderData) -> None:
        """Every rank gets what the run's train orders share (buffer handle, pad id, advantage setting)."""
        await self._all("open_data", data)

    async def update(self, order: TrainOrder) -> dict[str, float]:
        """One optimizer step of every rank on its shard of `order` (workers/trainer/order.py
        `shard_order`: whole groups, each row to one rank, which reads it from the buffer itself);
        the merged metrics (`merge_rank_metrics`: actor/num_tokens, pg_loss, grad_norm global;
        per-rank means weighted by the ranks' trained tokens; perf/total_num_tokens and
        trainer/rows_read summed). Raises ValueError before any rank is called when the order cannot
        be sharded (fewer rows than ranks)."""
        shards = shard_order(order, self.world_size, micro_batch_size=self._mbs,
                             max_tokens_per_micro_batch=self._max_tokens)
        results = await asyncio.gather(*(self._on(r, "update", s) for r, s in enumerate(shards)))
        return merge_rank_metrics(results, [float(r.get("actor/num_tokens", 0.0)) for r in results])

    async def export_weights(self, path: str) -> str:
        """Full weights as one safetensors file at `path` (rank 0 writes); returns path."""
        return (await self._all("export_weights", path))[0]

    async def save_hf(self, directory: str) -> str:
        """HF model directory (rank 0 writes); returns directory."""
        return (await self._all("save_hf", directory))[0]

    async def save_optimizer(self, path: str) -> str:
        """Full AdamW state (rank 0 writes); returns path."""
        return (await self._all("save_optimizer", path))[0]

    async def load_optimizer(self, path: str) -> None:
        """Every rank loads its part of a `save_optimizer` file."""
        await self._all("load_optimizer", path)

    async def full_state_dict(self) -> dict:
        """Full fp32 weights under HF names (rank 0's complete copy)."""
        return (await self._all("full_state_dict"))[0]

    async def export_adapter(self, directory: str) -> str:
        """The LoRA adapter as a PEFT directory (rank 0 writes); returns directory."""
        return (await self._all("export_adapter", directory))[0]

    async def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Plain log-probs of `token_ids` (every rank runs the forward); rank 0's result."""
        return (await self._all("probe_logprobs", token_ids))[0]

    async def compute_logprobs(self, batch: Any) -> Any:
        """log π under the current weights of `batch` (every rank runs the same forwards: the
        sharded parameters are gathered collectively); rank 0's result."""
        return (await self._all("compute_logprobs", batch))[0]

    async def open_weight_group(self, info: Any) -> None:
        """Rank 0 joins the weight-sync group as its sender; the others return at once."""
        await self._all("open_weight_group", info)

    async def broadcast_weights(self, version: int) -> Any:
        """Every rank gathers, rank 0 sends; rank 0's SendReport."""
        return (await self._all("broadcast_weights", version))[0]

    async def close(self) -> None:
        """Release every rank's weight-sync group and process group, then the ranks' rendezvous store."""
        await self._all("close")
        if self._rendezvous is not None:
            release_store(self._rendezvous)
            self._rendezvous = None

    async def run_on_lead(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(rank0_instance, *args)` inside rank 0 (Ray's `__ray_call__`: the weight-sync
        rendezvous asks the trainer's node for its address this way), or `fn(rank0, *args)` for a
        plain object."""
        lead = self.ranks[0]
        if is_actor_method(getattr(lead, "__ray_call__", None)):
            return count_received(await lead.__ray_call__.remote(fn, *args))
        return fn(lead, *args)


async def start_trainer_ranks(actor_cls: Any, settings: Any, *, world_size: int,
                              rank_options: Callable[[int], dict[str, Any]], **kwargs: Any) -> TrainerGroup:
    """Start the trainer as a TrainerGroup: one rank actor for world_size 1 (it hosts its own
    store), else `world_size` rank actors joined through a store this process hosts.

    actor_cls: a `ray.remote(...)` class of TrainerWorker (or one with its constructor);
    settings: its TrainerSettings; rank_options(rank): `.options(...)` kwargs of each rank (Ray
    placement, runtime_env); kwargs: extra constructor kwargs (e.g. `verl=`).
    """
    if world_size < 1:
        raise ValueError(f"trainer world_size must be >= 1, got {world_size}")
    if world_size == 1:
        return TrainerGroup([actor_cls.options(**rank_options(0)).remote(settings, **kwargs)],
                            micro_batch_size=settings.micro_batch_size,
                            max_tokens_per_micro_batch=settings.max_tokens_per_micro_batch)
    rendezvous = host_store()  # this node's IP as Ray sees it
    ranks = [actor_cls.options(**rank_options(r)).remote(settings, rank=r, world_size=world_size,
                                                         init_method=rendezvous.url, **kwargs)
             for r in range(world_size)]
    return TrainerGroup(ranks, micro_batch_size=settings.micro_batch_size,
                        max_tokens_per_micro_batch=settings.max_tokens_per_micro_batch, rendezvous=rendezvous)
