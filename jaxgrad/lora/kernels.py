r"""The LoRA block's kernel switch: which pieces of :func:`jaxgrad.lora.block.block` run as Pallas kernels.

``backend="xla"`` (the default): everything in ``jnp``, the block's hand-written VJP as before.
``backend="pallas"``, per block (``r`` the fp32 row statistic, f64 for f64):

* **Both RMSNorms.** Forward (and its recompute in the backward): ``rms_norm_fwd_pallas`` writes
  :math:`h = w \odot (x r)` and :math:`r = (\overline{x^2} + \varepsilon)^{-1/2}`; ``r`` is what the block saves,
  exactly as on the XLA path. Backward: ``rms_norm_bwd_pallas``,
  :math:`\bar x = r(w \bar h - n\, \overline{n\, w \bar h})`, :math:`\bar w = \sum_\mathrm{rows} \bar h\, n`
  with :math:`n = x r` recomputed from the saved ``r``; the block's fp32 :math:`\bar h` is read unrounded.
* **NF4 base weights.** Where a projection's frozen ``W`` is an :class:`NF4Weight`, its base product
  :math:`X W^\top` (forward, recompute) and :math:`\bar Y W` (backward) come from ``nf4_matmul_fwd_pallas`` /
  ``nf4_matmul_dx_pallas``, which read the packed codes tile by tile (the dequantised ``W`` is never formed). Each
  weight element is rounded to the activation dtype, as ``base_weight(w, dtype)`` does on the XLA path, and both
  products come back unrounded in fp32 so that :func:`lora_linear_fwd` / :func:`lora_linear_bwd` add the LoRA
  term and round once, as on the XLA path. The frozen base gets no gradient (as always).
* **SwiGLU**: the forward ``m = silu(e) u`` and the backward ``de = dm u silu'(e)``, ``du = dm
  silu(e)`` as the elementwise Pallas kernels of :mod:`jaxgrad.ops.swiglu` (fp32 arithmetic; ``m`` and ``de``, ``du``
  rounded once to the activation dtype; the fp32 ``dm`` read unrounded).
* **Everything else** (attention, RoPE, the LoRA rank-r matmuls, dense base weights) stays on XLA.

``backend="mosaic"`` (Hopper): each projection's forward with an adapter (a dense weight, or an NF4 one
dequantised to the activation dtype by XLA first) -- in the forward and in the backward's recompute -- is
:func:`jaxgrad.ops.lora_linear_mgpu.lora_linear_fwd_mgpu`, one Mosaic GPU kernel computing ``X W^T + s (X A^T) B^T``
with ``fold_lora_b``'s arithmetic (``sU`` rounded once to the operand dtype, one rounding of ``Y``), where the call
qualifies (a GPU, 16-bit operands, no dropout mask, ``fold_lora_b``; sizes off the kernels' tiles are zero-padded by
the kernels' wrappers); and each such projection's ``dX = dY W + (s dY B) A`` in the backward is
:func:`jaxgrad.ops.lora_linear_mgpu.lora_linear_dx_mgpu` (``dX`` in the operand dtype, as PEFT's bf16 autograd
writes it: half the bytes of fp32, and the sums q + k + v, gate + up stay fp32; ``s dY B`` rounded once to the
operand dtype). Both kernels read their rank-r products ``sU``, ``sG`` from a skinny XLA GEMM and return them, from
which XLA forms ``dB = dY^T (sU)`` and ``dA = (sG)^T h`` without a second skinny pass over ``h`` or ``dY``.
Elsewhere, and for everything else (``dA``, ``dB`` themselves, attention, norms), the XLA path.

``interpret``: ``None`` lets :mod:`jaxgrad.pallas_backend` decide (interpret mode unless JAX's default backend is
a GPU, where the kernels are compiled by Triton); ``True`` / ``False`` force it (tests on a GPU machine's CPU force
``True``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.ops import nf4_matmul
from jaxgrad.ops.nf4 import NF4Weight, nf4_absmax, nf4_dequantize
from jaxgrad.ops.rmsnorm import rms_norm_apply, rms_norm_bwd, rms_norm_bwd_pallas, rms_norm_fwd_pallas, rms_norm_rstd
from jaxgrad.ops.swiglu import _bwd_math as swiglu_bwd_math
from jaxgrad.ops.swiglu import swiglu_bwd_pallas, swiglu_fwd_pallas, swiglu_reference
from jaxgrad.train.mesh import GatheredWeight, whole

__all__ = ["BACKENDS", "BlockKernels", "base_weight"]

BACKENDS = ("xla", "reference", "pallas", "mosaic")  # block(backend=...); "reference" never reaches this module


def base_weight(w, dtype):
    """The frozen ``[out, in]`` weight in ``dtype``: ``w`` itself if it is an array, else an NF4 weight dequantised
    (:func:`jaxgrad.ops.nf4.nf4_dequantize`); a :class:`~jaxgrad.train.mesh.GatheredWeight` (a sharded layer's)
    gathered first. The XLA path's base operand, and what the Mosaic GPU kernels read."""
    w = whole(w)
    if isinstance(w, (jax.Array, np.ndarray)):
        return w if w.dtype == dtype else w.astype(dtype)
    return nf4_dequantize(w, dtype)


def _on_gpu() -> bool:
    """Whether this trace is for a GPU (the Mosaic GPU kernels run nowhere else; tests lowering for a GPU on a CPU
    replace it)."""
    return jax.default_backend() == "gpu"


def _nf4_operands(w: NF4Weight):
    """What the NF4 kernels read: packed uint8 codes, the float32 absmax per block (double quantisation decoded
    here: ``n / blocksize`` values, small), the static shape and blocksize."""
    w = whole(w)
    return jnp.asarray(w.packed, jnp.uint8), nf4_absmax(w), tuple(w.shape), int(w.blocksize)


@dataclasses.dataclass(frozen=True)
class BlockKernels:
    """Static (hashable) kernel choice of one block call; a ``nondiff_argnums`` argument of the block's VJP."""

    backend: str = "xla"  # "xla", "pallas" or "mosaic"
    interpret: bool | None = None
    # projections sharing an input as one GEMM with the LoRA A rows folded in (jaxgrad.lora.grouped); off by
    # default: on the H100 the same time at +459 MiB of peak memory (docs/design.md)
    group: bool = False
    # the backward recomputes the attention half for real, after the MLP backward (an optimization_barrier): less
    # peak memory, more time (block.py's module doc, "What the VJP saves"); off by default
    low_memory: bool = False
    # each projection's LoRA B folded into its base GEMM along K, [X | sU] [W | B]^T (lora_linear_fwd's fold_b);
    # block() turns it on by default (H100: the same time, 131 MiB less peak memory; docs/design.md)
    fold_b: bool = False
    # attention="cudnn" with a padding mask: cuDNN takes it as per-row key lengths (its padding-causal mask, no mask
    # tensor). block() sets it only for a concrete right-padded mask (jaxgrad.ops.attention.right_padded); otherwise,
    # and by default, the mask goes in as a boolean [B, 1, T, T] mask, right for any mask (block._cudnn_attention)
    cudnn_key_lengths: bool = False
    # the backward recomputes the MLP half for real (an optimization_barrier ties its input to dy): the forward's
    # gate, up and SwiGLU activations die after the forward instead of living until the backward; more time
    recompute_mlp: bool = False

    @property
    def pallas(self) -> bool:
        return self.backend == "pallas"

    def norm(self, x, w, eps, rstd=None):
        """``(h, r)``: ``h = RMSNorm(x; w)`` and the row statistic ``r`` (fp32; f64 for f64). With ``rstd`` given
        (the backward's recompute) that saved ``r`` is returned. The Pallas path recomputes ``h`` with the same
        kernel as the forward, so the recomputed ``h`` has the forward's bits (its own ``r``, which the kernel
        recomputes from the same ``x``, is the saved one)."""
        if self.pallas:
            h, r = rms_norm_fwd_pallas(x, w, eps, interpret=self.interpret)
            return h, (r if rstd is None else rstd)
        r = rms_norm_rstd(x, eps) if rstd is None else rstd
        return rms_norm_apply(x, w, r), r

    def norm_bwd(self, x, w, rstd, dh, dx_dtype):
        """``(dx, dw)`` from the saved ``rstd``: ``dx = r (w dh - n mean(n w dh))``, ``dw = sum_rows dh n``."""
        if self.pallas:
            return rms_norm_bwd_pallas(x, w, rstd, dh, dx_dtype, interpret=self.interpret)
        return rms_norm_bwd(x, w, rstd, dh, dx_dtype)

    def _mosaic(self, w, a, keep_scale) -> bool:
        """Whether a projection may take the Mosaic GPU kernels: the mosaic backend on a GPU, an adapter and no
        dropout mask (the shapes and dtypes are the kernels' own ``supported`` checks). An NF4 weight is dequantised
        by XLA to the activation dtype first (``base_weight``: the XLA path's rounding; the forward's and the
        backward's dequantisations are one after XLA's CSE in a training step)."""
        return self.backend == "mosaic" and a is not None and keep_scale is None and _on_gpu()

    def lora_fwd(self, h, w, a, b, scale, keep_scale):
        """``(Y, sU)``: the projection's output and ``s h A^T`` (rounded once to the operand dtype, for the
        backward's ``dB``) by the Mosaic GPU kernel (``backend="mosaic"``, module doc), or ``None`` where the call
        does not qualify and the XLA path computes it."""
        if not (self.fold_b and self._mosaic(w, a, keep_scale)):
            return None
        from jaxgrad.ops.lora_linear_mgpu import lora_linear_fwd_mgpu, supported

        w = base_weight(w, h.dtype)  # an NF4 weight dequantised (a dense one as it is)
        a, b = a.astype(h.dtype), b.astype(h.dtype)  # fp32 master adapters: operands in the activation dtype,
        # as the dX kernel takes them and as PEFT's autocast does (a bf16 adapter is unchanged)
        if supported(h.reshape(-1, h.shape[-1]), w, a, b) is not None:
            return None
        return lora_linear_fwd_mgpu(h, w, a, b, scale, return_su=True)

    def lora_dx(self, dy, w, a, b, scale, keep_scale, dtype):
        """``(dX, sG)``: the projection's whole ``dX = dY W + (s dY B) A`` in ``dtype`` (the sums of the projections'
        ``dX`` stay fp32) and ``sG = s dY B`` (rounded once to ``dtype``, for the backward's ``dA``) by the Mosaic GPU
        kernel (``backend="mosaic"``; ``dy`` rounded once to ``dtype`` first, as
        :func:`jaxgrad.ops.lora_linear.lora_linear_bwd` does), or ``None`` where the call does not qualify."""
        if not self._mosaic(w, a, keep_scale):
            return None
        from jaxgrad.ops.lora_linear_mgpu import lora_linear_dx_mgpu, supported_dx

        w = base_weight(w, dtype)  # an NF4 weight dequantised (a dense one as it is)
        d2 = dy.reshape(-1, dy.shape[-1]).astype(dtype)
        a, b = a.astype(dtype), b.astype(dtype)
        if supported_dx(d2, w, a, b) is not None:
            return None
        return lora_linear_dx_mgpu(d2, w, a, b, scale, out_dtype=dtype, return_sg=True)

    def swiglu(self, e, u):
        """``m = silu(e) u``: the Pallas kernel on the pallas backend (fp32 arithmetic, one rounding to e's dtype;
        float64 compiled for a GPU takes the XLA path, as the NF4 kernels do), else the plain reference (HF's
        ``act_fn(gate) * up`` in the activation dtype)."""
        if self.pallas and not nf4_matmul.compiled_f64(e.dtype, self.interpret):
            return swiglu_fwd_pallas(e, u, interpret=self.interpret)
        return swiglu_reference(e, u)

    def swiglu_bwd(self, e, u, dm, cdt):
        """``(de, du)``: ``de = dm u silu'(e)``, ``du = dm silu(e)``, ``silu'(e) = sigma(e) (1 + e (1 - sigma(e)))``.
        The Pallas kernel (pallas backend) reads the fp32 ``dm`` unrounded and writes ``de``, ``du`` in e's dtype
        (the projections' products take them in that dtype anyway); else XLA, in ``cdt``."""
        if self.pallas and not nf4_matmul.compiled_f64(e.dtype, self.interpret):
            return swiglu_bwd_pallas(e, u, dm, interpret=self.interpret)
        return swiglu_bwd_math(e.astype(cdt), u.astype(cdt), dm)

    def nf4_kernel(self, w) -> bool:
        return self.pallas and isinstance(w.value if isinstance(w, GatheredWeight) else w, NF4Weight)

    def base_fwd(self, h, w):
        """``h W^T`` in fp32 (f64 for f64) by the NF4 kernel, or ``None`` where the XLA path computes it (also for
        float64 compiled for a GPU: :func:`jaxgrad.ops.nf4_matmul.compiled_f64`)."""
        if not self.nf4_kernel(w) or nf4_matmul.compiled_f64(h.dtype, self.interpret):
            return None
        return nf4_matmul.nf4_matmul_fwd_pallas(h, *_nf4_operands(w), interpret=self.interpret, w_dtype=h.dtype,
                                                out_dtype=jnp.promote_types(h.dtype, jnp.float32))

    def base_dx(self, dy, w, dtype):
        """``dY W`` (``dy`` the block's fp32 sums rounded once to the block's ``dtype``, as the XLA path's
        :func:`jaxgrad.ops.lora_linear.lora_linear_bwd` does; ``W`` rounded to ``dtype``; fp32 accumulation) by the
        NF4 kernel, or ``None`` where the XLA path computes it. For a bf16 block that is one bf16 tensor-core pass,
        not the three exact passes an fp32 ``dy`` needs."""
        if not self.nf4_kernel(w) or nf4_matmul.compiled_f64(dtype, self.interpret):
            return None
        cdt = jnp.promote_types(dtype, jnp.float32)
        return nf4_matmul.nf4_matmul_dx_pallas(dy.astype(dtype), *_nf4_operands(w), interpret=self.interpret,
                                               w_dtype=dtype, out_dtype=cdt)


XLA = BlockKernels()
