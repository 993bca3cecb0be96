"""Config: every shipped config composes into a valid RunConfig; bad values stop the run naming the key;
file-system checks run in pre-flight and name the key too."""

import subprocess
import sys

import pytest

from orchestrator.control.checkpoint import CheckpointError
from orchestrator.config import ConfigError
from orchestrator.control.preflight import preflight
from stand_ins import CONFIGS, compose_config

GROUPS = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir())
# what a preset requires from the user (it has no default): rollout=aws names the runtime and bucket,
# a model preset its weights; aws's budgets need a model longer than the tiny one
AWS = ["rollout.acr.agent_runtime_arn=arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/my_agent-Ab12",
       "rollout.acr.s3_bucket=my-rollouts", "inference.max_model_len=16384"]
REQUIRED = {("rollout", "aws"): AWS, **{("model", m): ["model.path=/models/x"]
                                        for m in ("qwen2_5", "qwen3", "qwen3_coder")},
            ("inference", "vllm"): ["cluster=disaggregated"],
            ("task", "swe_mini"): ["rollout.contract=a2a"],
            ("task", "custom"): ["task.data_path=examples/data/arith/train.jsonl", "rollout.acr.agent_cmd=python a.py"]}


@pytest.mark.parametrize(
    "group,choice",
    [(g, p.stem) for g in GROUPS for p in sorted((CONFIGS / g).glob("*.yaml"))],
)
def test_every_shipped_config_loads(group, choice):
    prefix = "+" if group == "experiment" else ""  # experiments are optional presets
    required = REQUIRED.get((group, choice), [])
    cfg = compose_config([f"{prefix}{group}={choice}", *required])
    overridden = {o.split("=", 1)[0] for o in required}
    for key, value in _file_values(CONFIGS / group / f"{choice}.yaml", group):
        if key not in overridden:  # every value the file sets reaches the typed config
            assert _typed_value(cfg, key) == value, (key, _typed_value(cfg, key), value)
    if group == "experiment" and choice.startswith("blog_"):  # blog_<mode>_<sync_every>
        _, mode, k = choice.split("_")
        assert (cfg.mode.name, cfg.mode.sync_every) == (mode, int(k))
        # the report's convention (and the simulator's): a fixed mini-batch, k of them per weight sync
        assert cfg.rollout.batch_size == int(k) * compose_config([]).rollout.batch_size


def _file_values(path, group):
    """(dotted key, value) of every plain leaf a config file sets (no interpolations, no defaults list)."""
    import yaml

    text = path.read_text()
    data = yaml.safe_load(text) or {}
    data.pop("defaults", None)
    root = "" if "@package _global_" in text else f"{group}."

    def leaves(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from leaves(f"{prefix}{k}.", v)
        elif not (isinstance(node, str) and "${" in node):
            yield prefix[:-1], node

    return list(leaves(root, data))


def _typed_value(cfg, dotted):
    """The typed config's value at `dotted` (`async` is the field `async_`), lists as lists."""
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part if hasattr(node, part) else part + "_")
    return list(node) if isinstance(node, tuple) else node


def test_default_config_is_the_embedded_default():
    cfg = compose_config([])
    assert (cfg.mode.name, cfg.rollout.name, cfg.model.path) == ("sync", "local", None)
    assert cfg.samples_per_step == cfg.rollout.batch_size * cfg.rollout.n


