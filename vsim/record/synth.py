"""Synthesize a trace from shapes: the recorder's structure pass run on the meta device.

No GPU and no weights: the model is built on the meta device (tensors with shapes and no data),
trained one iteration (to create the optimizer's state) and then recorded by the same structure
pass as `vsim record` (vsim.record.recorder.Recorder: profiler ranges for ops, module hooks for
layers, saved-tensor hooks for activations, the dispatch log for reads, flops and bytes), so ops,
layers, phases, tensor kinds and lifetimes follow the recorder's rules. What the meta device
lacks is filled in:

- Allocations and frees. The meta device has no allocator, so a dispatch mode gives every new
  storage a synthetic address and reports it as an allocation inside the running op, and a
  finalizer on the storage reports its free when the last tensor using it dies (inside the op
  that releases it, as the CUDA allocator would see it). Sizes are rounded to the CUDA caching
  allocator's 512-byte blocks (`block_bytes=1` keeps exact sizes, as a CPU recording has).
- Kernels. An op is kept when it runs a non-view aten op (it would launch a kernel) or
  allocates; views and AccumulateGrad's steal are dropped, as in a GPU recording.
- Workspaces. cuDNN's are invisible without cuDNN; WORKSPACE_MODELS describe them per library
  from the operands' sizes (see `cudnn9_layout_workspace`), added to each convolution as memory
  allocated and freed inside the op (the recorder's merged per-op workspace). Library handles'
  resident blocks (cuBLAS workspaces) are added as the recordings show them.
- Kernel choices. The meta device runs scaled_dot_product_attention's math path (which keeps
  the whole attention matrix) and dropout as bernoulli and mul (a float mask); a CUDA GPU runs
  the memory-efficient attention kernel for fp32 and the fused dropout (a bool mask). Synthesis
  routes both to the CUDA kernels (aten::_scaled_dot_product_efficient_attention,
  aten::native_dropout), keeping what CUDA keeps; the top-level op names then differ from a
  recording's (aten::native_dropout for aten::dropout), as do batch norm's autograd nodes
  (NativeBatchNormBackward0 where cuDNN gives CudnnBatchNormBackward0, same tensors).
- Times. Op times come from the compute model (vsim.compute) on the hardware asked for; each
  convolution also gets its memory-optimal time (`dur_us_memory_algo`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .. import __version__
from ..compute import with_model_times
from ..errors import ConfigError
from ..hardware import Hardware
from ..trace.importers import AllocDraft, MemRec, build_trace, short_op_name
from ..trace.schema import Trace
from . import dispatchlog
from . import recorder as _rec
from .assemble import DISPATCH, StructureLog, structure_ops
from .hf import default_seq, is_hf, meta_safe
from .step import AUTOCAST_DTYPES, check_choice, step_from_parts
from .zoo import build_model

ALLOC = "vsim::a#"
FREE = "vsim::f#"
# The device code of the synthetic allocator events: not the profiler's CPU (0) or CUDA (1),
# whose own "[memory]" events (real host allocations made while tracing) must be ignored.
META_DEVICE_CODE = 99
SYNTH_VERSION = "vsim-synth 0.1"

# Blocks cuBLAS/cuDNN handles hold for the whole run, as every H100 recording shows them
# (`resident (unidentified)`: two 32 MiB cuBLAS workspaces and one 1 MiB block).
CUDA_LIBRARY_RESIDENTS = (32 * 2**20, 32 * 2**20, 2**20)

# aten ops that launch no kernel although they are not views.
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
              "detach", "lift_fresh", "_local_scalar_dense", "resize_", "set_", "alias",
              "_unsafe_view", "zeros_like_meta"}


# ---------------------------------------------------------------- workspace models

def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def cudnn9_layout_workspace(info: dict[str, Any], elem: int) -> int:
    """cuDNN 9 on an H100 with NCHW fp32/TF32 tensors, as the nine recordings show it: the
    chosen engines transpose their operands to NHWC inside the workspace. Forward: X + W + Y,
    none for a 1x1 stride-1 convolution (run as a GEMM) or a stride-1 convolution of fewer than
    8 input channels (the first layer, plain fp32 kernels). Backward: dY + W + dX when the input
    needs its gradient, else X + dY for a strided first layer and none for a stride-1 one.
    Within a few percent of most recorded convolutions; cuDNN's heuristics pick other engines
    for some shapes (FFT for a few GoogLeNet 5x5s, direct NCHW kernels that skip Y's transform),
    which this rule does not know."""
    x, w, y = (_numel(info[k]) * elem for k in ("input", "weight", "output"))
    kh, kw = info["weight"][2:4] if len(info["weight"]) >= 4 else (1, 1)
    stride = max(info.get("stride") or [1])
    cin = info["input"][1] if len(info["input"]) > 1 else 1
    pointwise = kh == 1 and kw == 1 and stride == 1
    first = cin < 8
    if info["phase"] == "fwd":
        if pointwise or (first and stride == 1):
            return 0
        return x + w + y
    if info.get("needs_input_grad", True):
        return y + w + x
    return 0 if stride == 1 else x + y


def no_workspace(info: dict[str, Any], elem: int) -> int:
    """Workspace-free convolutions (cuDNN's IMPLICIT_GEMM, vDNN's (m))."""
    return 0


WORKSPACE_MODELS: dict[str, Callable[[dict[str, Any], int], int]] = {
    "cudnn9-layout": cudnn9_layout_workspace,
    "none": no_workspace,
}


# ---------------------------------------------------------------- meta allocation tracking

class _MetaMemory:
    """Synthetic addresses for meta storages and their allocation and free events."""

    def __init__(self, block_bytes: int) -> None:
        self.block = max(1, block_bytes)
        self.next_addr = 1 << 24
        self.addr_of: dict[int, int] = {}           # storage cdata -> address
        self.live: dict[int, tuple[int, int]] = {}  # storage cdata -> (address, size) allocated
        self.events: list[tuple[int, int]] = []     # (address, +size / -size)
        self.recording = False

    def size(self, nbytes: int) -> int:
        return self.block * -(-nbytes // self.block) if nbytes > 0 else 0

    def _key(self, t: torch.Tensor) -> tuple[int, Any] | None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return st._cdata, st

    def addr(self, t: torch.Tensor) -> int | None:
        """The storage's address (a new one for a storage never seen)."""
        got = self._key(t)
        if got is None:
            return None
        key, st = got
        a = self.addr_of.get(key)
        if a is None:
            a = self.addr_of[key] = self.next_addr
            self.next_addr += max(self.block, self.size(st.nbytes())) + self.block
            weakref.finalize(st, self._gone, key)
        return a

    def allocated(self, t: torch.Tensor) -> None:
        """Called for each output of an aten op: a storage not seen before is an allocation."""
        got = self._key(t)
        if got is None:
            return
        key, st = got
        if key in self.addr_of or st.nbytes() <= 0:
            self.addr(t)
            return
        a = self.addr(t)
        assert a is not None
        size = self.size(st.nbytes())
        self.live[key] = (a, size)
        if self.recording:
            self.events.append((a, size))
            dispatchlog.marker(f"{ALLOC}{len(self.events) - 1}")

    def _gone(self, key: int) -> None:
        self.addr_of.pop(key, None)
        hit = self.live.pop(key, None)
        if hit is not None and self.recording:
            self.events.append((hit[0], -hit[1]))
            dispatchlog.marker(f"{FREE}{len(self.events) - 1}")


def _is_view(func: Any) -> bool:
    try:
        rets = func._schema.returns
    except AttributeError:
        return False
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write
                              for r in rets)


