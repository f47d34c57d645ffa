"""The training step the recorder (and the runtime) run: model, optimizer, autocast, grad scaler.

    step = training_step("gpt2", 8, "cuda", precision="bf16", optimizer="adamw")
    step()                      # forward + loss under autocast, backward, optimizer step,
                                # zero_grad(set_to_none=True)

Precisions: `fp32` (PyTorch's defaults: TF32 for cuDNN convolutions, not for matmuls, as every
trace before issue 17), `tf32` (TF32 for matmuls too), `bf16` and `fp16` (torch.autocast around
forward and loss; weights, gradients and optimizer state stay fp32; fp16 scales the loss with a
torch.amp.GradScaler, whose unscale and inf check run inside the step). Optimizers: `sgd` (lr 0.01,
momentum 0.9: the recorder's step before issue 17), `adam` (lr 1e-4) and `adamw` (lr 1e-4, weight
decay 0.01); foreach or fused as PyTorch picks by default (foreach on CUDA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .zoo import build_model

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adam", "adamw")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_choice(precision: str, optimizer: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")


def make_optimizer(params: list[nn.Parameter], optimizer: str, **kwargs: Any
                   ) -> torch.optim.Optimizer:
    """The optimizer named `optimizer` with the step's hyperparameters; kwargs (e.g. foreach)
    override PyTorch's implementation choice."""
    check_choice("fp32", optimizer)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, **kwargs)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-4, **kwargs)
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kwargs)


def set_tf32(precision: str) -> None:
    """The TF32 flags `precision` runs with (process-wide, as PyTorch keeps them): `tf32` turns
    matmul TF32 on; the others leave PyTorch's defaults (cuDNN on, matmul off)."""
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = True


@dataclass
class TrainingStep:
    """One training iteration as a callable. `capture` (the runtime's hook) is called with the
    loss after the forward pass and with None after the backward pass."""

    net: nn.Module
    opt: torch.optim.Optimizer
    inputs: Any
    target: Any
    loss_fn: Any
    precision: str = "fp32"
    optimizer: str = "sgd"
    device_type: str = "cuda"
    scaler: Any = None
    autocast: Callable[[], Any] = field(default=contextlib.nullcontext)

    @property
    def args(self) -> tuple[Any, ...]:
        return tuple(self.inputs) if isinstance(self.inputs, (tuple, list)) else (self.inputs,)

    def __call__(self, capture: Callable[[torch.Tensor | None], None] | None = None) -> None:
        with self.autocast():
            loss = self.loss_fn(self.net(*self.args), self.target)
        if capture is not None:
            capture(loss)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        if capture is not None:
            capture(None)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    step = __call__

    def meta(self) -> dict[str, Any]:
        """What the trace's meta records of the step."""
        out: dict[str, Any] = {"precision": self.precision, "optimizer": self.optimizer}
        if self.precision in AUTOCAST_DTYPES:
            out["autocast"] = str(AUTOCAST_DTYPES[self.precision]).replace("torch.", "")
        if self.scaler is not None:
            out["grad_scaler"] = "torch.amp.GradScaler (defaults)"
        return out


def step_from_parts(net: nn.Module, inputs: Any, target: Any, loss_fn: Any, device: Any,
                    precision: str = "fp32", optimizer: str = "sgd",
                    autocast: Callable[[], Any] | None = None,
                    **opt_kwargs: Any) -> TrainingStep:
    """A TrainingStep around a built model (training mode, `optimizer` over the parameters that
    need gradients, autocast and scaler for `precision`). `autocast` replaces torch.autocast
    (synthesis on the meta device emulates it)."""
    check_choice(precision, optimizer)
    dev = torch.device(device)
    net.train()
    opt = make_optimizer([p for p in net.parameters() if p.requires_grad], optimizer,
                         **opt_kwargs)
    set_tf32(precision)
    scaler = None
    ctx: Callable[[], Any] = contextlib.nullcontext
    if precision in AUTOCAST_DTYPES:
        dtype = AUTOCAST_DTYPES[precision]
        ctx = autocast or (lambda: torch.autocast(dev.type, dtype=dtype))
        if precision == "fp16" and dev.type != "meta":
            scaler = torch.amp.GradScaler(dev.type)
    return TrainingStep(net, opt, inputs, target, loss_fn, precision, optimizer, dev.type,
                        scaler, ctx)