@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.n=0", "rollout.n"),
        ("rollout.batch_size=-1", "rollout.batch_size"),
        ("mode.sync_every=3", "mode.sync_every"),  # 8 groups do not split into 3 mini-batches
        ("trainer.lr=0", "trainer.lr"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("logger.sinks=[console,mlflow]", "logger.sinks"),
        ("inference.max_model_len=16", "rollout.max_tokens"),  # 16 answer tokens do not fit
        ("rollout.max_tokens=600", "rollout.max_context_tokens"),  # 512-token budget < answer
        ("rollout.n=1", "rollout.n"),  # GRPO: a group of one has no baseline, nothing would train
        ("+bogus.key=1", "bogus"),  # a typo added with + must not be ignored
        ("rollout.poll_initial_s=-1", "rollout.poll_initial_s"),
        ("async.max_staleness=-1", "async.max_staleness"),
        ("async.on_stale=keep", "async.on_stale"),
        ("async.drain_timeout_s=-1", "async.drain_timeout_s"),
        ("async.max_concurrent_rollouts=31", "async.max_concurrent_rollouts"),  # < one mini-batch (8 x 4)
        ("+trainer.total_stepz=3", "trainer.total_stepz"),  # a typo inside a group, added with +
        ("+rollout.acr.limits.rps=9", "rollout.acr.limits.rps"),  # ... and in a nested dataclass
        ("run_dir=", "run_dir"),  # empty: would write the run into the current directory
        ("trainer.weight_sync.backend=nccl", "trainer.weight_sync.backend"),  # needs CUDA, cluster=local is CPU
        ("rollout.redispatch_lost=-1", "rollout.redispatch_lost"),  # issue 14: fault handling keys
        ("rollout.overflow=zero", "rollout.overflow"),  # issue 28: train_zero | drop | train_reward
        ("inference.max_restarts=-1", "inference.max_restarts"),
        ("inference.health_check_s=0", "inference.health_check_s"),
        ("trainer.collective_timeout_s=0", "trainer.collective_timeout_s"),
        ("inference.max_num_batched_tokens=256", "inference.max_num_batched_tokens"),  # < max_model_len 512 on CPU
        ("task.data_path=/nonexistent.jsonl", "task.data_path"),  # task=letters generates its rows: was ignored
        ("inference.block_size=16", "inference.block_size"),  # vLLM's CPU attention takes multiples of 32 only
        ("inference.block_size=0", "inference.block_size"),
        ("algorithm.max_gen_batches=-1", "algorithm.max_gen_batches"),
        ("rollout.setup_timeout_s=60", "rollout.setup_timeout_s"),  # contract=s3 has no setup phase
        ("rollout.rollout_slots=4", "rollout.rollout_slots"),
        ("rollout.contract=a2a rollout.run_timeout_s=0", "rollout.run_timeout_s"),
        ("rollout.contract=a2a rollout.rollout_slots=0", "rollout.rollout_slots"),
        ("rollout.acr.limits.sessions_per_s=0", "rollout.acr.limits.sessions_per_s"),
        ("task=swe_mini", "rollout.contract"),  # its agent speaks A2A only
        ("model.lora.rank=-1", "model.lora.rank"),  # issue 27: LoRA
        ("model.lora.rank=1024", "model.lora.rank"),  # over vLLM's largest max_lora_rank
        ("model.lora.rank=8 model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.rank=8 model.lora.dropout=1", "model.lora.dropout"),
        ("model.lora.rank=8 model.lora.init=pissa", "model.lora.init"),
        ("model.lora.rank=8 model.lora.target_modules=[]", "model.lora.target_modules"),
        ("model.lora.rank=8 trainer=verl", "trainer.name"),
        ("model.lora.rank=8 trainer.weight_sync.backend=shm", "trainer.weight_sync.backend"),  # adapter sync: file only
        ("inference.lora_sync=full", "inference.lora_sync"),
        ("trainer.weight_sync.probe_atol=0", "trainer.weight_sync.probe_atol"),
    ],
)
def test_bad_value_names_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}"):
        compose_config(override.split())  # several keys: space-separated


def test_cli_bad_value_exits_nonzero_before_ray_with_the_key(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "rollout.n=0", f"run_dir={tmp_path / 'r'}"],
        capture_output=True, text=True, timeout=60, cwd=CONFIGS.parent,
    )
    assert proc.returncode != 0
    assert "rollout.n" in proc.stderr
    assert "ray" not in proc.stdout.lower()  # failed before any part started


def test_cli_unknown_mode_exits_nonzero_naming_mode(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "mode=turbo", f"run_dir={tmp_path / 'r'}"],
        capture_output=True, text=True, timeout=60, cwd=CONFIGS.parent,
    )
    assert proc.returncode == 2
    assert "config error: mode: no choice 'turbo'; valid choices: async, eval, sync" in proc.stderr


