"""The product side by side with TRL's GRPOTrainer on the real model, in one run on this machine.

    python scripts/bench_peer.py --out bench_peer.json [--steps 12] [--eval-samples 16] [--work DIR]

What runs (one process tree, one after the other, the same machine):
1. the product: `python -m orchestrator.main +experiment=smollm2_local` (sync mode, its defaults:
   SmolLM2-135M-Instruct, task=addition through the arith agent, the gateway and vLLM CPU, the FSDP2
   trainer), `--steps` optimizer updates, the final weights saved as a checkpoint;
2. the peer: TRL's `GRPOTrainer` (`--side trl`, a subprocess of this script) on the same model
   folder, the same 80 train prompts rendered with the same chat template, the same reward
   function (examples/agents/arith_agent/app.py `score`), group size, prompts per update, sampling
   (temperature 1.0, top_p 1, top_k off, 32 new tokens), learning rate, clip range (0.2 both
   sides), loss aggregation (token mean: TRL's `dapo`, ours `token-mean`), advantages (group mean,
   divided by the group std: TRL `scale_rewards="group"`, ours `norm_adv_by_std`), no KL term
   (beta 0), one optimizer update per generated batch, the same number of updates; TRL generates
   with transformers' `generate` in its own process (what a user of this size runs instead);
3. one evaluator for both (and the base model): every held-out prompt (20) x `--eval-samples`
   samples at temperature 1.0 with transformers, seeded, in this process, not counted in either
   side's budget. The reward gain is final minus base on that evaluation.

Figures per side: held-out reward before / after and the gain, CPU seconds of the whole process
tree (sampled from /proc every `--sample-s`: every process the side started, Ray's and vLLM's
included; setup counted), wall time, trained tokens (completion tokens of the samples that
trained; ours: `perf/trained_tokens`, TRL: completion tokens of groups with reward variance, the
ones whose advantage is not zero) per minute of wall time, peak resident memory of the tree, and
reward gain per CPU-hour. `ratio` is ours / TRL's for each.

Differences that remain (also written into the JSON's `setup.differences`): the product filters
zero-variance groups out of the loss (TRL keeps them, at advantage 0, in the token-mean
denominator); the product recomputes pi_old and applies token-level TIS against the engine's
log-probs (TRL's samples come from the trained model itself, exactly on-policy); the product's
prompt order is its own seeded cycle, TRL's its RepeatSampler's shuffle (both over the same 80
prompts); the product runs every part as it would on a cluster (Ray, vLLM, the ACR emulator, S3,
agents, gateway), TRL one Python process with torch using both cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
AGENT = REPO / "examples" / "agents" / "arith_agent" / "app.py"
MAX_NEW_TOKENS = 32  # +experiment=smollm2_local's rollout.max_tokens
TEMPERATURE = 1.0


def reward_fn():
    """The arith agent's own `score(reply, answer)`, loaded from its file."""
    spec = importlib.util.spec_from_file_location("arith_agent_app", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.score


class TreeMeter:
    """CPU seconds and peak memory of a process and all its descendants, sampled from /proc every
    `interval_s` (psutil). A process's CPU is its last sample (utime + stime), so a process that
    lives less than one interval is missed: a lower bound, by at most one interval per process.
    Memory is summed over the tree twice: RSS (a page shared by N processes, such as the Ray
    actors' copies of torch and vLLM, counts N times: an overstatement) and PSS (/proc/PID/smaps_rollup:
    a shared page counts 1/N in each, so the sum is the tree's real share of RAM)."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.cpu_s: dict[int, float] = {}
        self.peak_rss_bytes = 0
        self.peak_pss_bytes = 0
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                procs = []
            rss = pss = 0
            for p in procs:
                try:
                    t = p.cpu_times()
                    self.cpu_s[(p.pid, p.create_time())] = t.user + t.system
                    mem = p.memory_full_info()
                    rss, pss = rss + mem.rss, pss + mem.pss
                except psutil.Error:
                    continue
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
            self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
            self.loads.append(os.getloadavg()[0])
            self._stop.wait(self.interval_s)

    def total_cpu_s(self) -> float:
        return sum(self.cpu_s.values())


def run_measured(cmd: list[str], log: Path, interval_s: float, timeout_s: float, env: dict | None = None) -> dict:
    """Run `cmd` (cwd: the repository), its output into `log`; return wall, CPU, peak RSS and PSS, load.
    Raises RuntimeError naming the log on a non-zero exit."""
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        with TreeMeter(proc.pid, interval_s) as meter:
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise RuntimeError(f"{cmd[:4]} ran past {timeout_s} s; its output: {log}") from None
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} exited {rc}; its output: {log}")
    return {"wall_s": time.monotonic() - t0, "cpu_s": meter.total_cpu_s(),
            "peak_rss_gb": meter.peak_rss_bytes / 2**30, "peak_pss_gb": meter.peak_pss_bytes / 2**30,
            "load_mean": sum(meter.loads) / max(1, len(meter.loads)), "load_max": max(meter.loads, default=math.nan)}


def run_ours(args: argparse.Namespace, work: Path) -> dict:
    run_dir = work / "ours"
    cmd = [sys.executable, "-m", "orchestrator.main", "+experiment=smollm2_local", f"trainer.total_steps={args.steps}",
           f"trainer.save_freq={args.steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
           f"seed={args.seed}", "logger=console", f"run_dir={run_dir}", *args.overrides]
    m = run_measured(cmd, work / "ours.log", args.sample_s, args.timeout_s)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    m["trained_tokens"] = sum(s.get("perf/trained_tokens", 0.0) for s in steps)
    m["updates"] = len(steps)
    m["train_reward_first"], m["train_reward_last"] = steps[0]["reward/mean"], steps[-1]["reward/mean"]
    m["rollout_corr_kl_max"] = max(abs(s.get("rollout_corr/kl", 0.0)) for s in steps)
    m["model_dir"] = str(run_dir / "checkpoints" / f"step-{args.steps:08d}" / "model")
    return m


def run_trl(args: argparse.Namespace, work: Path, model_dir: Path) -> dict:
    out_dir = work / "trl"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", "trl", "--model", str(model_dir),
           "--trl-out", str(out_dir), "--steps", str(args.steps), "--seed", str(args.seed)]
    m = run_measured(cmd, work / "trl.log", args.sample_s, args.timeout_s,
                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    stats = json.loads((out_dir / "trl_stats.json").read_text())
    m |= stats
    m["model_dir"] = str(out_dir / "model")
    return m


def trl_side(args: argparse.Namespace) -> None:
    """`--side trl`: TRL's GRPOTrainer with the settings of the module docstring; writes the final
    model and `trl_stats.json` (trained tokens, updates, train reward first/last) into --trl-out."""
    # TRL generates with transformers here, never vLLM: hide the installed vLLM CPU build from it
    # (find_spec returns None for a None module), since TRL 1.12's vLLM bridge does not import
    # against vLLM 0.32 (`NCCLTrainerSendWeightsArgs`)
    sys.modules.setdefault("vllm", None)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from workers.core.tasks.addition import make_rows

    score = reward_fn()
    out = Path(args.trl_out)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    rows = make_rows(None, args.seed, "train")
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in rows])
    counts = {"trained_tokens": 0, "rewards": []}

    def reward(completions, answer, completion_ids, **_):
        rewards = [score(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]
        for g in range(0, len(rewards), 4):  # groups of num_generations: only a group with variance trains
            if len(set(rewards[g:g + 4])) > 1:
                counts["trained_tokens"] += sum(len(ids) for ids in completion_ids[g:g + 4])
        counts["rewards"].append(sum(rewards) / len(rewards))
        return rewards

    config = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=args.steps, learning_rate=1e-5, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, warmup_steps=0,
        per_device_train_batch_size=32, gradient_accumulation_steps=1, num_generations=4,
        max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1,
        mask_truncated_completions=False, use_cpu=True, bf16=False, fp16=False, seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok)
    trainer.train()
    trainer.model.save_pretrained(out / "model", safe_serialization=True)
    tok.save_pretrained(out / "model")
    (out / "trl_stats.json").write_text(json.dumps({
        "trained_tokens": counts["trained_tokens"], "updates": trainer.state.global_step,
        "train_reward_first": counts["rewards"][0], "train_reward_last": counts["rewards"][-1],
        "torch_threads": torch.get_num_threads()}))


def evaluate(model_dir: str, samples: int, seed: int) -> float:
    """Mean reward of `model_dir` over every held-out prompt x `samples` samples (temperature 1.0,
    MAX_NEW_TOKENS, the chat template), with transformers; seeded, so two models see the same draws
    of the sampler's random numbers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.core.tasks.addition import make_rows

    score = reward_fn()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = make_rows(None, 0, "test")
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                     tokenize=False) for r in rows]
    total, count = 0.0, 0
    torch.manual_seed(seed)
    for start in range(0, len(texts), 10):
        batch = tok(texts[start:start + 10], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=TEMPERATURE, top_p=1.0, top_k=0,
                                 max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=samples,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        replies = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        for i, reply in enumerate(replies):
            total += score(reply, rows[start + i // samples]["answer"])
            count += 1
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the figures as JSON")
    ap.add_argument("--steps", type=int, default=12, help="optimizer updates on each side")
    ap.add_argument("--eval-samples", type=int, default=16, help="samples per held-out prompt in the evaluation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=0.5, help="CPU/RSS sampling interval of the process trees")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="bound on each side's run")
    ap.add_argument("--work", type=Path, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # internal: the TRL subprocess
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--trl-out", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for the product's run")
    args = ap.parse_args()
    if args.side == "trl":
        return trl_side(args)
    import tempfile

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from workers.embedded.smollm2 import ensure_smollm2

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_peer-"))
    work.mkdir(parents=True, exist_ok=True)
    base_dir = ensure_smollm2()
    load_before = os.getloadavg()
    print(f"work: {work}; load before: {load_before}", flush=True)
    sides = {"ours": run_ours(args, work)}
    print(f"ours: {sides['ours']}", flush=True)
    sides["trl"] = run_trl(args, work, base_dir)
    print(f"trl: {sides['trl']}", flush=True)
    base = evaluate(str(base_dir), args.eval_samples, args.seed)
    for name, m in sides.items():
        m["heldout_reward_before"] = base
        m["heldout_reward_after"] = evaluate(m["model_dir"], args.eval_samples, args.seed)
        m["reward_gain"] = m["heldout_reward_after"] - base
        m["cpu_hours"] = m["cpu_s"] / 3600.0
        m["reward_gain_per_cpu_hour"] = m["reward_gain"] / m["cpu_hours"]
        m["trained_tokens_per_min"] = 60.0 * m["trained_tokens"] / m["wall_s"]
        print(f"{name}: held-out {base:.3f} -> {m['heldout_reward_after']:.3f}", flush=True)
    ratio = {k: sides["ours"][k] / sides["trl"][k] if sides["trl"][k] else math.nan
             for k in ("reward_gain_per_cpu_hour", "trained_tokens_per_min", "reward_gain", "cpu_s", "wall_s",
                       "peak_rss_gb", "peak_pss_gb")}
    result = {"ours": sides["ours"], "trl": sides["trl"], "ratio": ratio, "setup": {
        "steps": args.steps, "prompts_per_update": 8, "group_size": 4, "eval_samples_per_prompt": args.eval_samples,
        "heldout_prompts": 20, "machine_cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
        "differences": __doc__.split("Differences that remain")[1].strip()}}
    print(json.dumps({"ratio": ratio}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
