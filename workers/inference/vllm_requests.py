"""The request path's vLLM glue: a GenerateRequest into vLLM's prompt and sampling parameters, and
vLLM's finished outputs back into segments (workers/inference/segments.py).

Sampling contract (see workers/inference/worker.py): only `stop_token_ids` end a generation with
"stop" (`ignore_eos=True`); log-probs are of the sampled token only; outputs are FINAL_ONLY.
vLLM is imported inside each function, so importing this module is cheap.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from workers.core.types import FinishReason, GenerateRequest
from workers.inference.segments import SegmentedGeneration, versions_from_spans

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def add_output(segments: SegmentedGeneration, request_id: str, out: Any, version: int | None = None) -> None:
    """Append one finished vLLM `CompletionOutput` (FINAL_ONLY: all of the segment's tokens).
    `version`: every token's version (a request pinned to a LoRA adapter version); None: from the
    engine's weight-version spans. Raises RuntimeError on a missing log-prob or version label, or
    an unknown finish reason."""
    ids = [int(t) for t in out.token_ids]
    positions = out.logprobs or []
    if len(positions) != len(ids):
        raise RuntimeError(f"request {request_id}: engine returned no log-prob for some tokens")
    reason = _FINISH_REASONS.get(str(out.finish_reason))
    if reason is None:
        raise RuntimeError(f"request {request_id}: engine finished with {out.finish_reason!r}")
    segments.add(
        ids,
        [float(pos[tok].logprob) for tok, pos in zip(ids, positions)],
        [version] * len(ids) if version is not None else versions_from_spans(request_id, out.weight_versions, len(ids)),
        reason,
    )


def tokens_prompt(ids: Any) -> Any:
    from vllm import TokensPrompt

    return TokensPrompt(prompt_token_ids=[int(t) for t in ids])


def sampling_params(req: GenerateRequest, max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=True,
        logprobs=0,  # only the sampled token's log-prob
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


async def last_output(stream: AsyncIterator[Any]) -> Any:
    final = None
    async for out in stream:
        final = out
    if final is None or not final.finished:
        raise RuntimeError("engine stream ended without a finished output")
    return final


def probe_params() -> Any:
    """SamplingParams of a prompt log-prob probe: one greedy token, log p of every prompt token
    (temperature 1, the actual next token only), no detokenization, the final output only."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=0,  # only the actual next token at each position
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
