"""The scheduler's own bookkeeping, seen from a caller on another thread."""
from __future__ import annotations

import pytest

from engine.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_a_request_is_in_flight_from_submit_to_result_also_while_it_prefills(engine):
    """A row being prefilled has left `waiting` and has no batch in `groups` yet; a caller asking "is the engine
    busy?" then must still see it (reading those two raced with admission: a CI failure of the disconnect test)."""
    ids = engine.encode(engine.chat_prompt([{"role": "user", "content": "Name three animals."}]))
    cfg = engine.decode_config(mode="diffusion", cache="block", max_new_tokens=8, temperature=0.0)
    seen: list[tuple[int, int, int]] = []
    sched = Scheduler(engine)
    try:
        def listener(_event) -> None:  # runs on the worker thread; the first call comes from the prefill
            if not seen:
                seen.append((sched.in_flight, len(sched.waiting), len(sched.groups)))
        t = sched.submit(ids, cfg, listener=listener, record=False)
        t.wait(120)
        assert seen == [(1, 0, 0)]  # mid-admission: in neither line, still in flight
        assert sched.in_flight == 0
        with sched._cv:  # a request cancelled before admission finishes without decoding, and is counted out
            c = sched.submit(ids, cfg, record=False)
            c.cancel()
            assert sched.in_flight == 1
        assert c.wait(60).summary.stop_reason == "cancelled" and sched.in_flight == 0
    finally:
        sched.close()