class _SynthDispatch(dispatchlog.DispatchLog):
    """The recorder's dispatch log on the meta device, plus allocations (_MetaMemory), whether
    each aten call would launch a kernel, and convolution geometry."""

    memory: _MetaMemory
    calls: list[tuple[str, bool, dict[str, Any] | None]]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "namespace", "") == "profiler":
            return out
        flat_in, _ = tree_flatten((args, kwargs))
        flat_out, _ = tree_flatten(out)
        for x in flat_out:
            if isinstance(x, torch.Tensor) and x.device.type == self.device_type:
                self.memory.allocated(x)
        reads, flops, nbytes = dispatchlog.call_profile(func, args, kwargs, out, flat_in,
                                                        flat_out, self.device_type,
                                                        self.memory.addr)
        name = str(getattr(func, "__name__", func)).split(".")[0]
        launches = not _is_view(func) and name not in _NO_KERNEL
        n = len(self.log.dispatch)
        self.log.dispatch.append((reads, flops, nbytes))
        mutated = dispatchlog.mutated_storages(func, args, kwargs, self.device_type,
                                               self.memory.addr)
        if mutated:
            self.log.mutated[n] = mutated
        self.calls.append((name, launches, _conv_info(name, args, out)))
        dispatchlog.marker(f"{DISPATCH}{n}")
        return out


