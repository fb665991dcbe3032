"""Wire codecs for quantized collectives (ZeRO++'s qwZ and qgZ): a flat float tensor to bytes
and back.

Blockwise symmetric quantization with round-to-nearest: the tensor is cut into blocks of
``block`` elements, each with one fp32 scale ``absmax / qmax``; an element becomes
``round(x / scale)`` in ``[-qmax, qmax]`` (int8: 127, int4: 7, two per byte). Decoding gives
``q * scale``, so every element is within ``scale / 2 = absmax_block / (2 qmax)`` of its value
(bf16: a cast, relative error at most 2**-8). The wire form is one uint8 tensor: the payload,
then the scales' bytes, of a length that depends only on the element count, so every rank
knows how many bytes each peer sends.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zero_ray.errors import ConfigError


class Codec(Protocol):
    """A lossy (or lossless) encoding of flat float tensors."""

    name: str

    def nbytes(self, numel: int) -> int:
        """Bytes on the wire for ``numel`` elements."""
        ...

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``x`` (1-D float) into ``out`` (uint8 of ``nbytes(x.numel())``)."""
        ...

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Write the values ``src`` encodes into ``out`` (1-D float, the encoded length)."""
        ...


class CastCodec:
    """A narrower float dtype on the wire (bf16)."""

    def __init__(self, dtype: torch.dtype, name: str) -> None:
        self.dtype = dtype
        self.name = name
        self._size = torch.empty(0, dtype=dtype).element_size()

    def nbytes(self, numel: int) -> int:
        return numel * self._size

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.view(self.dtype).copy_(x)

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(src.view(self.dtype))


class BlockQuant:
    """Blockwise symmetric integer quantization (8 or 4 bits) with an fp32 scale per block."""

    def __init__(self, bits: int, block: int) -> None:
        if bits not in (4, 8):
            raise ConfigError(f"bits={bits} is not supported; use 8 or 4")
        if block < 2 or block % 2:
            raise ConfigError(f"block={block} must be an even number >= 2")
        self.bits = bits
        self.block = block
        self.qmax = 2 ** (bits - 1) - 1
        self.name = f"int{bits}"

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def _payload(self, numel: int) -> int:
        padded = self._blocks(numel) * self.block
        return padded if self.bits == 8 else padded // 2

    def nbytes(self, numel: int) -> int:
        return self._payload(numel) + 4 * self._blocks(numel)

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """The largest error decoding may leave in each element of ``x``: half a step of its block."""
        scales = self._scales(self._padded(x))
        return (scales / 2).repeat_interleave(self.block)[: x.numel()]

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        pad = self._blocks(n) * self.block - n
        x = x.float()
        if not pad:
            return x.view(-1, self.block)
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        return x.view(-1, self.block)

    def _scales(self, blocks: torch.Tensor) -> torch.Tensor:
        scales = blocks.abs().amax(dim=1) / self.qmax
        return torch.where(scales > 0, scales, torch.ones_like(scales))

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        # few passes over the data: a step's every gather and reduction goes through here
        n = x.numel()
        payload = self._payload(n)
        blocks = self._padded(x)
        scales = self._scales(blocks)
        q = torch.div(blocks, scales[:, None]).round_().clamp_(-self.qmax, self.qmax).view(-1)
        if self.bits == 8:
            out[:payload].view(torch.int8).copy_(q)
        else:
            u = q.add_(8).to(torch.uint8).view(-1, 2)  # 1..15: two per byte, the first in the low nibble
            torch.bitwise_or(u[:, 0], u[:, 1].bitwise_left_shift(4), out=out[:payload])
        out[payload:].view(torch.float32).copy_(scales)

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        payload = self._payload(n)
        scales = src[payload:].view(torch.float32)
        if self.bits == 8:
            q = src[:payload].view(torch.int8)
        else:
            packed = src[:payload]
            q = torch.empty(2 * payload, dtype=torch.int8, device=src.device)
            torch.bitwise_and(packed, 0x0F, out=q.view(torch.uint8)[0::2])
            torch.bitwise_right_shift(packed, 4, out=q.view(torch.uint8)[1::2])
            q.sub_(8)
        full = n // self.block * self.block
        if full:  # whole blocks straight into the output
            torch.mul(q[:full].view(-1, self.block), scales[:full // self.block, None], out=out[:full].view(-1, self.block))
        if full < n:
            out[full:].copy_(q[full:n].float() * scales[-1])


def codec(name: str, *, block: int = 256) -> Codec | None:
    """The codec of a ``Topology`` comm dtype; None for "fp32" (the buffer's own dtype, no codec)."""
    if name == "fp32":
        return None
    if name == "bf16":
        return CastCodec(torch.bfloat16, "bf16")
    if name == "int8":
        return BlockQuant(8, block)
    if name == "int4":
        return BlockQuant(4, block)
    raise ConfigError(f"comm dtype {name!r} is not one of fp32, bf16, int8, int4")
