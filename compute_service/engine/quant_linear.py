"""A base projection whose weight is stored weight-only quantized (4 or 8 bits, group-wise).

Same call as `Linear` (`__call__([T, K]) -> [T, N]`, `in_features`, `out_features`,
`nbytes`), so the model, the LoRA backend (which adds its deltas to the output, in
the activations' dtype) and CUDA graphs do not change.

CUDA: the codes are packed at construction (`kernels.quant_pack`: int32 words, group-major
scales) and only the packed form is kept on the GPU; a call runs `kernels.quant_matmul`
(fused dequantize + matmul, split-K for decode), or for `dense_min_tokens` rows and more
(`kernels.quant_matmul.dense_min_rows`: 65, or 384 for a large 4-bit weight in groups of
128+, 129 in groups of 32), dequantizes the weight once into a temporary and runs a library GEMM, which is
faster there. Nothing in a call syncs with the host, so decode steps capture
into CUDA graphs. `qweight` and `dequantize()` rebuild the canonical form from the packed one.

CPU (and CUDA for a group size the packed layout cannot hold, e.g. 16 or 96):
dequantize-then-matmul on every call (the reference path; slow, meant for tests and small models).
`use_kernel=True` runs the packed path on CPU too (Triton's interpreter, for tests).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from compute_service.engine.quantized import QuantizedWeight
from kernels.env_switch import env_int

if TYPE_CHECKING:
    from kernels.split_sum import SplitSum

DEFER_SPLIT_ENV = "LORAPLEX_DEFER_SPLIT"
ORDERED_X_ENV = "LORAPLEX_ORDERED_X"


def defer_split_enabled() -> bool:
    """LORAPLEX_DEFER_SPLIT (for A/B runs; unset or 1 by default): 0 keeps every split-K sum inside the
    projection's launch, where otherwise `QuantLinear(..., split_out=True)` leaves it to the next kernel."""
    return env_int(DEFER_SPLIT_ENV, lambda v: v in (0, 1), "0 or 1") != 0


def ordered_x_enabled() -> bool:
    """LORAPLEX_ORDERED_X (for A/B runs; unset or 1 by default): 0 makes every act-order projection gather x in a
    launch of its own, where otherwise the kernel that writes x writes it in the projection's order
    (`input_perm`, `kernels.perm`)."""
    return env_int(ORDERED_X_ENV, lambda v: v in (0, 1), "0 or 1") != 0


