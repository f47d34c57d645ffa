"""Write a large synthetic vsim trace, for measuring the loader and the engine at scale.

    python tools/make_big_trace.py OUT.vsim.json.gz [--ops 1000000] [--streams 2]

The trace is a straight network of ops/2 layers: layer i's forward reads activation i and its
weight (one weight per 8 layers) and writes activation i+1; the backward runs in reverse, reads
activations i and i+1, writes a gradient of the weight on every 8th layer and frees activation
i+1. With --streams 2 (the default), the
backward of every 64th layer (--reduce-every, a multiple of 8) hands its gradient to a reduce op
on stream 1 that depends on it (as an all-reduce would), and the next backward depends on that
reduce. With --streams N above 2 those reduce ops are spread over N - 1 streams (one op each when
N - 1 is their count): many streams that cross-communicate only through deps.
Nothing here is measured: it exercises sizes, not figures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from typing import Any, TextIO

ACT_BYTES = 1 << 16
WEIGHT_BYTES = 1 << 14
WEIGHT_EVERY = 8


def write(out: TextIO, n_ops: int, streams: int, reduce_every: int = 64) -> int:
    """Write the document; returns the number of ops."""
    layers = n_ops // 2
    n_weights = (layers + WEIGHT_EVERY - 1) // WEIGHT_EVERY
    # Tensor ids: activations 0..layers, weights, then gradients.
    w0 = layers + 1
    g0 = w0 + n_weights
    ops: list[dict[str, Any]] = []
    tensors: list[dict[str, Any]] = []
    consumers: dict[int, list[int]] = {}
    producer: dict[int, int] = {}
    t = 0.0
    next_id = 0

    def add(name: str, layer: int, phase: str, dur: float, stream: int, reads: list[int],
            writes: list[int], frees: list[int], deps: list[int]) -> int:
        nonlocal t, next_id
        oid = next_id
        next_id += 1
        for r in reads:
            consumers.setdefault(r, []).append(oid)
        for w in writes:
            producer[w] = oid
        ops.append({"name": name, "cat": "op", "ph": "X", "ts": round(t, 3), "dur": dur,
                    "pid": 1, "tid": stream,
                    "args": {"op": oid, "layer": f"layer{layer}", "layer_type": "conv",
                             "phase": phase, "reads": reads, "writes": writes, "frees": frees,
                             "deps": deps, "kernels": [[f"k{oid}", 7, round(t, 3), dur]],
                             "flops": 1e6, "dram_bytes": 2.0 * ACT_BYTES}})
        if stream == 0:
            t += dur
        return oid

    for i in range(layers):
        add(f"layer{i}.forward", i, "fwd", 5.0, 0, [i, w0 + i // WEIGHT_EVERY], [i + 1], [], [])
    reduce_stream = 0
    last_reduce: int | None = None
    for j in range(layers):
        i = layers - 1 - j
        grad = [g0 + i // WEIGHT_EVERY] if i % WEIGHT_EVERY == 0 else []
        deps = [last_reduce] if last_reduce is not None else []
        last_reduce = None
        oid = add(f"layer{i}.backward", i, "bwd", 10.0, 0, [i, i + 1, w0 + i // WEIGHT_EVERY],
                  grad, [i + 1], deps)
        if streams > 1 and grad and i % reduce_every == 0 and next_id < n_ops:
            reduce_stream = reduce_stream % (streams - 1) + 1
            last_reduce = add(f"reduce{i}", i, "bwd", 3.0, reduce_stream, grad, [], [], [oid])
    for k in range(layers):  # activations, then weights, then gradients
        tensors.append({"id": k, "bytes": ACT_BYTES, "kind": "input" if k == 0 else
                        "activation", "name": f"a{k}"})
    tensors.append({"id": layers, "bytes": ACT_BYTES, "kind": "activation", "name": f"a{layers}"})
    for k in range(n_weights):
        tensors.append({"id": w0 + k, "bytes": WEIGHT_BYTES, "kind": "weight", "name": f"w{k}"})
        tensors.append({"id": g0 + k, "bytes": WEIGHT_BYTES, "kind": "gradient",
                        "name": f"g{k}"})
    tensors.sort(key=lambda x: x["id"])
    for tt in tensors:
        tt["producer"] = producer.get(tt["id"])
        tt["consumers"] = consumers.get(tt["id"], [])
    meta = {"source": "synthetic", "model": f"chain of {layers} layers (tools/make_big_trace.py)",
            "batch_size": 1}
    sidecar = {"format": "vsim-trace", "version": 1, "meta": meta, "measured": None,
               "tensors": tensors}
    out.write('{"vsim":')
    out.write(json.dumps(sidecar, separators=(",", ":")))
    out.write(',"traceEvents":[')
    for n, ev in enumerate(ops):
        if n:
            out.write(",")
        out.write(json.dumps(ev, separators=(",", ":")))
    out.write('],"displayTimeUnit":"ms"}')
    return len(ops)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--reduce-every", type=int, default=64)
    args = parser.parse_args()
    opener = gzip.open if args.out.endswith(".gz") else open
    with opener(args.out, "wt") as out:  # type: ignore[operator]
        n = write(out, args.ops, args.streams, args.reduce_every)
    print(f"wrote {n} ops to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
