"""The trainer's channel to its agent: a request asked now and answered later
(``ask``/``answer``, which a reconcile uses to fetch its node state beside its first
collective), and a reply nobody will read (``forget``), against a stand-in agent."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from leto.backends.gloo import messages as M
from leto.backends.gloo.channel import AgentChannel
from leto.backends.gloo.wire import Conn, listen_unix


class _Agent:
    """Accepts one trainer; replies to each GetState with the count of GetStates so far,
    held back until ``release`` is set (so a test can see the reply arrive late)."""

    def __init__(self, name: str) -> None:
        self.srv = listen_unix("\0" + name)
        self.release = threading.Event()
        self.asked: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, _ = self.srv.accept()
        conn = Conn(sock)
        _, fds = conn.recv()  # the hello, with the status board's fd
        for fd in fds:
            os.close(fd)
        while True:
            try:
                obj, _ = conn.recv()
            except Exception:  # noqa: BLE001 - the trainer closed: done
                return
            msg = M.decode(obj)
            if isinstance(msg, M.GetState):
                self.asked.append(msg.id)
                self.release.wait(10)
                conn.send({"re": msg.id, "ps": {"3": f"state {len(self.asked)}"}})


@pytest.fixture
def chan() -> Iterator[tuple[AgentChannel, _Agent]]:
    name = f"leto-test-chan-{os.getpid()}-{threading.get_ident()}"
    agent = _Agent(name)
    ch = AgentChannel(name, {"rank": 0, "role": "trainer"}, heartbeat=60.0)
    yield ch, agent
    ch.conn.sock.close()
    agent.srv.close()


def test_a_request_asked_now_is_answered_later_and_in_order(
    chan: tuple[AgentChannel, _Agent],
) -> None:
    ch, agent = chan
    first = ch.ask(M.GetState(rank=0))
    second = ch.ask(M.GetState(rank=0))
    assert first != second
    agent.release.set()
    # answered out of the order asked: each id gets its own reply
    assert ch.answer(second, M.GetState.TAG)[0]["ps"] == {"3": "state 2"}
    assert ch.answer(first, M.GetState.TAG)[0]["ps"] == {"3": "state 1"}
    assert ch.request(M.GetState(rank=0))[0]["ps"] == {"3": "state 3"}


def test_a_forgotten_reply_is_dropped_whether_it_came_before_or_after(
    chan: tuple[AgentChannel, _Agent],
) -> None:
    ch, agent = chan
    late = ch.ask(M.GetState(rank=0))
    ch.forget(late)  # its reply has not come yet
    agent.release.set()
    early = ch.ask(M.GetState(rank=0))
    reply = ch.request(M.GetState(rank=0))[0]  # every reply before this one has come
    assert reply["ps"] == {"3": "state 3"}
    ch.forget(early)  # its reply came already
    assert ch._replies == {} and ch._forgotten == set()
    with pytest.raises(TimeoutError, match="no reply from the agent to get_state"):
        ch.answer(late, M.GetState.TAG, timeout=0.2)
