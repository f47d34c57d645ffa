"""The vDNN paper's Titan X figures (validation/paper/*.yaml, `kind: paper`) against the simulator.

Traces: validation/paper/traces/NET.vsim.json.gz, synthesized from shapes by make_traces.sh (the
networks as the paper's figures identify them, vsim/record/paper_nets.py). Their op times are
re-modelled here on the paper's GPU (titan-x-maxwell) with its efficiency file, which is fitted
to convnet-benchmarks' Titan X timings, not to the paper (held out: Fig. 6 is checked against it).

vDNN's baseline semantics, as an analysis of a trace (`vdnn_baseline`): network-wide allocation
of every layer's output feature map plus the input (ReLU in place: no map of its own; max pooling
keeps no indices, cuDNN's backward reads X and Y), weights (no weight gradients or momentum:
Fig. 4's breakdown has none and its categories sum to its totals), the minimal dY/dX buffers
reused across layers (two buffers of the largest map; three when the network forks, where a
gradient sum needs a buffer of its own: GoogLeNet), and one workspace buffer, the largest any
convolution needs. cuDNN 4's workspaces are not knowable from shapes; the traces carry cuDNN 9's
layout workspaces (the rule measured on the H100, vsim/record/synth.py), so the total is given
fully predicted and, as a diagnostic, with Fig. 4's workspace in place of the modelled one.

Policies (`vdnn_semantics` transform of the trace, then simulated on the titan-x-maxwell profile
with the cnmem allocator at the card's capacity): momentum and weight gradients take no memory,
pooling keeps no indices, and ReLU's backward writes its dX into its dY. Tensors are otherwise
freed after their last use, as vDNN's own release rules do for its policies; the network-wide
baseline is the analysis above.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..hardware import Hardware, load_hardware, parse_percent
from ..trace.schema import Trace

MIB = 2**20
FIG6_ROWS_FC = 3
POLICIES = (("base(p)", "none"), ("base(m)", "none:algo=memory"),
            ("all(m)", "vdnn:mode=all,algo=memory"), ("all(p)", "vdnn:mode=all,algo=performance"),
            ("conv(m)", "vdnn:mode=conv,algo=memory"),
            ("conv(p)", "vdnn:mode=conv,algo=performance"), ("dyn", "vdnn:mode=dyn"))
POLICY_NETWORKS = ("alexnet-b128", "overfeat-b128", "googlenet-b128", "vgg16-b64", "vgg16-b128",
                   "vgg16-b256")
DEEP_NETWORKS = ("vgg116-b32", "vgg216-b32", "vgg316-b32", "vgg416-b32")
CLASSIFIER_TYPES = ("fc", "loss", "optimizer", "softmax", "dropout")


def is_paper_file(path: Path) -> bool:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # not a readable YAML file: not a paper file (its own loader says why)
    return isinstance(doc, dict) and doc.get("kind") == "paper"


def load_paper(path: str | Path) -> dict[str, Any]:
    """The paper's figures; ConfigError naming the file and key when one is missing."""
    where = str(path)
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read ({exc})", where) from None
    if not isinstance(doc, dict) or doc.get("kind") != "paper":
        raise ConfigError("expected a mapping with kind: paper", where)
    for key in ("hardware", "fig1_baseline_mib", "fig4_breakdown_mib", "fig5_fig6_vgg16_layers",
                "tolerance"):
        if key not in doc:
            raise ConfigError(f"missing required field {key!r}", where)
    return doc


def _trace(folder: Path, net: str, hw: Hardware) -> Trace:
    from ..compute import with_model_times
    from ..trace import load_trace

    path = folder / "traces" / f"{net}.vsim.json.gz"
    if not path.is_file():
        raise ConfigError(f"no trace for {net} (run validation/paper/make_traces.sh)", str(path))
    return with_model_times(load_trace(path), hw)


# ---------------------------------------------------------------- the baseline (Fig. 1 and 4)

@dataclasses.dataclass(frozen=True)
class FwdLayer:
    """A forward layer's output (Y), inputs (X), weights and workspace, in bytes."""

    name: str
    layer_type: str
    y: int
    x: int
    w: int
    ws: int


