"""One GenerateResult from the engine segments of a request that weight updates cut apart.

With `InferenceSettings.in_flight="abort_resume"` a weight update aborts a running request; the
worker resubmits it with prompt + the tokens so far and the rest of its token budget, possibly
several times. `SegmentedGeneration` accumulates the segments and builds the one result the
caller sees. Pure logic: no vLLM, no asyncio (worker.py converts vLLM outputs into calls here).

Invariant (checked in `add`): the result's token i is token i of the concatenated segments, with
its own log-prob and version; versions never decrease; the total never exceeds `max_tokens`, so
a resumed request is given `remaining_tokens()` and nothing more.

Callers: workers/inference/worker.py (`InferenceWorker.generate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from workers.core.types import FinishReason, GenerateResult


class VersionSpanLike(Protocol):
    """Output tokens [start, end) were sampled by weights labelled `version` (vLLM's
    `WeightVersionSpan`; the worker labels each version with `str(policy_version)`)."""

    version: str
    start: int
    end: int


def versions_from_spans(request_id: str, spans: Sequence[VersionSpanLike] | None, num_tokens: int) -> list[int]:
    """[num_tokens] per-token versions from weight-version spans.

    Raises RuntimeError unless the spans tile [0, num_tokens) in order with integer labels.
    """
    versions: list[int] = []
    for span in spans or ():
        if span.start != len(versions) or span.end <= span.start:
            raise RuntimeError(f"request {request_id}: weight-version spans do not tile the output: {spans}")
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise RuntimeError(f"request {request_id}: weight-version spans cover {len(versions)} of {num_tokens} tokens")
    return versions


class SegmentedGeneration:
    """Concatenates the segments of one request; see the module docstring for the invariant."""

    def __init__(self, request_id: str, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"request {request_id}: max_tokens must be >= 1, got {max_tokens}")
        self._request_id = request_id
        self._max_tokens = max_tokens
        self._ids: list[int] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._finish: FinishReason | None = None
        self._num_segments = 0

    def num_tokens(self) -> int:
        return len(self._ids)

    def remaining_tokens(self) -> int:
        """Token budget left for the next segment (max_tokens minus the tokens so far)."""
        return self._max_tokens - len(self._ids)

    def ids(self) -> tuple[int, ...]:
        """[num_tokens] the generated ids so far (appended to the prompt of a resumed segment)."""
        return tuple(self._ids)

    def finish_reason(self) -> FinishReason | None:
        """Finish reason of the last segment (None before the first)."""
        return self._finish

    def num_segments(self) -> int:
        return self._num_segments

    def next_segment_id(self) -> str:
        """Engine request id of the next segment: the request's own id, then `<id>-resume<k>`."""
        n = self._num_segments
        return self._request_id if n == 0 else f"{self._request_id}-resume{n}"

    def add(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], finish: FinishReason) -> None:
        """Append one finished segment: [n] ids, their log-probs and versions.

        Raises RuntimeError if the lists differ in length, the budget would be exceeded, a version
        is lower than the one before it, or a segment follows one that did not end in "abort".
        """
        if not len(ids) == len(logprobs) == len(versions):
            raise RuntimeError(
                f"request {self._request_id}: segment has {len(ids)} ids, {len(logprobs)} log-probs, "
                f"{len(versions)} versions"
            )
        if self._finish is not None and self._finish != "abort":
            raise RuntimeError(f"request {self._request_id}: segment after one that finished {self._finish!r}")
        if len(ids) > self.remaining_tokens():
            raise RuntimeError(
                f"request {self._request_id}: segment of {len(ids)} tokens exceeds the remaining budget "
                f"{self.remaining_tokens()} of max_tokens={self._max_tokens}"
            )
        merged = self._versions + list(versions)
        if any(b < a for a, b in zip(merged, merged[1:])):
            raise RuntimeError(f"request {self._request_id}: token versions go backwards: {merged}")
        self._ids.extend(int(t) for t in ids)
        self._logprobs.extend(float(x) for x in logprobs)
        self._versions = merged
        self._finish = finish
        self._num_segments += 1

    def result(self, *, version_if_empty: int, finish_reason: FinishReason | None = None) -> GenerateResult:
        """The concatenated result; `finish_reason` overrides the last segment's. `policy_version`
        is the last token's version, or `version_if_empty` when no token was generated.

        Raises RuntimeError before the first segment."""
        reason = finish_reason or self._finish
        if reason is None:
            raise RuntimeError(f"request {self._request_id}: no engine output")
        return GenerateResult(
            output_ids=tuple(self._ids),
            logprobs=tuple(self._logprobs),
            finish_reason=reason,
            policy_version=self._versions[-1] if self._versions else version_if_empty,
            token_versions=tuple(self._versions),
        )
