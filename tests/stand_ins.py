"""Stand-ins and builders the test modules share (not collected: no `test_` prefix).

Test modules import it by name (`from stand_ins import make_sample`): tests/conftest.py puts
tests/ on sys.path, because pytest runs with `--import-mode=importlib` and tests/ cannot be a
package (the name `tests` is taken by a package in TransferQueue's wheel). The fixtures built on
these live in tests/conftest.py.

Nothing here imports torch, Ray or a model at import time (a pure test must stay fast); the few
helpers that need them import them when called. Stand-ins replace seams, never the code under
test (STYLE.md: simulate at the seams).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from contextlib import suppress as contextlib_suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.loop.batching import Group
from workers.core.types import OrderData, RolloutResult, Sample, SampleInfo, TrainOrder, TrajectoryRow

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
HERE = Path(__file__).resolve().parent

# Scripted ACR agents: real agent apps, run by the ACR emulator as processes (argv lists)
ECHO_AGENT = [sys.executable, str(HERE / "acr_echo_agent.py")]  # echoes payload, session id, headers
BEHAVIOUR_AGENT = [sys.executable, str(HERE / "rollout_behaviour_agent.py")]  # result chosen by row `behaviour`
TOOLKIT_S3_AGENT = [sys.executable, str(HERE / "acr_toolkit_agent.py")]  # agentcore-rl-toolkit, S3 contract
TOOLKIT_HTTP_AGENT = [sys.executable, str(HERE / "acr_toolkit_http_agent.py")]  # toolkit, HTTP contract
TOOLKIT_A2A_AGENT = [sys.executable, str(HERE / "a2a_behaviour_agent.py")]  # toolkit, A2A contract
STUB_AGENT = [sys.executable, "-m", "workers.embedded.stub_agent"]  # the embedded default's stub
LETTERS_AGENT = [sys.executable, str(REPO / "examples/agents/letters_agent/app.py")]


# --- time and versions ------------------------------------------------------------------------------


class FakeClock:
    """Virtual time. `now()` (or calling the clock) reads it, advancing it by `tick_s` first;
    `sleep` advances it by the time slept and records it in `slept`, yielding to the loop once."""

    def __init__(self, start_s: float = 1000.0, *, tick_s: float = 0.0) -> None:
        self.t = start_s
        self.tick_s = tick_s
        self.slept: list[float] = []

    def now(self) -> float:
        self.t += self.tick_s
        return self.t

    __call__ = now

    async def sleep(self, dt_s: float) -> None:
        self.slept.append(dt_s)
        self.t += dt_s
        await asyncio.sleep(0)


@dataclass
class ManualVersions:
    """A VersionSource the test bumps by hand (stands in for the weight-sync counter)."""

    v: int = 0

    def current(self) -> int:
        return self.v


# --- samples ---------------------------------------------------------------------------------------


def make_row(prompt: Sequence[int], generated: Sequence[int], *, logprobs: float | Sequence[float] = -0.5,
             versions: int | Sequence[int] = 0) -> TrajectoryRow:
    """One row: `prompt` (mask 0, log-prob 0, version -1), then `generated` (mask 1) with `logprobs`
    and `versions`, each one value for every generated token or one per token."""
    n_p, n_g = len(prompt), len(generated)
    lps = (float(logprobs),) * n_g if isinstance(logprobs, (int, float)) else tuple(logprobs)
    vers = (versions,) * n_g if isinstance(versions, int) else tuple(versions)
    if len(lps) != n_g or len(vers) != n_g:
        raise ValueError(f"{n_g} generated tokens, {len(lps)} log-probs, {len(vers)} versions")
    return TrajectoryRow(token_ids=tuple(prompt) + tuple(generated), loss_mask=(0,) * n_p + (1,) * n_g,
                         rollout_logprobs=(0.0,) * n_p + lps, versions=(-1,) * n_p + vers)


def seeded_row(prompt_len: int, gen_len: int, seed: int = 0) -> TrajectoryRow:
    """A row of `prompt_len` + `gen_len` token ids in 1..50 that depend on `seed`."""
    ids = [(seed * 7 + i) % 50 + 1 for i in range(prompt_len + gen_len)]
    return make_row(ids[:prompt_len], ids[prompt_len:])


def make_sample(group_id: int, index: int, reward: float | None = 1.0, *, rows: Sequence[TrajectoryRow] | None = None,
                status: str = "completed", latency_s: float = 0.1) -> Sample:
    """Sample `s-{group_id}-{index}` of input `in-{group_id}`; a sample that did not complete has
    no reward. Default rows: one `seeded_row(2, 3 + index, seed=index)`."""
    return Sample(session_id=f"s-{group_id}-{index}", group_id=group_id, input_id=f"in-{group_id}",
                  sample_index=index, rows=tuple(rows) if rows is not None else (seeded_row(2, 3 + index, index),),
                  reward=reward if status == "completed" else None, status=status,  # type: ignore[arg-type]
                  latency_s=latency_s)


def make_group(group_id: int, rewards: Sequence[float]) -> Group:
    """A group of completed samples, one per reward, with the default rows."""
    return Group(group_id, tuple(make_sample(group_id, i, r) for i, r in enumerate(rewards)))


def reply_ids(tokenizer, text: str) -> tuple[int, ...]:
    """The token ids a model generates to answer `text`: its ids, then eos (a scripted reply)."""
    return (*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id)


# --- config -----------------------------------------------------------------------------------------


def compose_config(overrides: Sequence[str] = (), *, run_dir: str | Path = "/tmp/x"):
    """The typed RunConfig for `configs/` with Hydra `overrides`, as `main` composes it."""
    from hydra import compose, initialize_config_dir

    from orchestrator.config import register, to_run_config

    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=[f"run_dir={run_dir}", *overrides]))


# --- waiting ------------------------------------------------------------------------------------------


def new_session_id(prefix: str = "test-session") -> str:
    """A fresh ACR session id, `{prefix}-{uuid4}`: inside ACR's 33-256 characters for any prefix
    of up to 200."""
    return f"{prefix}-{uuid.uuid4()}"


def wait_until(pred: Callable[[], Any], timeout_s: float, every_s: float = 0.05) -> Any:
    """Poll `pred` until it returns something truthy (returned) or `timeout_s` passes (then its
    last value)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(every_s)
    return pred()


