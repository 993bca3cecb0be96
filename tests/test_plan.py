"""dry_run=true: the plan of every shipped experiment fits the GPUs it names, the memory model
counts parameters exactly, a plan that cannot fit exits 2 naming the GPU and the bytes, and the
placement the plan prints is what Ray does with that many logical GPUs on that many nodes."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections import Counter

import pytest

from orchestrator.config import ConfigError
from orchestrator.planning.dry_run import build_plan, check_plan, format_plan, param_count
from stand_ins import CONFIGS, REPO, compose_config
from workers.core.memory_plan import (GIB, KNOWN_SHAPES, EngineLoad, GpuMemory, ModelShape, TrainerLoad,
                                      engine_memory, host_memory, known_shape, trainer_memory)
from workers.core.placement import assign_bundles, plan_placement

EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_shipped_experiment_plans_on_the_gpus_it_names(name):
    cfg = compose_config([f"+experiment={name}"])
    plan = build_plan(cfg, machine_bytes=16 * GIB)  # cluster=local: a 16 GiB machine
    check_plan(plan)  # raises ConfigError when a GPU (or the local machine) does not fit
    text = format_plan(plan)
    if cfg.cluster.name == "local":
        assert plan.gpus == [] and "no GPUs" in text
        return
    placement = plan_placement(cfg.cluster.placement_spec())
    named = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    assert placement.num_gpus == named, f"{name} names {named} GPUs but places {placement.num_gpus}"
    assert len(plan.gpus) == named  # every named GPU is used, none twice
    assert len({(g.node, g.gpu) for g in plan.gpus}) == named
    assert all(g.memory.total <= plan.gpu_bytes for g in plan.gpus)
    assert f"peak: " in text and "GPU 0:" in text


def test_parameter_count_is_exact_on_the_tiny_models_weights(tiny_model_dir):
    """The shape's parameter count equals the numel summed from the safetensors header."""
    raw = (tiny_model_dir / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    numel = sum(_prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    shape = ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    assert shape.num_params == numel


def test_local_dry_run_names_cpus_and_the_tiny_models_real_parameter_count(tiny_model_dir, monkeypatch, tmp_path):
    """cluster=local: no "0 GPU(s) of 80 GiB" and no "0.00 B parameters"; the count is the built
    model's (its config.json), before the build the recipe's upper bound, said as such."""
    real = ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text())).num_params
    header = build_plan(compose_config(["cluster.num_cpus=3"])).header
    assert header[0] == "plan: cluster=local, one machine: 3 CPU(s) (cluster.num_cpus), no GPUs"
    assert header[1].startswith(f"model: tiny: {real:,} parameters (") and header[1].endswith("config.json)")
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))  # nothing built there
    header = build_plan(compose_config([])).header
    assert "CPU(s) (this machine's)" in header[0] and "GPU(s) of" not in header[0]
    assert header[1].startswith("model: tiny (built on first use): ") and "not built yet" in header[1]
    assert " B parameters" not in header[1]
    assert param_count(7_615_616_512) == "7.62 B" and param_count(1_250_000) == "1.25 M" and param_count(513) == "513"


def test_local_dry_run_of_an_8b_model_on_a_24_gib_machine_does_not_fit():
    """Issue 29: `cluster=local dry_run=true` said "the plan fits" for an 8B model on 2 CPUs without
    checking anything. The trainer rank and the CPU engine share this machine's memory: the 8B
    trainer alone holds 16 bytes per parameter (fp32 master, gradients, two Adam moments), ~122 GiB."""
    big = compose_config(["cluster=local", "model=qwen3", "model.path=/models/Qwen3-8B"])
    plan = build_plan(big, machine_bytes=24 * GIB)
    assert plan.gpus == [] and plan.host is not None and plan.host.roles == ["trainer rank 0", "inference replica 0"]
    assert plan.host.memory.optimizer + plan.host.memory.gradients == 12 * KNOWN_SHAPES["qwen3-8b"].num_params
    assert "in this machine's 24.0 GiB of memory" in plan.header[-1]
    with pytest.raises(ConfigError, match=r"^dry run: cluster=local: this machine \(trainer rank 0, inference "
                                          r"replica 0\) needs about [\d,]+ bytes \(\d+\.\d GiB: .*\) but has "
                                          r"25,769,803,776 bytes \(24\.0 GiB\); use a smaller model"):
        check_plan(plan)
    tiny = build_plan(compose_config(["cluster=local"]), machine_bytes=24 * GIB)
    check_plan(tiny)  # the tiny model fits: ~1 GiB of KV cache and little else
    assert 1 * GIB <= tiny.host.memory.total < 4 * GIB
    text = format_plan(tiny)
    assert "this machine (CPU, estimate):" in text and "trainer rank 0, inference replica 0" in text
    assert text.splitlines()[-2].endswith(" / 24.0")


