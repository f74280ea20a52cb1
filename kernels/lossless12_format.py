"""Lossless 12-bit bf16 weight format: 8-bit sign+mantissa plane + 4-bit exponent-code plane + exception list.

bf16 = 1 sign | 8 exponent | 7 mantissa bits. Trained (and GGUF-dequantized) weights use a narrow exponent range,
so per tensor we keep the 15 most frequent exponents in a 16-entry table and store each weight as
    hi[i] = sign << 7 | mantissa          (uint8 plane, one byte per weight)
    code  = index of its exponent in exp_table, 0..14; code 15 = ESCAPE   (uint8 plane `lo`, two codes per byte:
            element 2j in the low nibble of lo[j], element 2j+1 in the high nibble)
A weight whose exponent is not in the table is an escape: its code is 15, its hi byte is 0 and exp_table[15] = 0,
so the shift/mask decode below yields exactly +0.0 for it, and its original bf16 bits go to the exception list
(exc_index: sorted flat indices, exc_bits: original bits as int16). A GEMV kernel can therefore decode every
weight in registers with shifts, masks and one 16-entry lookup, and apply the exceptions as an additive sparse
correction  y[row] += exc_value * x[col]  (exact, because the decoded escape is +0). `exc_row_ptr` (CSR offsets
over rows = flat_index // shape[-1]) lets the kernel for one output row find its exceptions without a search.

Decode of one weight (what a kernel does):
    bits = (hi & 0x80) << 8 | exp_table[code] << 7 | (hi & 0x7F)
The flat (row-major) layout keeps a block of weights along the input dimension contiguous in both planes; when
shape[-1] is even (every real weight matrix) each row starts on a byte boundary of `lo`. See docs/LOSSLESS12.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ESCAPE = 15          # reserved exponent code
TABLE_SIZE = 16      # codes 0..14 are exponents, 15 is the escape
N_EXPONENTS = TABLE_SIZE - 1


@dataclass
class Packed12:
    shape: tuple[int, ...]
    exp_table: torch.Tensor     # uint8[16]: exponent of code c; entry 15 (escape) is 0
    hi: torch.Tensor            # uint8[n]: sign << 7 | mantissa; 0 for escapes
    lo: torch.Tensor            # uint8[ceil(n/2)]: two 4-bit exponent codes a byte (even element in the low nibble)
    exc_index: torch.Tensor     # int64[k]: sorted flat indices of escapes
    exc_bits: torch.Tensor      # int16[k]: their original bf16 bits
    exc_row_ptr: torch.Tensor   # int32[rows+1]: exceptions of row r are exc_index[ptr[r]:ptr[r+1]]

    @property
    def numel(self) -> int:
        return self.hi.numel()

    @property
    def n_escapes(self) -> int:
        return self.exc_index.numel()

    @property
    def escape_rate(self) -> float:
        return self.n_escapes / max(self.numel, 1)

    @property
    def nbytes(self) -> int:
        """Every stored byte: both planes, the exponent table, the exception list and its row offsets."""
        return sum(t.numel() * t.element_size()
                   for t in (self.exp_table, self.hi, self.lo, self.exc_index, self.exc_bits, self.exc_row_ptr))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / max(self.numel, 1)


def _bits(w: torch.Tensor) -> torch.Tensor:
    """The raw bf16 bits of w as non-negative int32 (0..65535), flattened."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16:
        got = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
        raise TypeError(f"lossless12 encodes bfloat16 tensors only, got {got}; convert with .to(torch.bfloat16) "
                        f"first if that conversion is what you mean (it is lossy for fp32/fp16)")
    return w.detach().contiguous().view(torch.int16).flatten().to(torch.int32) & 0xFFFF


def exponent_histogram(w: torch.Tensor) -> torch.Tensor:
    """int64[256]: how many elements of the bf16 tensor w have each biased exponent (0 = zero/subnormal,
    255 = inf/NaN)."""
    return torch.bincount((_bits(w) >> 7) & 0xFF, minlength=256)


