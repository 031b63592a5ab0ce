"""A checkpoint whose weights the engine cannot run in their stored form (FP8, bitsandbytes): each such weight
is dequantized at load to float32 (then cast to the model dtype like any dense weight), on `work_device`
where the loader set one (a GPU); nothing is kept quantized. The formats' own files say how a weight is
stored (`fp8.dequantize`, `bnb.dequantize`)."""
from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)

RawSource = Callable[[str], "torch.Tensor | None"]
# (name, the stored tensor, raw source on the work device, move-to-work-device) -> float32 weight, or None
# when `name` is not one of the format's stored weights (returned as stored)
Dequantize = Callable[[str, torch.Tensor, RawSource, Callable[[torch.Tensor], torch.Tensor]], "torch.Tensor | None"]


class DequantizingSource:
    """Tensor source by HF name; the format's stored weights come back dequantized in float32."""

    format_name = None              # no projection stays quantized: a dense checkpoint to the loader

    def __init__(self, raw: RawSource, dequantize: Dequantize, what: str) -> None:
        self._raw = raw
        self._dequantize = dequantize
        self.work_device: torch.device | None = None
        log.info("%s: weights dequantized at load to the model dtype (no kernels for their stored form)", what)

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.work_device is None else t.to(self.work_device)

    def _raw_placed(self, name: str) -> torch.Tensor | None:
        t = self._raw(name)
        return None if t is None else self._place(t)

    def __call__(self, name: str) -> torch.Tensor | None:
        t = self._raw(name)
        if t is None:
            return None
        w = self._dequantize(name, t, self._raw_placed, self._place)
        return t if w is None else w

    def quantized(self, prefix: str) -> None:
        return None
