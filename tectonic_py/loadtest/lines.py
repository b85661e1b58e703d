"""Newline-delimited JSON between the coordinator and its worker processes (the workers'
stdin and stdout): one small object per line, so either side can be read with no framing
beyond ``\\n`` and a dead peer shows as the end of the stream."""

from __future__ import annotations

import json
from typing import Any

import trio


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


class JsonLines:
    """Reads one JSON object per line from a trio stream; None once the stream ends."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def next(self) -> dict[str, Any] | None:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[: i + 1]
                return dict(json.loads(line))
            chunk = await self.stream.receive_some(1 << 20)
            if not chunk:
                return None
            self.buf += chunk
