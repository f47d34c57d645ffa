"""A small network trace with PyTorch's semantics, for the policy tests: what autograd saves,
in-place ReLU, gradient maps, weight gradients read by an optimizer step. Every size and time is
given by the caller so that tests can work the answers out by hand.

Per layer type (X: the layer's input feature map, Y: its output, g: the incoming gradient):
- conv, fc: forward reads X and its weight, writes Y (conv: plus a workspace freed at its end);
  backward reads g, X and the weight, writes the gradient of X (not for the network input) and of
  the weight. Autograd saves X.
- relu: aten::relu_ modifies X in place (Y is X); backward reads g and Y (the result is saved).
- pool: forward reads X, writes Y and the argmax indices; backward reads g, X and the indices.
- loss: forward reads X, writes the softmax (saved) and the loss; backward reads the softmax.
- add (output bytes: k, how many layers back the skip starts): a residual connection, Y = X + S
  where S is the input of the layer k places before (a layer that makes a new tensor, not a
  relu); saves nothing; backward reads g and writes a gradient for X and one for S, which is
  summed (an `accumulate` op) with the gradient of S that the layers between produce.
Each tensor is freed by its last reader; weights, weight gradients and the input live on. Op ids:
forward 0..n-1 in layer order, then backward in reverse layer order (with the accumulations of
residual gradients: 2n-1 is the last without adds), then the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vsim.trace.schema import Op, Tensor, Trace


@dataclass
class Net:
    # tensor id -> (size, kind, producer op)
    tensors: dict[int, tuple[int, str, int | None]] = field(default_factory=dict)

    def tensor(self, size: int, kind: str, producer: int | None) -> int:
        tid = len(self.tensors)
        self.tensors[tid] = (size, kind, producer)
        return tid


def torch_net(layers: list[tuple[str, int]], input_bytes: int, *, fwd_us: dict[str, float],
              weight_bytes: int = 0, workspace_bytes: int = 0, opt_us: float = 0.0) -> Trace:
    """layers: (type, output bytes) in forward order (relu: output bytes ignored, in place)."""
    net = Net()
    x = net.tensor(input_bytes, "input", None)
    cur, cur_size = x, input_bytes
    fwd: list[dict] = []
    saved: list[dict] = []  # per layer, what its backward needs
    weights: list[int] = []
    inputs: list[tuple[int, int]] = []  # per layer, its input (tensor, bytes)
    clock = 0.0
    for i, (ty, out) in enumerate(layers):
        oid = len(fwd)
        dur = fwd_us[ty]
        inputs.append((cur, cur_size))
        reads: tuple[int, ...] = (cur,)
        writes: tuple[int, ...] = ()
        info: dict = {"type": ty, "x": cur, "x_size": cur_size}
        name = f"aten::{ty}"
        if ty == "add":
            if not 1 <= out <= i or layers[i - out][0] not in ("conv", "fc", "pool", "add"):
                raise ValueError(f"add at layer {i}: no skip {out} layers back")
            skip, skip_size = inputs[i - out]
            y = net.tensor(cur_size, "activation", oid)
            reads, writes = (cur, skip), (y,)
            info.update(saves=(), skip=skip, skip_size=skip_size, skip_layer=i - out)
            cur = y
        elif ty in ("conv", "fc"):
            w = net.tensor(weight_bytes, "weight", None)
            weights.append(w)
            y = net.tensor(out, "activation", oid)
            reads, writes = (cur, w), (y,)
            if ty == "conv" and workspace_bytes:
                writes = (y, net.tensor(workspace_bytes, "workspace", oid))
            info.update(w=w, saves=(cur, w))
            cur, cur_size = y, out
        elif ty == "relu":
            name = "aten::relu_"
            info.update(saves=(cur,))
        elif ty == "pool":
            y = net.tensor(out, "activation", oid)
            idx = net.tensor(out, "activation", oid)
            writes = (y, idx)
            info.update(saves=(cur, idx))
            cur, cur_size = y, out
        elif ty == "loss":
            s = net.tensor(cur_size, "activation", oid)
            loss = net.tensor(4, "activation", oid)
            writes = (s, loss)
            info.update(saves=(s,))
        else:
            raise ValueError(ty)
        fwd.append(dict(id=oid, name=name, layer=f"{ty}{i}", layer_type=ty, phase="fwd",
                        start_us=clock, dur_us=dur, reads=reads, writes=writes))
        clock += dur
        saved.append(info)
    n = len(layers)
    bwd: list[dict] = []
    grad = None
    wgrads: list[int] = []
    skip_grads: dict[int, list[int]] = {}  # layer -> gradients of its input from residuals
    for j in range(n):
        i = n - 1 - j
        oid = n + len(bwd)
        info = saved[i]
        ty = info["type"]
        reads = tuple(info["saves"]) + ((grad,) if grad is not None else ())
        writes = []
        gx = None
        if not (ty in ("conv", "fc") and info["x"] == x):
            gx = net.tensor(info["x_size"], "gradient", oid)
            writes.append(gx)
        if ty in ("conv", "fc"):
            wgrads.append(net.tensor(weight_bytes, "gradient", oid))
            writes.append(wgrads[-1])
        if ty == "add" and info["skip"] != x:
            gs = net.tensor(info["skip_size"], "gradient", oid)
            writes.append(gs)
            skip_grads.setdefault(info["skip_layer"], []).append(gs)
        bwd.append(dict(id=oid, name=f"{ty}_backward", layer=f"{ty}{i}", layer_type=ty,
                        phase="bwd", start_us=clock, dur_us=2 * fwd_us[ty], reads=reads,
                        writes=tuple(writes)))
        clock += 2 * fwd_us[ty]
        grad = gx
        if gx is not None and i in skip_grads:  # the residuals' gradients of this input
            oid = n + len(bwd)
            total = net.tensor(info["x_size"], "gradient", oid)
            bwd.append(dict(id=oid, name="accumulate", layer=f"{ty}{i}", layer_type="add",
                            phase="bwd", start_us=clock, dur_us=fwd_us["add"],
                            reads=(gx, *skip_grads.pop(i)), writes=(total,)))
            clock += fwd_us["add"]
            grad = total
    ops = fwd + bwd
    if opt_us:
        ops.append(dict(id=len(ops), name="sgd_step", layer="optimizer", layer_type="optimizer",
                        phase="opt", start_us=clock, dur_us=opt_us,
                        reads=tuple(weights) + tuple(wgrads), writes=()))
    # Free each activation / gradient map after its last reader (never the weight gradients).
    last: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for o in ops:
        for t in o["reads"]:
            last[t] = o["id"]
            readers.setdefault(t, []).append(o["id"])
    frees: dict[int, list[int]] = {}
    for t, o in last.items():
        size, kind, _ = net.tensors[t]
        if kind in ("activation",) or (kind == "gradient" and t not in wgrads):
            frees.setdefault(o, []).append(t)
    for o in ops:  # workspaces: freed by the op that made them
        for t in o["writes"]:
            if net.tensors[t][1] == "workspace":
                frees.setdefault(o["id"], []).append(t)
    op_objs = tuple(Op(frees=tuple(sorted(frees.get(o["id"], ()))), **o) for o in ops)
    tensors = tuple(Tensor(t, size, kind, f"t{t}", p, tuple(readers.get(t, ())))
                    for t, (size, kind, p) in net.tensors.items())
    return Trace(meta={"source": "synthetic", "model": "torch_net"}, tensors=tensors, ops=op_objs)
