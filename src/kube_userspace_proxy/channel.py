"""The control process <-> worker channel: length-prefixed pickled tuples on a socketpair.

Both ends are this program, connected by a socketpair the control process made, so pickle's
trust model holds; it is the cheapest codec for the full table of 10,000 ports.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 512 * 1024 * 1024


def send(writer: asyncio.StreamWriter, message: tuple[Any, ...]) -> None:
    """Queue `message` (a tuple whose first item names it); never blocks."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_HEADER.pack(len(body)) + body)


async def receive(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    """The next message; raises asyncio.IncompleteReadError at end of stream."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_MESSAGE:
        raise ValueError(f"channel message of {size} bytes is over the {MAX_MESSAGE} limit")
    message = pickle.loads(await reader.readexactly(size))
    if not isinstance(message, tuple) or not message:
        raise ValueError(f"malformed channel message: {type(message).__name__}")
    return message
