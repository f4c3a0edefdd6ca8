"""Run the emulated link between a device and a cloud, until interrupted.

    python benchmarks/link.py --target 127.0.0.1:8765 --listen 8766 \\
        --delay-ms 25 --jitter-ms 5 --up-kbit 10000 --down-kbit 50000

Point the device at the listening port. Delay and jitter are one-way and apply to both
directions; bandwidth is per direction (kbit/s; omit for unlimited)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from collab.link_emulator import LinkEmulator, LinkProfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HOST:PORT of the cloud")
    parser.add_argument("--listen", type=int, default=0, help="port to listen on (0 = any)")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--up-kbit", type=float, help="device → cloud bandwidth")
    parser.add_argument("--down-kbit", type=float, help="cloud → device bandwidth")
    args = parser.parse_args()
    host, port = args.target.rsplit(":", 1)

    def profile(kbit: float | None) -> LinkProfile:
        rate = kbit * 1000 / 8 if kbit else None
        return LinkProfile(args.delay_ms / 1000, args.jitter_ms / 1000, rate)

    async def run() -> None:
        link = LinkEmulator(
            host, int(port), profile(args.up_kbit), profile(args.down_kbit), listen_port=args.listen
        )
        await link.start()
        print(f"link 127.0.0.1:{link.port} -> {args.target} (Ctrl-C to stop)", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await link.close()
            print(f"up {link.stats.bytes_up:,} B, down {link.stats.bytes_down:,} B")

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
