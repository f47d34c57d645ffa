"""What one call costs on the host as it passes the native tracker's key (counter.cpp), apart
from any training step: a loop of one aten call, timed plain, under the boxed counter and under
the fast (unboxed) one, rounds alternating; on the device's tensors and on CPU tensors. And what
the places a gated counter would resynchronise at cost: a module's forward pre-hook and an
autograd node's pre-hook, per call.

Section 6b found 1.5-10 us per counted call from whole steps (host issue time over the step
alone); this asks whether a call through the key costs that in isolation, or whether the steps'
figure holds something else.

    python validation/host/waits/key_probe.py [-o OUT.json] [--calls 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from vsim.runtime import native  # noqa: E402
from vsim.runtime.results import provenance  # noqa: E402


def _no_hook(*_args: object) -> None:
    return None


def timed(fn, calls: int, sync) -> float:
    """ns per call of `calls` calls of fn."""
    sync()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter_ns() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--out", default=None)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    m = native.load()
    if m is None:
        raise SystemExit(f"native tracker: {native.error()}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    result: dict = {"ns_per_call": {}, "hooks_ns_per_call": {}}
    for dev in devices:
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        x = torch.zeros(256, device=dev)
        ops = {"add_": partial(x.add_, 1.0),  # a kernel, an operator Fast counts
               "view": partial(x.view, -1),   # no kernel, Fast counts it
               "abs_": x.abs_}                # a kernel, boxed under both counters
        for name, fn in ops.items():
            got: dict[str, list[float]] = {"plain": [], "boxed": [], "fast": []}
            timed(fn, args.calls // 4, sync)  # warm up
            for r in range(args.rounds):
                order = list(got) if r % 2 == 0 else list(got)[::-1]
                for variant in order:
                    if variant == "plain":
                        got[variant].append(timed(fn, args.calls, sync))
                        continue
                    m.set_fast(variant == "fast")
                    m.begin()
                    try:
                        got[variant].append(timed(fn, args.calls, sync))
                    finally:
                        m.end()
                        m.set_fast(False)
            med = {k: statistics.median(v) for k, v in got.items()}
            result["ns_per_call"][f"{dev}:{name}"] = {"median": med, "runs": got}
            print(dev, name, {k: round(v) for k, v in med.items()},
                  "added: boxed", round(med["boxed"] - med["plain"]),
                  "fast", round(med["fast"] - med["plain"]), flush=True)
        # resynchronising places: a module's forward pre-hook, an autograd node's pre-hook
        mod = torch.nn.Identity()
        y = torch.zeros(256, device=dev, requires_grad=True)
        hk: dict[str, list[float]] = {"module": [], "module_hooked": [], "node_register": []}
        node = (y * 2).grad_fn
        for _ in range(args.rounds):
            hk["module"].append(timed(partial(mod, y), args.calls, sync))
            h = mod.register_forward_pre_hook(_no_hook)
            hk["module_hooked"].append(timed(partial(mod, y), args.calls, sync))
            h.remove()
            hk["node_register"].append(
                timed(partial(node.register_prehook, _no_hook), args.calls // 10, sync))
        med = {k: statistics.median(v) for k, v in hk.items()}
        result["hooks_ns_per_call"][dev] = {"median": med, "runs": hk}
        print(dev, "hooks", {k: round(v) for k, v in med.items()}, flush=True)
    result["provenance"] = provenance(torch.device(devices[-1]), " ".join(sys.argv))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