def test_local_dry_run_joining_a_ray_cluster_says_its_memory_is_not_checked(capsys):
    from orchestrator.main import _dry_run

    cfg = compose_config(["cluster=local", "cluster.address=10.0.0.5:6379"])
    plan = build_plan(cfg, machine_bytes=1)
    assert plan.host is None and "memory of the Ray cluster at 10.0.0.5:6379 is not checked" in plan.header[-1]
    check_plan(plan)  # nothing known to refuse
    _dry_run(cfg)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "memory not checked" in last and "fits" not in last  # the end line does not claim what was not checked


def test_host_memory_sums_ranks_and_engines_without_cuda_overhead():
    trainer = GpuMemory(weights=10, gradients=4, optimizer=8, activations=3)
    engine = GpuMemory(weights=2, activations=1, kv_cache=5, other=0)
    m = host_memory(trainer, 1, engine, 2)
    # 1 trainer rank + 2 engines: weights 10 + 2·2, activations 3 + 2·1, KV 2·5
    assert (m.weights, m.gradients, m.optimizer, m.activations, m.kv_cache, m.other) == (14, 4, 8, 5, 10, 0)
    assert m.total == 41


@pytest.mark.parametrize("key,published_b", [("qwen2.5-7b", 7.62), ("qwen3-8b", 8.19), ("qwen3-14b", 14.77),
                                             ("qwen3-32b", 32.76), ("qwen3-30b-a3b", 30.53)])
def test_known_shapes_match_the_published_parameter_counts(key, published_b):
    """Published = the safetensors totals on each model card (billions)."""
    assert KNOWN_SHAPES[key].num_params / 1e9 == pytest.approx(published_b, abs=0.01)


def test_known_shape_matches_directory_names():
    assert known_shape("Qwen3-8B") is KNOWN_SHAPES["qwen3-8b"]
    assert known_shape("Qwen2.5-7B-Instruct") is KNOWN_SHAPES["qwen2.5-7b"]
    assert known_shape("Qwen3-Coder-30B-A3B-Instruct") is KNOWN_SHAPES["qwen3-coder-30b-a3b"]
    assert known_shape("Qwen3-80B") is None  # "qwen3-8" must not match a longer number
    assert known_shape("my-model") is None


def test_trainer_memory_shards_states_and_checkpointing_cuts_activations():
    shape = KNOWN_SHAPES["qwen3-8b"]
    p = shape.num_params
    one = trainer_memory(shape, TrainerLoad(1, "bf16", 8192, False))
    eight = trainer_memory(shape, TrainerLoad(8, "bf16", 8192, False))
    assert eight.optimizer == 8 * p // 8 and one.optimizer == 8 * p  # Adam: two fp32 moments, sharded
    assert eight.gradients == 4 * p // 8
    ckpt = trainer_memory(shape, TrainerLoad(8, "bf16", 8192, True))
    logits = 8192 * shape.vocab_size * 14
    assert ckpt.activations < eight.activations and ckpt.activations > logits


def test_engine_kv_cache_is_what_the_utilization_leaves():
    shape = KNOWN_SHAPES["qwen3-8b"]
    load = EngineLoad(tensor_parallel_size=1, dtype="bfloat16", gpu_bytes=80 * GIB, gpu_memory_utilization=0.9,
                      kv_cache_bytes=None, max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=256)
    e = engine_memory(shape, load)
    assert e.memory.weights == 2 * shape.num_params
    assert e.memory.total == int(0.9 * 80 * GIB)  # weights + activations + KV + overhead = vLLM's share
    assert e.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads, head_dim 128, bf16
    assert e.kv_tokens == e.memory.kv_cache // e.kv_bytes_per_token


