"""tests/serve/live.py's free_port: a port it handed out is not handed out again in the same
process, even while nothing listens on it yet (a `ray start` given one port for two of its
components exits)."""

from __future__ import annotations

from tests.serve import live


class _Picks:
    """random.Random's stand-in: picks 21001, 21001, 21002 in turn."""

    def __init__(self) -> None:
        self.picks = iter([21001, 21001, 21002])

    def choice(self, _ports) -> int:
        return next(self.picks)


def test_a_port_is_handed_out_once(monkeypatch):
    monkeypatch.setattr(live, "_HANDED_OUT", set())
    monkeypatch.setattr(live.random, "Random", _Picks)
    first = live.free_port()
    monkeypatch.setattr(live.random, "Random", _Picks)  # (the same picks again)
    assert (first, live.free_port()) == (21001, 21002)
