"""The adapter bookkeeping of one replica (workers/inference/adapters.py): pinning, unloading, and
the race of a request that ends while the next version's adapter loads."""

from __future__ import annotations

from workers.inference.adapters import AdapterVersions


def test_a_version_is_unloaded_when_superseded_and_unused():
    a = AdapterVersions(0)
    a.add(1, "/a/v1")
    assert a.make_current(1) == []
    v, lora = a.acquire()
    assert v == 1 and lora.lora_name == "policy-v1" and lora.lora_int_id == 2
    a.add(2, "/a/v2")
    assert a.make_current(2) == []  # v1 still serves a request
    assert a.loaded() == [1, 2]
    assert a.release(1) == [AdapterVersions.lora_id(1)]
    assert a.loaded() == [2]


def test_a_request_ending_while_the_next_adapter_loads_keeps_it():
    """load_adapter registers v2, then awaits vLLM's add_lora; a v1 request ending meanwhile must
    not unload v2 (it is not current yet): new requests would get no adapter, the base model."""
    a = AdapterVersions(0)
    a.add(1, "/a/v1")
    a.make_current(1)
    a.acquire()
    a.add(2, "/a/v2")  # loading, not current yet
    assert a.release(1) == []  # v1 is current: kept; v2 is loading: kept
    a.make_current(2)
    assert a.request_for(2) is not None and a.acquire()[1].lora_name == "policy-v2"


def test_before_any_adapter_the_base_serves():
    a = AdapterVersions(3)
    assert a.acquire() == (3, None)
    assert a.release(3) == []
