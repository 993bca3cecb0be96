"""The LoRA adapter versions one replica serves (`InferenceSettings.lora_rank` > 0): which are
loaded, which requests use which, and when one can be unloaded.

Invariants:
- Every request is pinned at admission to the adapter of the current policy version and keeps it
  to its end (all of its segments, whatever syncs happen meanwhile), so each of its tokens is
  labelled with that version and was sampled by that adapter.
- Version v is served as vLLM LoRA `policy-v{v}` with lora_int_id v + 1 and its own directory;
  vLLM's prefix cache keys every block by the LoRA's name and path
  (vllm/v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`), so KV computed under one version
  is never served to a request of another, and an adapter load needs no cache reset.
- A version is unloaded (vLLM `remove_lora`) once it is older than the current one and no request
  uses it; a newer version (registered, still loading) is never unloaded: a request that ends
  while the next adapter loads must not drop it (found by the probe in an async run: the replica
  then served the base model labelled as the new version).
- Before the first adapter load the current version is served by the base model alone (the
  adapter's init is B = 0: version 0 is the base); `request_for` then gives None.

No vLLM import here except `LoRARequest`, built in `add`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class AdapterVersions:
    """Adapter bookkeeping of one replica; see the module docstring. `current`: the version new
    requests get."""

    current: int
    _loaded: dict[int, Any] = field(default_factory=dict)  # version -> LoRARequest
    _users: dict[int, int] = field(default_factory=dict)  # version -> requests in flight on it

    @staticmethod
    def lora_id(version: int) -> int:
        return version + 1  # vLLM's lora_int_id must be > 0

    def request_for(self, version: int) -> Any:
        """The LoRARequest of `version`, None when it is served by the base (nothing loaded)."""
        return self._loaded.get(version)

    def acquire(self) -> tuple[int, Any]:
        """Pin a new request: (current version, its LoRARequest or None)."""
        v = self.current
        self._users[v] = self._users.get(v, 0) + 1
        return v, self._loaded.get(v)

    def release(self, version: int) -> list[int]:
        """A request pinned to `version` ended; returns the lora ids to unload now."""
        left = self._users.get(version, 0) - 1
        if left > 0:
            self._users[version] = left
            return []
        self._users.pop(version, None)
        return self._unused()

    def add(self, version: int, path: str) -> Any:
        """Register `version`'s adapter directory; returns its LoRARequest (to load into vLLM)."""
        from vllm.lora.request import LoRARequest

        req = LoRARequest(lora_name=f"policy-v{version}", lora_int_id=self.lora_id(version), lora_path=path)
        self._loaded[version] = req
        return req

    def make_current(self, version: int) -> list[int]:
        """New requests get `version` from now on; returns the lora ids to unload now."""
        self.current = version
        return self._unused()

    def _unused(self) -> list[int]:
        # only versions below the current one: a newer one is being loaded (registered by `add`
        # before vLLM has it, made current after); unloading it then would serve the base
        gone = [v for v in self._loaded if v < self.current and not self._users.get(v)]
        for v in gone:
            del self._loaded[v]
        return [self.lora_id(v) for v in gone]

    def loaded(self) -> list[int]:
        """Versions whose adapter is loaded, ascending."""
        return sorted(self._loaded)

    def users(self, version: int) -> int:
        return self._users.get(version, 0)
