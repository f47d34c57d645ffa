"""The native tracker's host cost by part, on one model's training step (no plan): the step
alone; under the counter alone (counter.cpp's boxed fallback counting every outermost aten
call; "counter-fast": the common operators' calls counted by unboxed kernels, counter.cpp's
Fast); under the saved-tensor hooks alone (the
C++ pack and unpack, called through autograd's Python hook machinery; now on only around the
calls with a save a plan acts on); under the boxed counter and the hooks; under the counter
with backward gated and no node acting ("counter-gated": backward's nodes untracked, counter.cpp's
Gate; what a plan acting nowhere in backward would pay); and the runtime's own
instrumented runs (Session.run("none", instrument=True): calibration, then native iterations),
with the tracker before and now. Iterations alternate between the variants (the host's speed
drifts); each variant's host issue time (until the step returns, before the final synchronize)
and iteration time are the medians of its iterations.

    python validation/host/waits/tracker_parts.py MODEL BATCH TRACE [--iters 30] -o OUT.json
        [--variants plain,counter,counter-gated] [--no-session]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from vsim.runtime import native  # noqa: E402
from vsim.runtime.measure import Session  # noqa: E402
from vsim.runtime.results import provenance  # noqa: E402
from vsim.trace import load_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batch", type=int)
    ap.add_argument("trace")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--variants", default=None, help="which of the step's variants (all)")
    ap.add_argument("--no-session", action="store_true", help="leave out the runtime's runs")
    args = ap.parse_args()
    s = Session(args.model, args.batch, load_trace(args.trace), device=args.device)
    m = native.actions()
    if m is None:
        raise SystemExit(f"no native module: {native.error()}")

    def counted() -> None:
        m.begin()
        try:
            s.step()
        finally:
            m.end()

    def counted_fast() -> None:  # the common operators counted by unboxed kernels
        m.set_fast(True)
        m.begin()
        try:
            s.step()
        finally:
            m.end()
            m.set_fast(False)

    def hooked(counter: bool) -> Callable[[], None]:
        def run() -> None:
            m.arm_packs({}, None, None, None, False)
            if counter:
                m.begin()
            try:
                with torch.autograd.graph.saved_tensors_hooks(m.pack, m.unpack):
                    s.step()
            finally:
                if counter:
                    m.end()
                m.disarm_packs()
        return run

    # calibrated once: backward's nodes and the count after backward (counter.cpp's Gate)
    m.calibrate(True)
    m.begin()
    try:
        s.step()
    finally:
        m.end()
        m.calibrate(False)
    spans, _, after_backward, _ = m.nodes()

    through: list[int] = []  # calls through the tracker's key per gated step

    def counted_gated() -> None:  # backward's nodes untracked: no node acts
        m.arm(b"", {}, None)
        m.arm_gate([-1] * len(spans), after_backward)
        m.begin()
        try:
            s.step()
        finally:
            m.end()
            m.disarm()
        through.append(m.gated()[1])

    # the hooks on every save, as before (now on only around the calls with a save a plan acts
    # on: none here); section 3 of the README ran a RecordFunction observer beside the counter
    variants = {"plain": s.step, "counter": counted, "counter-fast": counted_fast,
                "hooks": hooked(False), "counter+hooks": hooked(True),
                "counter-gated": counted_gated}
    if args.variants:
        variants = {k: variants[k] for k in args.variants.split(",")}
    issued: dict[str, list[float]] = {k: [] for k in variants}
    total: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(3 + args.iters):
        for name, f in variants.items():
            s._sync()
            t0 = time.perf_counter()
            f()
            t1 = time.perf_counter()
            s._sync()
            t2 = time.perf_counter()
            if i >= 3:
                issued[name].append((t1 - t0) * 1e6)
                total[name].append((t2 - t0) * 1e6)
    calls = m.count()
    out: dict = {"model": args.model, "batch": args.batch, "counted_calls": calls,
                 "iters": args.iters, "variants": {}, "nodes": len(spans),
                 "gated_calls_through": through[-1] if through else None}
    for name in variants:
        out["variants"][name] = {"host_issue_us": round(statistics.median(issued[name]), 1),
                                 "iteration_us": round(statistics.median(total[name]), 1)}
    # the runtime's own runs: without the tracker; instrumented as before (the hooks
    # throughout); instrumented now (the hooks where armed)
    for label, inst, env in () if args.no_session else (("session", False, {}),
                             ("session-instrumented-before", True, {"VSIM_NATIVE_HOOKS": "always"}),
                             ("session-instrumented", True, {"VSIM_NATIVE_HOOKS": "armed"}),
                             ("session-instrumented-fast", True,
                              {"VSIM_NATIVE_HOOKS": "armed", "VSIM_NATIVE_COUNTER": "fast"})):
        os.environ.update(env)
        r = s.run("none", iters=args.iters, instrument=inst)
        out["variants"][label] = {
            "host_issue_us": r["host_issue_us"], "iteration_us": r["iteration_time_us"],
            "executed": r.get("executed")}
    out["provenance"] = provenance(s.device, " ".join(sys.argv))
    Path(args.out).write_text(json.dumps(out, indent=1))
    for name, v in out["variants"].items():
        print(f"  {args.model} {name:22s} issue {v['host_issue_us'] / 1e3:7.2f} ms  "
              f"iteration {v['iteration_us'] / 1e3:7.2f} ms")
    print(f"  counted calls {calls}; gated, through the key: {out['gated_calls_through']}")


if __name__ == "__main__":
    main()