def forward_layers(trace: Trace) -> list[FwdLayer]:
    """Forward ops that produce a feature map (not ReLU in place, not the loss); a max pooling's
    indices (its larger output, int64) are left out."""
    tensors = trace.tensor_by_id()
    out = []
    for op in trace.ops:
        if op.phase != "fwd" or op.layer_type in ("loss", "relu"):
            continue
        ys = [tensors[t].size_bytes for t in op.writes
              if tensors[t].kind in ("activation", "temporary")]
        if not ys:
            continue
        y = min(ys) if op.layer_type == "pool" else sum(ys)
        x = sum(tensors[t].size_bytes for t in op.reads
                if tensors[t].kind in ("activation", "input"))
        w = sum(tensors[t].size_bytes for t in op.reads if tensors[t].kind == "weight")
        ws = sum(tensors[t].size_bytes for t in op.writes if tensors[t].kind == "workspace")
        out.append(FwdLayer(op.layer, op.layer_type, y, x, w, ws))
    return out


def forks(trace: Trace) -> bool:
    """Whether a feature map feeds more than one forward layer (ReLU in place not counted)."""
    readers: dict[int, set[str]] = defaultdict(set)
    kinds = {t.id: t.kind for t in trace.tensors}
    for op in trace.ops:
        if op.phase == "fwd" and op.layer_type not in ("relu", "loss"):
            for t in op.reads:
                if kinds[t] in ("activation", "input"):
                    readers[t].add(op.layer)
    return any(len(r) > 1 for r in readers.values())


def vdnn_baseline(trace: Trace) -> dict[str, Any]:
    """vDNN's network-wide baseline allocation of a trace (see the module docstring), bytes."""
    layers = forward_layers(trace)
    images = max((t.size_bytes for t in trace.tensors if t.kind == "input"), default=0)
    weights = sum(t.size_bytes for t in trace.tensors if t.kind == "weight")
    fmaps = images + sum(lay.y for lay in layers)
    buffers = 3 if forks(trace) else 2
    grads = buffers * max((lay.y for lay in layers), default=0)
    ws = max((t.size_bytes for t in trace.tensors if t.kind == "workspace"), default=0)
    largest = max((lay.x + lay.y + lay.w + lay.ws for lay in layers), default=0)
    total = weights + fmaps + grads + ws
    return {"weights": weights, "feature_maps": fmaps, "gradient_maps": grads,
            "gradient_buffers": buffers, "workspace": ws, "total": total,
            "largest_layer": largest}


# ---------------------------------------------------------------- per-layer times (Fig. 6)

def layer_times(trace: Trace) -> list[dict[str, Any]]:
    """Forward and backward time (us) of each CONV and FC layer with its in-place ReLU, in
    forward order, named CONV1.., FC1.. as Fig. 6 names them (pooling layers are not rows)."""
    rows: list[dict[str, Any]] = []
    row_of_layer: dict[str, int] = {}
    current: int | None = None
    for op in trace.ops:
        if op.phase != "fwd":
            continue
        if op.layer_type in ("conv", "fc"):
            current = len(rows)
            rows.append({"type": op.layer_type, "fwd_us": 0.0, "bwd_us": 0.0})
        elif op.layer_type != "relu":
            current = None
        if current is not None and op.layer_type in ("conv", "fc", "relu"):
            rows[current]["fwd_us"] += op.dur_us
            row_of_layer[op.layer] = current
    for op in trace.ops:
        if op.phase == "bwd" and op.layer in row_of_layer and op.layer_type != "loss":
            rows[row_of_layer[op.layer]]["bwd_us"] += op.dur_us
    n = {"conv": 0, "fc": 0}
    for r in rows:
        n[r["type"]] += 1
        r["layer"] = f"{r['type'].upper()}{n[r['type']]}"
    return rows


# ---------------------------------------------------------------- vDNN's semantics for policies