async def until(pred: Callable[[], Any], every_s: float = 0.005) -> None:
    """Yield to the loop until `pred()` holds; callers bound it with `asyncio.wait_for`."""
    while not pred():
        await asyncio.sleep(every_s)


class InThread:
    """Runs each method of a blocking object in a worker thread, as a Ray actor would run it in its
    own process, so two sides of a collective (sender and receivers) make progress together."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        fn = getattr(self._obj, name)

        async def call(*args: Any) -> Any:
            return await asyncio.to_thread(fn, *args)

        return call


def load_module(path: str | Path, name: str | None = None):
    """Import the file at `path` as module `name` (default: its stem + "_under_test"), registered in
    sys.modules (dataclasses look their module up there), e.g. an example agent's file that is not
    on the import path."""
    import importlib.util

    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or f"{path.stem}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- models and Ray --------------------------------------------------------------------------------


def hf_token_logprobs(model, token_ids: Sequence[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits_{t-1} / T)[token_t] for t >= 1 under a plain HF causal LM: the reference
    for an engine's or trainer's log-probs."""
    import torch

    ids = torch.tensor([list(token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature  # [seq, vocab]
    logp = torch.log_softmax(logits, dim=-1)
    return logp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()


def random_qwen2(path: str | Path, *, vocab: int = 128, hidden_size: int = 64, num_layers: int = 2,
                 max_positions: int = 256, tie: bool = False, seed: int = 0) -> str:
    """Save a randomly initialised (seeded) small Qwen2 at `path`; returns `path` as str."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, tie_word_embeddings=tie)
    Qwen2ForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


@contextmanager
def own_ray(*, num_cpus: int = 2, num_gpus: int = 0, ship: Sequence[object] = (), **init_kw: Any) -> Iterator[Any]:
    """A Ray instance of the caller's own (address="local": never joins another), shut down after.

    `ship`: modules whose classes and functions go to Ray workers by value (workers cannot import
    test modules; tests/ is not on their path). Yields the `ray` module."""
    import ray

    for module in ship:
        ray.cloudpickle.register_pickle_by_value(module)
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
             **init_kw)
    try:
        yield ray
    finally:
        ray.shutdown()


# --- a scripted model server ---------------------------------------------------------------------------

Answer = Callable[[dict], "tuple[int, dict] | Awaitable[tuple[int, dict]]"]


def chat_completion(body: dict, message: dict, *, finish_reason: str = "stop",
                    usage: tuple[int, int] = (5, 4)) -> dict:
    """An OpenAI Chat Completions response body for request `body` answering `message`."""
    prompt_tokens, completion_tokens = usage
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"], "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


class ScriptedChatServer:
    """OpenAI Chat Completions on 127.0.0.1, in a thread with its own loop, for agents under test.

    `answer(body)` (plain or async) gives `(status, response body)` for each request; every request
    body is recorded in `requests` with its Authorization header under "auth". `routes` adds POST
    handlers (aiohttp) by path. The server binds port 0 and keeps its socket: no free-port race."""

    def __init__(self, answer: Answer, *, routes: dict[str, Callable] | None = None) -> None:
        self._respond = answer
        self._routes = dict(routes or {})
        self.requests: list[dict] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _chat(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append({"auth": request.headers.get("Authorization"), **body})
        result = self._respond(body)
        status, payload = await result if inspect.isawaitable(result) else result
        return web.Response(status=status, text=json.dumps(payload), content_type="application/json")

    def _run(self) -> None:
        from aiohttp import web

        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        for path, handler in self._routes.items():
            app.router.add_post(path, handler)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.SockSite(runner, self._sock).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def start(self) -> ScriptedChatServer:
        self._thread.start()
        assert self._ready.wait(10), "scripted chat server did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._sock.close()

    def __enter__(self) -> ScriptedChatServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the driver loops' seams, simulated (no models, no Ray) ---------------------------------------------


class MemoryStore:
    """The buffer seam in memory: samples by partition, in arrival order; `cleared` lists the
    partitions cleared whole, in order."""

    def __init__(self) -> None:
        self.partitions: dict[str, list[Sample]] = {}
        self.cleared: list[str] = []
        self.rows_read = 0

    async def put(self, samples: Sequence[Sample], partition: str) -> None:
        self.partitions.setdefault(partition, []).extend(samples)

    def sample(self, partition: str, session_id: str) -> Sample:
        """One stored sample whole (what a test's trainer stand-in inspects); KeyError if absent."""
        found = [s for s in self.partitions.get(partition, []) if s.session_id == session_id]
        if len(found) != 1:
            raise KeyError(f"{session_id} is stored {len(found)} times in {partition!r}")
        return found[0]

    def read_rows(self, partition: str, keys: Sequence[str]) -> list[TrajectoryRow]:
        """The rows under `keys`, as a trainer rank reads them (`TrajectoryBuffer.read_rows`);
        KeyError for a key not stored; `rows_read` counts them."""
        by_key = {k: r for s in self.partitions.get(partition, []) for k, r in zip(s.info().row_keys, s.rows)}
        self.rows_read += len(keys)
        return [by_key[k] for k in keys]

    async def clear(self, partition: str) -> None:
        self.partitions.pop(partition, None)
        self.cleared.append(partition)

    async def clear_samples(self, partition: str, samples: Sequence[SampleInfo]) -> None:
        """Free the named samples (the product clears their keys: none named twice, none missing)."""
        gone = [s.session_id for s in samples]
        stored = {s.session_id for s in self.partitions.get(partition, [])}
        assert len(set(gone)) == len(gone) and set(gone) <= stored, f"cleared {gone}, stored {sorted(stored)}"
        kept = [s for s in self.partitions.get(partition, []) if s.session_id not in gone]
        if kept:
            self.partitions[partition] = kept
        else:
            self.partitions.pop(partition, None)


class SimReplica:
    """The weights seam of a simulated inference replica, a `WeightSync` (workers/weight_sync/protocol.py):
    its policy version `served`, bumped by `sync` (which refuses a skipped or repeated version)."""

    def __init__(self, version: int = 0) -> None:
        self.served = version

    def version(self) -> int:
        return self.served

    async def sync(self, version: int) -> None:
        assert version == self.served + 1, f"synced version {version} onto {self.served}"
        await asyncio.sleep(0.001)
        self.served = version

    def lost(self) -> frozenset[int]:
        return frozenset()

    async def metrics(self) -> dict[str, float]:
        return {}


class SimRollouts:
    """The rollout seam: a rollout generates its two tokens at the start and at the end of a random
    (seeded) latency, each with the replica's version at that moment, so in-flight generation
    spans weight syncs and staleness is real; reward `reward_fn(request)`."""

    def __init__(self, store: MemoryStore, engine: SimReplica, rng, reward_fn: Callable[[Any], float],
                 max_latency_s: float = 0.02) -> None:
        self.store, self.engine, self.rng, self.reward_fn = store, engine, rng, reward_fn
        self.max_latency_s = max_latency_s
        self.dispatched = 0

    def shape(self, sample: Sample) -> Sample:
        """The sample as the rollout worker stores it (a subclass changes its fate); as is here."""
        return sample

    async def run_all(self, reqs: Sequence[Any], partition: str) -> list[RolloutResult]:
        async def one(r: Any) -> Sample:
            self.dispatched += 1
            v0 = self.engine.served
            latency_s = self.rng.random() * self.max_latency_s
            await asyncio.sleep(latency_s)
            v1 = self.engine.served
            row = TrajectoryRow((1, 2, 3, 4), (0, 0, 1, 1), (0.0, 0.0, -0.3, -0.2), (-1, -1, v0, v1))
            return self.shape(Sample(f"s{r.group_id}-{r.sample_index}", r.group_id, r.input_id, r.sample_index, (row,),
                                     self.reward_fn(r), "completed", latency_s))

        out = await asyncio.gather(*(one(r) for r in reqs))
        await self.store.put(out, partition)
        return [RolloutResult(s.info()) for s in out]


def alternating_reward(request: Any) -> float:
    """0, 1, 0, 1, ... by sample index: every group of two or more has reward variance."""
    return float(request.sample_index % 2)


class RecordingTrainer:
    """The trainer seam: reads the order's rows from the store as a rank does, records (replica
    version at the update, sample) for every sample with a row read, builds the real train batch."""

    def __init__(self, engine: SimReplica, store: MemoryStore) -> None:
        self.engine, self.store = engine, store
        self.trained: list[tuple[int, Sample]] = []

    async def update(self, order: TrainOrder) -> dict[str, float]:
        from workers.trainer.train_batch import order_batch

        for s in order.samples:
            if s.row_keys:
                self.trained.append((self.engine.served, self.store.sample(order.partition, s.session_id)))
        rows = self.store.read_rows(order.partition, [k for s in order.samples for k in s.row_keys])
        batch = order_batch(order, rows, OrderData())
        await asyncio.sleep(0.005)
        return {"actor/num_tokens": float(batch.num_loss_tokens)}


class ListLogger:
    """The metrics logger seam: keeps every (step, metrics)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append((step, metrics))


# --- random inputs for the algorithm parity tests -----------------------------------------------------


def random_mask(gen, bsz: int, seq: int):
    """Right-padded float mask (torch, bsz x seq) from generator `gen`: each row keeps 1..seq-1
    tokens starting at column 1 (column 0 is prompt); with seq == 1, the one column."""
    import torch

    mask = torch.zeros(bsz, seq)
    for b in range(bsz):
        n = int(torch.randint(1, max(seq, 2), (1,), generator=gen).item())
        mask[b, 1 : 1 + n] = 1.0
    if seq == 1:
        mask[:, 0] = 1.0
    return mask


class FileTrainer:
    """The trainer's checkpoint surface (`save_hf`, `save_optimizer`: coroutines, as a TrainerGroup's),
    writing real files so that `RunCheckpointer` commits a complete, verifiable checkpoint."""

    async def save_hf(self, d: str) -> None:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / "config.json").write_text("{}")

    async def save_optimizer(self, p: str) -> None:
        Path(p).write_bytes(b"adam")


class BlockingAcr:
    """The product's `AsyncAcrClient` called from blocking test code: the client lives on an event
    loop of its own in a daemon thread, and each method waits for its coroutine. Made after
    `stack_env` set the AWS variables (the client reads them when it starts); closed at exit."""

    _open: list["BlockingAcr"] = []

    def __init__(self, cfg: Any = None) -> None:
        import atexit

        from workers.acr.client import AsyncAcrClient

        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="blocking-acr", daemon=True).start()
        self._client = self._wait(AsyncAcrClient(cfg).start())
        if not BlockingAcr._open:
            atexit.register(BlockingAcr._close_all)
        BlockingAcr._open.append(self)

    def _wait(self, coro: Awaitable[Any], timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def invoke(self, arn: str, session_id: str, payload: dict, qualifier: str | None = None) -> dict:
        return self._wait(self._client.invoke(arn, session_id, payload, qualifier))

    def stop_session(self, arn: str, session_id: str, qualifier: str | None = None) -> bool:
        return self._wait(self._client.stop_session(arn, session_id, qualifier))

    def wait_for_result(self, bucket: str, key: str, timeout_s: float) -> dict | None:
        return self._wait(self._client.wait_for_result(bucket, key, timeout_s), timeout_s + 30)

    def stats(self) -> Any:
        return self._client.stats()

    @classmethod
    def _close_all(cls) -> None:
        for c in cls._open:
            with contextlib_suppress(Exception):
                c._wait(c._client.close(), 5)
            c._loop.call_soon_threadsafe(c._loop.stop)
        cls._open.clear()


def groups_batch(groups: Sequence[Group], *, pad_id: int = 0, norm_adv_by_std: bool = True):
    """A rank's train batch of whole `groups` of Samples (workers/trainer/train_batch.py
    `build_train_batch` over their samples, group by group)."""
    from workers.trainer.train_batch import build_train_batch

    return build_train_batch([s for g in groups for s in g.samples], pad_id=pad_id, norm_adv_by_std=norm_adv_by_std)
