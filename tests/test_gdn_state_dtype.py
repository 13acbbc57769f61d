"""The GDN state stored in bf16 (MEMRA_GDN_STATE_DTYPE=bfloat16, vLLM's --mamba-ssm-cache-dtype bfloat16).

The kernels compute in fp32 and round the state to its storage dtype wherever some path stores it: after every
token of the recurrent step (a decode's state goes through memory; a verify's scan keeps it in registers) and
after every 64-token chunk of the chunked prefill (a prompt cut there continues from the stored state). So the
promises that hold for an fp32 state hold for a bf16 one, bit for bit, within that dtype:
- the kernels: a verify's scan == decode steps; a prompt in 64-aligned pieces == one shot; a wave == its pieces;
- a model: E5 (chunked prime), decode after either, the gate's arms (E1, E4) on the CPU's ops and on the GPU's
  kernel table in Triton's interpreter.
Against the fp32 state the tokens may differ (the state loses 16 bits each step): the door's liveness is that
the stored state is bf16 and the logits move.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import gpu_kernel_table, hf_dir
from memra.config.from_hf import from_hf_config
from memra.errors import ConfigError, MemraError
from memra.gate import run_battery
from memra.kernels import reference
from memra.kernels.exact import gdn_prefill_inputs
from memra.settings import Settings

BF16 = {"MEMRA_GDN_STATE_DTYPE": "bfloat16"}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _inputs(t: int, h: int = 2, dk: int = 32, dv: int = 48):
    """gdn_prefill_inputs (the kernels' own checks' arguments) on the CPU, the state stored in bf16."""
    q, k, v, beta, decay, s0 = gdn_prefill_inputs(t, h, dk, dv, device="cpu", seed=60)
    return q, k, v, beta, decay, s0.bfloat16()


def test_the_checkpoint_names_the_state_dtype_and_the_door_overrides_it():
    raw = json.loads((hf_dir("qwen3_5") / "config.json").read_text())
    assert from_hf_config(raw).gdn.state_dtype == "float32"  # where the checkpoint names none
    cfg = from_hf_config({**raw, "mamba_ssm_dtype": "bfloat16"})
    assert cfg.gdn.state_dtype == "bfloat16" and cfg.gdn.state_torch_dtype == torch.bfloat16
    assert cfg.with_gdn_state("auto") is cfg and cfg.with_gdn_state("float32").gdn.state_dtype == "float32"
    with pytest.raises(ConfigError, match="mamba_ssm_dtype = 'float16'"):
        from_hf_config({**raw, "mamba_ssm_dtype": "float16"})
    with pytest.raises(MemraError, match="MEMRA_GDN_STATE_DTYPE='fp8' is not one of auto, float32, bfloat16"):
        Settings.from_env({"MEMRA_GDN_STATE_DTYPE": "fp8"})
    llama = from_hf_config(json.loads((hf_dir("llama") / "config.json").read_text()))
    assert llama.with_gdn_state("bfloat16") is llama  # no GDN layers, no state


def test_the_pools_store_the_state_in_its_dtype(load_model):
    from memra.cache import RecurrentPool

    fp32 = load_model(hf_dir("qwen3_5"))
    bf16 = fp32.with_doors(**BF16)
    assert bf16.cfg.gdn.state_dtype == "bfloat16" and fp32.cfg.gdn.state_dtype == "float32"
    pools = [RecurrentPool(m.cfg, 2, m.dtype, "cpu") for m in (fp32, bf16)]
    assert {t.dtype for t in pools[1].ssm.values()} == {torch.bfloat16}
    g = fp32.cfg.gdn
    ssm_bytes = len(fp32.cfg.gdn_layers) * g.n_v_heads * g.k_head_dim * g.v_head_dim * 2  # what bf16 saves a slot
    assert pools[0].slot_bytes - pools[1].slot_bytes == ssm_bytes
    assert bf16.new_cache(64).ssm_state(fp32.cfg.gdn_layers[0]).dtype == torch.bfloat16


def test_the_interpreted_kernels_carry_the_state_as_they_store_it():
    """The Triton kernels (interpreted): a verify's scan over T tokens == T decode steps through memory, every
    state bf16; a prompt in 64-aligned pieces == one shot, a wave == its pieces; the twins agree to bf16's
    rounding (each side rounds the state once a step, where fp32 noise may round it the other way)."""
    from memra.kernels.pieces import RecurrentPieces
    from memra.kernels.triton import gdn as gdn_triton

    q, k, v, beta, decay, s0 = _inputs(150)
    o, states = gdn_triton.delta_rule_scan(q[None, :5], k[None, :5], v[None, :5], beta[None, :5], decay[None, :5],
                                           s0[None])
    assert states.dtype == torch.bfloat16
    s = s0
    for j in range(5):
        oj, s = gdn_triton.delta_rule_step(q[j], k[j], v[j], beta[j], decay[j], s)
        same_bits(oj, o[0, j])
        same_bits(s, states[0, j])
    o_ref, states_ref = reference.delta_rule_scan(q[None, :5], k[None, :5], v[None, :5], beta[None, :5],
                                                  decay[None, :5], s0[None])
    assert (states.float() - states_ref.float()).abs().max() <= 2 ** -7 * states_ref.float().abs().max()
    assert (o - o_ref).abs().max() <= 2 ** -7 * o_ref.abs().max()

    whole, s_whole = gdn_triton.gdn_prefill(q, k, v, beta, decay, s0, 40)
    assert s_whole.dtype == torch.bfloat16
    cut = 88  # position 128
    o1, s1 = gdn_triton.gdn_prefill(q[:cut], k[:cut], v[:cut], beta[:cut], decay[:cut], s0, 40)
    o2, s2 = gdn_triton.gdn_prefill(q[cut:], k[cut:], v[cut:], beta[cut:], decay[cut:], s1, 40 + cut)
    same_bits(torch.cat((o1, o2)), whole)
    same_bits(s2, s_whole)
    o_ref, s_ref = reference.gdn_prefill(q, k, v, beta, decay, s0, 40)
    assert (s_whole.float() - s_ref.float()).abs().max() <= 2 ** -6 * s_ref.float().abs().max()

    pool = torch.stack([s0 * (0.5 + i) for i in range(4)])  # [slots, Hv, Dk, Dv] bf16
    before = pool.clone()
    pieces = RecurrentPieces.of([0, 1, 51], [1, 50, 99], [7, 40, 0], [3, 0, 2], pool.device)
    o_wave = gdn_triton.gdn_prefill_pieces(q, k, v, beta, decay, pool, pieces)
    for first, t, pos0, slot in zip([0, 1, 51], [1, 50, 99], [7, 40, 0], [3, 0, 2]):
        rows = slice(first, first + t)
        o_solo, s_solo = gdn_triton.gdn_prefill(q[rows], k[rows], v[rows], beta[rows], decay[rows], before[slot], pos0)
        same_bits(o_wave[rows], o_solo)
        same_bits(pool[slot], s_solo)


def test_the_decode_tile_keeps_the_promise_on_a_bf16_state(monkeypatch):
    """GDN_BLOCK_DV = 64 (the decode step's tile, against the earlier 32) on a bf16 state, with a partial last tile:
    the verify's scan equals decode steps bit for bit, and the values are the 32-column tile's within a rounding."""
    from memra.kernels.triton import gdn as gdn_triton

    assert gdn_triton.GDN_BLOCK_DV == 64
    q, k, v, beta, decay, s0 = _inputs(4, dv=96)
    args = (q[None], k[None], v[None], beta[None], decay[None], s0[None])
    o, states = gdn_triton.delta_rule_scan(*args)
    monkeypatch.setattr(gdn_triton, "GDN_BLOCK_DV", 32)
    o32, states32 = gdn_triton.delta_rule_scan(*args)
    monkeypatch.setattr(gdn_triton, "GDN_BLOCK_DV", 64)
    s = s0
    for j in range(4):
        oj, s = gdn_triton.delta_rule_step(q[j], k[j], v[j], beta[j], decay[j], s)
        same_bits(oj, o[0, j])
        same_bits(s, states[0, j])
    assert (states.float() - states32.float()).abs().max() <= 2 ** -7 * states32.float().abs().max()
    assert (o - o32).abs().max() <= 2 ** -7 * o32.abs().max()


def test_the_chunk_carry_is_rounded_as_a_cut_would_store_it():
    """Why the prefill rounds between chunks: a prompt cut at a chunk stores the state there and the next piece
    starts from the stored bf16 bits; a one-shot prime that carried the fp32 state past the same chunk instead
    (the canary: the state rounded only where the prompt ends) gives the next chunk other bits."""
    q, k, v, beta, decay, s0 = _inputs(128)
    o1, s1 = reference.gdn_prefill(q[:64], k[:64], v[:64], beta[:64], decay[:64], s0, 0)
    o2, s2 = reference.gdn_prefill(q[64:], k[64:], v[64:], beta[64:], decay[64:], s1, 64)
    o, s = reference.gdn_prefill(q, k, v, beta, decay, s0, 0)
    same_bits(torch.cat((o1, o2)), o)
    same_bits(s2, s)
    o_carried, _ = reference.gdn_prefill(q, k, v, beta, decay, s0.float(), 0)
    assert not torch.equal(o_carried[64:], o2), "carrying the fp32 state past the chunk did not change a bit"


def _chunked_prime_and_decode(model) -> None:
    """E5 and the decode after it: a prompt primed in 64-aligned pieces leaves the one-shot prime's logits and
    bf16 states, and decoding from either gives the same logits."""
    prompt = [(37 * i + 11) % model.cfg.vocab_size for i in range(150)]
    whole, cut = model.new_cache(256), model.new_cache(256)
    want = model.prime(prompt, whole)
    model.prime(prompt[:64], cut)
    model.prime(prompt[64:128], cut)
    same_bits(model.prime(prompt[128:], cut), want)
    for layer in model.cfg.gdn_layers:
        assert whole.ssm_state(layer).dtype == torch.bfloat16
        same_bits(whole.ssm_state(layer), cut.ssm_state(layer))
    token = int(want.argmax())
    for _ in range(3):
        a, b = model.decode_step(token, whole), model.decode_step(token, cut)
        same_bits(a, b)
        token = int(a.argmax())


def test_a_bf16_state_keeps_every_promise_on_the_cpu_ops(load_model):
    fp32 = load_model(hf_dir("qwen3_5"))
    model = fp32.with_doors(**BF16)
    _chunked_prime_and_decode(model)
    lines: list[str] = []
    assert run_battery(model, steps=6, batch=3, mode="strict", plen=12, out=lines.append), "\n".join(lines)
    assert "GDN state bfloat16" in lines[0] and lines[-1].startswith("ALL GREEN")
    assert sum(line.endswith(": PASS") for line in lines) == 5  # gate1, gate2, gate3, gate4, liveness
    prompt = list(range(3, 90))
    assert not torch.equal(model.prime(prompt, model.new_cache(128)), fp32.prime(prompt, fp32.new_cache(128)))
    from memra.gate.train_arm import run_train_battery  # E11: the training forward is the sampler here too

    lines = []
    assert run_train_battery(model, steps=6, plen=8, out=lines.append), "\n".join(lines)


def test_the_prefix_cache_and_scoring_keep_their_bits_on_a_bf16_state(load_model):
    """E8 and E9 within the bf16 state: a prefix-cache hit restores the snapshot stored at the cut (bf16, the
    bits a cold prime carries past that chunk), and scoring runs the continuation through decode's own step."""
    from memra.gate.prefix_battery import run_prefix_battery
    from memra.gate.score_arm import run_score_battery

    model = load_model(hf_dir("qwen3_5")).with_doors(**BF16)
    lines: list[str] = []
    assert run_prefix_battery(model, batches=(1, 2), steps=4, out=lines.append), "\n".join(lines)
    assert run_score_battery(model, steps=6, out=lines.append), "\n".join(lines)


@pytest.mark.slow  # ~1 minute in the interpreter; on a GPU: tests/test_cuda_exact.py's gate with the door
def test_a_bf16_state_keeps_its_bits_on_the_gpu_kernel_table(monkeypatch):
    """E5 and the decode after it on the GPU's kernels (Triton's interpreter): the recurrent step and the
    chunked prefill round where they store, so 64-aligned pieces and the one-shot prime agree."""
    from memra import step
    from memra.kernels.table import KernelTable
    from memra.loading.checkpoint import load

    table = gpu_kernel_table()
    monkeypatch.setattr(KernelTable, "build", classmethod(lambda cls, device, settings: table))
    monkeypatch.setattr(step, "exact_piece", lambda model: step.INVARIANT_PIECE)
    model = load(hf_dir("qwen3_5"), device="cpu", tokenizer=False, settings=Settings.from_env(BF16))
    model = model.with_doors(MEMRA_DECODE_PLAN="row")  # the stacked plan's check needs the GPU's torch ops
    _chunked_prime_and_decode(model)


def test_a_fixture_copy_with_a_bf16_checkpoint_loads_with_it(tmp_path, load_model):
    """A checkpoint whose config names bfloat16 (`mamba_ssm_dtype`) is served with it unless the door says
    otherwise (vLLM reads the same field)."""
    import memra

    dst = tmp_path / "qwen3_5"
    shutil.copytree(hf_dir("qwen3_5"), dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, "mamba_ssm_dtype": "bfloat16"}))
    model = memra.load(dst, device="cpu", tokenizer=False, settings=Settings())
    assert model.cfg.gdn.state_dtype == "bfloat16"
    assert model.with_doors(MEMRA_GDN_STATE_DTYPE="float32").cfg.gdn.state_dtype == "float32"


def test_vllms_argument_stores_the_state_in_bf16_through_memra_llm():
    """LLM(mamba_ssm_cache_dtype="bfloat16"), vLLM's name: the model LLM loads keeps its GDN state in bf16, and
    generating with it gives the tokens the door's model gives (docs/VLLM.md; `memra serve
    --mamba-ssm-cache-dtype bfloat16` sets the same setting, tests/test_vllm_flags.py)."""
    from memra import LLM, SamplingParams

    llm = LLM(str(hf_dir("qwen3_5")), device="cpu", mamba_ssm_cache_dtype="bfloat16", warm_up=False, max_model_len=128)
    assert llm.model.cfg.gdn.state_dtype == "bfloat16"
    params = SamplingParams(max_tokens=8, temperature=0)
    got = llm.generate(["The state of the art"], params, use_tqdm=False)[0].outputs[0].token_ids
    door = LLM(str(hf_dir("qwen3_5")), device="cpu", warm_up=False, max_model_len=128,
               settings=Settings.from_env(BF16))
    assert door.generate(["The state of the art"], params, use_tqdm=False)[0].outputs[0].token_ids == got
    llm.close()
    door.close()
