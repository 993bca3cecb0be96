"""Memory estimate per GPU of a run: trainer ranks (FSDP2) and vLLM replicas, before anything starts.

Pure (no torch, no Ray): from a model's shape (`ModelShape`, read from its Hugging Face
config.json or from `KNOWN_SHAPES`) and the run's parallelism and budgets, the bytes each GPU
holds. Estimates, not measurements; each formula says what it counts and where it comes from.

Trainer rank (world size W, FSDP2 full sharding, workers/trainer/worker.py):
- weights: the fp32 master shard 4·P/W, plus the parameters gathered for compute: the root module
  (embeddings, lm_head, final norm) and two decoder layers at a time (one computing, one
  prefetched), in the compute dtype (bf16 with `trainer.mixed_precision=bf16`, else fp32);
- gradients: the fp32 gradient shard 4·P/W;
- optimizer state: AdamW's two fp32 moments 8·P/W;
- with LoRA (`model.lora.rank` r, `ModelShape.lora_params`: Q = r·Σ(fan_in + fan_out) over the
  adapted matrices): the frozen base shard in the compute dtype (2·P/W with bf16, else 4·P/W),
  and the adapter's fp32 master 4·Q/W, gradients 4·Q/W and AdamW moments 8·Q/W only;
- activations at the token budget T (`trainer.max_tokens_per_micro_batch`, else micro_batch_size ×
  max_context_tokens): tensors saved for backward per token and decoder layer,
  2·(4h + (a + 2k)·d + 2·a·d + 4·I) bytes in bf16 (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", §4.1, with FlashAttention/SDPA (no s² term), GQA
  (k KV heads) and SwiGLU (intermediate I)); with activation checkpointing only each layer's input
  (2·h bytes per token) is kept, plus one layer's full set during its recompute; and the logits,
  T·V·14 bytes (bf16 logits 2, their fp32 cast 4, softmax for the entropy 4, fp32 gradient 4;
  workers/trainer/helpers.py `token_logprobs`).

vLLM replica (tensor parallel t, `inference.dtype`): weights 2·P/t (bf16), plus with the LoRA
adapter sync the `max_loras` adapter slots vLLM allocates at `max_lora_rank`; activations of one
engine step of `max_num_batched_tokens` N tokens, N·2·(4h + 3·I/t) bytes, plus fp32 logits of
`max_num_seqs` rows, plus `VLLM_OVERHEAD_BYTES` (CUDA graphs, NCCL buffers, allocator slack);
KV cache: what is left of `gpu_memory_utilization` × GPU memory (vLLM's own sizing), or
`kv_cache_bytes` when given. One token's KV on one GPU is 2·L·max(1, k/t)·d·2 bytes; vLLM refuses
to start when the cache cannot hold one `max_model_len` sequence, and so does the plan.

Colocated (trainer rank i and replica i on one GPU): the trainer's shards stay resident while the
engine serves, and the engine sleeps (weights offloaded, KV dropped) while the trainer computes,
so the GPU must hold max(trainer resident + engine budget, trainer peak).

One CPU machine (cluster=local): the trainer ranks and the vLLM CPU engines share its memory side by
side (a CPU engine does not sleep), so it must hold their sum, each counted as above with the KV
cache `kv_cache_bytes` (`inference.kv_cache_gib`) and without `VLLM_OVERHEAD_BYTES` (CUDA's). Ray,
the sample store, the emulator and the agents are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

GIB = 2**30
VLLM_OVERHEAD_BYTES = 2 * GIB  # CUDA graphs, NCCL buffers, allocator fragmentation (vLLM's non-torch memory)
LOGITS_BYTES_PER_ENTRY = 14  # bf16 logits 2 + fp32 cast 4 + softmax (entropy) 4 + fp32 gradient 4
ADAM_BYTES_PER_PARAM = 8  # two fp32 moments
MASTER_BYTES_PER_PARAM = 4  # fp32 master weights (and fp32 gradients)
GATHERED_LAYERS = 2  # FSDP2: the layer computing and the one prefetched
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "bf16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only transformer (Hugging Face config names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0  # MoE: experts per layer (0: dense MLP)
    moe_intermediate_size: int = 0
    qkv_bias: bool = False  # Qwen2 / Qwen2.5: biases on q, k, v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelShape":
        """From a config.json dict (Qwen2, Qwen3, Qwen3-MoE, Llama). Raises ValueError naming a missing key."""
        try:
            h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(hidden_size=h, num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
                       num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                       head_dim=int(cfg.get("head_dim") or h // heads),
                       intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       num_experts=int(cfg.get("num_experts") or 0),
                       moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                       qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
                       qk_norm=cfg.get("model_type") in ("qwen3", "qwen3_moe"))
        except KeyError as exc:
            raise ValueError(f"config.json has no {exc.args[0]!r}") from None

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention (q, k, v, o), MLP or experts + router, norms."""
        h, a, k, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = h * a * d + 2 * h * k * d + a * d * h
        attn += (a + 2 * k) * d if self.qkv_bias else 0
        attn += 2 * d if self.qk_norm else 0
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    @property
    def root_params(self) -> int:
        """Embeddings, lm_head (unless tied) and the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def num_params(self) -> int:
        return self.num_hidden_layers * self.layer_params + self.root_params

    def lora_params(self, rank: int) -> int:
        """Parameters of a rank-`rank` LoRA adapter on every linear layer of the decoder (PEFT's
        all-linear: q, k, v, o and the MLP's gate, up, down, each expert's with MoE; not the
        output head): r · (fan_in + fan_out) per adapted matrix. An upper bound for narrower
        `target_modules`."""
        h, a, k, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = (h + a * d) + 2 * (h + k * d) + (a * d + h)
        inter, experts = (self.moe_intermediate_size, self.num_experts) if self.num_experts else (self.intermediate_size, 1)
        return rank * self.num_hidden_layers * (attn + experts * 3 * (h + inter))

    def activation_bytes_per_token_layer(self) -> int:
        """bf16 bytes saved for backward per token and layer (module docstring formula)."""
        h, a, k, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        inter = self.moe_intermediate_size * 8 if self.num_experts else self.intermediate_size  # top-8 routing
        return 2 * (4 * h + (a + 2 * k) * d + 2 * a * d + 4 * inter)

    def kv_bytes_per_token(self, tensor_parallel_size: int, dtype_bytes: int = 2) -> int:
        """KV-cache bytes of one token on one GPU of a `tensor_parallel_size`-way engine."""
        kv_heads = max(1, self.num_key_value_heads // tensor_parallel_size)
        return 2 * self.num_hidden_layers * kv_heads * self.head_dim * dtype_bytes


def _qwen(h: int, layers: int, heads: int, kv: int, inter: int, tied: bool, vocab: int = 151936,
          head_dim: int = 128, experts: int = 0, moe_inter: int = 0, qwen2: bool = False) -> ModelShape:
    return ModelShape(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
                      num_experts=experts, moe_intermediate_size=moe_inter, qkv_bias=qwen2, qk_norm=not qwen2)


# Shapes of the preset families (their config.json values), so a plan can be made on a machine
# without the weights. Matched by the start of model.path's directory name, lower-cased.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": _qwen(896, 24, 14, 2, 4864, True, head_dim=64, qwen2=True),
    "qwen2.5-1.5b": _qwen(1536, 28, 12, 2, 8960, True, qwen2=True),
    "qwen2.5-3b": _qwen(2048, 36, 16, 2, 11008, True, qwen2=True),
    "qwen2.5-7b": _qwen(3584, 28, 28, 4, 18944, False, vocab=152064, qwen2=True),
    "qwen2.5-14b": _qwen(5120, 48, 40, 8, 13824, False, vocab=152064, qwen2=True),
    "qwen2.5-32b": _qwen(5120, 64, 40, 8, 27648, False, vocab=152064, qwen2=True),
    "qwen3-0.6b": _qwen(1024, 28, 16, 8, 3072, True),
    "qwen3-1.7b": _qwen(2048, 28, 16, 8, 6144, True),
    "qwen3-4b": _qwen(2560, 36, 32, 8, 9728, True),
    "qwen3-8b": _qwen(4096, 36, 32, 8, 12288, False),
    "qwen3-14b": _qwen(5120, 40, 40, 8, 17408, False),
    "qwen3-32b": _qwen(5120, 64, 64, 8, 25600, False),
    "qwen3-30b-a3b": _qwen(2048, 48, 32, 4, 6144, False, experts=128, moe_inter=768),
    "qwen3-coder-30b-a3b": _qwen(2048, 48, 32, 4, 6144, False, experts=128, moe_inter=768),
    "smollm2-135m": ModelShape(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                               head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),  # Llama
}


def known_shape(name: str) -> ModelShape | None:
    """The shape whose key is the longest prefix of `name` (a directory name, any case), or None."""
    low = name.lower()
    keys = [k for k in KNOWN_SHAPES if low.startswith(k) and (len(low) == len(k) or not low[len(k)].isdigit())]
    return KNOWN_SHAPES[max(keys, key=len)] if keys else None


@dataclass(frozen=True)
class GpuMemory:
    """Bytes one GPU holds at its peak, by what holds them."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0
    other: int = 0  # engine overhead; colocated: the part of the engine's budget beyond weights and KV

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache + self.other


