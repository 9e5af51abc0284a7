"""Benchmark: the authenticated worker channel against the same transport without MACs.

A driver sends ``--frames`` batches of ``--size`` bytes (pickled numpy arrays, as a batch of
model-sized contents) to a worker that answers each with a small acknowledgement, over
localhost TCP, in both of two ways within one run:

* fedsim: :class:`~fedsim.engine.channel.DriverChannel` / ``WorkerChannel`` (mutual HMAC-SHA256
  handshake, every frame MACed over its sequence number, length and payload);
* plain: the same framing (length-prefixed pickles, one thread serving) with no handshake and
  no MAC, the lower bound of any transport that sends pickles over a socket.

Prints one JSON object: megabytes per second each way, round trips per second for small
frames, and ``mac_overhead = fedsim_s / plain_s`` (1.0 means the MAC costs nothing).
"""

from __future__ import annotations

import argparse
import json
import pickle
import socket
import statistics
import threading
import time

import numpy as np

from fedsim.engine.channel import DriverChannel, WorkerChannel, wait_any
from fedsim.engine.channel_frames import new_key


class Ack:
    """Stands in for a ClientWorker: acknowledges each batch with its byte count."""

    def run_batch(self, batch: np.ndarray) -> int:
        return int(batch.nbytes)


def fedsim_seconds(payload: np.ndarray, frames: int) -> float:
    key = new_key()
    server = WorkerChannel(Ack(), "127.0.0.1", key)
    channel = DriverChannel(0, server.address, key)
    start = time.perf_counter()
    for _ in range(frames):
        future = channel.send(payload)
        while not future.done:
            wait_any([channel], None)
        assert future.value() == payload.nbytes
    seconds = time.perf_counter() - start
    channel.close()
    server.close()
    return seconds


def _read_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise EOFError("closed")
        got += n
    return buffer


def _plain_send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(len(data).to_bytes(8, "big"))
    sock.sendall(data)


def _plain_recv(sock: socket.socket) -> bytearray:
    return _read_exact(sock, int.from_bytes(_read_exact(sock, 8), "big"))


def plain_seconds(payload: np.ndarray, frames: int) -> float:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(frames):
            batch = pickle.loads(_plain_recv(sock))
            _plain_send(sock, pickle.dumps(int(batch.nbytes)))
        sock.close()

    threading.Thread(target=serve, daemon=True).start()
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    start = time.perf_counter()
    for _ in range(frames):
        _plain_send(sock, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        assert pickle.loads(_plain_recv(sock)) == payload.nbytes
    seconds = time.perf_counter() - start
    sock.close()
    listener.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4 * 2**20, help="bytes per large frame")
    parser.add_argument("--frames", type=int, default=100, help="large frames per repetition")
    parser.add_argument("--small-frames", type=int, default=2000, help="64-byte round trips")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    large = np.random.default_rng(0).standard_normal(args.size // 8)
    small = np.zeros(8)
    fedsim_large, plain_large, fedsim_small, plain_small = [], [], [], []
    for _ in range(args.reps):  # interleaved, so a slow spell of the machine hits both
        fedsim_large.append(fedsim_seconds(large, args.frames))
        plain_large.append(plain_seconds(large, args.frames))
        fedsim_small.append(fedsim_seconds(small, args.small_frames))
        plain_small.append(plain_seconds(small, args.small_frames))
    megabytes = args.size * args.frames / 1e6
    f_large, p_large = statistics.median(fedsim_large), statistics.median(plain_large)
    f_small, p_small = statistics.median(fedsim_small), statistics.median(plain_small)
    print(
        json.dumps(
            {
                "frame_bytes": args.size,
                "frames": args.frames,
                "repetitions": args.reps,
                "fedsim_mb_per_s": megabytes / f_large,
                "plain_mb_per_s": megabytes / p_large,
                "mac_overhead": f_large / p_large,
                "fedsim_round_trips_per_s": args.small_frames / f_small,
                "plain_round_trips_per_s": args.small_frames / p_small,
                "small_frame_overhead": f_small / p_small,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