def _shape(x: Any) -> list[int] | None:
    return list(x.shape) if isinstance(x, torch.Tensor) else None


def _conv_info(name: str, args: Any, out: Any) -> dict[str, Any] | None:
    if name == "convolution":
        x, w = args[0], args[1]
        return {"phase": "fwd", "input": _shape(x), "weight": _shape(w), "output": _shape(out),
                "stride": list(args[3]), "padding": list(args[4]), "groups": int(args[8])}
    if name == "convolution_backward":
        grad_out, x, w = args[0], args[1], args[2]
        mask = list(args[-1])
        return {"phase": "bwd", "input": _shape(x), "weight": _shape(w),
                "output": _shape(grad_out), "stride": list(args[4]), "padding": list(args[5]),
                "groups": int(args[9]), "needs_input_grad": bool(mask[0])}
    return None


class _CudaKernels(TorchFunctionMode):
    """Take the kernels a CUDA GPU takes where the meta device would take others:
    scaled_dot_product_attention's memory-efficient kernel for fp32 (meta: the math path, which
    keeps the attention matrix) and the fused dropout (meta: bernoulli and mul, which keeps a
    float mask where CUDA keeps a bool one)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
            if training and 0 < p < 1 and not inplace and x.numel() > 0:
                return torch.native_dropout(x, p, True)[0]
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, q.requires_grad, dropout, causal, scale=kwargs.get("scale"))
            return out[0]
        return func(*args, **kwargs)


# Autocast on the meta device, which has no autocast kernels: the function-level emulation of
# CUDA autocast's op lists (torch/csrc/autograd/autocast_mode.cpp) for the ops the zoo's and
# Hugging Face's models call. Lower precision: matmuls, convolutions, attention. fp32: norms,
# softmaxes, losses and the pointwise ops CUDA autocast runs in fp32 (pow, exp, log, rsqrt, sum).
_AUTOCAST_LOW = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm",
                 "baddbmm", "addbmm", "mv", "addmv", "einsum", "conv1d", "conv2d", "conv3d",
                 "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                 "scaled_dot_product_attention", "prelu"}
_AUTOCAST_FP32 = {"layer_norm", "group_norm", "softmax", "log_softmax", "cross_entropy",
                  "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "kl_div",
                  "binary_cross_entropy_with_logits", "pow", "__pow__", "exp", "log", "rsqrt",
                  "reciprocal", "sum", "cumsum", "prod", "logsumexp", "softplus", "norm",
                  "cosine_similarity"}


class _MetaAutocast(TorchFunctionMode):
    """torch.autocast as CUDA does it, emulated on meta tensors: floating arguments of the
    lower-precision ops cast to `dtype`, of the fp32 ops to float32. Casts of parameters are
    cached until the region ends, as autocast caches casts of leaf tensors that need gradients.
    A cast is its own top-level op here (aten::to), where CUDA makes it inside the op that
    needs it; the bytes and lifetimes are the same."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, torch.Tensor] = {}

    def _cast(self, x: Any, dtype: torch.dtype) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()) or x.dtype in (
                dtype, torch.float64):
            return x
        leaf = x.is_leaf and x.requires_grad
        if leaf and id(x) in self.cache:
            return self.cache[id(x)]
        y = x.to(dtype)
        if leaf:
            self.cache[id(x)] = y
        return y

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        dtype = self.dtype if name in _AUTOCAST_LOW else \
            torch.float32 if name in _AUTOCAST_FP32 else None
        if dtype is not None:
            args = tuple(self._cast(a, dtype) for a in args)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> None:
        self.cache.clear()
        super().__exit__(*exc)


