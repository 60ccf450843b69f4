"""LoRA: the adapter's math in one place. A projection W gains a low-rank update W + s·A·B, where A
[in..., rank] and B [rank, out...] are trained and s = alpha / rank is a constant of the adapter; the
frozen base can be kept in a low-precision or quantized form (QLoRA). PEFT's files are read and written
by `meshlm.formats.adapters`."""

from __future__ import annotations

from meshlm.config import QUANTIZED, TrainConfig


def base_storage(cfg: TrainConfig) -> tuple[str, str | None]:
    """How a LoRA run keeps its frozen base: (dtype, quantize). A quantized base keeps its other weights
    (embedding, norms, head) in the compute dtype."""
    if cfg.frozen_dtype in QUANTIZED:
        return cfg.compute_dtype, cfg.frozen_dtype
    return cfg.frozen_dtype, None