def test_run_dir_of_an_earlier_run_or_a_file_is_refused(tmp_path):
    """Regression (new-user report): a second run into the same run_dir appended its steps to the
    first run's metrics.jsonl, mixing two histories."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="^run_dir already holds a run"):
        preflight(compose_config(run_dir=tmp_path))
    a_file = tmp_path / "metrics.jsonl"
    with pytest.raises(ConfigError, match="^run_dir exists and is not a directory"):
        preflight(compose_config(run_dir=a_file))


def test_auto_resume_of_a_run_that_died_before_its_first_checkpoint_starts_again_keeping_its_files(tmp_path):
    """Regression (chaos run): a driver killed before its first checkpoint left metrics.jsonl and
    no checkpoint, and `resume_mode=auto` was refused as "already holds a run"."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "consumed_prompts.jsonl").write_text('{"step": 1, "input_ids": ["a"]}\n')
    pre = preflight(compose_config(["trainer.resume_mode=auto"], run_dir=tmp_path))
    assert pre.checkpoint is None
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "consumed_prompts.jsonl").exists()
    assert (tmp_path / "attempts" / "0" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # set aside, not lost
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # the second attempt died too
    preflight(compose_config(["trainer.resume_mode=auto"], run_dir=tmp_path))
    assert (tmp_path / "attempts" / "1" / "metrics.jsonl").is_file()


# --- pre-flight: file-system checks after the (pure) schema validation ------------------------------

@pytest.mark.parametrize(
    "override,key",
    [
        ("model.path=/nonexistent/model", "model.path"),
        ("model.chat_template=/nonexistent/template.jinja", "model.chat_template"),
        ("task=gsm8k task.data_path=/nonexistent/gsm8k.jsonl", "task.data_path"),
    ],
)
def test_preflight_names_the_key_of_a_missing_file(tmp_path, override, key):
    cfg = compose_config(tuple(override.split()), run_dir=tmp_path / "run")  # the schema reads values only: this passes
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}"):
        preflight(cfg)
    assert not (tmp_path / "run").exists()  # refused before run_dir is created