# ---------------------------------------------------------------- the synthesis

class _MetaRecorder(_rec.Recorder):
    """The recorder's structure pass on the meta device: one warm-up iteration, then the
    structure iteration; assembled by `_finish` below instead of the GPU/CPU joins."""

    def __init__(self, model: Any, optimizer: Any, *, memory: _MetaMemory, **kwargs: Any):
        super().__init__(model, optimizer, device="cpu", warmup=1, iters=1, timing_iters=1,
                         **kwargs)
        self.device = torch.device("meta")
        self.gpu = False
        self.schedule = ["warmup", "structure"]
        self.memory = memory
        self.log = StructureLog(device_type=META_DEVICE_CODE)

    def begin_structure(self) -> None:
        self.memory.recording = True
        super().begin_structure()

    def end_structure(self) -> None:
        super().end_structure()
        self.memory.recording = False

    def _finish(self) -> None:
        self._trace = Trace(meta={}, tensors=(), ops=())  # the caller assembles


def synthesize(model: str, batch: int, hw: Hardware, *, workspace: str = "cudnn9-layout",
               block_bytes: int = 512, library_residents: bool = True,
               tf32: tuple[bool, bool] = (True, False), foreach: bool = True,
               precision: str = "fp32", optimizer: str = "sgd", seq: int | None = None,
               progress: Callable[[str], None] | None = None) -> Trace:
    """A trace of one training iteration of zoo `model` at `batch` (`seq` for Hugging Face
    models) as `vsim record` runs it (vsim.record.step: `precision`, `optimizer`, cross-entropy,
    zero_grad(set_to_none=True)), with op times from the compute model on `hw`. `tf32` =
    (cuDNN convolutions, matmuls) as PyTorch's flags (its defaults: True, False; precision
    tf32 turns matmuls on). bf16/fp16 autocast is emulated (_MetaAutocast); fp16 has no grad
    scaler here (its unscale needs values). ConfigError for an unknown model, workspace model,
    precision or optimizer."""
    if workspace not in WORKSPACE_MODELS:
        raise ConfigError(f"unknown workspace model {workspace!r}; known: "
                          f"{', '.join(WORKSPACE_MODELS)}")
    check_choice(precision, optimizer)
    if precision == "tf32":
        tf32 = (tf32[0], True)
    say = progress or (lambda _m: None)
    say(f"building {model} (batch {batch}{'' if seq is None else f', seq {seq}'}) on the meta "
        f"device, {precision}, {optimizer}")
    with torch.device("meta"):
        net, (inputs, target), loss_fn = build_model(model, batch, "meta", seq=seq)
    autocast = None
    if precision in AUTOCAST_DTYPES:
        dtype = AUTOCAST_DTYPES[precision]
        autocast = lambda: _MetaAutocast(dtype)  # noqa: E731
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        training = step_from_parts(net, inputs, target, loss_fn, "meta", precision, optimizer,
                                   autocast=autocast, foreach=foreach)
    finally:  # synthesis does not change the process's flags; tf32 goes into meta
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    opt = training.opt
    step = training.step

    memory = _MetaMemory(block_bytes)
    calls: list[tuple[str, bool, dict[str, Any] | None]] = []

    class Dispatch(_SynthDispatch):
        pass
    Dispatch.memory = memory
    Dispatch.calls = calls
    # the recorder's names for these (bound in vsim.record.recorder) stand in for the meta run
    saved = _rec.tensor_addr, _rec.DispatchLog, _rec.storage_bytes
    _rec.tensor_addr = memory.addr  # type: ignore[assignment]
    _rec.DispatchLog = Dispatch  # type: ignore[misc]
    _rec.storage_bytes = lambda t: memory.size(t.untyped_storage().nbytes())  # type: ignore
    try:
        with _CudaKernels(), (meta_safe() if is_hf(model) else contextlib.nullcontext()):
            rec = _MetaRecorder(net, opt, memory=memory, inputs=(inputs, target),
                                loss_fn=loss_fn)
            with rec:
                while not rec.done:
                    step()
                    rec.step()
    finally:
        _rec.tensor_addr, _rec.DispatchLog, _rec.storage_bytes = saved  # type: ignore[misc]
    say(f"structure pass: {len(rec.structure_capture.ops)} top-level ops, {len(calls)} aten "
        f"calls, {sum(1 for e in memory.events if e[1] > 0)} allocations")
    trace = _assemble(rec, memory, calls, workspace, library_residents)
    elem = 4
    meta = {
        "source": "synthetic", "model": model, "batch_size": batch,
        "device": "synthetic", "device_type": "meta", "torch": torch.__version__,
        "cuda": None, "cudnn": None, "recorder": SYNTH_VERSION, "hardware": hw.name,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": f"vsim synth {model} --batch {batch}"
                   + ("" if seq is None else f" --seq {seq}")
                   + f" --precision {precision} --optimizer {optimizer} --hw {hw.name}",
        "dtype": "float32", "tf32": {"cudnn": tf32[0], "matmul": tf32[1]},
        "cudnn_benchmark": False, **training.meta(),
        "optimizer_config": _rec.optimizer_label(opt),
        "stream_names": {"0": "compute"},
        "synth": {"version": __version__, "workspace_model": workspace,
                  "block_bytes": block_bytes, "element_bytes": elem,
                  "library_residents_bytes": list(CUDA_LIBRARY_RESIDENTS)
                  if library_residents else [],
                  "times": "vsim.compute model on " + hw.name},
        "structure_check": trace.meta.get("structure_check", {}),
    }
    if seq is not None or is_hf(model):
        meta["seq_len"] = seq if seq is not None else default_seq(model)
    trace = Trace(meta=meta, tensors=trace.tensors, ops=trace.ops)
    return with_model_times(trace, hw)


