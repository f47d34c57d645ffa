"""What a module call gated by vsim.runtime.fwdgate costs on the host, against the same call
counted by the native tracker and run with no tracker at all: a module making `--inner`
in-place aten calls on a small tensor, called in a loop, rounds alternating. "gated": the
fwdgate hooks (a forward pre-hook calling counter.cpp's gate_forward, a forward hook calling
ungate_forward) around the call, its calls untracked. ns per module call, medians over the
rounds; the difference gated - plain is what the host model charges per gated module call
(`module_hooks_us`), counted - plain per counted call what gating saves.

    python validation/host/waits/module_hooks_probe.py -o OUT.json [--calls 20000]
        [--rounds 5] [--inner 1,4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from vsim.runtime import native  # noqa: E402
from vsim.runtime.fwdgate import ForwardGate  # noqa: E402
from vsim.runtime.results import provenance  # noqa: E402


class Inner(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x.add_(1.0)
        return x


def timed(nat, mod: Inner, x: torch.Tensor, calls: int, mode: str) -> float:  # type: ignore[no-untyped-def]
    """ns per module call under `mode`: "plain", "counted" or "gated"."""
    gate = None
    if mode == "gated":  # every call gated: calibration's counts are the loop's
        spans = [(i * mod.n, (i + 1) * mod.n) for i in range(calls)]
        gate = ForwardGate(nat, {id(mod): (lambda: mod, spans)})
    if mode != "plain":
        nat.begin()
        if gate is not None:
            gate.begin()
    torch.cuda.synchronize() if x.is_cuda else None
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        mod(x)
    dt = time.perf_counter_ns() - t0
    if mode != "plain":
        through = nat.gated()[1]
        nat.end()
        if gate is not None:
            assert gate.gated == calls, (gate.gated, calls)
            assert through == 0, through
            gate.close()
    return dt / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner", default="1,4")
    args = ap.parse_args()
    nat = native.load()
    if nat is None:
        raise SystemExit(f"the native tracker could not be built: {native.error()}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.zeros(16, device=device)
    rows = {}
    for n in (int(v) for v in args.inner.split(",")):
        mod = Inner(n)
        got: dict[str, list[float]] = {"plain": [], "counted": [], "gated": []}
        for _ in range(args.rounds):
            for mode in got:
                got[mode].append(timed(nat, mod, x, args.calls, mode))
        med = {k: statistics.median(v) for k, v in got.items()}
        rows[str(n)] = {"ns_per_module_call": med, "rounds": got,
                        "gated_minus_plain_ns": med["gated"] - med["plain"],
                        "counted_minus_plain_ns_per_call": (med["counted"] - med["plain"]) / n}
        print(f"{n} inner call(s): plain {med['plain']:.0f} ns, counted {med['counted']:.0f}, "
              f"gated {med['gated']:.0f} (hooks {med['gated'] - med['plain']:.0f} ns; "
              f"counting {(med['counted'] - med['plain']) / n:.0f} ns per call)")
    out = {"device": str(device), "calls": args.calls, "rounds": args.rounds, "inner": rows,
           "provenance": provenance(device, " ".join(sys.argv))}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