def _rows_cols(shape: tuple[int, ...], n: int) -> tuple[int, int]:
    cols = max(shape[-1], 1) if len(shape) else 1
    return (n // cols if n else 0), cols


def encode(w: torch.Tensor) -> Packed12:
    """Pack a bf16 tensor into the 12-bit format, on w's device. Bit-exact: decode(encode(w)) has w's bits, NaN
    payloads too."""
    b = _bits(w)
    n = b.numel()
    exp = (b >> 7) & 0xFF
    hist = torch.bincount(exp, minlength=256)
    order = torch.sort(hist, descending=True, stable=True).indices[:N_EXPONENTS]
    chosen = order[hist[order] > 0].sort().values          # the used ones among the 15 most frequent, ascending
    exp_table = torch.zeros(TABLE_SIZE, dtype=torch.uint8, device=b.device)
    exp_table[:chosen.numel()] = chosen.to(torch.uint8)
    lut = torch.full((256,), ESCAPE, dtype=torch.int32, device=b.device)
    lut[chosen] = torch.arange(chosen.numel(), dtype=torch.int32, device=b.device)

    code = lut[exp]
    esc = code == ESCAPE
    hi = ((b >> 8) & 0x80) | (b & 0x7F)
    hi = torch.where(esc, torch.zeros_like(hi), hi).to(torch.uint8)
    if n % 2:
        code = torch.cat([code, code.new_zeros(1)])          # tail nibble of an odd count is 0
    lo = (code[0::2] | (code[1::2] << 4)).to(torch.uint8)

    exc_index = esc.nonzero().flatten().to(torch.int64)       # nonzero() is sorted
    exc_bits = w.detach().contiguous().view(torch.int16).flatten()[exc_index].clone()
    rows, cols = _rows_cols(tuple(w.shape), n)
    per_row = torch.bincount(exc_index // cols, minlength=rows)
    exc_row_ptr = torch.cat([per_row.new_zeros(1), per_row.cumsum(0)]).to(torch.int32)
    return Packed12(tuple(w.shape), exp_table, hi, lo, exc_index, exc_bits, exc_row_ptr)


def decode(p: Packed12) -> torch.Tensor:
    """The bf16 tensor p was encoded from, bit for bit."""
    n = p.hi.numel()
    lo = p.lo.to(torch.int32)
    code = torch.stack([lo & 0xF, lo >> 4], dim=1).flatten()[:n]
    hi = p.hi.to(torch.int32)
    bits = ((hi & 0x80) << 8) | (p.exp_table.to(torch.int32)[code] << 7) | (hi & 0x7F)   # escapes decode to +0
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    bits[p.exc_index] = p.exc_bits
    return bits.view(torch.bfloat16).reshape(p.shape)


def tensor_stats(name: str, w: torch.Tensor) -> dict:
    """Measurement row for one bf16 tensor: distinct exponents, top-15/16 coverage, escape rate, bits/weight."""
    hist = exponent_histogram(w).to(torch.float64)
    top = hist.sort(descending=True).values
    n = max(w.numel(), 1)
    p = encode(w)
    return dict(name=name, shape=tuple(w.shape), numel=w.numel(), distinct=int((hist > 0).sum()),
                top15=float(top[:15].sum() / n), top16=float(top[:16].sum() / n), escapes=p.n_escapes,
                escape_rate=p.escape_rate, nbytes=p.nbytes, bits_per_weight=p.bits_per_weight,
                exact=bool(torch.equal(decode(p).view(torch.int16), w.contiguous().view(torch.int16))))


@dataclass
class Packed12Linear:
    """A [N, K] weight in the 12-bit format, as device tensors the kernel reads."""
    hi16: torch.Tensor      # int16 [N, K/2]: the hi bytes of elements 2j (low byte) and 2j+1 (high byte)
    lo: torch.Tensor        # uint8 [N, K/2]: their exponent codes (2j low nibble, 2j+1 high nibble)
    table: torch.Tensor     # int32 [16]: exponent << 23 per code; the escape code's entry is 0
    exc_row: torch.Tensor   # int32 [E]: escapes' rows, sorted
    exc_col: torch.Tensor   # int32 [E]: escapes' columns
    exc_val: torch.Tensor   # float32 [E]: escapes' exact values
    row_ptr: torch.Tensor   # int32 [N + 1]: escapes of row n are exc_*[row_ptr[n]:row_ptr[n + 1]]
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.hi16, self.lo, self.table, self.exc_row, self.exc_col, self.exc_val, self.row_ptr))


def to_linear_planes(w: torch.Tensor, device=None) -> Packed12Linear:
    """A bf16 [N, K] weight (K even) encoded and laid out for the fused linear kernel (kernels/lossless12_linear.py)."""
    if w.dim() != 2 or w.shape[1] % 2:
        raise ValueError(f"lossless12 linear weights must be 2-D with an even number of columns, got {tuple(w.shape)}")
    n, k = w.shape
    p = encode(w.to(device) if device is not None else w)  # encodes on the GPU when given one: seconds, not minutes
    exc_row = (p.exc_index // k).to(torch.int32)
    planes = Packed12Linear(
        hi16=p.hi.view(torch.int16).reshape(n, k // 2), lo=p.lo.reshape(n, k // 2),
        table=p.exp_table.to(torch.int32) << 23, exc_row=exc_row, exc_col=(p.exc_index % k).to(torch.int32),
        exc_val=(p.exc_bits.to(torch.int32) << 16).view(torch.float32), row_ptr=p.exc_row_ptr, shape=(n, k))
    return Packed12Linear(**{f: (getattr(planes, f).to(device) if f != "shape" else planes.shape)
                             for f in planes.__dataclass_fields__})


def decode_linear_weight(w: Packed12Linear, dtype=torch.bfloat16) -> torch.Tensor:
    """The [N, K] weight, decoded with torch ops (the exact values the fused kernel multiplies with)."""
    h = w.hi16.to(torch.int32) & 0xFFFF
    c = w.lo.to(torch.int32)
    even = ((h & 0x80) << 24) | w.table[c & 15] | ((h & 0x7F) << 16)
    odd = ((h & 0x8000) << 16) | w.table[c >> 4] | ((h & 0x7F00) << 8)
    full = torch.stack([even, odd], dim=-1).reshape(w.shape).view(torch.float32)
    full[w.exc_row.long(), w.exc_col.long()] = w.exc_val
    if dtype == torch.bfloat16:  # the top half of the fp32 bits: exact, NaN payloads too (a float cast is not)
        return (full.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return full.to(dtype)

