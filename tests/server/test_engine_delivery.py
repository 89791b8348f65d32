"""A newcomer's first token is handed over right after its prefill step, before the decode step of the
requests already running in the same iteration (which would delay it by a whole step)."""

from __future__ import annotations

from gpuscope.server.engine import Request
from gpuscope.server.model import encode
from tests.conftest import wait_for
from tests.server.test_engine import Rig


class Letters:
    """A detokenizer that makes every token text, so every token is an event."""

    def feed(self, token: int) -> str:
        return "x"

    def finish(self) -> str:
        return ""


def test_prefill_tokens_are_delivered_before_the_decode_step():
    rig = Rig(max_wait=0.0)
    try:
        steps: list[tuple[str, set[int]]] = []
        deliveries: list[tuple[int, set[int]]] = []
        rig.engine.runner.new_decoder = lambda prompt: Letters()
        rig.engine.on_step = lambda op, batch, seconds: steps.append((op, {id(r) for r in batch}))
        deliver = rig.engine._deliver

        def recording(events):
            deliveries.append((len(steps), {id(req) for req, _ in events}))
            deliver(events)

        rig.engine._deliver = recording
        # Held between two steps while the first request runs (it cannot end early: ignore_eos), the
        # newcomer joins at the next iteration: a prefill for it, then a decode step for the first.
        running = Request("a", encode("hi"), 200, 0.0, trace_id="t", ignore_eos=True)
        rig.pause_after(lambda: len(running.generated) >= 3)
        rig.engine.submit(running)
        assert rig.paused.wait(60), "the first request never decoded"
        newcomer = rig.submit(tokens=4)
        rig.resume()
        wait_for(lambda: newcomer.outcome and running.outcome, timeout=60, what="both requests done")
        at = next(i for i, (op, ids) in enumerate(steps) if op == "prefill" and id(newcomer) in ids)
        assert steps[at + 1][0] == "decode" and id(running) in steps[at + 1][1]  # the same iteration's
        first = next(count for count, ids in deliveries if id(newcomer) in ids)
        assert first == at + 1  # delivered after the prefill (step at), before the decode (step at + 1)
    finally:
        rig.close()