class QuantLinear:
    """Quantized weight [N, K] (canonical form, see `quantized.py`), optional bias [N] in the model dtype."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, *,
                 use_kernel: bool | None = None, dense_min_tokens: int | None = None) -> None:
        """`dense_min_tokens`: rows from which a call dequantizes + runs a GEMM (default: the kernel's rule,
        `kernels.quant_matmul.dense_min_rows`)."""
        self.device = torch.device(device)
        self.bias = None if bias is None else bias.to(self.device).contiguous()
        self.use_kernel = self.device.type == "cuda" if use_kernel is None else use_kernel
        if self.use_kernel and use_kernel is None and not _packable(qweight):
            self.use_kernel = False     # a group size the packed layout cannot hold: dequantize per call
        self._bits, self._group_size = qweight.bits, qweight.group_size
        self._shape = qweight.shape
        # act-order: the codes are stored by group, the kernels read x in that order (one gather a call, unless x
        # arrives in that order: `input_perm`)
        self._perm = None if qweight.perm is None else qweight.perm.to(self.device)
        self._qweight: QuantizedWeight | None = None
        # the same as int32 for the kernels that write x in this order (`input_perm`); kernel path only
        self._perm32 = None if self._perm is None or not self.use_kernel else self._perm.to(torch.int32)
        self._inverse32 = None if self._perm32 is None else torch.argsort(self._perm32).to(torch.int32)
        if not self.use_kernel:
            self._qweight = qweight.to(self.device)
            return
        from kernels.quant_matmul import dense_min_rows  # imported late: the interpreter flag must be set first
        from kernels.quant_pack import pack_quantized

        q = qweight.to(self.device)
        n, k = self._shape
        self.dense_min_tokens = (dense_min_tokens if dense_min_tokens is not None
                                 else dense_min_rows(n, k, qweight.bits, qweight.group_size))
        self.packed = pack_quantized(q.q, q.scales, q.offsets, q.bits, q.group_size)
        del q
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 4)
        # One zero counter per output tile of a split-K launch (16-feature tiles of up to 64 tokens, or 64-feature
        # tiles of up to 256, suffice).
        self.locks = torch.zeros(4 * -(-self._shape[0] // 16), dtype=torch.int32, device=self.device)
        from kernels.quant_wgmma import async_dots_enabled, async_one_row_enabled

        self.defer_split = defer_split_enabled()
        self.async_dots = async_dots_enabled(self.device)     # 2-32 and 65+ rows: the asynchronous-dot kernel (sm_90+)
        self.async_one_row = self.async_dots and async_one_row_enabled()    # and one row (A/B runs)

    @property
    def qweight(self) -> QuantizedWeight:
        """The canonical form (rebuilt from the packed codes on the kernel path)."""
        if self._qweight is not None:
            return self._qweight
        from kernels.quant_pack import unpack_quantized

        q, s, o = unpack_quantized(self.packed)
        return QuantizedWeight(q, s, o, self._bits, self._group_size, self._perm)

    @property
    def act_order(self) -> bool:
        """Whether the codes are stored in an act-order channel order (x is read in that order: gathered by the
        call, or written so by the kernel before it, `input_perm`)."""
        return self._perm is not None

    @property
    def input_perm(self) -> torch.Tensor | None:
        """int32 [K] where the kernels read x in a stored channel order (act-order: stored channel j is the model's
        channel perm[j]), else None. A kernel that writes x in that order (`kernels.perm`) lets a call skip its
        gather (`ordered=True`). None on the dequantize-per-call path, which reads x in the model's order."""
        return self._perm32

    @property
    def input_perm_inverse(self) -> torch.Tensor | None:
        """`input_perm`'s inverse (int32: the stored position of each model channel), or None without one."""
        return self._inverse32

    @property
    def bits(self) -> int:
        return self._bits

    @property
    def group_size(self) -> int:
        return self._group_size

    @property
    def in_features(self) -> int:
        return self._shape[1]

    @property
    def out_features(self) -> int:
        return self._shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: packed codes, scales, offsets (and bias, and an act-order permutation)."""
        perm = self._perm32 if self._perm32 is not None else self._perm        # the kernels read int32
        extra = (0 if self.bias is None else self.bias.nbytes) + (0 if perm is None else perm.nbytes)
        if self.use_kernel:
            return self.packed.nbytes + extra
        n, k = self._shape
        qw = self._qweight
        assert qw is not None
        return n * k * self.bits // 8 + qw.scales.nbytes + qw.offsets.nbytes + extra

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] dense weight (for fingerprints, sharding and tests)."""
        return self.qweight.dequantize(dtype)

    def takes_addend(self, x: torch.Tensor, ordered: bool = False) -> bool:
        """Whether `self(x, addend=..., ordered=ordered)` is allowed: one 16-bit row on the kernel (the one-row
        kernel), with x in the order the kernel reads (not an act-order weight's x in the model's order: x is
        then gathered by a launch of its own first, which the one-row kernel's early reads of x must not race)."""
        return (self.use_kernel and (self._perm is None or ordered) and x.is_cuda and x.numel() == x.shape[-1]
                and x.dtype in (torch.float16, torch.bfloat16))

    def sums_width(self, t: int, dtype: torch.dtype, ordered: bool = False) -> int:
        """The width of the slices of x ([t, K] of `dtype`) whose float32 sums a call reads (`x_sums`): 128 or 32
        where it runs a pair-codes path of the kernel, else 0. The kernel that writes x can write them
        (`kernels.rms_norm.add_rms_norm`, `kernels.silu_mul.silu_mul`), so that the call needs no launch of its
        own for them. Not with act-order unless x arrives in the stored order (`ordered`; else x is gathered first,
        and the sums would be of another order's slices)."""
        if not self.use_kernel or (self._perm is not None and not ordered) or t < 1 or t >= self.dense_min_tokens:
            return 0
        from kernels.quant_matmul import pick_config, sums_width

        n, k = self._shape
        cfg = pick_config(t, n, k, self._bits, self.num_sms, self._group_size, dtype, async_dots=self.async_dots,
                          async_one_row=self.async_one_row)
        return sums_width(cfg, self.packed, dtype)

    def __call__(self, x: torch.Tensor, addend: torch.Tensor | None = None,
                 x_sums: torch.Tensor | None = None, beside_lora: bool = False,
                 split_out: bool = False, ordered: bool = False) -> torch.Tensor | SplitSum:
        """[T, N]. `addend` (float32, one row, `takes_addend`) is added before rounding and left zero; the call
        then follows the launch that wrote it (`kernels.quant_matmul.quant_matmul`'s condition). `x_sums`: x's
        slice sums as `sums_width` asks for them ([T, K / width] float32), written with x. `beside_lora`: a LoRA
        launch runs beside this call on another stream (`LlamaModel._project`); the kernel's config leaves room
        for it (`pick_config`). `split_out`: where the kernel splits K (and `defer_split_enabled`), the output
        as its partials (`kernels.split_sum.SplitSum`), for a kernel that reads them (the norm, RoPE, SwiGLU)
        to sum; otherwise a tensor as always. `ordered`: x is already in the stored channel order (`input_perm`,
        written so by the kernel before); no gather."""
        if ordered and self._perm is not None and self._perm32 is None:
            raise ValueError("this call dequantizes in the model's channel order: x cannot arrive in another")
        if addend is not None and not self.takes_addend(x, ordered):
            raise ValueError("an addend takes one 16-bit row on the quantized kernel (see takes_addend)")
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if not self.use_kernel:
            assert self._qweight is not None
            return F.linear(x, self._qweight.dequantize(x.dtype), bias)                    # [T, N]
        from kernels.perm import gather_columns
        from kernels.quant_dequant import dequantize_packed
        from kernels.quant_matmul import launch_split, pick_config, quant_matmul

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if self._perm32 is not None and not ordered:
            x2 = gather_columns(x2, self._perm32)
        t, (n, k) = x2.shape[0], self._shape
        if t >= self.dense_min_tokens:
            w = torch.empty(n, k, dtype=x.dtype, device=x.device)
            dequantize_packed(self.packed, w)
            return F.linear(x2, w, bias).view(*lead, n)
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
        may_defer = split_out and x.dim() == 2 and self.defer_split      # partials left to the next kernel if split
        cfg = pick_config(t, n, k, self._bits, self.num_sms, self._group_size, x.dtype,
                          addend is not None or beside_lora, self.async_dots, self.async_one_row, deferred=may_defer)
        split = launch_split(cfg, self.packed)
        partials = None
        if split > 1:
            partials = torch.empty(split, t, n, dtype=torch.float32, device=x.device)
        defer = split > 1 and may_defer
        quant_matmul(x2, self.packed, bias, out, cfg, partials, self.locks, addend, x_sums, defer_split=defer)
        if defer:
            from kernels.split_sum import SplitSum
            return SplitSum(partials, x.dtype)
        return out.view(*lead, n)


def _packable(qw: QuantizedWeight) -> bool:
    """Whether the kernel's packed layout holds this weight (group size a multiple of 32 that divides, or is
    a multiple of, the 256/128-wide packed block)."""
    from kernels.quant_pack import check_packable

    try:
        check_packable(*qw.shape, qw.bits, qw.group_size)
    except ValueError:
        return False
    return True
