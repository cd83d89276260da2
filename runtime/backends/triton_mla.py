"""TritonMLABackend: MLA layers through the Triton MLA kernel (triton_mla.py), float32 included.

FlashInfer's MLA kernels exist for 16-bit activations only; the Triton kernel computes in float32
(`ieee` dots for float32 inputs) and takes any power-of-two latent rank and rope width. As its own
backend, with its own declaration, routing can pick it: a float32 Kimi-Linear or Bailing artifact
compiled for cuda routes MLA here instead of dying inside FlashInfer at start-up, and
`--route mla_attention=triton_mla` picks it for a 16-bit artifact (what `mla_impl="triton"` on
the FlashInfer backend used to be, a constructor option routing never saw).

It is FlashInferAttentionBackend with `mla_impl="triton"` and MLA layers only: the paged metadata,
the store of this step's rows, the static buffers of captured decode graphs and the padding are
that backend's, tested with it; FlashInfer itself is never imported (no FlashInfer wrapper serves
an MLA layer under the Triton kernel). Decode steps read the page table and sequence lengths as
they are (the kernel's page-table mode): nothing is planned on the host for them; extend and mixed
steps of up to `whole_extend_tokens` tokens read them with the step's query offsets (the kernel's
varlen form: nothing planned either, so their buckets may be whole-step graphs), larger ones build
the paged metadata for the kernel's row arrays. Lifecycle: runtime/backends/flashinfer_attention.py.

Its routing options are that backend's: `kv_splits` ("auto", the default, or "fixed") splits every
row's keys at fixed positions, so a row's output is the same bits in any step of any batch (decode,
target_verify, extend and mixed: the Triton kernel serves them all here); `whole_extend_tokens`
bounds the extend and mixed steps on the varlen form, which graphs may capture.
"""

from __future__ import annotations

from compiler.splitops import DTYPES, BackendCapability, LayerKind, Mode, ShapeLimit
from runtime.backends.flashinfer_attention import (KV_SPLITS, MLA_EXTEND_CAPTURE, WHOLE_EXTEND_TOKENS,
                                                   FlashInferAttentionBackend, full_layer_options)
from runtime.backends.protocol import BackendSetup

__all__ = ["TritonMLABackend"]

_POW2_WHY = "the Triton MLA kernel tiles the latent and the rope part whole (tl.arange needs a power of two)"


class TritonMLABackend(FlashInferAttentionBackend):
    name = "triton_mla"
    capability = BackendCapability(
        name="triton_mla", device="cuda", ops=frozenset({"mla_attention"}), kinds=frozenset({LayerKind.FULL_MLA}),
        modes_capturable=frozenset({Mode.DECODE}), op_capture=(MLA_EXTEND_CAPTURE,), dtypes=frozenset(DTYPES),
        limits=(ShapeLimit("mla_attention", "q_latent", -1, power_of_two=True, why=_POW2_WHY),
                ShapeLimit("mla_attention", "q_rope", -1, power_of_two=True, why=_POW2_WHY)),
        # the FlashInfer backend's options of those names
        options=(("kv_splits", KV_SPLITS), ("whole_extend_tokens", WHOLE_EXTEND_TOKENS)),
        batch_invariant=(("kv_splits", "fixed"),),
        priority=0,
        doc="MLA through the Triton split-KV kernel (triton_mla.py): every dtype; decode captured, extend and "
            "mixed steps of up to whole_extend_tokens tokens captured (its varlen form), larger ones eager")

    @classmethod
    def build(cls, setup: BackendSetup) -> "TritonMLABackend":
        return cls(setup.kv_pool, **full_layer_options(setup), **cls._kernel_options(setup.options))

    def __init__(self, kv_pool, q_heads, scales=None, **kwargs):
        kwargs.setdefault("workspace_bytes", 0)  # FlashInfer's float workspace: no FlashInfer wrapper runs here
        super().__init__(kv_pool, q_heads, scales, mla_impl="triton", **kwargs)
        gqa = [i for i, g in self.layers.items() if g.kind != "mla"]
        if gqa:
            raise ValueError(f"{self.name} serves MLA layers only; layers {gqa} are GQA")

    def _kernel_library(self):
        """No FlashInfer: every layer of this backend runs the Triton kernel."""
        return None
