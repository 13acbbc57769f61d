"""Pure-torch definition of every op the model uses.

This file is the meaning of each op: the CPU path runs it directly, and every fast kernel added
later must match it (bit for bit where the exactness contract says so, or to a stated bound).
Shapes use: T tokens in this step, S cached positions, E hidden, H heads, D head dim.
Precision rules follow the reference implementations the checkpoints were trained with:
norms, softmax, GDN gates and GDN state are computed in fp32; matmuls run in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memra.kernels.cuts import aligned_cuts, window_rows, window_start  # noqa: F401 (window_rows: the decode rows' cut)
from memra.kernels.slots import state_slots

# --- dense algebra ---------------------------------------------------------------------------


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ b[N]) -> [..., N], in the dtype of x."""
    return F.linear(x, w, b)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim. `w` is the fp32 *effective* multiplier (already 1+w for zero-centred norms).

    The two styles differ only in where the cast back happens: Llama-style norms cast the normalised
    activations to the model dtype and multiply there; zero-centred (Qwen3-Next/3.5) norms multiply in
    fp32 and cast last. In fp32 both are the same computation.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xf * w).to(x.dtype)
    return w.to(x.dtype) * xf.to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the pre-norm that reads it: (h + delta, rms_norm(h + delta))."""
    s = h + delta
    return s, rms_norm(s, w, eps, zero_centered)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: [..., 2F] (gate | up) -> [..., F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation (Gemma's gelu_pytorch_tanh): [..., 2F] (gate | up) -> [..., F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_silu_mul(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """Step's clamped SwiGLU: silu(gate) capped at `limit`, up clamped to [-limit, limit], then the product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


# --- rotary embedding --------------------------------------------------------------------------


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (int) -> cos, sin [T, R] in `dtype` (NeoX layout: the R/2 angles repeated twice)."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2] fp32
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R channels of each head, NeoX style (pairs (i, i+R/2)); the rest pass through.

    x [T, H, D], cos/sin [T, R].
    """
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """An attention step's work between projection and attention: q [T, Hq, D] and k [T, Hkv, D]
    rotated (apply_rope), then k and v [T, Hkv, D] written to the pool rows `rows` [T] (flat: block *
    BLOCK + offset of k/v_pool [n_blocks, BLOCK, Hkv, D]). -> the rotated q."""
    hkv, d = k.shape[1], k.shape[2]
    k_pool.view(-1, hkv, d).index_copy_(0, rows, apply_rope(k, cos, sin))
    v_pool.view(-1, hkv, d).index_copy_(0, rows, v)
    return apply_rope(q, cos, sin)


# --- attention ---------------------------------------------------------------------------------


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Softmax attention of T new queries over S cached keys (the new tokens included, at the end).

    q [T, Hq, D], k/v [S, Hkv, D] with S = pos0 + T; query t sits at position pos0 + t and sees keys
    0..pos0+t, or with a sliding `window` W only the last W of them, pos0+t-W+1..pos0+t (Mistral,
    Gemma, Step: HF's `kv_idx > q_idx - sliding_window`). GQA: query head h reads KV head h // (Hq / Hkv).
    Scores and softmax in fp32, the probabilities cast back to the model dtype before the value matmul.
    Returns [T, Hq, D].
    """
    t, hq, _ = q.shape
    s, hkv, _ = k.shape
    group = hq // hkv
    qh = q.transpose(0, 1)  # [Hq, T, D]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)).float() * scale  # [Hq, T, S]
    key_pos = torch.arange(s, device=q.device)
    query_pos = pos0 + torch.arange(t, device=q.device)
    hidden = key_pos[None, :] > query_pos[:, None]
    if window is not None:
        hidden = hidden | (key_pos[None, :] <= query_pos[:, None] - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)  # [T, Hq, D]


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor, pos0: int,
                      scale: float, window: int | None = None) -> torch.Tensor:
    """causal_attention over a paged prefix: rows [pos0 + T] flat pool rows of positions 0.. in order.
    With a window, only the positions the first query can see onwards are read (the same keys whatever
    the chunk, since the start depends on pos0 alone: a chunked prime reads what a one-shot one does)."""
    hkv, d = k_pool.shape[-2:]
    lo = window_start(pos0, window)
    rows = rows[lo:]
    return causal_attention(q, k_pool.view(-1, hkv, d)[rows], v_pool.view(-1, hkv, d)[rows], pos0 - lo, scale, window)


