"""The GPU kernel of TopKGatherDot, in Triton: one kernel for the PyTorch host here and the TensorRT
plugin (runtime/tensorrt.py compiles it ahead of time), same contract as the ONNX node and the native CPU kernel.

    query_hat [B, Hkv, g, T, r]   key_cache [B, Hkv, r, S] (dim-major K^)   ->   scores [B, Hkv, g, T, S]

Arguments are ordered (input pointers, int32 scalars, output pointer) then compile-time constants:
the calling convention TensorRT's ahead-of-time plugin launch uses, so the same compiled kernel
serves both hosts. One program per (query row, block of S):

    the rule's keep set of the row (select.py: rank of |q^|, of the group's summed |q^|, or of r - c; ties: lower index)
    K^[rows, block] loaded under the mask `keep`  (masked lanes issue no memory traffic: k of r rows read)
    scores[block] = sum over kept rows of q^[c] * K^[c, block]   (float32 accumulation)
"""

from __future__ import annotations

import torch

from ...ops.spec import GROUP
from .select import group_block, jit, next_pow2, triton_for

tl = keep_of = None  # the kernel's free names, bound per mode by select.jit (triton is imported only there)


KERNEL_SIGNATURE = ("query_hat", "key_cache", "S", "rows_per_kv", "scores")  # the runtime arguments, in order


def topk_gather_dot_kernel(q_ptr, k_ptr, S, rows_per_kv, out_ptr,
                           R: tl.constexpr, K: tl.constexpr, RULE: tl.constexpr, G: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    bh = row // rows_per_kv
    c = tl.arange(0, BLOCK_R)
    in_r = c < R
    q = tl.load(q_ptr + row * R + c, mask=in_r, other=0.0).to(tl.float32)
    if RULE == GROUP:  # one selection for the group: the g rows of this token
        t_count = rows_per_kv // G
        t = (row % rows_per_kv) % t_count
        j = tl.arange(0, BLOCK_G)
        qg = tl.load(q_ptr + (bh * rows_per_kv + j[:, None] * t_count + t) * R + c[None, :],
                     mask=(j[:, None] < G) & in_r[None, :], other=0.0).to(tl.float32)
    else:
        qg = q[None, :]
    keep = tl.max(keep_of(qg, c, in_r, R, K, RULE).to(tl.int32), axis=0) > 0  # the group's rows agree
    s = blk * BLOCK_S + tl.arange(0, BLOCK_S)
    in_s = s < S
    kb = tl.load(k_ptr + bh * R * S + c[:, None] * S + s[None, :], mask=keep[:, None] & in_s[None, :], other=0.0)
    scores = tl.sum(tl.where(keep, q, 0.0)[:, None] * kb.to(tl.float32), axis=0)
    tl.store(out_ptr + row * S + s, scores.to(out_ptr.dtype.element_ty), mask=in_s)


def _kernel(interpret: bool):
    return jit(topk_gather_dot_kernel, interpret)


def jit_kernel():
    """The @triton.jit function itself (for ahead-of-time compilation by the TensorRT plugin)."""
    return _kernel(False)[0]


def block_sizes(r: int, s: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_S): r padded to a power of two; S blocks sized so a program holds <= 8k elements."""
    block_r = next_pow2(r)
    return block_r, max(16, min(next_pow2(s), 8192 // block_r))


def topk_gather_dot(query_hat: torch.Tensor, key_cache: torch.Tensor, k: int, interpret: bool | None = None,
                    rule: int = 0) -> torch.Tensor:
    """query_hat [B, Hkv, g, T, r], key_cache [B, Hkv, r, S] -> scores [B, Hkv, g, T, S] (query_hat's dtype).
    rule: a code of ops.spec (MAGNITUDE per query row, GROUP shared by the GQA group, STATIC the first k)."""
    if query_hat.dim() != 5 or key_cache.dim() != 4:
        raise ValueError("expected query_hat [B, Hkv, g, T, r] and key_cache [B, Hkv, r, S]")
    b, hkv, g, t, r = query_hat.shape
    if key_cache.shape[:3] != (b, hkv, r):
        raise ValueError(f"query_hat {tuple(query_hat.shape)} and key_cache {tuple(key_cache.shape)} disagree on B, Hkv or r")
    if not 1 <= k <= r:
        raise ValueError(f"k must be in [1, r={r}], got {k}")
    if interpret is None:
        interpret = not query_hat.is_cuda
    kernel, triton = _kernel(interpret)
    s = key_cache.shape[-1]
    q = query_hat.contiguous()
    kc = key_cache.contiguous().to(q.dtype)
    out = torch.empty(b, hkv, g, t, s, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    block_r, block_s = block_sizes(r, s)
    grid = (b * hkv * g * t, triton.cdiv(s, block_s))
    with triton_for(interpret):  # the interpreter also reads the mode while it runs
        kernel[grid](q, kc, s, g * t, out, R=r, K=k, RULE=rule, G=g, BLOCK_G=group_block(g),
                     BLOCK_R=block_r, BLOCK_S=block_s)
    return out