def vdnn_semantics(trace: Trace) -> Trace:
    """The trace as vDNN's framework would hold it (module docstring): momentum, weight
    gradients and pooling indices take no bytes; ReLU's backward reuses its dY for its dX."""
    ops = list(trace.ops)
    tensors = {t.id: t for t in trace.tensors}
    zero: set[int] = {t.id for t in trace.tensors if t.kind == "optimizer_state"
                      or (t.kind == "gradient" and t.name.startswith("grad "))}
    for op in ops:
        if op.phase == "fwd" and op.layer_type == "pool":
            ws = [t for t in op.writes if tensors[t].kind in ("activation", "temporary")]
            if len(ws) == 2:
                zero.add(max(ws, key=lambda t: tensors[t].size_bytes))
    # ReLU backward in place: its dX takes no bytes and its dY lives until dX's last use.
    index = {op.id: i for i, op in enumerate(ops)}
    free_op = {t: op.id for op in ops for t in op.frees}
    for op in list(ops):
        if op.phase != "bwd" or op.layer_type != "relu" or len(op.writes) != 1:
            continue
        dx = op.writes[0]
        dys = [t for t in op.frees if tensors[t].kind == "gradient" and t in op.reads]
        if not dys or dx not in free_op:
            continue
        dy = dys[0]
        zero.add(dx)
        i = index[op.id]
        ops[i] = dataclasses.replace(ops[i], frees=tuple(t for t in ops[i].frees if t != dy))
        j = index[free_op[dx]]
        ops[j] = dataclasses.replace(ops[j], frees=(*ops[j].frees, dy))
        free_op[dy] = ops[j].id
    new_tensors = tuple(dataclasses.replace(t, size_bytes=0) if t.id in zero else t
                        for t in trace.tensors)
    return dataclasses.replace(trace, ops=tuple(ops), tensors=new_tensors,
                               meta={**trace.meta, "semantics": "vdnn (vsim.paper)"})


def feature_time_us(predicted: Trace) -> float:
    """Time of the feature-extraction layers in a predicted trace: every op but the classifier
    (FC, loss, optimizer), with the stalls it waited."""
    return sum(op.dur_us + float(op.attr("stall_us", 0.0)) for op in predicted.ops
               if op.layer_type not in CLASSIFIER_TYPES and op.phase != "opt")


def policy_rows(trace: Trace, hw: Hardware, capacity: int | None = None
                ) -> list[dict[str, Any]]:
    """Each policy of the paper on `trace` (vDNN semantics) with cnmem at `capacity` (default:
    the card's): memory, offload, fits (and whether it would without fragmentation, with the
    exact allocator), feature-extraction throughput against base(p) on an oracle GPU. The base
    rows' memory is the network-wide baseline (`vdnn_baseline`; base(m) without workspace)."""
    from ..allocator import make_allocator
    from ..engine import simulate
    from ..policies import make_policy

    t = vdnn_semantics(trace)
    cap = hw.capacity_bytes if capacity is None else capacity
    exact = make_allocator("exact")
    oracle = simulate(t, hw, make_policy("none"), exact, 2**50)
    ref = feature_time_us(oracle.predicted)
    base = vdnn_baseline(trace)
    rows = []
    for label, spec in POLICIES:
        if label.startswith("base"):
            # vDNN's baseline is network-wide allocation (the analysis); its time is that of
            # an oracle GPU with room for it
            res = simulate(t, hw, make_policy(spec), exact, 2**50)
            need = base["total"] - (base["workspace"] if label == "base(m)" else 0)
            r = dict(res.report, fits=need <= cap, peak_allocated_bytes=need,
                     avg_allocated_bytes=need)
            fits_exact = need <= cap
        else:
            res = simulate(t, hw, make_policy(spec), make_allocator("cnmem"), cap)
            r = res.report
            fits_exact = bool(r["fits"]) or bool(
                simulate(t, hw, make_policy(spec), exact, cap).report["fits"])
        feature = feature_time_us(res.predicted)
        throughput = ref / feature if res.report["fits"] and feature else None
        rows.append({"policy": label, "spec": spec, "fits": r["fits"], "fits_exact": fits_exact,
                     "peak_bytes": r["peak_allocated_bytes"], "avg_bytes": r["avg_allocated_bytes"],
                     "offloaded_bytes": r["d2h_bytes"],
                     "pinned_host_bytes": r["pinned_host_peak_bytes"],
                     "iteration_us": r["iteration_time_us"],
                     "feature_throughput": throughput,
                     "notes": [n for n in r["notes"] if "dyn" in n]})
    return rows


# ---------------------------------------------------------------- the check