def prefill_attention_pieces(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pieces,
                             scale: float, window: int | None = None) -> torch.Tensor:
    """prefill_attention for each of several sequences' pieces (memra.kernels.pieces.AttentionPieces),
    piece by piece (the definition). q [N, Hq, D] -> [N, Hq, D]; rows in no piece are left unset."""
    o = torch.empty_like(q)
    for first, t, pos0, at in pieces.spans:
        o[first : first + t] = prefill_attention(q[first : first + t], k_pool, v_pool, pieces.rows[at : at + pos0 + t],
                                                 pos0, scale, window)
    return o


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One new query per head over a paged prefix: q [Hq, D]; k/v_pool [n_blocks, BLOCK, Hkv, D];
    rows [S] flat pool rows of positions 0..S-1 in order (the new token last). -> [Hq, D]."""
    hkv, d = k_pool.shape[-2:]
    k = k_pool.view(-1, hkv, d)[rows]
    v = v_pool.view(-1, hkv, d)[rows]
    return causal_attention(q[None], k, v, rows.numel() - 1, scale)[0]


def paged_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                         starts: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """R query rows, each over its own paged prefix rows[starts[r] : starts[r] + lens[r]]. q [R, Hq, D]
    -> [R, Hq, D]. Row by row through paged_decode_attention (the definition)."""
    out = [paged_decode_attention(q[r], k_pool, v_pool, rows[int(a) : int(a) + int(n)], scale)
           for r, (a, n) in enumerate(zip(starts.tolist(), lens.tolist()))]
    return torch.stack(out) if out else q.new_empty(q.shape)


# --- Gated DeltaNet ----------------------------------------------------------------------------


def causal_conv(u: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over new inputs, continuing from the previous window.

    u [T, C] raw projections, state [C, Kc-1] the last raw inputs (zeros at sequence start),
    w [C, Kc] (column Kc-1 multiplies the current token). Returns (out [T, C], new state [C, Kc-1]).
    Written as Kc shifted multiply-adds in a fixed order rather than F.conv1d, so no backend
    (cuDNN with TF32, say) can choose another reduction order or precision behind our back.
    """
    kc = w.shape[1]
    window = torch.cat((state.to(u.dtype), u.t()), dim=1)  # [C, Kc-1+T]
    t = u.shape[0]
    wf, xf = w.float(), window.float()  # accumulate in fp32 and round once, as a conv kernel does
    acc = xf[:, 0:t] * wf[:, 0:1]
    for j in range(1, kc):
        acc = acc + xf[:, j : j + t] * wf[:, j : j + 1]
    return F.silu(acc.to(u.dtype)).t(), window[:, window.shape[1] - (kc - 1) :]


def causal_conv_pieces(u: torch.Tensor, pool: torch.Tensor, w: torch.Tensor, pieces) -> torch.Tensor:
    """causal_conv for several sequences' pieces in the rows of one wave (memra.kernels.pieces
    .RecurrentPieces), piece by piece: u [N, C] -> out [N, C]; pool[slot] [C, Kc-1] stepped in place."""
    outs = []
    for first, t, _, slot in pieces.spans:
        out, new = causal_conv(u[first : first + t], pool[slot], w)
        pool[slot].copy_(new)
        outs.append(out)
    return torch.cat(outs)


