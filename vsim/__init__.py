"""vsim: a trace-driven simulator of GPU memory virtualization for DNN training."""

__version__ = "0.1.0"
