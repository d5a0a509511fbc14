"""Quantized expert weights: the container, the quantizers, and the ``moe_xpu::moe_gemm_quant`` op.

One container, :class:`QuantizedExperts`, holds the experts' weights in one of four formats and
knows how the quantized kernel (``sycl/kernels/moe_gemm_quant.cpp``) reads them:

- ``"int8"``: int8 values [E, N, K] with a float32 scale per output channel; with int8 activations
  and a scale per token this is W8A8 (int32 accumulation), with float activations weight-only.
- ``"int4"``: 4-bit values with a float32 scale per group of ``group_size`` (32, 64 or 128) along K,
  symmetric (zero point 8) or with a uint8 zero point per group.
- ``"fp8"``: float8 e4m3fn values [E, N, K] with float32 scales per 128 x 128 block (the
  DeepSeek-V3 / Qwen3-FP8 checkpoint layout) or per output channel.
- ``"mxfp4"``: e2m1 values with an e8m0 scale (a power of two, uint8) per block of 32 along K (the
  GPT-OSS checkpoint layout).

Values are stored per output channel, K contiguous (the nn.Linear and checkpoint layout); 4-bit
values are packed eight to an int32 word in the kernel's lane order (see the kernel file).
Activations stay in float32, bfloat16 or float16 for the weight-only formats, and each weight is
dequantized in the kernel's k loop: no dequantized copy of the weights is ever made.
"""

from __future__ import annotations

import torch

from moe_xpu import _dispatch, _runtime, ops
from moe_xpu._dispatch import metadata

FORMATS = ("int8", "int4", "fp8", "mxfp4")
INT4_GROUP_SIZES = (32, 64, 128)
MXFP4_BLOCK = 32
PACKED_K = 128  # k per block of sixteen packed 4-bit words (the kernel's kPackedK)
PACKED_COLS = 8  # columns whose blocks are stored interleaved (the kernel's kPackedCols)
PACKED_FORMATS = ("int4", "mxfp4")  # 4-bit values in packed words (pack_nibbles)
FP8_MAX = 448.0
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_LAUNCHER_FORMAT = {"int8": "int8", "int4": "int4", "fp8": "fp8_e4m3", "mxfp4": "mxfp4"}


def _fail(message: str) -> None:
    raise ops.MoeXpuInputError(message)


# ---------------------------------------------------------------------------------------------
# 4-bit packing in the kernel's lane order
# ---------------------------------------------------------------------------------------------