@dataclass(frozen=True)
class TrainerLoad:
    """What `trainer_memory` needs: world size, compute precision and the token budget."""

    world_size: int
    mixed_precision: str | None
    tokens_per_micro_batch: int
    activation_checkpointing: bool
    lora_rank: int = 0  # model.lora.rank: 0 trains every weight


@dataclass(frozen=True)
class EngineLoad:
    """What `engine_memory` needs: tensor parallelism, dtype and vLLM's sizing knobs."""

    tensor_parallel_size: int
    dtype: str
    gpu_bytes: int
    gpu_memory_utilization: float
    kv_cache_bytes: int | None
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    lora_params: int = 0  # parameters of the LoRA slots the engine allocates (max_loras x one adapter at max_lora_rank)


@dataclass(frozen=True)
class EngineMemory:
    """One vLLM GPU: its memory, the KV tokens it holds and the tokens one sequence needs."""

    memory: GpuMemory
    kv_tokens: int
    kv_bytes_per_token: int


def trainer_memory(shape: ModelShape, load: TrainerLoad) -> GpuMemory:
    """Peak bytes of one FSDP2 trainer rank (module docstring). Raises ValueError on a bad load."""
    if load.world_size < 1 or load.tokens_per_micro_batch < 1:
        raise ValueError("world_size and tokens_per_micro_batch must be >= 1")
    p, w, t = shape.num_params, load.world_size, load.tokens_per_micro_batch
    compute_bytes = 2 if load.mixed_precision == "bf16" else 4
    gathered = compute_bytes * (shape.root_params + GATHERED_LAYERS * shape.layer_params)
    per_layer = shape.activation_bytes_per_token_layer() * t
    if load.activation_checkpointing:
        layers = shape.num_hidden_layers * 2 * shape.hidden_size * t + per_layer
    else:
        layers = shape.num_hidden_layers * per_layer
    logits = t * shape.vocab_size * LOGITS_BYTES_PER_ENTRY
    if load.lora_rank:  # frozen base in the compute dtype; only the adapter has fp32 master, grads, Adam
        q = shape.lora_params(load.lora_rank)
        return GpuMemory(weights=compute_bytes * p // w + MASTER_BYTES_PER_PARAM * q // w + gathered,
                         gradients=MASTER_BYTES_PER_PARAM * q // w, optimizer=ADAM_BYTES_PER_PARAM * q // w,
                         activations=layers + logits)
    return GpuMemory(weights=MASTER_BYTES_PER_PARAM * p // w + gathered, gradients=MASTER_BYTES_PER_PARAM * p // w,
                     optimizer=ADAM_BYTES_PER_PARAM * p // w, activations=layers + logits)


def engine_memory(shape: ModelShape, load: EngineLoad) -> EngineMemory:
    """Bytes of one GPU of a vLLM replica and the KV tokens it can hold (module docstring).
    The KV cache is `kv_cache_bytes` when given, else what `gpu_memory_utilization` leaves (may be < 0:
    the caller refuses the plan)."""
    tp, dtype_bytes = load.tensor_parallel_size, DTYPE_BYTES[load.dtype]
    weights = dtype_bytes * (shape.num_params + load.lora_params) // tp
    acts = (load.max_num_batched_tokens * 2 * (4 * shape.hidden_size + 3 * shape.intermediate_size // tp)
            + load.max_num_seqs * shape.vocab_size * 4)
    if load.kv_cache_bytes is not None:
        kv = load.kv_cache_bytes
    else:
        kv = int(load.gpu_memory_utilization * load.gpu_bytes) - weights - acts - VLLM_OVERHEAD_BYTES
    per_token = shape.kv_bytes_per_token(tp, dtype_bytes)
    return EngineMemory(GpuMemory(weights=weights, activations=acts, kv_cache=max(kv, 0), other=VLLM_OVERHEAD_BYTES),
                        kv_tokens=kv // per_token if kv > 0 else 0, kv_bytes_per_token=per_token)


def colocated_memory(trainer: GpuMemory, engine: GpuMemory, engine_budget: int) -> GpuMemory:
    """One GPU shared by a trainer rank and a sleeping-while-training engine: the larger of
    (trainer resident state + the engine's whole budget) and the trainer's own peak."""
    resident = trainer.weights + trainer.gradients + trainer.optimizer
    serving = resident + max(engine_budget, engine.total)
    if serving >= trainer.total:
        return GpuMemory(weights=trainer.weights + engine.weights, gradients=trainer.gradients,
                         optimizer=trainer.optimizer, activations=engine.activations, kv_cache=engine.kv_cache,
                         other=serving - resident - engine.weights - engine.activations - engine.kv_cache)
    return trainer


def host_memory(trainer: GpuMemory, num_ranks: int, engine: GpuMemory, num_replicas: int) -> GpuMemory:
    """One CPU machine holding `num_ranks` trainer ranks and `num_replicas` CPU engines at once: the
    sum of their bytes, the engines' CUDA overhead (`other`) left out (module docstring)."""
    r, n, t, e = num_ranks, num_replicas, trainer, engine
    return GpuMemory(weights=r * t.weights + n * e.weights, gradients=r * t.gradients, optimizer=r * t.optimizer,
                     activations=r * t.activations + n * e.activations, kv_cache=n * e.kv_cache, other=r * t.other)


@dataclass
class GpuPlan:
    """One physical GPU of the plan: who runs on it and its memory at peak."""

    node: int
    gpu: int
    roles: list[str] = field(default_factory=list)
    memory: GpuMemory = field(default_factory=GpuMemory)
