"""Plain numpy references shared by the tests (no numbakv code inside)."""

import numpy as np


def f32_to_bf16_bits(x) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the 16-bit patterns."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    out[nan] = 0x7FC0
    return out


def bf16_bits_to_f32(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def random_storage(rng, shape, dtype: str) -> np.ndarray:
    """Random data in a storage dtype (uint16 bit patterns for bfloat16)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x)
    return x.astype(dtype)


def as_f32(arr, dtype: str) -> np.ndarray:
    return bf16_bits_to_f32(arr) if dtype == "bfloat16" else np.asarray(arr, dtype=np.float32)