def _assemble(rec: _MetaRecorder, memory: _MetaMemory,
              calls: list[tuple[str, bool, dict[str, Any] | None]], workspace: str,
              library_residents: bool) -> Trace:
    capture = rec.structure_capture
    for op in capture.ops:  # the synthetic allocator events, as the profiler would give them
        for ts, name in op.markers:
            for prefix in (ALLOC, FREE):
                if name.startswith(prefix):
                    addr, delta = memory.events[int(name[len(prefix):])]
                    op.mem.append(MemRec(ts, op.tid, addr, delta, None, None,
                                         META_DEVICE_CODE, 0))
        op.mem.sort(key=lambda m: m.ts_ns)
    sops, allocs, diag = structure_ops(capture, rec.log)
    ws_model = WORKSPACE_MODELS[workspace]
    drafts = []
    for s in sops:
        d = s.draft
        idx = [int(n[len(DISPATCH):]) for _, n in s.op.markers if n.startswith(DISPATCH)]
        mine = [calls[i] for i in idx if i < len(calls)]
        launches = sum(1 for _, k, _ in mine if k)
        d.keep = launches > 0
        d.attrs["launches"] = launches
        conv = next((info for _, _, info in mine if info), None)
        if conv is not None:
            d.attrs["out_channels"] = conv["output"][1] if conv["phase"] == "fwd" \
                else conv["weight"][0]
            ws = ws_model(conv, 4)
            if ws > 0:
                aid = len(allocs)
                allocs[aid] = AllocDraft(aid, memory.size(ws))
                # held while the op runs: after its outputs are allocated, before it frees
                first_free = next((i for i, (_, sign) in enumerate(d.events) if sign < 0),
                                  len(d.events))
                d.events[first_free:first_free] = [(aid, +1), (aid, -1)]
        if short_op_name(d.name).endswith("AccumulateGrad") and not d.events:
            d.keep = False
        drafts.append(d)
    if library_residents:
        for size in CUDA_LIBRARY_RESIDENTS:
            aid = len(allocs)
            allocs[aid] = AllocDraft(aid, size, resident=True, kind="temporary",
                                     name="resident (unidentified)")
    built = build_trace(drafts, allocs)
    return built.trace({"structure_check": {**diag, **built.diagnostics}})