def causal_conv_step(u: torch.Tensor, states: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of B sequences: u [B, C], states [B, C, Kc-1] -> (out [B, C], new states).
    The same multiply-adds, in the same order, as causal_conv."""
    window = torch.cat((states.to(u.dtype), u[:, :, None]), dim=2)  # [B, C, Kc]
    wf, xf = w.float(), window.float()
    acc = xf[..., 0] * wf[:, 0]
    for j in range(1, w.shape[1]):
        acc = acc + xf[..., j] * wf[:, j]
    return F.silu(acc.to(u.dtype)), window[..., 1:]


def causal_conv_step_into(u: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """causal_conv_step for rows whose states are pool[slots] ([slots, C, Kc-1]), stepped there -> out [B, C]."""
    slots = state_slots(slots)  # an inert padding row's (memra.kernels.slots): the scratch slot it names
    out, new = causal_conv_step(u, pool[slots], w)
    pool[slots] = new
    return out


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the sqrt, as the GDN kernels define it)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, a_neg: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and value head: beta = sigmoid(b); g = A * softplus(a + dt_bias) with A = -exp(A_log) < 0.

    b, a [T, Hv]; returns fp32 (beta, g) [T, Hv]; g is the log of the per-step decay.
    """
    beta = torch.sigmoid(b.float())
    g = a_neg * F.softplus(a.float() + dt_bias)
    return beta, g


def gdn_heads(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, a_neg: torch.Tensor, dt_bias: torch.Tensor,
              n_k_heads: int, n_v_heads: int, dk: int, dv: int, eps: float = 1e-6):
    """What the delta rule reads, per token: conv output mixed [N, 2*Hk*Dk + Hv*Dv] (q | k | v) and gate
    inputs b, a [N, Hv] -> q, k [N, Hv, Dk] (l2-normed, q scaled by Dk^-0.5, each key head repeated over
    its Hv/Hk value heads), v [N, Hv, Dv], beta, decay [N, Hv], all fp32 (gdn_gates)."""
    n, key_dim = mixed.shape[0], n_k_heads * dk
    q, k, v = mixed.split([key_dim, key_dim, n_v_heads * dv], dim=-1)
    q = l2_normalize(q.reshape(n, n_k_heads, dk).float(), eps) * dk ** -0.5
    k = l2_normalize(k.reshape(n, n_k_heads, dk).float(), eps)
    ratio = n_v_heads // n_k_heads
    q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    beta, decay = gdn_gates(b, a, a_neg, dt_bias)
    return q, k, v.reshape(n, n_v_heads, dv).float(), beta, decay


def gdn_recurrent(q, k, v, beta, g, state, step=None):
    """The delta rule, one token at a time (decode, and the definition of the op).

    q, k [T, Hv, Dk] (l2-normalised, q scaled), v [T, Hv, Dv], beta, g [T, Hv], all fp32;
    state [Hv, Dk, Dv] in the state's dtype (fp32 or bf16). For each token: decay S, predict m = S^T k,
    correct S += k (beta (v - m))^T, read o = S^T q. Returns (o [T, Hv, Dv], final state).
    `step` replaces delta_rule_step (the op table passes its fast twin).
    """
    step, s, outs = step or delta_rule_step, state, []
    for t in range(q.shape[0]):
        o, s = step(q[t], k[t], v[t], beta[t], g[t], s)
        outs.append(o)
    return torch.stack(outs), s


def delta_rule_step(q, k, v, beta, g, s):
    """One token of the delta rule; any leading dims broadcast (heads, or batch x heads).

    q, k [..., Dk], v [..., Dv], beta, g [...], s [..., Dk, Dv] -> (o [..., Dv], new s). In fp32; o from
    the fp32 state, the new state returned in s's dtype (bf16: rounded, as every path stores and carries it).
    """
    store, s = s.dtype, s.float() * g.exp()[..., None, None]
    predicted = (s * k[..., :, None]).sum(-2)  # [..., Dv]
    delta = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return (s * q[..., :, None]).sum(-2), s.to(store)


def delta_rule_step_into(q, k, v, beta, g, pool, slots):
    """delta_rule_step for B sequences whose states live in a pool: q, k [B, H, Dk], v [B, H, Dv], beta,
    g [B, H], pool [n_slots, H, Dk, Dv] (fp32 or bf16), slots [B] -> o [B, H, Dv]; pool[slots] is stepped in place."""
    slots = state_slots(slots)  # an inert padding row's (memra.kernels.slots): the scratch slot it names
    o, s = delta_rule_step(q, k, v, beta, g, pool[slots])
    pool[slots] = s
    return o


def delta_rule_scan(q, k, v, beta, g, s, step=None):
    """n sequences x T tokens of the delta rule, one token at a time. q, k [n, T, H, Dk], v [n, T, H, Dv],
    beta, g [n, T, H], s [n, H, Dk, Dv] -> (o [n, T, H, Dv], the state after each token [n, T, H, Dk, Dv],
    in s's dtype). The verify's GDN (T tokens, n = 1) in one call."""
    step = step or delta_rule_step
    outs, states = [], []
    for t in range(q.shape[1]):
        o, s = step(q[:, t], k[:, t], v[:, t], beta[:, t], g[:, t], s)
        outs.append(o)
        states.append(s)
    return torch.stack(outs, dim=1), torch.stack(states, dim=1)


def gdn_chunk(q, k, v, beta, g, state):
    """The delta rule over one chunk of n tokens in closed (WY) form; algebraically equal to gdn_recurrent.

    Same arguments as gdn_recurrent (the state's dtype as delta_rule_step's). In the chunk, G = cumsum(g) and
    Gamma_ij = exp(G_i - G_j):
      A = strict_lower((diag(beta) K K^T) * Gamma);  (I + A) X = [diag(beta) V | diag(beta) K * exp(G)]
      U, W = X;  V' = U - W S;  O = (Q * exp(G)) S + lower((Q K^T) * Gamma) V'
      S' = exp(G_n) S + (K * exp(G_n - G))^T V'
    """
    n, store, state = q.shape[0], state.dtype, state.float()
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [Hv, n, D]
    bh, gh = beta.t(), g.t().cumsum(-1)  # [Hv, n]
    diff = gh[:, :, None] - gh[:, None, :]  # G_i - G_j  [Hv, n, n]
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    gamma = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # zero above the diagonal
    kb = kh * bh[..., None]
    a = (kb @ kh.transpose(1, 2)) * gamma
    a = a.tril(-1)
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    rhs = torch.cat((vh * bh[..., None], kb * gh.exp()[..., None]), dim=-1)
    x = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    dv = v.shape[-1]
    u, w = x[..., :dv], x[..., dv:]
    v_new = u - w @ state  # [Hv, n, Dv]
    out = (qh * gh.exp()[..., None]) @ state + ((qh @ kh.transpose(1, 2)) * gamma) @ v_new
    g_last = gh[:, -1]
    new_state = state * g_last.exp()[:, None, None] + (kh * (g_last[:, None] - gh).exp()[..., None]).transpose(1, 2) @ v_new
    return out.transpose(0, 1), new_state.to(store)


GDN_CHUNK = 64  # chunk length of the closed-form prefill; cuts sit at absolute multiples of it


def gdn_prefill(q, k, v, beta, g, state, pos0: int):
    """The delta rule over T prompt tokens at absolute position pos0 (arguments as gdn_recurrent), in
    closed-form chunks cut where the absolute position is a multiple of GDN_CHUNK — so a prompt primed
    in 64-aligned pieces sees exactly the chunks of a one-shot prime. -> (o [T, Hv, Dv], final state)."""
    outs = []
    for a, b in aligned_cuts(q.shape[0], pos0, GDN_CHUNK):
        o, state = gdn_chunk(q[a:b], k[a:b], v[a:b], beta[a:b], g[a:b], state)
        outs.append(o)
    return torch.cat(outs), state


def gdn_prefill_pieces(q, k, v, beta, g, pool: torch.Tensor, pieces) -> torch.Tensor:
    """gdn_prefill for several sequences' pieces in the rows of one wave (memra.kernels.pieces
    .RecurrentPieces), piece by piece: -> o [N, Hv, Dv]; pool[slot] [Hv, Dk, Dv] stepped in place."""
    outs = []
    for first, t, pos0, slot in pieces.spans:
        rows = slice(first, first + t)
        o, new = gdn_prefill(q[rows], k[rows], v[rows], beta[rows], g[rows], pool[slot], pos0)
        pool[slot].copy_(new)
        outs.append(o)
    return torch.cat(outs)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: RMSNorm(o) * w * SiLU(z) per value head; plain weight (not 1+w).

    o [T, Hv, Dv] fp32 or model dtype (rounded to the model dtype first), z [T, Hv, Dv] model dtype,
    w [Dv] fp32. Returns model dtype.
    """
    dtype = z.dtype
    of = o.to(dtype).float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    y = w.to(dtype) * of.to(dtype)
    return (y * F.silu(z.float())).to(dtype)


# --- mixture of experts ------------------------------------------------------------------------


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype, bias=None):
    """Softmax over all experts in fp32, keep the top k, optionally renormalise. -> (weights [T, k], ids [T, k]).
    With `bias` [X] (Step): sigmoid scores in fp32, the k best of score + bias chosen, their scores kept."""
    if bias is None:
        weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    else:
        probs = torch.sigmoid(router_logits.float())
        weights = probs.gather(1, ids := torch.topk(probs + bias, top_k, dim=-1).indices)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(dtype), ids


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                linear_fn=None, silu_mul_fn=None) -> torch.Tensor:
    """Weighted sum of the chosen SwiGLU experts. x [T, E], weights/ids [T, k], w_gate_up [X, 2F, E], w_down [X, E, F].

    Experts run in ascending id, each over the rows that chose it, so a row's sum is accumulated in
    the same order whatever its batchmates chose; with an M-invariant `linear_fn` (the op table's)
    a row's expert outputs do not depend on how many rows share the expert either. `silu_mul_fn`: the
    op table's activation (the grouped kernels' twin uses the one they use)."""
    linear_fn, silu_mul_fn = linear_fn or linear, silu_mul_fn or silu_mul
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        rows, slot = (ids == expert).nonzero(as_tuple=True)
        h = linear_fn(silu_mul_fn(linear_fn(x[rows], w_gate_up[expert])), w_down[expert])
        out.index_add_(0, rows, h * weights[rows, slot, None])
    return out