def packed_words_shape(E: int, N: int, K: int) -> tuple[int, int, int]:
    """Shape of the int32 words holding [E, N, K] 4-bit values (pack_nibbles)."""
    return E, -(-N // PACKED_COLS), -(-K // PACKED_K) * PACKED_K


def output_columns(format: str, data: torch.Tensor, scale: torch.Tensor) -> int:
    """N of a container's tensors: data's rows for 8-bit formats; for 4-bit ones (whose data rows
    are chunks of columns), the scales' rows (their scale blocks are one column wide)."""
    return scale.shape[1] if format in PACKED_FORMATS else data.shape[1]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [E, N, K] -> int32 words [E, ceil(N / 8), ceil(K / 128) * 128]: for each
    block of 128 k of a column, word l holds k = 16 r + l (r = 0..7) in bits 4r..4r+3; columns go
    in chunks of 8 (N padded with zeros), a chunk's row holding block by block the 16 words of each
    of its 8 columns, so a tile of adjacent columns is one sequential read. K must be a multiple of
    16."""
    E, N, K = q.shape
    _, chunks, words = packed_words_shape(E, N, K)
    blocks = words // PACKED_K
    padded = torch.zeros(E, chunks * PACKED_COLS, blocks * PACKED_K, dtype=torch.uint8, device=q.device)
    padded[:, :N, :K] = q
    r = padded.view(E, chunks, PACKED_COLS, blocks, 8, 16)  # [e, chunk, column, block, r, l]
    pairs = r[..., 0::2, :] | (r[..., 1::2, :] << 4)  # byte b of word l: r = 2b (low), 2b + 1 (high)
    # -> [e, chunk, block, column, l, byte]
    return pairs.permute(0, 1, 3, 2, 5, 4).contiguous().view(torch.int32).reshape(E, chunks, words)


def unpack_nibbles(words: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 values [E, N, K]."""
    E, chunks, W = words.shape
    blocks = W // PACKED_K
    b = words.contiguous().view(torch.uint8).view(E, chunks, blocks, PACKED_COLS, 16, 4)
    b = b.permute(0, 1, 3, 2, 5, 4)  # [e, chunk, column, block, byte, l]
    values = torch.stack((b & 0xF, b >> 4), dim=5)  # [.., byte, low/high, l]: r = 2 byte + h
    return values.reshape(E, chunks * PACKED_COLS, blocks * PACKED_K)[:, :N, :K]


def _e2m1_table(device) -> torch.Tensor:
    pos = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat((pos, -pos))


def e2m1_to_float(nibbles: torch.Tensor) -> torch.Tensor:
    return _e2m1_table(nibbles.device)[nibbles.long()]


def e8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    e = exponents.to(torch.int32)
    out = torch.pow(2.0, (e - 127).to(torch.float32))
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


# ---------------------------------------------------------------------------------------------
# The container
# ---------------------------------------------------------------------------------------------

class QuantizedExperts:
    """Quantized weights of E experts standing for float weights b [E, K, N] (``moe_gemm``'s b).

    ``data``: int8 [E, N, K] (int8), float8_e4m3fn [E, N, K] (fp8), int32
    [E, ceil(N/8), ceil(K/128)*128] (int4, mxfp4: packed words, :func:`pack_nibbles`).
    ``scale``: float32 (uint8 exponents for mxfp4) [E, ceil(N / block_n), ceil(K / block_k)].
    ``zero``: uint8 like ``scale`` (int4) or None.
    ``block``: (block_n, block_k), the scale block. ``shape``: (E, K, N). ``k_contiguous_source``:
    made from ``w.transpose(1, 2)`` (``dequantize`` then returns that layout again).

    Build it with :func:`quantize_experts`, or from checkpoint tensors with :meth:`from_fp8`,
    :meth:`from_mxfp4`, :meth:`from_int8`.
    """

    def __init__(self, format: str, data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 block: tuple[int, int], shape: tuple[int, int, int], k_contiguous_source: bool = True):
        if format not in FORMATS:
            _fail(f"format must be one of {FORMATS}, got {format!r}")
        self.format = format
        self.data = data
        self.scale = scale
        self.zero = zero
        self.block = (int(block[0]), int(block[1]))
        self.shape = torch.Size(shape)
        self.k_contiguous_source = bool(k_contiguous_source)
        _check_container(self)

    # --- construction from checkpoint tensors ----------------------------------------------
    @classmethod
    def from_fp8(cls, weight, weight_scale_inv, block_size: tuple[int, int] | None = (128, 128)):
        """DeepSeek-V3 / Qwen3-FP8 experts as stored: ``weight`` float8_e4m3fn [E, N, K] (or a list
        of E nn.Linear weights [N, K]) and ``weight_scale_inv`` float32 [E, ceil(N/128), ceil(K/128)]
        (the dequantization multiplier, despite its name), or [E, N] / [E, N, 1] per channel with
        ``block_size=None``."""
        weight = _stack(weight, "weight")
        scale = _stack(weight_scale_inv, "weight_scale_inv")
        if weight.dtype != torch.float8_e4m3fn:
            _fail(f"weight must be torch.float8_e4m3fn, got {weight.dtype}")
        if weight.dim() != 3:
            _fail(f"weight must be [E, N, K], got shape {tuple(weight.shape)}")
        E, N, K = weight.shape
        if block_size is None:
            scale = scale.reshape(E, N, 1) if scale.dim() == 2 else scale
            block = (1, max(K, 1))
        else:
            block = tuple(block_size)
        return cls("fp8", weight, scale.float(), None, block, (E, K, N))

    @classmethod
    def from_mxfp4(cls, blocks, scales):
        """GPT-OSS experts as stored: ``blocks`` uint8 [E, N, K / 32, 16] (two e2m1 values a byte,
        the even k in the low nibble) and ``scales`` uint8 [E, N, K / 32] (e8m0 exponents)."""
        blocks, scales = _stack(blocks, "blocks"), _stack(scales, "scales")
        if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16:
            _fail(f"blocks must be uint8 [E, N, K / 32, 16], got {blocks.dtype} {tuple(blocks.shape)}")
        E, N, nb, _ = blocks.shape
        if scales.dtype != torch.uint8 or tuple(scales.shape) != (E, N, nb):
            _fail(f"scales must be uint8 [E, N, K / 32] = [{E}, {N}, {nb}], got {scales.dtype} {tuple(scales.shape)}")
        K = nb * MXFP4_BLOCK
        nibbles = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).reshape(E, N, K)
        return cls("mxfp4", pack_nibbles(nibbles), scales.contiguous(), None, (1, MXFP4_BLOCK), (E, K, N))

    @classmethod
    def from_int8(cls, b: torch.Tensor, b_scale: torch.Tensor):
        """int8 weights b [E, K, N] (either layout moe_gemm accepts, read in place) with float32
        scales per output channel b_scale [E, N]."""
        if not isinstance(b, torch.Tensor) or b.dtype != torch.int8 or b.dim() != 3:
            _fail(f"b must be an int8 [E, K, N] tensor, got {getattr(b, 'dtype', type(b).__name__)}")
        E, K, N = b.shape
        if not isinstance(b_scale, torch.Tensor) or tuple(b_scale.shape) != (E, N) or b_scale.dtype != torch.float32:
            _fail(f"b_scale must be float32 [E, N] = [{E}, {N}], got "
                  f"{getattr(b_scale, 'dtype', None)} {tuple(getattr(b_scale, 'shape', ()))}")
        return cls("int8", b.transpose(1, 2), b_scale.reshape(E, N, 1), None, (1, max(K, 1)), (E, K, N),
                   k_contiguous_source=b.stride(1) == 1 or K <= 1)

    # --- tensor-like helpers ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def group_size(self) -> int:
        return self.block[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored values plus scales (and zero points)."""
        total = self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
        return total + (self.zero.numel() if self.zero is not None else 0)

    def to(self, device) -> "QuantizedExperts":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedExperts(self.format, move(self.data), move(self.scale), move(self.zero), self.block,
                                tuple(self.shape), self.k_contiguous_source)

    def expert_slice(self, start: int, stop: int) -> "QuantizedExperts":
        """Experts start..stop-1 (views)."""
        E, K, N = self.shape
        zero = None if self.zero is None else self.zero[start:stop]
        return QuantizedExperts(self.format, self.data[start:stop], self.scale[start:stop], zero, self.block,
                                (stop - start, K, N), self.k_contiguous_source)

    def scales_per_element(self) -> torch.Tensor:
        """float32 [E, N, K]: the scale of every weight."""
        E, K, N = self.shape
        bn, bk = self.block
        s = e8m0_to_float(self.scale) if self.format == "mxfp4" else self.scale.float()
        return s.repeat_interleave(bn, dim=1)[:, :N].repeat_interleave(bk, dim=2)[:, :, :K]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weights this stands for, [E, K, N], in the layout it was made from."""
        E, K, N = self.shape
        if self.format == "int8":
            values = self.data.float()
        elif self.format == "fp8":
            values = self.data.float()
        else:
            nibbles = unpack_nibbles(self.data, N, K)
            if self.format == "mxfp4":
                values = e2m1_to_float(nibbles)
            else:
                zero = 8.0 if self.zero is None else _per_element(self.zero.float(), self.block, N, K)
                values = nibbles.float() - zero
        w = (values * self.scales_per_element()).to(dtype)  # [E, N, K]
        return w.transpose(1, 2) if self.k_contiguous_source else w.transpose(1, 2).contiguous()

    def __repr__(self) -> str:
        E, K, N = self.shape
        return (f"QuantizedExperts(format={self.format!r}, E={E}, K={K}, N={N}, block={self.block}, "
                f"zero_points={self.zero is not None}, device={self.device})")


def _per_element(t: torch.Tensor, block: tuple[int, int], N: int, K: int) -> torch.Tensor:
    return t.repeat_interleave(block[0], dim=1)[:, :N].repeat_interleave(block[1], dim=2)[:, :, :K]


def _stack(t, name: str) -> torch.Tensor:
    if isinstance(t, (list, tuple)):
        if not t or not all(isinstance(x, torch.Tensor) for x in t):
            _fail(f"{name} must be a tensor or a non-empty list of tensors")
        if t[0].dtype == torch.float8_e4m3fn:  # torch 2.8 cannot copy float8 in stack: move bytes
            return torch.stack([x.view(torch.uint8) for x in t]).view(torch.float8_e4m3fn)
        return torch.stack(list(t))
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_container(q: QuantizedExperts) -> None:
    """Everything the kernel relies on, checked once when the container is made."""
    E, K, N = q.shape
    bn, bk = q.block
    data, scale, zero = q.data, q.scale, q.zero
    if not isinstance(data, torch.Tensor) or not isinstance(scale, torch.Tensor):
        _fail("data and scale must be tensors")
    if bn < 1 or bk < 1:
        _fail(f"block sizes must be positive, got {q.block}")
    if bk % 16 != 0 and bk < K:
        _fail(f"the scale block along K must be a multiple of 16 or cover all of K = {K}, got {bk}")
    expected_data = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.int32, "mxfp4": torch.int32}[q.format]
    if data.dtype != expected_data:
        _fail(f"{q.format} data must be {expected_data}, got {data.dtype}")
    if q.format == "int8" and bk < K:
        _fail(f"int8 scales are per output channel (block_k >= K = {K}), got blocks of {bk} along K")
    if q.format in PACKED_FORMATS:
        if bk < 16 or bk & (bk - 1):
            _fail(f"the {q.format} group size along K must be a power of two of at least 16, got {bk}")
        if K % bk != 0:
            _fail(f"K = {K} must be a multiple of the {q.format} group size {bk}")
        shape = packed_words_shape(E, N, K)
        if tuple(data.shape) != shape or not data.is_contiguous():
            _fail(f"{q.format} data must be contiguous packed words [E, ceil(N / 8), ceil(K / 128) * 128] = "
                  f"{list(shape)}, got {tuple(data.shape)}")
    elif tuple(data.shape) != (E, N, K):
        _fail(f"{q.format} data must be [E, N, K] = [{E}, {N}, {K}], got {tuple(data.shape)}")
    scale_shape = (E, -(-N // bn), -(-K // bk) if K else 1)
    scale_dtype = torch.uint8 if q.format == "mxfp4" else torch.float32
    if tuple(scale.shape) != scale_shape or scale.dtype != scale_dtype:
        _fail(f"{q.format} scale must be {scale_dtype} {list(scale_shape)} (blocks {q.block}), got "
              f"{scale.dtype} {list(scale.shape)}")
    if zero is not None:
        if q.format != "int4":
            _fail("zero points are for the int4 format only")
        if tuple(zero.shape) != scale_shape or zero.dtype != torch.uint8:
            _fail(f"int4 zero points must be uint8 {list(scale_shape)}, got {zero.dtype} {list(zero.shape)}")
    for name, t in (("scale", scale), ("zero", zero)):
        if t is not None and t.device != data.device:
            _fail(f"{name} is on {t.device} but data is on {data.device}")


# ---------------------------------------------------------------------------------------------
# Quantizers
# ---------------------------------------------------------------------------------------------

def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic int8 quantization of each row of x [T, K] (on x's device):
    returns (x_int8 [T, K], scale float32 [T]) with x ~= x_int8 * scale[:, None]."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        _fail(f"x must be a 2-D float tensor [T, K], got {getattr(x, 'dtype', type(x).__name__)} "
              f"{tuple(getattr(x, 'shape', ()))}")
    T, K = x.shape
    C = _runtime.sycl_module()
    if (x.device.type == "cpu" and C is not None and 0 < T * K <= _QUANTIZE_ON_HOST
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        # One pass in the launcher (sycl/host_checks.cpp), the same bits: a decode step's few rows
        # cost a chain of seven torch ops otherwise, each waking torch's thread pool.
        x = x if x.stride(1) == 1 else x.contiguous()
        q = torch.empty(T, K, dtype=torch.int8)
        scale = torch.empty(T, dtype=torch.float32)
        C.quantize_rows_on_host(x.data_ptr(), ops._launcher_dtype(x.dtype), T, K, x.stride(0), q.data_ptr(),
                                scale.data_ptr())
        return q, scale
    if x.device.type != "cpu" or K == 0 or T * K <= _QUANTIZE_CHUNK:
        return _quantize_rows(x)
    # On the CPU, rows in chunks of about a megabyte of float32: the temporaries stay in cache and
    # are reused, where whole-tensor temporaries are fresh allocations faulted in on every call
    # (2048 x 2048 bf16: 2.5-2.7 ms in chunks, 3.6-14 ms whole by the allocator's state). Each row's
    # result does not depend on the chunking: the same bits.
    q = torch.empty(T, K, dtype=torch.int8)
    scale = torch.empty(T, dtype=torch.float32)
    rows = max(1, _QUANTIZE_CHUNK // K)
    for start in range(0, T, rows):
        q[start:start + rows], scale[start:start + rows] = _quantize_rows(x[start:start + rows])
    return q, scale


_QUANTIZE_CHUNK = 1 << 18  # elements of x per chunk (1 MB of float32)
_QUANTIZE_ON_HOST = 1 << 17  # up to this many elements of x (CPU), quantize_rows_on_host


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token's arithmetic on rows of x: scale = max |x| / 127, round half to even."""
    xf = x.float()
    amax = xf.abs().amax(dim=1) if x.shape[1] else torch.zeros(x.shape[0], device=x.device)
    scale = amax / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # In place on the float copy (float32 x is not copied, and must not be written).
    scaled = xf / safe[:, None] if xf is x else xf.div_(safe[:, None])
    return scaled.round_().clamp_(-127, 127).to(torch.int8), scale


def _float_weights(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """w [E, K, N] -> (float32 [E, N, K], whether w was K-contiguous)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.is_floating_point():
        _fail(f"w must be a 3-D float tensor [E, K, N], got {getattr(w, 'dtype', type(w).__name__)} "
              f"{tuple(getattr(w, 'shape', ()))}")
    k_contiguous = w.shape[1] <= 1 or w.stride(1) == 1
    return w.detach().float().transpose(1, 2), k_contiguous


def _block_amax(wt: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """max |w| over each bn x bk block of wt [E, N, K] (padded blocks at the edges)."""
    E, N, K = wt.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros(E, nb * bn, kb * bk, dtype=torch.float32, device=wt.device)
    padded[:, :N, :K] = wt.abs()
    return padded.view(E, nb, bn, kb, bk).amax(dim=(2, 4))


def quantize_experts(w: torch.Tensor, format: str, *, group_size: int = 128, zero_point: bool = False,
                     block_size: tuple[int, int] | None = (128, 128)) -> QuantizedExperts:
    """Quantizes float expert weights w [E, K, N] (a contiguous tensor or ``w.transpose(1, 2)`` of
    nn.Linear-layout weights) into ``format``:

    - ``"int8"``: symmetric, a scale per output channel;
    - ``"int4"``: a scale per ``group_size`` (32, 64, 128) along K; symmetric, or with a uint8 zero
      point per group when ``zero_point`` (asymmetric min/max);
    - ``"fp8"``: e4m3fn with a scale per ``block_size`` (N, K) block, (128, 128) by default, or per
      output channel with ``block_size=None``;
    - ``"mxfp4"``: e2m1 values with a power-of-two scale per block of 32 along K (OCP MX).
    """
    if format not in FORMATS:
        _fail(f"format must be one of {FORMATS}, got {format!r}")
    wt, k_contiguous = _float_weights(w)
    E, N, K = wt.shape
    if format == "int8":
        amax = wt.abs().amax(dim=2, keepdim=True) if K else torch.zeros(E, N, 1, device=wt.device)
        scale = amax / 127.0
        q = torch.round(wt / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-127, 127)
        return QuantizedExperts("int8", q.to(torch.int8), scale, None, (1, max(K, 1)), (E, K, N), k_contiguous)
    if format == "fp8":
        bn, bk = (1, max(K, 1)) if block_size is None else (int(block_size[0]), int(block_size[1]))
        if bn < 1 or bk < 1 or (bk % 16 and bk < K):
            _fail(f"block_size must be positive with its K size a multiple of 16, got {block_size}")
        scale = _block_amax(wt, bn, bk) / FP8_MAX
        per = _per_element(torch.where(scale > 0, scale, torch.ones_like(scale)), (bn, bk), N, K)
        q = (wt / per).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedExperts("fp8", q, scale, None, (bn, bk), (E, K, N), k_contiguous)
    if format == "int4":
        if group_size not in INT4_GROUP_SIZES:
            _fail(f"group_size must be one of {INT4_GROUP_SIZES} for int4, got {group_size}")
        if K % group_size:
            _fail(f"K = {K} must be a multiple of group_size = {group_size}")
        g = wt.reshape(E, N, K // group_size, group_size)
        if zero_point:
            lo, hi = g.amin(dim=3).clamp(max=0.0), g.amax(dim=3).clamp(min=0.0)
            scale = (hi - lo) / 15.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            zero = torch.round(-lo / safe).clamp_(0, 15)
            q = torch.round(g / safe[..., None] + zero[..., None]).clamp_(0, 15)
            zero_t = zero.to(torch.uint8)
        else:
            scale = g.abs().amax(dim=3) / 7.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(g / safe[..., None]).clamp_(-8, 7) + 8
            zero_t = None
        q = q.reshape(E, N, K).to(torch.uint8)
        return QuantizedExperts("int4", pack_nibbles(q), scale, zero_t, (1, group_size), (E, K, N), k_contiguous)
    # mxfp4
    if K % MXFP4_BLOCK:
        _fail(f"K = {K} must be a multiple of the MXFP4 block {MXFP4_BLOCK}")
    g = wt.reshape(E, N, K // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = g.abs().amax(dim=3)
    # OCP MX: shared exponent floor(log2(amax)) - 2 (e2m1's largest exponent), clamped to e8m0.
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127.0))
    exp = exp.clamp_(-127, 127)
    scaled = g / torch.pow(2.0, exp)[..., None]
    mag = scaled.abs().clamp(max=6.0).contiguous()
    # Round to the nearest e2m1 value, ties to the even code (0, 1, 2, 4 win their midpoints).
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=wt.device)
    nearest = torch.bucketize(mag, midpoints)  # a value on a midpoint goes to the lower code
    nearest += (mag == 0.75) | (mag == 1.75) | (mag == 3.5)  # ... unless the upper one is even
    nibbles = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8).reshape(E, N, K)
    scales = (exp + 127).to(torch.uint8)
    return QuantizedExperts("mxfp4", pack_nibbles(nibbles), scales, None, (1, MXFP4_BLOCK), (E, K, N), k_contiguous)


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_quant_metadata(a, q_data, q_scale, q_zero, group_offsets, a_scale, gather_index, bias, format,
                         K, N, block_n, block_k, out_dtype) -> torch.dtype:
    """Checks everything knowable without reading values; returns the output dtype."""
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        _fail(f"a must be a 2-D tensor [T, K], got {tuple(getattr(a, 'shape', ()))}")
    if a.shape[1] != K:
        _fail(f"the weights' K ({K}) must equal a.shape[1] = {a.shape[1]}")
    w8a8 = a.dtype == torch.int8
    if w8a8:
        if format != "int8":
            _fail(f"int8 a (W8A8) needs int8 weights, got {format!r} weights")
        if a_scale is None:
            _fail("int8 a needs a_scale: float32 [T], one scale per row of a")
        if block_k < K:
            _fail(f"int8 a (W8A8) needs one weight scale per output channel, got scale blocks of {block_k} along K = {K}")
        if out_dtype is None:
            out_dtype = torch.bfloat16
        if out_dtype not in FLOAT_DTYPES:
            _fail(f"out_dtype must be bfloat16, float16 or float32 for int8 a, got {out_dtype}")
    else:
        if a.dtype not in FLOAT_DTYPES:
            _fail(f"a must be float32, bfloat16, float16 or (with int8 weights and a_scale) int8, got {a.dtype}")
        if a_scale is not None:
            _fail("a_scale is for int8 a (W8A8) only")
        out_dtype = ops._resolve_out_dtype(a, out_dtype)
    if a_scale is not None:
        if a_scale.dtype != torch.float32 or a_scale.dim() != 1 or a_scale.shape[0] != a.shape[0]:
            _fail(f"a_scale must be float32 [T] = [{a.shape[0]}], got {a_scale.dtype} {tuple(a_scale.shape)}")
    E = q_data.shape[0]
    if group_offsets.dim() != 1 or group_offsets.dtype not in ops.INDEX_DTYPES:
        _fail(f"group_offsets must be 1-D int32 or int64, got {group_offsets.dtype} {tuple(group_offsets.shape)}")
    if group_offsets.shape[0] != E:
        _fail(f"group_offsets must have E = {E} entries (one per expert), got {group_offsets.shape[0]}")
    if gather_index is not None and (gather_index.dim() != 1 or gather_index.dtype not in ops.INDEX_DTYPES):
        _fail(f"gather_index must be 1-D int32 or int64, got {gather_index.dtype} {tuple(gather_index.shape)}")
    if bias is not None:
        if tuple(bias.shape) != (E, N) or not bias.is_floating_point():
            _fail(f"bias must be a float tensor [E, N] = [{E}, {N}], got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (("weights", q_data), ("scales", q_scale), ("zero points", q_zero), ("group_offsets", group_offsets),
                    ("a_scale", a_scale), ("gather_index", gather_index), ("bias", bias)):
        if t is not None and t.device != a.device:
            _fail(f"{name} on {t.device} but a is on {a.device}: all inputs must share a device")
    if a.device.type not in ("cpu", "xpu"):
        _fail(f"a must be a CPU or XPU tensor, got device {a.device}")
    return out_dtype


def _container(q_data, q_scale, q_zero, format, K, N, block_n, block_k) -> QuantizedExperts:
    return QuantizedExperts(format, q_data, q_scale, q_zero, (block_n, block_k), (q_data.shape[0], K, N))


_SYMMETRIC_ZEROS: dict = {}


def _symmetric_zero(device: torch.device) -> torch.Tensor:
    """The zero point of 4-bit values without their own (8: unsigned nibbles 0..15 stand for -8..7),
    one byte per device the kernel reads with strides 0."""
    zero = _SYMMETRIC_ZEROS.get(device)
    if zero is None:
        zero = _SYMMETRIC_ZEROS[device] = torch.full((1,), 8, dtype=torch.uint8, device=device)
    return zero


def quant_args(a, q: QuantizedExperts, group_offsets, a_scale, gather_index, bias, out):
    """The launcher's GemmArgs for quantized weights (strides of 8-bit data in bytes, of 4-bit data
    in words)."""
    C = _runtime.sycl_module()
    E, K, N = q.shape
    se, sn, sk = q.data.stride()
    args = C.GemmArgs(
        _runtime.queue_address(a.device), getattr(C.DType, _LAUNCHER_FORMAT[q.format]), ops._launcher_dtype(a.dtype),
        ops._launcher_dtype(out.dtype), a.data_ptr(), a.stride(0), a.shape[0], q.data.data_ptr(), se, sk, sn,
        out.data_ptr(), out.stride(0), out.shape[0], group_offsets.data_ptr(), group_offsets.dtype == torch.int64,
        E, K, N)
    scale = q.scale
    args.b_scale = scale.data_ptr()
    args.scale_stride_e, args.scale_stride_n, args.scale_stride_k = scale.stride()
    args.scale_block_n, args.scale_block_k = q.block
    zero = q.zero if q.zero is not None else _symmetric_zero(a.device)
    args.b_zero = zero.data_ptr()
    if q.zero is not None:
        args.zero_stride_e, args.zero_stride_n, args.zero_stride_k = zero.stride()
    if a_scale is not None:
        args.a_scale = a_scale.data_ptr()
    return ops.set_optional_inputs(args, gather_index, bias)


def _kernel_ready(a, q: QuantizedExperts, group_offsets, a_scale, gather_index, bias):
    a = ops.rows_contiguous(a)
    group_offsets = group_offsets.contiguous()
    gather_index = None if gather_index is None else gather_index.contiguous()
    a_scale = None if a_scale is None else a_scale.contiguous()
    bias = None if bias is None else bias.float().contiguous()
    return a, group_offsets, a_scale, gather_index, bias


# Kept per call metadata (see _dispatch.MetadataTable), so that a repeated call (a decode step's
# shapes, token after token) neither builds launch arguments nor plans again: it only reads its
# tensors' addresses.
_QUANT_LAUNCHES = _dispatch.MetadataTable()


def run_quant(a, q: QuantizedExperts, group_offsets, a_scale, gather_index, bias, out_dtype, *,
              activation: int = 0, up_offset: int = 0, out_columns: int | None = None,
              scatter_index=None, row_weight=None, out_rows: int | None = None,
              gather_matches_offsets: bool = True, configure=None):
    """Launches the quantized kernel (inputs checked). The fused MoE passes its epilogue: the
    gated activation (activation, up_offset, out_columns), scatter index, row weight, and with
    ``gather_matches_offsets=False`` an index table longer than the groups' rows. Where the plan
    asks for float32 A (``ops.prepare_launch``), 16-bit A is widened once and the float32 output
    rounded to ``out_dtype`` after (the same rounding as the kernel's: the same bits).
    ``configure(args)`` (tests, tuning) edits the launcher's arguments before they are planned;
    such a call is planned afresh and not kept."""
    a, group_offsets, a_scale, gather_index, bias = _kernel_ready(a, q, group_offsets, a_scale, gather_index, bias)
    rows = out_rows if out_rows is not None else (a.shape[0] if gather_index is None else gather_index.shape[0])
    N = out_columns if out_columns is not None else q.shape[2]

    key = (metadata(a), q.format, q.shape, q.block, metadata(q.data), metadata(q.scale), metadata(q.zero),
           metadata(group_offsets), metadata(a_scale), metadata(gather_index), metadata(bias), out_dtype,
           activation, up_offset, N, metadata(scatter_index), metadata(row_weight), rows, gather_matches_offsets)
    prepared = _QUANT_LAUNCHES.get(key) if configure is None else None
    if prepared is None:
        args = quant_args(a, q, group_offsets, a_scale, gather_index, bias,
                          torch.empty(rows, N, dtype=out_dtype, device=a.device))
        args.N = N
        args.activation, args.up_offset = activation, up_offset
        args.gather_matches_offsets = gather_matches_offsets
        if scatter_index is not None:
            args.scatter_index = scatter_index.data_ptr()
            args.scatter_is_int64 = scatter_index.dtype == torch.int64
        if row_weight is not None:
            args.row_weight = row_weight.data_ptr()
        if configure is not None:
            configure(args)
        prepared = ops.prepare_launch(args, a, widen_out=True)
        if configure is None:
            prepared = _QUANT_LAUNCHES.keep(key, prepared)
    out = torch.empty(rows, N, dtype=prepared.out_dtype(out_dtype), device=a.device)
    zero = q.zero if q.zero is not None else _symmetric_zero(a.device)
    queue = 0 if a.device.type == "cpu" else _runtime.queue_address(a.device)
    prepared.launch(queue, a, q.data.data_ptr(), group_offsets.data_ptr(),
                    0 if gather_index is None else gather_index.data_ptr(), 0 if bias is None else bias.data_ptr(),
                    out.data_ptr(), 0 if scatter_index is None else scatter_index.data_ptr(),
                    0 if row_weight is None else row_weight.data_ptr(), q.scale.data_ptr(), zero.data_ptr(),
                    0 if a_scale is None else a_scale.data_ptr())
    return out if out.dtype == out_dtype else out.to(out_dtype)


def reference_quant(a, q: QuantizedExperts, group_offsets, a_scale, gather_index, bias, out_dtype):
    """The plain-PyTorch path (CPU tensors without the SYCL runtime, MOE_XPU_BACKEND=torch):
    dequantized weights (and activations), float32 grouped GEMM."""
    from moe_xpu import torch_fallback

    af = a.float() * a_scale[:, None] if a_scale is not None else a
    w = q.dequantize(torch.float32)
    return torch_fallback.moe_gemm(af.float(), w, group_offsets, gather_index,
                                   None if bias is None else bias.float(), out_dtype)


@torch.library.custom_op("moe_xpu::moe_gemm_quant", mutates_args=())
def _moe_gemm_quant_op(
    a: torch.Tensor,
    q_data: torch.Tensor,
    q_scale: torch.Tensor,
    q_zero: torch.Tensor | None,
    group_offsets: torch.Tensor,
    a_scale: torch.Tensor | None,
    gather_index: torch.Tensor | None,
    bias: torch.Tensor | None,
    format: str,
    K: int,
    N: int,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    raise NotImplementedError(f"moe_xpu.moe_gemm (quantized) has no implementation for device {a.device}")


_CHECKED = _dispatch.MetadataTable()


def _checked_out_dtype(a, q_data, q_scale, q_zero, group_offsets, a_scale, gather_index, bias, format, K, N,
                       block_n, block_k, out_dtype) -> torch.dtype:
    """check_quant_metadata, kept per metadata: a repeated call is not checked again. Arguments of
    other types than the checks take are not kept (the checks then name them)."""
    tensors = (a, q_data, q_scale, q_zero, group_offsets, a_scale, gather_index, bias)
    settings = (format, K, N, block_n, block_k, out_dtype)
    if not (all(t is None or isinstance(t, torch.Tensor) for t in tensors)
            and all(v is None or isinstance(v, (str, int, torch.dtype)) for v in settings)):
        return check_quant_metadata(*tensors, *settings)
    key = tuple(metadata(t) for t in tensors) + settings
    found = _CHECKED.get(key)
    return found if found is not None else _CHECKED.keep(key, check_quant_metadata(*tensors, *settings))


def _quant_impl(a, q_data, q_scale, q_zero, group_offsets, a_scale, gather_index, bias, format, K, N,
                block_n, block_k, out_dtype=None):
    out_dtype = _checked_out_dtype(a, q_data, q_scale, q_zero, group_offsets, a_scale, gather_index, bias,
                                   format, K, N, block_n, block_k, out_dtype)
    q = _container(q_data, q_scale, q_zero, format, K, N, block_n, block_k)
    return _run_checked(a, q, group_offsets, a_scale, gather_index, bias, out_dtype)


def _run_checked(a, q: QuantizedExperts, group_offsets, a_scale, gather_index, bias, out_dtype):
    if a.device.type == "xpu":
        ops._check_values_on_device(a, group_offsets, gather_index)
        if _runtime.sycl_module() is None:
            raise RuntimeError(f"moe_xpu: the SYCL launcher is not available: {_runtime.import_error()}")
    elif _runtime.cpu_backend() == "torch":
        ops._check_values_on_host(a, group_offsets, gather_index)
        return reference_quant(a, q, group_offsets, a_scale, gather_index, bias, out_dtype)
    return run_quant(a, q, group_offsets, a_scale, gather_index, bias, out_dtype)


_dispatch.register_device_kernel(_moe_gemm_quant_op, _quant_impl)


@_moe_gemm_quant_op.register_fake
def _moe_gemm_quant_fake(a, q_data, q_scale, q_zero, group_offsets, a_scale, gather_index, bias, format, K, N,
                         block_n, block_k, out_dtype=None):
    out_dtype = check_quant_metadata(a, q_data, q_scale, q_zero, group_offsets, a_scale, gather_index, bias,
                                     format, K, N, block_n, block_k, out_dtype)
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    return a.new_empty(rows, N, dtype=out_dtype)


def as_quantized(b, b_scale) -> QuantizedExperts | None:
    """moe_gemm's b as a container: itself, int8 b with b_scale, or None for float weights."""
    if isinstance(b, QuantizedExperts):
        if b_scale is not None:
            _fail("b_scale is given by the QuantizedExperts b itself; pass b_scale only with an int8 tensor b")
        return b
    if isinstance(b, torch.Tensor) and b.dtype == torch.int8:
        if b_scale is None:
            _fail("int8 b needs b_scale: float32 [E, N], one scale per output channel")
        return QuantizedExperts.from_int8(b, b_scale)
    if b_scale is not None:
        _fail(f"b_scale is for int8 b, got b of dtype {getattr(b, 'dtype', type(b).__name__)}")
    return None


def moe_gemm_quantized(a, q: QuantizedExperts, group_offsets, *, a_scale=None, gather_index=None, bias=None,
                       out_dtype=None) -> torch.Tensor:
    E, K, N = q.shape
    bn, bk = q.block
    if _dispatch.direct_call_ok(a, q.data, q.scale, q.zero, group_offsets, a_scale, gather_index, bias):
        # q is checked as made: the direct call skips remaking it from its tensors (as the op does)
        out_dtype = _checked_out_dtype(a, q.data, q.scale, q.zero, group_offsets, a_scale, gather_index, bias,
                                       q.format, K, N, bn, bk, out_dtype)
        return _run_checked(a, q, group_offsets, a_scale, gather_index, bias, out_dtype)
    return _moe_gemm_quant_op(a, q.data, q.scale, q.zero, group_offsets, a_scale, gather_index, bias, q.format,
                              K, N, bn, bk, out_dtype)
