"""Writes traces/handmade-convnet.vsim.json.gz: a hand-made six-layer convolutional network.

Not a recording: sizes and times are round numbers chosen to look like VGG-16 at batch 256 on an
H100 (3 GiB feature maps, milliseconds per layer), so that the simulator and its policies can be
tried before any GPU recording exists. Its meta says source "synthetic" and handmade true.
Run: python traces/make_handmade.py
"""

from __future__ import annotations

from pathlib import Path

from vsim.trace import Op, Tensor, Trace, save_trace

GIB = 2**30
# (layer, type, output GiB, forward ms, backward ms)
LAYERS = [("conv1", "conv", 3.0, 6.0, 14.0), ("conv2", "conv", 3.0, 12.0, 26.0),
          ("conv3", "conv", 1.5, 6.0, 13.0), ("conv4", "conv", 1.5, 9.0, 19.0),
          ("conv5", "conv", 0.75, 4.0, 9.0), ("fc6", "fc", 0.01, 1.0, 2.0)]
INPUT_GIB, WEIGHT_GIB, GAP_US = 0.56, 0.5, 8.0


def build() -> Trace:
    tensors: list[Tensor] = []
    ops: list[Op] = []

    def new_tensor(size_gib: float, kind: str, name: str, producer: int | None) -> int:
        tensors.append(Tensor(len(tensors), int(size_gib * GIB), kind, name, producer))
        return len(tensors) - 1

    weights = new_tensor(WEIGHT_GIB, "weight", "weights", None)
    x = new_tensor(INPUT_GIB, "input", "images", None)
    t = 0.0
    acts = [x]
    for name, kind, out_gib, fwd_ms, _ in LAYERS:
        oid = len(ops)
        y = new_tensor(out_gib, "activation", f"{name}.out", oid)
        ops.append(Op(oid, f"{name}.forward", name, kind, "fwd", t, fwd_ms * 1e3,
                      reads=(acts[-1], weights), writes=(y,), deps=(oid - 1,) if oid else ()))
        t += fwd_ms * 1e3 + GAP_US
        acts.append(y)
    grad_out: int | None = None
    for i in reversed(range(len(LAYERS))):
        name, kind, _, _, bwd_ms = LAYERS[i]
        oid = len(ops)
        grad_in = new_tensor(tensors[acts[i]].size_bytes / GIB, "gradient", f"{name}.dX", oid)
        reads = (acts[i], acts[i + 1], weights) + ((grad_out,) if grad_out is not None else ())
        frees = (acts[i + 1],) + ((grad_out,) if grad_out is not None else ())
        ops.append(Op(oid, f"{name}.backward", name, kind, "bwd", t, bwd_ms * 1e3, reads=reads,
                      writes=(grad_in,), frees=frees, deps=(oid - 1,)))
        t += bwd_ms * 1e3 + GAP_US
        grad_out = grad_in
    consumers: dict[int, list[int]] = {}
    for op in ops:
        for r in op.reads:
            consumers.setdefault(r, []).append(op.id)
    tensors = [Tensor(v.id, v.size_bytes, v.kind, v.name, v.producer,
                      tuple(consumers.get(v.id, ()))) for v in tensors]
    meta = {"source": "synthetic", "handmade": True, "model": "handmade-convnet",
            "batch_size": 256, "device": "none (hand-made)", "hardware": "h100-sxm",
            "description": __doc__.split("\n\n")[1].replace("\n", " ")}
    return Trace(meta=meta, tensors=tuple(tensors), ops=tuple(ops))


if __name__ == "__main__":
    out = Path(__file__).with_name("handmade-convnet.vsim.json.gz")
    save_trace(build(), out)
    print(f"wrote {out}")
