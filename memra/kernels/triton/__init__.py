"""The batch-invariant GPU twins (Triton) of memra.kernels.reference, one module per family:

    linear     dense matmul, one frozen tile per bucket of M          (reference.linear)
    quant      matmuls over split GGUF weights (Q8_0, Q4_K, Q5_K, Q6_K) (quant.reference_linear)
    norm       RMS, residual + RMS and gated RMS row norms             (reference.*_norm)
    rope       rotary embedding, one fused elementwise launch          (reference.apply_rope)
    activation SwiGLU's silu(gate) * up in one launch, torch's bits    (reference.silu_mul)
    attention  paged decode, split at fixed positions                 (reference.paged_*)
    prefill_attention  causal prefill: one prompt piece, or every piece
               of a wave in one launch                                 (reference.prefill_attention*)
    gdn        the delta rule: recurrent step / scan, chunked prefill  (reference.delta_rule_*, gdn_prefill*)
    gdn_heads  GDN's token preparation: l2 norms, scale, heads, gates (reference.gdn_heads)
    conv       GDN's causal conv: prompt, a wave's pieces, decode step (reference.causal_conv*)
    moe        grouped expert matmuls planned on the device            (reference.moe_experts)
    sampling   a batch's seeded sampling in one launch                 (memra.sampling.device_sample)
    common     what several families share: the interpreter switch, fp32 -> bf16 rounding

Every module here needs Triton; memra.kernels.table imports them only where Triton is installed and is the
one place that picks between a family and its twin. The families depend on the twins (reference, quant,
cuts) and on `common` / `linear`, never on the table or the self-test (memra.kernels.exact).
"""
