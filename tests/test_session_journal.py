"""The open-session journal (workers/acr/journal.py): entries survive as files, a writer forgets only
its own, and nothing is lost to a half-written or unreadable entry."""

from __future__ import annotations

import json

from workers.acr.journal import JOURNAL_DIRNAME, JournalEntry, JournalWriter, SessionJournal

ARN = "arn:aws:bedrock-agentcore:us-west-2:123456789012:runtime/agent-1"


def test_entries_round_trip_and_remove_is_idempotent(tmp_path):
    j = SessionJournal(tmp_path)
    assert j.entries() == []  # no directory yet
    entries = [JournalEntry("exp-run-g0-s0-" + "a" * 32, ARN, "DEFAULT"),
               JournalEntry("exp-run-g0-s1-" + "b" * 32, ARN, None, local=True)]
    j.add(entries)
    assert j.entries() == sorted(entries, key=lambda e: e.session_id)
    assert SessionJournal(tmp_path).entries() == j.entries()  # another reader (the reaper, the next start)
    j.remove([entries[0].session_id, "never-recorded"])
    assert j.entries() == [entries[1]]
    j.remove([entries[0].session_id])  # again: no error
    assert j.entries() == [entries[1]]


def test_a_session_id_that_is_no_safe_file_name_is_still_one_entry(tmp_path):
    j = SessionJournal(tmp_path)
    odd = "../../etc/passwd with spaces/" + "x" * 40
    j.add([JournalEntry(odd, ARN)])
    files = list((tmp_path / JOURNAL_DIRNAME).iterdir())
    assert len(files) == 1 and files[0].parent == tmp_path / JOURNAL_DIRNAME
    assert j.entries() == [JournalEntry(odd, ARN)]
    j.remove([odd])
    assert j.entries() == []


def test_a_half_written_entry_is_dropped_and_an_unreadable_one_is_kept(tmp_path):
    j = SessionJournal(tmp_path)
    j.add([JournalEntry("s" * 40, ARN)])
    d = tmp_path / JOURNAL_DIRNAME
    (d / ".tmp-0123").write_text('{"session_id": "hal')  # a write killed before its rename
    (d / "broken.json").write_text("not json")
    assert j.entries() == [JournalEntry("s" * 40, ARN)]
    assert not (d / ".tmp-0123").exists()  # never recorded: removed
    assert (d / "broken.json").exists()  # never deleted unread
    assert json.loads((d / ("s" * 40 + ".json")).read_text())["arn"] == ARN


def test_a_writer_forgets_only_what_it_recorded(tmp_path):
    j = SessionJournal(tmp_path)
    earlier = JournalEntry("earlier-run-" + "e" * 32, ARN)  # a sweep could not stop it yet
    j.add([earlier])
    w = JournalWriter(j, ARN, "DEFAULT", local=False)
    ids = [f"exp-run-g{i}-s0-" + "c" * 32 for i in range(4)]
    w.record(ids)
    w.record(ids[:1])  # a second record of one id changes nothing
    assert {e.session_id for e in j.entries()} == {earlier.session_id, *ids}
    assert all(e.qualifier == "DEFAULT" and not e.local for e in j.entries() if e.session_id in ids)
    w.forget([ids[0], earlier.session_id])  # not this writer's: kept
    assert {e.session_id for e in j.entries()} == {earlier.session_id, *ids[1:]}
    w.forget_all_but([ids[2]])  # the end of a run whose actors still hold ids[2] open
    assert {e.session_id for e in j.entries()} == {earlier.session_id, ids[2]}
    assert w.recorded == {ids[2]}