def test_preflight_accepts_a_model_dir_and_creates_run_dir(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    cfg = compose_config((f"model.path={tmp_path / 'model'}", f"model.chat_template={tmp_path / 't.jinja'}"),
                         run_dir=tmp_path / "a" / "run")
    pre = preflight(cfg)
    assert pre.run_dir == (tmp_path / "a" / "run").resolve() and pre.run_dir.is_dir()
    assert pre.checkpoint is None  # trainer.resume_mode=disable


def test_preflight_refuses_a_missing_checkpoint_and_an_uncreatable_run_dir(tmp_path):
    with pytest.raises(CheckpointError):
        preflight(compose_config(("trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'no-ckpt'}"),
                                 run_dir=tmp_path / "run"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="^run_dir: cannot create"):
        preflight(compose_config(run_dir=tmp_path / "file" / "run"))  # a parent is a file


def test_schema_validation_reads_no_file(tmp_path):
    """Values only: paths that do not exist validate; pre-flight is the one file-system step."""
    cfg = compose_config(("model.path=/nonexistent/model", "task=gsm8k", "task.data_path=/nonexistent/x.jsonl"),
                         run_dir=tmp_path / "nope" / "run")
    assert cfg.model.path == "/nonexistent/model" and not (tmp_path / "nope").exists()


def test_config_imports_without_torch_ray_or_vllm():
    code = "import sys, orchestrator.config; print(sorted(m for m in ('torch', 'ray', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=CONFIGS.parent)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


# --- choice lists live once: the config accepts exactly what the owning module defines -------------

def test_choice_lists_are_the_owning_modules():
    from typing import get_args

    from orchestrator.config.trainer import WEIGHT_SYNC_BACKENDS
    from orchestrator.loop.staleness import ON_STALE_CHOICES
    from workers.core.placement import PLACEMENT_MODES
    from workers.inference.settings import IN_FLIGHT_MODES
    from workers.rollout.contract import Contract
    from workers.trainer.settings import VerlStrategy
    from workers.weight_sync.setup import BROADCAST_BACKENDS, FILE_BACKEND

    assert set(WEIGHT_SYNC_BACKENDS) == {FILE_BACKEND, *BROADCAST_BACKENDS}
    assert {p.stem for p in (CONFIGS / "cluster").glob("*.yaml")} == set(PLACEMENT_MODES)  # one yaml per mode
    for key, choices in [("cluster.name", ("local",)), ("trainer.verl.strategy", get_args(VerlStrategy)),
                         ("rollout.contract", get_args(Contract)), ("async.on_stale", ON_STALE_CHOICES),
                         ("async.in_flight", IN_FLIGHT_MODES)]:
        for choice in choices:
            compose_config([f"{key}={choice}"])  # each owned choice validates
        with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}"):
            compose_config([f"{key}=not_a_choice"])


def test_verl_trainer_refuses_a_top_p_it_cannot_score():
    """verl's actor divides the logits by the temperature but applies no top-p nucleus: with
    rollout.top_p < 1 its log-probs could not match the engine's, so the config is refused."""
    with pytest.raises(ConfigError, match=r"^rollout\.top_p.*trainer=verl"):
        compose_config(["trainer=verl", "rollout.top_p=0.9"])
    assert compose_config(["trainer=verl", "rollout.temperature=0.6"]).rollout.temperature == 0.6


def test_readme_documents_every_exit_status_and_stderr_prefix_the_entry_point_uses():
    """docs/operations.md's "Exit status" table lists each status `orchestrator/main.py` exits with (`_fail`,
    `_leave_now`) and the `kind:` its stderr line starts with; a new status must be documented."""
    import re

    main_py = (CONFIGS.parent / "orchestrator" / "main.py").read_text()
    used = re.findall(r'_fail\("([a-z ]+)",.*?, (\d+)\)', main_py, flags=re.S)
    assert {code for _, code in used} >= {"1", "2", "3", "130"}, used
    readme = (CONFIGS.parent / "README.md").read_text()
    operations = (CONFIGS.parent / "docs" / "operations.md").read_text()
    table = operations.split("\n## Exit status", 1)[1].split("\n\n")[2]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert set(rows) == {"0"} | {code for _, code in used}, rows
    for kind, code in used:
        assert f"`{kind}:`" in rows[code], (kind, code)
    assert re.findall(r"_leave_now\((\d+)\)", main_py) == ["130"]
    assert "`make run` exits 2 on any failure" in readme  # make's own status, not the job's


def test_fixed_concurrency_caps_the_async_loop_in_flight():
    """rollout.concurrency=fixed: (η + 1)·B groups in flight, or async.max_concurrent_rollouts in
    whole groups; adaptive: no cap of the admission's own (its window decides)."""
    from orchestrator.config.run import async_loop_settings

    cfg = compose_config(["mode=async", "mode.sync_every=2", "async.max_staleness=2"])
    s = async_loop_settings(cfg)
    assert (s.groups_per_update, s.max_running_groups, s.drain_timeout_s) == (4, 12, 60.0)
    assert async_loop_settings(compose_config(["mode=async", "async.max_concurrent_rollouts=50"])).max_running_groups == 12
    assert async_loop_settings(compose_config(["mode=async", "rollout.concurrency=adaptive"])).max_running_groups is None


def test_adaptive_concurrency_starts_where_fixed_runs():
    """The product's gate (orchestrator/wiring/training.py) starts the throughput-seeking policy at
    the fixed policy's in-flight cap, between one mini-batch and the staleness window."""
    from orchestrator.wiring.training import _concurrency

    gate = _concurrency(compose_config(["mode=async", "rollout.concurrency=adaptive", "mode.sync_every=2",
                                        "async.max_staleness=2"]), [])
    assert (gate.policy.min_groups, gate.policy.limit, gate.policy.max_groups) == (4, 12, 24)  # B, (eta+1)B, (eta+1)kB
    gate = _concurrency(compose_config(["mode=async", "rollout.concurrency=adaptive",
                                        "async.max_concurrent_rollouts=48"]), [])
    assert gate.policy.limit == 12  # the user's fixed cap, 48 rollouts of n = 4
    assert _concurrency(compose_config(["mode=async"]), []) is None


@pytest.mark.parametrize("faults, message", [
    ("{crsh: 0.05}", "unknown fault kind(s) ['crsh']; known: ['throttle', 'server_error'"),
    ("{crash: 1.5}", "faults.crash must be in [0, 1], got 1.5"),
])
def test_a_bad_fault_names_the_valid_kinds(faults, message):
    """Issue 29: a typo in a fault name gave a raw FaultRates.__init__() error."""
    with pytest.raises(ConfigError, match=r"^rollout\.acr\.faults") as exc:
        compose_config([f"+rollout.acr.faults={faults}"])
    assert message in str(exc.value)


def test_colocated_replicas_beyond_the_trainers_gpus_name_the_key_to_set_and_the_fix():
    """Issue 29: the message named cluster.inference.replicas (interpolated, never set by the user)."""
    with pytest.raises(ConfigError, match=r"^inference\.replicas=3 must be <= the trainer's 1 GPUs") as exc:
        compose_config(["cluster=colocated", "inference.replicas=3"])
    assert "set inference.replicas<=1" in str(exc.value)


def test_eval_takes_rollout_n_1_since_it_samples_eval_n():
    """Issue 29: `mode=eval rollout.n=1` was refused with GRPO's group-baseline message."""
    assert compose_config(["mode=eval", "rollout.n=1"]).rollout.n == 1
    with pytest.raises(ConfigError, match=r"^rollout\.n"):
        compose_config(["rollout.n=1"])  # training still needs a group


def test_rollout_aws_on_the_embedded_model_says_which_defaults_clash_and_the_fix():
    """Issue 29: `rollout=aws` (max_tokens 1024, for a real model) on the embedded default
    (vllm_cpu, max_model_len 512) failed on a key the user never set, with no way out named."""
    arn = "arn:aws:bedrock-agentcore:us-west-2:123456789012:runtime/my_agent-AbCd"
    with pytest.raises(ConfigError, match=r"^rollout\.max_tokens") as exc:
        compose_config(["rollout=aws", f"rollout.acr.agent_runtime_arn={arn}", "rollout.acr.s3_bucket=my-bucket"])
    assert "rollout=aws sets max_tokens, inference=vllm_cpu the context" in str(exc.value)
    assert "set rollout.max_tokens below 512 or raise inference.max_model_len" in str(exc.value)


@pytest.mark.parametrize("overrides, names", [
    (["trainer.weight_sync.backend=gloo", "inference.max_restarts=2"], "trainer.weight_sync.backend=gloo"),
    (["trainer.weight_sync.backend=shm", "inference.max_restarts=1"], "trainer.weight_sync.backend=shm"),
    (["cluster=colocated", "inference.max_restarts=1"], "cluster=colocated"),
])
def test_replica_replacement_where_it_cannot_work_is_refused_naming_the_backend(overrides, names):
    """Issue 29: a dead replica was replaced on the file sync only, and elsewhere the setting was
    silently ignored; now an explicit max_restarts there is refused, naming what prevents it."""
    with pytest.raises(ConfigError, match=r"^inference\.max_restarts") as err:
        compose_config(overrides)
    assert names in str(err.value) and "trainer.weight_sync.backend=file" in str(err.value) or "colocated" in names


@pytest.mark.parametrize("overrides, restarts", [
    ([], 3), (["trainer.weight_sync.backend=gloo"], 0), (["cluster=colocated"], 0),
    (["trainer.weight_sync.backend=gloo", "inference.max_restarts=0"], 0), (["inference.max_restarts=5"], 5),
])
def test_replica_restarts_default_to_what_the_weight_sync_allows(overrides, restarts):
    assert compose_config(overrides).replica_restarts == restarts


def test_results_are_deleted_from_the_embedded_s3_but_kept_in_a_users_bucket():
    """moto keeps every object in memory, so rollout=local deletes each result once read; a user's
    bucket on AWS is the durable record and keeps it (a lifecycle rule bounds it)."""
    from orchestrator.config.rollout import rollout_settings

    local, aws = compose_config(), compose_config(["rollout=aws", *AWS])
    assert local.rollout.acr.delete_results and not aws.rollout.acr.delete_results
    s = rollout_settings(local.rollout, exp_id="e", agent_runtime_arn="a", gateway_base_url="", model_id="m")
    assert s.delete_results


def test_a2a_lifecycle_keys_reach_the_workers_and_the_slot_cap():
    from orchestrator.config import pool_limits
    from orchestrator.config.rollout import rollout_settings

    cfg = compose_config(["rollout.contract=a2a", "rollout.setup_timeout_s=1200", "rollout.run_timeout_s=900",
                          "rollout.rollout_slots=128", "rollout.acr.limits.max_open_sessions=256"])
    s = rollout_settings(cfg.rollout, exp_id="e", agent_runtime_arn="a", gateway_base_url="", model_id="m")
    assert (s.setup_timeout_s, s.run_timeout_s) == (1200, 900)
    limits = pool_limits(cfg.rollout)
    assert (limits.rollout_slots, limits.max_open_sessions) == (128, 256)
    assert pool_limits(compose_config().rollout).rollout_slots is None


def test_lora_configs_that_run():
    """rank 0 / null is off; the merged sync takes any backend; max_lora_rank is vLLM's next choice."""
    assert not compose_config([]).model.lora.enabled
    assert not compose_config(["model.lora.rank=null"]).model.lora.enabled
    cfg = compose_config(["model.lora.rank=12", "inference.lora_sync=merged", "trainer.weight_sync.backend=shm"])
    assert cfg.model.lora.enabled and cfg.model.lora.max_lora_rank() == 16
