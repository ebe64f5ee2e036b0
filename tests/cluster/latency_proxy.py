"""A TCP proxy that adds latency, for the cluster lane: this kernel has no netem and there is no iptables,
so a slow link is a process in the middle. Each byte read from one side is written to the other side
``delay`` seconds later, in order (a one-way delay, both directions; bandwidth is not limited).

    python -m tests.cluster.latency_proxy --route 0.0.0.0:23500=10.77.0.2:23500 --route ... \\
        --delay-ms 50 [--delay-file FILE] [--ready FILE] [--stats FILE]

``--delay-file``: when the file exists its content (milliseconds) replaces ``--delay-ms``; it is read again
every 0.2 s, so a test can switch the same links between 0 and 50 ms while the job runs (A/B on one job).
``--ready``: written (with the pid) once every route listens. ``--stats``: connections accepted and bytes
carried each way, rewritten every second (a test checks that the traffic really went through). Stops on
SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

CHUNK = 1 << 16
STATS = {"connections": 0, "bytes_to_server": 0, "bytes_to_client": 0}


class Delay:
    """The current one-way delay in seconds: --delay-ms, or the delay file's number when it exists."""

    def __init__(self, default_ms: float, path: str | None):
        self.default_s, self.path, self.value = default_ms / 1000, Path(path) if path else None, default_ms / 1000

    async def follow(self) -> None:
        while True:
            try:
                self.value = float(self.path.read_text()) / 1000 if self.path and self.path.exists() else self.default_s
            except (OSError, ValueError):
                pass  # half-written: keep the last value
            await asyncio.sleep(0.2)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay, counter: str) -> None:
    """Copy reader -> writer, each chunk held until ``delay`` after it was read (order kept)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        try:
            while data := await reader.read(CHUNK):
                queue.put_nowait((loop.time() + delay.value, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((loop.time() + delay.value, b""))

    reading = asyncio.ensure_future(read())
    try:
        while True:
            due, data = await queue.get()
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if not data:
                break
            writer.write(data)
            STATS[counter] += len(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        reading.cancel()
        writer.close()


async def serve(listen: tuple[str, int], upstream: tuple[str, int], delay: Delay) -> asyncio.AbstractServer:
    async def on_client(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection(*upstream)
        except OSError:
            c_writer.close()
            return
        STATS["connections"] += 1
        await asyncio.gather(
            pump(c_reader, u_writer, delay, "bytes_to_server"), pump(u_reader, c_writer, delay, "bytes_to_client")
        )

    return await asyncio.start_server(on_client, *listen, reuse_address=True)


def parse_route(text: str) -> tuple[tuple[str, int], tuple[str, int]]:
    listen, _, to = text.partition("=")
    (lh, _, lp), (th, _, tp) = listen.rpartition(":"), to.rpartition(":")
    return (lh, int(lp)), (th, int(tp))


async def main_async(args) -> None:
    delay = Delay(args.delay_ms, args.delay_file)
    follow = asyncio.ensure_future(delay.follow())
    servers = [await serve(*parse_route(r), delay) for r in args.route]
    if args.ready:
        tmp = Path(args.ready).with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "ports": [s.sockets[0].getsockname()[1] for s in servers]}))
        tmp.replace(args.ready)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    while not stop.is_set():
        if args.stats:  # whole or not at all: a reader never sees a half-written file
            tmp = Path(args.stats).with_suffix(".tmp")
            tmp.write_text(json.dumps(STATS))
            tmp.replace(args.stats)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
    follow.cancel()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.cluster.latency_proxy", description=__doc__.split("\n")[0])
    p.add_argument("--route", action="append", required=True, metavar="LHOST:LPORT=HOST:PORT")
    p.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay, each direction")
    p.add_argument("--delay-file", help="a file whose number (ms) replaces --delay-ms while it exists")
    p.add_argument("--ready", help="write this file (pid, ports) once listening")
    p.add_argument("--stats", help="rewrite this file every second: connections and bytes each way")
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
