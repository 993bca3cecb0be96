"""`TrainerShell`: one data-parallel trainer rank around an engine (the `Trainer` protocol).

The shell owns what does not depend on the model library: the rank's lifecycle and process
group, the algorithm around the step (rollout correction and rejection through `plan_update`,
global token and sequence counts, the bypass-mode metrics, the metric names), the file framing of
weights, HF directories and optimizer state (rank 0 writes atomically, every rank gathers), and
the weight-sync group (rank 0 sends). The engine (`TrainerEngine`, workers/trainer/protocol.py)
does forwards, the training step, the full weights and the optimizer state: HF FSDP2
(`TrainerWorker`, workers/trainer/worker.py) or verl (`VerlTrainerWorker`,
workers/trainer/verl_worker.py).

Invariants:
- `update` takes at most one optimizer step per call (none when no token is left to train on any
  rank, or the grad norm is not finite) and increments `num_updates` exactly once.
- Process group: `init_method` None hosts a rendezvous store in this process (world size 1 only);
  otherwise every rank joins the store served at `init_method` (workers/weight_sync/rendezvous.py),
  so no rank binds a port someone else picked. The shell destroys only a group it created.
- Files (`export_weights`, `save_optimizer`) are written by rank 0 (temp file + rename) after a
  gather every rank takes part in; with world size > 1 every rank returns after a barrier.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.rollout_correction import compute_rollout_correction
from workers.core.types import OrderData, TrainOrder
from workers.trainer.helpers import _atomic_write, plan_update
from workers.trainer.protocol import StepInputs, StepOutcome, TrainerEngine
from workers.trainer.rows import RowReader
from workers.trainer.settings import TrainerSettings
from workers.trainer.train_batch import order_batch
from workers.weight_sync.broadcast import SendReport, bucket_bytes_of, send_weights
from workers.weight_sync.plan import TensorSpec
from workers.weight_sync.rendezvous import StoreAddress, host_store, join_store, release_store
from workers.weight_sync.transport import BucketTransport, WeightGroupInfo, open_transport
from workers.weight_sync.lora import LORA_ADAPTER_DIR

WEIGHTS_FILENAME = "model.safetensors"  # single-file HF checkpoint name
RENDEZVOUS_TIMEOUT_S = 600.0  # bound on the process group's store waits (s): model loads precede the first
SUM_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/entropy")


@dataclass(frozen=True)
class RankContext:
    """Where an engine runs: this rank, the data-parallel world size, the torch device."""

    rank: int
    world_size: int
    device: torch.device


def pick_device(cfg: TrainerSettings) -> torch.device:
    """CUDA (the current device) for device "cuda", or "auto" when CUDA is available; else CPU."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


