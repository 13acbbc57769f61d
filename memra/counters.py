"""Process-wide liveness counters: the only module-level mutable state in memra.

Each counts work that actually ran on a path a gate is checking, so a gate can prove its path was
exercised (a gate that passes because nothing ran is a defect). They only ever increase; read them
with `snapshot()` before and after. Exported later on /metrics.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_counts = {
    "decode_batch_rows": 0,  # rows decoded through decode_step_batch[_sampled]
    "stacked_decode_forwards": 0,  # decode steps whose rows ran as one stacked forward (the stacked plan)
    "device_sampled_rows": 0,  # rows whose next token was chosen on the device
    "lean_parked_rows": 0,  # sampled rows whose logits were parked in cache.last_logits_dev
    "prime_pieces": 0,  # prompt pieces prime ran (a forward each, or a share of a batched one)
    "prime_batches": 0,  # prefill forwards that carried pieces of two or more sequences (step.prime_batch)
    "prime_batch_segments": 0,  # ... the pieces they carried
    "prime_batch_splits": 0,  # ... of those forwards, the ones that walked the stage split (PP)
    "kv_window_released_blocks": 0,  # KV blocks given back as they fell out of every layer's sliding window
    "mixed_steps": 0,  # decode steps that carried a prefill wave in their forward (step.mixed_step)
    "graph_captures": 0,  # decode steps recorded as CUDA graphs (memra.graphs)
    "graph_replays": 0,  # decode steps replayed from them
    "kernel_compiles": 0,
    "moe_front_merged": 0,  # MoE forwards that read router, shared gate and shared gate/up in one launch (model.ffn)
    "cpu_gdn_steps": 0,  # GDN delta-rule steps run in C, one call a layer for all rows and heads (memra.kernels.cpu_gdn)
    "cpu_layer_steps": 0,  # one-token layer steps run as one C call (memra.kernels.cpu_layer)
    "min_tokens_masked_rows": 0,  # sampled rows whose stop ids min_tokens masked (engine.sampler, sampling)
    "fp8_block_weights_loaded": 0,  # FP8 block-scaled weights dequantized at load (memra.loading.fp_source)
    "nvfp4_weights_loaded": 0,  # NVFP4 weights (modelopt or compressed-tensors) dequantized at load  # Triton kernels compiled or loaded from its disk cache (after warm-up: a stalled step)
    # speculative decoding (memra.spec)
    "spec_verify_forwards": 0,  # decode_step_t calls (T-token verify forwards)
    "spec_verify_columns": 0,  # tokens they fed (sum of T)
    "spec_verify_batch_rows": 0,  # sequences verified together in one forward (memra.verify_batch)
    "spec_verify_split_walks": 0,  # verify forwards that walked the stage split (MEMRA_SPEC_PP)
    "spec_drafted_tokens": 0,  # draft tokens proposed to a verify
    "spec_accepted_tokens": 0,  # ... of which the accept walk kept
    "spec_rollbacks": 0,  # verifies whose rejected suffix was dropped (trail or replay)
    # the prefix cache (memra.prefix)
    "prefix_queried_tokens": 0,  # prompt tokens of the sequences started with the prefix cache on
    "prefix_cached_tokens": 0,  # ... of those, served from it (a resumed prime skipped them)
    "prefix_pages_added": 0,  # 64-token prompt pages added to it
    "prefix_snapshots": 0,  # recurrent-state snapshots taken at aligned cuts (hybrids)
    "prefix_evicted_blocks": 0,  # KV blocks it gave back, least recently used first
    "prefix_forks": 0,  # sequences started as copies of a just-primed identical prompt (n > 1, repeated prompts)
    # pipeline parallelism (memra.pp)
    "pp_split_walks": 0,  # forwards that walked the stage split (any body)
    "pp_boundary_copies": 0,  # boundary payloads handed from one stage to the next
    "pp_peer_boundary_copies": 0,  # ... of which over a native cross-device peer copy
    "pp_peer_probe_bypassed": 0,  # bring-ups that skipped the peer probe (MEMRA_PEER_PROBE=0 + host bounce)
    "pp_peer_probes": 0,  # boundary probes run at bring-up (pattern + ladder)
    "pp_peer_runtime_probes": 0,  # runtime re-probes run
    "pp_peer_runtime_probe_failures": 0,
    "pp_peer_runtime_probe_deferred": 0,
    "dual_pp_overlaps": 0,  # a dual-wave stage section began while another stage section was running
    "dual_pp_slot_pairs": 0,  # wave pairs issued on two different boundary slots
    "dual_pp_slot_uses_0": 0,
    "dual_pp_slot_uses_1": 0,
    "dual_pp_slot_collisions": 0,  # wave pairs that would have shared a slot (refused)
    **{f"dual_pp_stage_{what}_{name}": 0 for what in ("ns", "samples")
       for name in ("wave_a_stage0", "wave_b_stage0", "wave_a_stage1", "wave_b_stage1")},  # MEMRA_DUAL_PP_TIMING=1
    "prime_split_chunks": 0,  # prime pieces walked through the stage split
    "prime_pipe_overlaps": 0,  # pipelined-prime stage sections that began while another ran
    # pipeline stages in separate processes (memra.pp.dist; counted on rank 0, the driver)
    "pp_dist_sends": 0,  # messages rank 0 sent down the pipeline (commands and boundary payloads)
    "pp_dist_replies": 0,  # replies (logits, acknowledgements) rank 0 received from the last stage
    "pp_dist_prime_pieces": 0,  # prompt pieces rank 0 sent through the stages
    "pp_dist_failures": 0,  # PipelineErrors raised because a rank died, hung or failed
    # scoring (memra.engine.scoring: echo / prompt_logprobs / LLM.score)
    "scored_tokens": 0,  # positions given a logprob
    "scored_prompt_tokens": 0,  # ... tokens primed with every position's logits (the prefill arithmetic)
    "scored_decode_tokens": 0,  # ... continuation tokens stepped with the decode arithmetic (verify columns)
    # structured output (memra.structured)
    "grammars_compiled": 0,  # constraints compiled by llguidance (cache misses)
    "grammar_masked_rows": 0,  # rows whose logits a grammar's mask was applied to before the token was chosen
    # weight updates and the training forward (memra.weights, memra.train)
    "weight_updates": 0,  # updates landed (llm.update_weights, POST /v1/update_weights)
    "weights_updated": 0,  # ... canonical weights copied in place by them
    "train_forwards": 0,  # memra.train.Trainer forwards
    "train_exact_tokens": 0,  # ... positions whose logprob came from the sampler's arithmetic (E11)
    "train_grad_tokens": 0,  # ... positions run through the differentiable walk (the gradient's path)
    "train_checkpointed_layers": 0,  # ... layer walks under activation checkpointing
}


def bump(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def delta(before: dict[str, int]) -> dict[str, int]:
    now = snapshot()
    return {k: now[k] - before.get(k, 0) for k in now}
