"""WebSocket sentence mode reads each ``input.text`` once: a message costs its own length, not
the text already waiting for a sentence end. A 4,000-character buffer with no sentence end
followed by 60,000 empty deltas costs the server well under 2 s of CPU (re-splitting the whole
buffer on every message cost about a minute).

The server is a real ``streamvox serve`` process; its CPU time is read from /proc, so the
client's own work is not counted.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import websockets
from conftest import ServerProcess

CPU_BUDGET_S = 2.0
DELTAS = 60_000


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def next_event(ws, timeout: float) -> dict:
    while True:
        message = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(message, str):
            return json.loads(message)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads CPU time from /proc")
async def test_empty_deltas_on_a_long_buffer_cost_little_server_cpu(tmp_path):
    server = ServerProcess(tmp_path / "data")
    try:
        url = server.wait_listening().replace("http://", "ws://") + "/v1/stream"
        async with websockets.connect(url, max_size=None) as ws:
            assert (await next_event(ws, 30))["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.config", "voice": "default"}))
            await ws.send(json.dumps({"type": "input.text", "text": "word " * 800}))  # no sentence end yet
            await asyncio.sleep(1.0)  # the session is set up: what follows is the deltas' cost
            before = cpu_seconds(server.proc.pid)
            empty = json.dumps({"type": "input.text", "text": ""})
            for _ in range(DELTAS):
                await ws.send(empty)
            await ws.send(json.dumps({"type": "response.cancel"}))  # answered after every delta was read
            event = await next_event(ws, 300)
            spent = cpu_seconds(server.proc.pid) - before
        assert event["type"] == "session.done", event
    finally:
        server.kill()
    assert spent < CPU_BUDGET_S, f"{DELTAS} empty deltas cost {spent:.2f} s of server CPU"