class TrainerShell:
    """One trainer rank: the engine built by `make_engine` inside this rank's process group.

    Args:
        cfg: TrainerSettings.
        make_engine: builds the engine once the process group exists and the seed is set.
        rank, world_size: this rank in the data-parallel group.
        init_method: `tcp://HOST:PORT` of a rendezvous store already served (`host_store`), shared
            by all ranks; None hosts one here, which only works for world_size 1.

    Raises:
        ValueError: world_size > 1 without init_method, rank out of range, or a process group of
            another size already exists in this process.
    """

    def __init__(self, cfg: TrainerSettings, make_engine: Callable[[RankContext], TrainerEngine], *,
                 rank: int = 0, world_size: int = 1, init_method: str | None = None,
                 device: torch.device | None = None) -> None:
        if not (0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if world_size > 1 and init_method is None:
            raise ValueError("world_size > 1 needs an init_method shared by all ranks")
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device = device or pick_device(cfg)
        self._hosted: StoreAddress | None = None
        self._owns_process_group = not dist.is_initialized()
        if self._owns_process_group:
            self._init_process_group(init_method)
        elif dist.get_world_size() != world_size:
            raise ValueError(f"a process group of size {dist.get_world_size()} exists; asked for {world_size}")
        torch.manual_seed(cfg.seed)
        self.engine = make_engine(RankContext(rank, world_size, self.device))
        self._rc_cfg = cfg.rollout_correction_config()
        self.num_updates = 0
        self._weight_transport: BucketTransport | None = None
        self._rows = RowReader()
        self._data = OrderData()  # the run's buffer, pad id and advantage setting (open_data)

    def _init_process_group(self, init_method: str | None) -> None:
        if init_method is None:
            self._hosted = address = host_store("127.0.0.1")
        else:
            address = StoreAddress.parse(init_method)
        dist.init_process_group(
            backend="nccl" if self.device.type == "cuda" else "gloo",
            store=join_store(address, timeout_s=RENDEZVOUS_TIMEOUT_S),
            rank=self.rank, world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.cfg.collective_timeout_s),  # a dead peer cannot hang a rank
        )

    def _global_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t)
        return float(t.item())

    # --- training -------------------------------------------------------------------------

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log π(token t | tokens < t) under the current weights, no grad.

        Returns [B, T] float32 on CPU; column 0 and padding are 0.
        """
        return self.engine.compute_logprobs(batch)

    def open_data(self, data: OrderData) -> None:
        """What every train order of the run shares (`OrderData`), given once before the first update:
        the buffer this rank reads its rows from, the pad id, the advantage setting."""
        self._data = data
        self._rows.open(data.buffer)

    def update(self, order: TrainOrder) -> dict[str, float]:
        """One optimizer step on this rank's shard of a train order: read its rows from the trajectory
        buffer (workers/trainer/rows.py: this rank's own TransferQueue client), build the padded
        batch (workers/trainer/train_batch.py `order_batch`), `train_batch`. Adds
        `perf/total_num_tokens` (every token of the rows read: verl's attention-mask sum before
        padding) and `trainer/rows_read` (rows this rank read for this order), both summed over ranks.

        Raises ValueError when the order has no row for this rank, and as `train_batch`."""
        rows = self._rows.read(order)
        metrics = self.train_batch(order_batch(order, rows, self._data))
        return {**metrics, "perf/total_num_tokens": float(sum(len(r.token_ids) for r in rows)),
                "trainer/rows_read": float(len(rows))}

    def train_batch(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch.

        Steps: log π_old (decoupled: recomputed, no grad; bypass: the rollout log-probs); IS
        weights, rejection masks and `rollout_corr/*` metrics from π_old (bypass: π_θ before the
        step) vs π_rollout; rejection narrows the loss mask and recomputes the advantages of groups
        that lost a sample (`apply_rejection`); the engine's step: per micro-batch, PPO clip loss
        on π_θ / π_old (times the IS weights in decoupled mode), normalised by the mini-batch's
        global token (or sequence) count after rejection, backward; clip the global grad norm;
        AdamW step (skipped when the grad norm is not finite, or when no token is left to train
        on any rank).

        Returns metrics: actor/pg_loss, actor/grad_norm, actor/pg_clipfrac, actor/ppo_kl,
        actor/pg_clipfrac_lower, actor/entropy (token-weighted means over this rank's micro-batches;
        entropy only with `compute_entropy`), actor/num_tokens (global, after rejection), actor/lr,
        actor/step_skipped (1.0 if the step was skipped), and rollout_corr/* (this rank's
        mini-batch; with rejection rules also rs_excluded_sample_fraction and rs_recomputed_groups).

        Raises:
            ValueError: the batch has no trained token, (world_size > 1) ranks hold different
                numbers of micro-batches, or a rejected reward token in a batch without SampleTable.
        """
        plan = plan_update(batch, self._rc_cfg,  # π_old is read only where the loss is: trained tokens
                           lambda b: self.engine.compute_logprobs(b, trained_only=True))
        loss_mask = plan.train.loss_mask
        num_tokens = self._global_sum(float(loss_mask.sum().item()))
        num_seqs = self._global_sum(float(plan.train.num_trained_rollouts()))  # rollouts, not rows: see losses.py
        if num_tokens > 0:
            step = self.engine.train_step(plan.train, StepInputs(
                plan.old_logprobs, plan.is_weights, num_tokens, num_seqs, capture_logprobs=plan.rc is None,
                seq_num_tokens=plan.train.rollout_num_tokens()))
        else:  # nothing to train on any rank: no forward, no step
            step = StepOutcome({k: 0.0 for k in SUM_METRICS}, 0.0, True,
                               torch.zeros(batch.batch_size, batch.seq_len))
        rc = plan.rc
        if rc is None:  # bypass without rules: π_θ before the step came from the training forward
            rc = compute_rollout_correction(step.logprobs, batch.rollout_logprobs, batch.loss_mask, self._rc_cfg)
        self.num_updates += 1

        sums = dict(step.sums)
        if not self.cfg.compute_entropy:
            sums.pop("actor/entropy", None)
        local_tokens = float(loss_mask.sum().item())
        metrics = {"actor/pg_loss": self._global_sum(sums.pop("actor/pg_loss") / self.world_size)}
        for name, total in sums.items():
            metrics[name] = total / local_tokens if local_tokens > 0 else 0.0
        metrics.update({
            "actor/grad_norm": step.grad_norm,
            "actor/num_tokens": num_tokens,
            "actor/lr": self.engine.lr(),
            "actor/step_skipped": 1.0 if step.skipped else 0.0,
        })
        metrics.update(rc.metrics)
        metrics.update(plan.extra)
        return metrics

    # --- weights out ----------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights under HF names, on CPU (complete on rank 0; every rank must call this).

        Tied parameters (e.g. lm_head.weight with tie_word_embeddings) appear once, under the name HF
        saves them as, so the dict loads with `from_pretrained` and vLLM's loaders.
        """
        return self.engine.full_state_dict()

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def export_weights(self, path: str) -> str:
        """Write the full weights as one safetensors file at `path` (temp file + rename); return path.

        Every rank must call it (the gather is collective); only rank 0 writes.
        """
        sd = self.full_state_dict()
        if self.rank == 0:
            _atomic_write(path, lambda tmp: save_file(sd, tmp, metadata={"format": "pt"}))
        self._barrier()
        return path

    def save_hf(self, directory: str) -> str:
        """Write an HF model directory (config.json, generation config, model.safetensors, tokenizer
        files when the source directory has them) that `from_pretrained` loads; return directory.
        With LoRA (`cfg.lora`): model.safetensors holds the frozen base, and `lora_adapter/` the
        adapter in PEFT's format (`export_adapter`): a checkpoint resumes the adapter exactly."""
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
            self.engine.write_hf_metadata(directory)
        if self.cfg.lora is None:
            self.export_weights(os.path.join(directory, WEIGHTS_FILENAME))
            return directory
        sd = self.engine.full_state_dict(merge=False)
        if self.rank == 0:
            _atomic_write(os.path.join(directory, WEIGHTS_FILENAME), lambda tmp: save_file(sd, tmp, metadata={"format": "pt"}))
        self.export_adapter(os.path.join(directory, LORA_ADAPTER_DIR))
        return directory

    def export_adapter(self, directory: str) -> str:
        """Write the LoRA adapter as a PEFT directory (adapter_config.json + adapter_model.safetensors,
        replaced atomically) at `directory`; return it. Every rank must call it (the gather is
        collective); only rank 0 writes. Raises RuntimeError without `cfg.lora`."""
        from workers.trainer.lora import peft_config, write_adapter_dir

        if self.cfg.lora is None:
            raise RuntimeError("export_adapter needs model.lora (this trainer trains every weight)")
        adapter = self.engine.adapter_state_dict()
        if self.rank == 0:
            write_adapter_dir(directory, peft_config(self.cfg.lora, self.cfg.model_path), adapter)
        self._barrier()
        return directory

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t), t = 1 .. len-1, of the plain softmax (temperature 1, no
        top-p) under the current weights: what `InferenceWorker.prompt_logprobs` returns for the
        same tokens (the weight sync's proof of arrival). Every rank must call it."""
        from workers.trainer.helpers import raw_token_logprobs

        return raw_token_logprobs(self.engine, token_ids)

    def weight_specs(self) -> list[TensorSpec]:
        """Name, full shape and sync dtype of every tensor `broadcast_weights` sends (HF names, tied
        aliases left out as in `full_state_dict`), in its order."""
        return self.engine.weight_specs()

    def open_weight_group(self, info: WeightGroupInfo) -> None:
        """Rank 0 joins the weight-sync group `info` as its sender (blocks until every receiver
        joined with a collective backend); other ranks only take part in the gathers later."""
        if self.rank == 0:
            if self._weight_transport is not None:
                raise RuntimeError("this trainer already joined a weight-sync group")
            self._weight_transport = open_transport(info, 0, self.device)

    def broadcast_weights(self, version: int) -> SendReport | None:
        """Send the current full weights as `version` to every receiver of the weight-sync group, in
        buckets of `weight_sync_bucket_mb` (every rank must call it; rank 0 returns the SendReport,
        others None). Raises RuntimeError before `open_weight_group`."""
        if self.rank == 0 and self._weight_transport is None:
            raise RuntimeError("broadcast_weights before open_weight_group")
        tensors = self.engine.full_tensors()
        if self.rank != 0:
            for _ in tensors:  # the gathers are collective: take part in every one
                pass
            return None
        return send_weights(self._weight_transport, self.weight_specs(), tensors, version=version,
                            bucket_bytes=bucket_bytes_of(self.cfg.weight_sync_bucket_mb))

    def close(self) -> None:
        """Release the buffer client, the weight-sync group, and the process group if this worker created it."""
        self._rows.close()
        if self._weight_transport is not None:
            self._weight_transport.close()
            self._weight_transport = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False
        if self._hosted is not None:
            release_store(self._hosted)
            self._hosted = None

    # --- checkpoint: optimizer state ------------------------------------------------------

    def save_optimizer(self, path: str) -> str:
        """Write the full (unsharded) AdamW state and `num_updates` to `path` with torch.save
        (temp file + rename); return path. Every rank must call it (the gather is collective);
        only rank 0 writes. Parameter keys are HF names, so the file is world-size independent and
        both engines read it."""
        osd = self.engine.optimizer_state()
        if self.rank == 0:
            _atomic_write(path, lambda tmp: torch.save({"optimizer": osd, "num_updates": self.num_updates}, tmp))
        self._barrier()
        return path

    def load_optimizer(self, path: str) -> None:
        """Load a `save_optimizer` file into this rank's optimizer (every rank reads `path`) and
        restore `num_updates`. Raises ValueError when the file is not an optimizer checkpoint."""
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(blob, dict) or "optimizer" not in blob or "num_updates" not in blob:
            raise ValueError(f"{path} is not an optimizer checkpoint written by save_optimizer")
        self.engine.load_optimizer_state(blob["optimizer"])
        self.num_updates = int(blob["num_updates"])
