"""The floor for a store-and-forward HTTP relay, for bench_proxy_overhead.py's `relay floor` row:
read a whole request (httptools), write it to one keep-alive upstream connection, read the whole
answer, write it back. No routing, no JSON, no retries, no metrics, one upstream connection per
client connection: what is left is copying the bytes twice over loopback on uvloop.

    python bench/_raw_relay.py --port P --upstream 127.0.0.1:UPSTREAM_PORT
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import uvloop


class _Message:
    """Collects one HTTP message (request or response) from an httptools parser."""

    def __init__(self) -> None:
        self.done = False
        self.body: list[bytes] = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


async def _read(reader: asyncio.StreamReader, parser_class: type) -> tuple[bytes, bytes] | None:
    """One whole message: (its raw bytes, its body); None at EOF. One request at a time per
    connection (the load generator's closed loop), so no bytes of a next message are read."""
    message = _Message()
    parser = parser_class(message)
    raw = bytearray()
    data = b""
    while True:
        if data:
            raw += data
            parser.feed_data(data)
            if message.done:
                return bytes(raw), b"".join(message.body)
        data = await reader.read(1 << 20)
        if not data:
            return None


async def _serve(upstream_host: str, upstream_port: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    up_reader, up_writer = await asyncio.open_connection(upstream_host, upstream_port)
    try:
        while True:
            request = await _read(reader, httptools.HttpRequestParser)
            if request is None:
                return
            up_writer.write(request[0])  # the same bytes: host header and all, as a relay would
            answer = await _read(up_reader, httptools.HttpResponseParser)
            if answer is None:
                return
            writer.write(answer[0])
            await writer.drain()
    finally:
        up_writer.close()
        writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT")
    args = parser.parse_args()
    host, port = args.upstream.rsplit(":", 1)

    async def run() -> None:
        server = await asyncio.start_server(lambda r, w: _serve(host, int(port), r, w), "127.0.0.1", args.port)
        async with server:
            await server.serve_forever()

    uvloop.run(run())


if __name__ == "__main__":
    main()