def training_step(model: str, batch: int, device: Any, precision: str = "fp32",
                  optimizer: str = "sgd", seq: int | None = None) -> TrainingStep:
    """Zoo model `model` (vsim.record.zoo, `seq` for Hugging Face models) at `batch` on `device`,
    trained as the module docstring says, on synthetic data."""
    check_choice(precision, optimizer)
    net, (inputs, target), loss_fn = build_model(model, batch, device, seq=seq)
    return step_from_parts(net, inputs, target, loss_fn, device, precision, optimizer)


# ------------------------------------------------------- the step a trace was recorded with

@dataclass(frozen=True)
class StepConfig:
    """What `training_step` needs to rebuild the step a trace recorded: the model (zoo,
    torchvision, Hugging Face name or MODULE:CALLABLE), batch, precision, optimizer and
    sequence length (Hugging Face models)."""

    model: str
    batch: int
    precision: str = "fp32"
    optimizer: str = "sgd"
    seq: int | None = None

    def build(self, device: Any) -> TrainingStep:
        return training_step(self.model, self.batch, device, precision=self.precision,
                             optimizer=self.optimizer, seq=self.seq)

    def flags(self) -> str:
        """The command-line flags that name this step (as `vsim record` takes them)."""
        return (f" --precision {self.precision} --optimizer {self.optimizer}"
                + ("" if self.seq is None else f" --seq {self.seq}"))


def _meta_optimizer(value: Any) -> str | None:
    """meta.optimizer: the step's name (sgd, adam, adamw), or as traces before issue 17 wrote
    it, the optimizer's label ("SGD(lr=0.01, momentum=0.9)")."""
    if not isinstance(value, str) or not value:
        return None
    head = value.split("(", 1)[0].strip().lower()
    return head if head in OPTIMIZERS else value


def recorded_step(meta: dict[str, Any]) -> dict[str, Any]:
    """What a trace's meta says of its step: model, batch, precision, optimizer, seq (None where
    it says nothing). Traces before issue 17 have no precision: fp32 (tf32 when their meta says
    matmuls ran in TF32)."""
    precision = meta.get("precision")
    if precision is None and meta.get("source") == "measured":
        tf32 = meta.get("tf32") or {}
        precision = "tf32" if isinstance(tf32, dict) and tf32.get("matmul") else "fp32"
    seq = meta.get("seq_len")
    return {"model": meta.get("model"), "batch": meta.get("batch_size"),
            "precision": precision, "optimizer": _meta_optimizer(meta.get("optimizer")),
            "seq": int(seq) if isinstance(seq, int) and not isinstance(seq, bool) else None}


def step_config(meta: dict[str, Any], model: str | None = None, batch: int | None = None,
                precision: str | None = None, optimizer: str | None = None,
                seq: int | None = None, what: str = "the trace") -> StepConfig:
    """The step to run for a trace with `meta`: each of model, batch, precision, optimizer and
    seq as given, else as the meta says (else the recorder's defaults: fp32, sgd). One given
    that differs from what the trace recorded is a ConfigError: the run's ops would not be the
    trace's."""
    rec = recorded_step(meta)
    asked: dict[str, Any] = {"model": model, "batch": batch, "precision": precision,
                             "optimizer": optimizer, "seq": seq}
    flag = {"model": "model", "batch": "--batch", "precision": "--precision",
            "optimizer": "--optimizer", "seq": "--seq"}
    for key, value in asked.items():
        if value is not None and rec[key] is not None and value != rec[key]:
            raise ConfigError(f"{flag[key]} {value} differs from {what}, recorded with "
                              f"{flag[key]} {rec[key]}: the run's ops would not be the "
                              "trace's (record a trace of this step, or leave the flag out)")
    got: dict[str, Any] = {k: asked[k] if asked[k] is not None else rec[k] for k in asked}
    if got["model"] is None or got["batch"] is None:
        raise ConfigError(f"{what} does not name its model and batch (meta.model, "
                          "meta.batch_size): give them")
    cfg = StepConfig(str(got["model"]), int(got["batch"]), got["precision"] or "fp32",
                     got["optimizer"] or "sgd", got["seq"])
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(f"{what} was recorded with optimizer {cfg.optimizer!r}, which the "
                          f"runtime cannot rebuild (known: {', '.join(OPTIMIZERS)})")
    check_choice(cfg.precision, cfg.optimizer)
    return cfg
