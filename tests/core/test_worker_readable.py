"""The worker pipe's readiness check (``worker._Readable``): what ``Connection.poll`` answers, from one
``select.poll`` registered once."""

from __future__ import annotations

import multiprocessing as mp
import time

from pypto_serving import worker


def test_it_answers_as_connection_poll_does() -> None:
    ours, theirs = mp.Pipe()
    readable = worker._Readable(ours)
    assert not readable(0) and not ours.poll(0)
    theirs.send_bytes(b"step")
    assert readable(0) and ours.poll(0)
    assert readable(0)  # asking again consumes nothing
    assert ours.recv_bytes() == b"step"
    assert not readable(0)


def test_a_closed_peer_reads_as_ready_so_the_receive_sees_the_end() -> None:
    ours, theirs = mp.Pipe()
    readable = worker._Readable(ours)
    theirs.close()
    assert readable(0) and ours.poll(0)
    try:
        ours.recv_bytes()
    except EOFError:
        pass
    else:
        raise AssertionError("a closed peer should end the receive")


def test_it_waits_up_to_the_timeout() -> None:
    ours, _theirs = mp.Pipe()
    readable = worker._Readable(ours)
    start = time.perf_counter()
    assert not readable(0.05)
    assert time.perf_counter() - start >= 0.045
