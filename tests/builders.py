"""Small traces built in code for tests: every number is chosen so the answer can be worked out
by hand in the test's comment."""

from __future__ import annotations

from typing import Any

from vsim.trace.schema import Op, Tensor, Trace


def op(id: int, start: float, dur: float, layer: str = "", layer_type: str = "other",
       phase: str = "fwd", **kw: Any) -> Op:
    return Op(id=id, name=kw.pop("name", f"op{id}"), layer=layer or f"l{id}",
              layer_type=layer_type, phase=phase, start_us=start, dur_us=dur, **kw)


def tensor(id: int, size: int, kind: str = "activation", producer: int | None = None,
           consumers: tuple[int, ...] = ()) -> Tensor:
    return Tensor(id=id, size_bytes=size, kind=kind, name=f"t{id}", producer=producer,
                  consumers=consumers)


def trace(ops: list[Op], tensors: list[Tensor], **meta: Any) -> Trace:
    return Trace(meta={"source": "synthetic", "model": "test", **meta}, tensors=tuple(tensors),
                 ops=tuple(ops))


def chain(n_layers: int, act_bytes: int, fwd_us: float, bwd_us: float,
          weight_bytes: int = 0, layer_type: str = "conv") -> Trace:
    """A straight network: layer i's forward reads activation i and writes i+1 (saved for its
    backward); backward runs in reverse and frees the activation it read. Input is tensor 0."""
    tensors = [tensor(0, act_bytes, "input")]
    ops: list[Op] = []
    t = 0.0
    for i in range(n_layers):
        tensors.append(tensor(i + 1, act_bytes, "activation", producer=i))
        ops.append(op(i, t, fwd_us, layer=f"layer{i}", layer_type=layer_type,
                      reads=(i,), writes=(i + 1,)))
        t += fwd_us
    for j in range(n_layers):
        i = n_layers - 1 - j
        oid = n_layers + j
        ops.append(op(oid, t, bwd_us, layer=f"layer{i}", layer_type=layer_type, phase="bwd",
                      reads=(i, i + 1), frees=(i + 1,)))
        t += bwd_us
    consumers: dict[int, list[int]] = {}
    for o in ops:
        for r in o.reads:
            consumers.setdefault(r, []).append(o.id)
    tensors = [Tensor(x.id, x.size_bytes, x.kind, x.name, x.producer,
                      tuple(consumers.get(x.id, []))) for x in tensors]
    if weight_bytes:
        tensors.append(tensor(len(tensors), weight_bytes, "weight"))
    return trace(ops, tensors)


def assert_chrome_trace_events(events: list[dict[str, Any]]) -> None:
    """What ui.perfetto.dev and chrome://tracing need of trace events: name/ph/pid on each, a
    number for ts where there is one, X events with dur >= 0, and slices of one (pid, tid)
    that never overlap."""
    spans: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for ev in events:
        assert {"name", "ph", "pid"} <= set(ev)
        if ev["ph"] in ("X", "i", "C"):
            assert isinstance(ev["ts"], (int, float))
        if ev["ph"] == "X":
            assert ev["dur"] >= 0
            spans.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for slices in spans.values():
        slices.sort()
        for (_, e0), (s1, _) in zip(slices, slices[1:], strict=False):
            assert s1 >= e0