def test_a_plan_that_does_not_fit_names_the_gpu_and_the_bytes():
    # full fine-tuning (the preset trains LoRA, issue 27: 32B then fits the trainer's GPUs)
    cfg = compose_config(["+experiment=swe_agent_2node", "model.path=/models/Qwen3-32B", "model.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"node 0 GPU \d \(trainer rank \d\) needs [\d,]+ bytes .* but has "
                                          r"85,899,345,920 bytes"):
        check_plan(build_plan(cfg))
    cfg = compose_config(["+experiment=swe_agent_2node", "inference.gpu_memory_utilization=0.2"])
    with pytest.raises(ConfigError, match=r"inference replica 0: its KV cache .* cannot hold one "
                                          r"inference.max_model_len=16384 sequence"):
        check_plan(build_plan(cfg))


def test_unknown_model_without_config_json_is_a_config_error():
    cfg = compose_config(["+experiment=swe_agent_2node", "model.path=/nowhere/my-model"])
    with pytest.raises(ConfigError, match="no config.json here and its directory name matches no known shape"):
        build_plan(cfg)


@pytest.mark.parametrize("overrides,code,needle", [
    ([], 0, "dry run: the plan fits; nothing was started"),
    (["model.path=/models/Qwen3-32B", "model.lora.rank=0"], 2, "config error: dry run: node 0 GPU"),
])
def test_main_dry_run_exit_status(tmp_path, overrides, code, needle):
    """The acceptance command: prints the plan, exits 0; a plan that cannot fit exits 2. Nothing starts:
    no run_dir is created."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "orchestrator.main", "+experiment=swe_agent_2node", "dry_run=true",
                          f"run_dir={run_dir}", *overrides], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == code, out.stderr[-3000:]
    assert needle in out.stdout + out.stderr
    assert "node 1:" in out.stdout and "inference replica 3 (tp 2)" in out.stdout
    # issue 25: the SWE preset is the toolkit's A2A recipe, and the plan says its bounds
    assert ("rollouts: contract a2a, 256 container slot(s) (open sessions), 128 rollout slot(s) (32 per replica, "
            "inference.max_num_seqs 128), warm pool 128, setup <= 1200 s, run <= 1200 s, 5 new session(s)/s") in out.stdout
    assert not run_dir.exists()


# the experiments that name a GPU cluster (the blog ones and qwen3_random_gsm8k run on cluster=local)
GPU_EXPERIMENTS = [n for n in EXPERIMENTS if "override /cluster:" in (CONFIGS / "experiment" / f"{n}.yaml").read_text()
                   and "override /cluster: local" not in (CONFIGS / "experiment" / f"{n}.yaml").read_text()]


@pytest.mark.parametrize("name", GPU_EXPERIMENTS)
def test_ray_places_the_experiment_on_the_logical_gpus_it_names(name):
    """A Ray cluster of the experiment's nodes x GPUs (logical, simulated nodes): its placement groups
    are created and land as the plan says (GPUs per node; a trainer node's ranks on one host)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    from orchestrator.wiring.placement_groups import PlacedGroups

    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process by another test module")
    cfg = compose_config([f"+experiment={name}"])
    c = cfg.cluster
    plan = plan_placement(c.placement_spec())
    expected = Counter(s.node for s in assign_bundles(plan, [c.gpus_per_node] * c.nodes) for _ in s.gpus)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": c.gpus_per_node})
    try:
        for _ in range(c.nodes - 1):
            cluster.add_node(num_cpus=1, num_gpus=c.gpus_per_node)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        placed = PlacedGroups.create(plan, ready_timeout_s=60)
        try:
            per_node: Counter = Counter()
            for pg in placed.groups:
                table = placement_group_table(pg)
                for i, node in table["bundles_to_node_id"].items():
                    per_node[node] += int(table["bundles"][i].get("GPU", 0))
            assert sorted(per_node.values()) == sorted(expected.values())
            for pg, spec in zip(placed.groups, plan.groups):
                if spec.strategy == "STRICT_PACK":  # a trainer node's ranks share a host
                    assert len(set(placement_group_table(pg)["bundles_to_node_id"].values())) == 1
        finally:
            placed.remove()
    finally:
        ray.shutdown()
        cluster.shutdown()


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def test_embedded_model_built_says_whether_the_cache_holds_it(tiny_model_dir, monkeypatch, tmp_path):
    """The build's phase line says "cached" only when the model is there (a new user read "built on
    the first run" on every run)."""
    from workers.embedded.models import embedded_model_built

    assert embedded_model_built("tiny") and not embedded_model_built("nope")
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))  # nothing built there
    assert not any(embedded_model_built(name) for name in ("tiny", "qwen3_random", "smollm2_135m"))


def test_a_dry_run_plans_the_embedded_model_the_experiment_trains(monkeypatch, tmp_path):
    """Issue 29: `+experiment=qwen3_random_gsm8k dry_run=true` planned the tiny model (513,152
    parameters), not the random Qwen3 it trains. Unbuilt, the recipe's shape with the real Qwen3
    vocabulary gives the same count the built model's config.json does."""
    from workers.embedded.qwen3_random import built_qwen3_random

    built = built_qwen3_random()
    if built is not None:  # the shipped recipe's build, where the suite has made it: the counts agree
        real = ModelShape.from_hf_config(json.loads((built / "config.json").read_text())).num_params
        assert build_plan(compose_config(["+experiment=qwen3_random_gsm8k"])).header[1].startswith(
            f"model: qwen3_random: {param_count(real)} parameters")
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))  # nothing built there
    header = build_plan(compose_config(["+experiment=qwen3_random_gsm8k"])).header
    assert header[1].startswith("model: qwen3_random (built on first use): 19.50 M parameters ("), header[1]
    assert "151669 tokens of vocabulary" in header[1]