def check(path: str | Path, progress: Callable[[str], None] | None = None,
          policies: bool = True) -> dict[str, Any]:
    """Every comparison of the paper file; {fig1: [...], fig6: {...}, policies: {...},
    deep: [...], ok}."""
    say = progress or (lambda _m: None)
    doc = load_paper(path)
    folder = Path(path).parent
    hw = load_hardware(str(doc["hardware"]))
    tol_mem = parse_percent(doc["tolerance"]["baseline_memory"], f"{path}: tolerance")
    tol_time = parse_percent(doc["tolerance"]["layer_time_total"], f"{path}: tolerance")
    fig1, fig4 = doc["fig1_baseline_mib"], doc["fig4_breakdown_mib"]
    traces: dict[str, Trace] = {}
    rows = []
    for net, fig in fig1.items():
        say(f"baseline {net}")
        traces[net] = _trace(folder, net, hw)
        base = vdnn_baseline(traces[net])
        paper_ws = float(fig4[net]["workspace"]) * MIB
        with_paper_ws = base["total"] - base["workspace"] + paper_ws
        total = float(fig["total"]) * MIB
        err = base["total"] / total - 1
        rows.append({"network": net, "predicted": base, "paper_mib": fig4[net],
                     "fig1_total_mib": fig["total"], "error": err,
                     "error_with_fig4_workspace": with_paper_ws / total - 1,
                     "largest_layer_fraction": base["largest_layer"] / base["total"],
                     "paper_largest_layer_fraction": parse_percent(
                         fig["largest_layer_fraction"], f"{path}: fig1"),
                     "ok": abs(err) <= tol_mem})
    say("VGG-16(64) per-layer times")
    layers = layer_times(traces.get("vgg16-b64") or _trace(folder, "vgg16-b64", hw))
    paper_rows = {r["layer"]: r for r in doc["fig5_fig6_vgg16_layers"]}
    fig6 = []
    for r in layers:
        p = paper_rows.get(r["layer"])
        fig6.append({"layer": r["layer"], "fwd_ms": r["fwd_us"] / 1e3, "bwd_ms": r["bwd_us"] / 1e3,
                     "paper_fwd_ms": p["fwd_ms"] if p else None,
                     "paper_bwd_ms": p["bwd_ms"] if p else None})
    matched = [r for r in fig6 if r["paper_fwd_ms"] is not None]
    tot = {k: sum(r[k] for r in matched) for k in ("fwd_ms", "bwd_ms", "paper_fwd_ms",
                                                   "paper_bwd_ms")}
    total_err = (tot["fwd_ms"] + tot["bwd_ms"]) / (tot["paper_fwd_ms"] + tot["paper_bwd_ms"]) - 1
    fig6_result = {"rows": fig6, "totals": tot, "error": total_err,
                   "rows_matched": len(matched), "rows_paper": len(paper_rows),
                   "ok": abs(total_err) <= tol_time and len(matched) == len(paper_rows)}
    result: dict[str, Any] = {"paper": str(path), "hardware": hw.name, "fig1": rows,
                              "fig6": fig6_result}
    if policies:
        result["policies"] = {}
        for net in POLICY_NETWORKS:
            say(f"policies {net}")
            t = traces.get(net) or _trace(folder, net, hw)
            result["policies"][net] = policy_rows(t, hw)
        result["deep"] = []
        for net in DEEP_NETWORKS:
            say(f"vDNN_dyn {net}")
            t = _trace(folder, net, hw)
            base = vdnn_baseline(t)
            dyn = policy_rows_dyn(t, hw)
            result["deep"].append({"network": net, "baseline_bytes": base["total"], **dyn})
        from .headline import headline_rows

        say("the VGG-16(256) headline")
        result["headline"] = headline_rows(
            result["policies"]["vgg16-b256"], traces.get("vgg16-b256") or _trace(
                folder, "vgg16-b256", hw), result["policies"]["vgg16-b128"], hw,
            float(doc["headlines"]["vgg16_b128_vdnn_all_m_max_gb"]), tol_mem,
            traces.get("vgg16-b128") or _trace(folder, "vgg16-b128", hw))
    result["ok"] = (all(r["ok"] for r in rows) and fig6_result["ok"]
                    and all(r["ok"] for r in result.get("headline", [])))
    return result


def policy_rows_dyn(trace: Trace, hw: Hardware) -> dict[str, Any]:
    """vDNN_dyn alone (the deep VGGs): fits, GPU peak, pinned host memory, its choice."""
    from ..allocator import make_allocator
    from ..engine import simulate
    from ..policies import make_policy

    r = simulate(vdnn_semantics(trace), hw, make_policy("vdnn:mode=dyn"),
                 make_allocator("cnmem")).report
    return {"fits": r["fits"], "peak_bytes": r["peak_allocated_bytes"],
            "avg_bytes": r["avg_allocated_bytes"], "pinned_host_bytes": r["pinned_host_peak_bytes"],
            "offloaded_bytes": r["d2h_bytes"], "iteration_us": r["iteration_time_us"],
            "choice": next((n for n in r["notes"] if "dyn" in n), "")}


