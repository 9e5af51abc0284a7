"""Benchmark: what the driver sends its workers a round, large contents per batch vs once.

One point of :mod:`experiments.bench.secure_scale` (``--mode``, C = ``--cohort``,
d = ``--dim``, 10^6 registered clients, AES-CTR masks, ``--warmup`` + ``--rounds``
rounds) runs twice, each in a fresh process, alternating ``--repeats`` times:

* ``per_batch``: every batch carries its contents, as before
  :mod:`fedsim.engine.channel_contents` (its threshold set beyond any content);
* ``once``: a content of 64 KiB or more crosses each driver-worker connection once.

Under a timeout (Flower's strategies pass one) every client is a batch of its own, so in
``per_batch`` the phase's model crossed the channel once per client. Each run records the
bytes of every frame the driver sends on its channels and the driver's CPU seconds spent
pickling and sending them (``thread_time``), per round over all rounds (warm-up included,
since the frames are counted from the first), and the point's summary from
:func:`experiments.bench.secure_report.summarise` (``round_s``, ``server_cpu_s``, ...).
Prints one JSON object with the medians per way and ``down_ratio = per_batch / once``.

    .venv/bin/python experiments/bench/channel_contents.py \\
        --out experiments/bench/channel_contents.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WAYS = ("per_batch", "once")


def measure(way: str, args: dict[str, Any]) -> dict[str, Any]:
    """One run of the point in this process: the driver's channel bytes and CPU a round."""
    import fedsim.engine.backend as backend  # noqa: PLC0415
    import fedsim.engine.channel as channel  # noqa: PLC0415
    from experiments.bench import secure_scale  # noqa: PLC0415

    if way == "per_batch":
        backend.SHARED_CONTENT_BYTES = 1 << 62  # no content is large enough to share
    counted = {"frames": 0, "bytes": 0, "cpu_s": 0.0}
    send = channel.DriverChannel.send

    def counting(self, batch, what="a batch", contents=()):
        start = time.thread_time()
        original = self.conn.send

        def frame(payload, prefix=b""):
            counted["frames"] += 1
            counted["bytes"] += len(prefix) + len(payload)
            return original(payload, prefix)

        self.conn.send = frame
        try:
            return send(self, batch, what, contents)
        finally:
            del self.conn.send
            counted["cpu_s"] += time.thread_time() - start

    channel.DriverChannel.send = counting
    point = secure_scale.Point(
        mode=args["mode"], cohort=args["cohort"], dim=args["dim"], population=10**6,
        rounds=args["rounds"], warmup=args["warmup"], workers=2, dropout=0.02, seed=0,
        secagg_degree=16, ring_bits=32, noise_multiplier=1.0, prg="aes-ctr",
    )  # fmt: skip
    summary = secure_scale.summarise([secure_scale.run_point(point)])
    rounds = args["rounds"] + args["warmup"]
    return {
        "way": way,
        "down_mb_per_round": counted["bytes"] / rounds / 1e6,
        "frames_per_round": counted["frames"] / rounds,
        "send_cpu_s_per_round": counted["cpu_s"] / rounds,
        "round_s": summary["round_s"],
        "server_cpu_s": summary["server_cpu_s"],
        "client_s": summary["client_s"],
    }


def _in_subprocess(way: str, args: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps({"way": way, **args})],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"{way} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("fedavg", "ddgauss", "dmm"), default="ddgauss")
    parser.add_argument("--cohort", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(measure(spec.pop("way"), spec)))
        return {}
    for name in ("cohort", "dim", "rounds", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} = {getattr(args, name)}; it must be >= 1")
    setting = {k: getattr(args, k) for k in ("mode", "cohort", "dim", "rounds", "warmup")}
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            runs[way].append(_in_subprocess(way, setting))
    medians = {
        way: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "way"}
        for way, rs in runs.items()
    }
    result = {
        "benchmark": "the driver's channel bytes a round: large contents per batch vs once",
        "machine": f"{os.cpu_count()}-CPU {platform.machine()} {platform.system()}",
        "python": platform.python_version(),
        **setting,
        "repeats": args.repeats,
        "runs": runs,
        "median": medians,
        "down_ratio": medians["per_batch"]["down_mb_per_round"]
        / medians["once"]["down_mb_per_round"],
        "send_cpu_ratio": medians["per_batch"]["send_cpu_s_per_round"]
        / medians["once"]["send_cpu_s_per_round"],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
