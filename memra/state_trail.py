"""A verify forward's trail of recurrent states: each GDN layer's conv and delta-rule state after every one of its
T tokens, so that memra.cache.Cache.rollback can drop a rejected suffix by copying one column back instead of
replaying the tokens it keeps."""

from __future__ import annotations

import torch


class StateTrail:
    """The recurrent state after each token of a T-token verify forward, so a rejected suffix can be
    dropped by copying column n-1 back (no replay). Grow-only buffers, reused round after round.

        conv[layer]: [T, conv_dim, Kc-1]    ssm[layer]: [T, Hv, Dk, Dv] in the state's dtype (GdnConfig.state_dtype)
    """

    def __init__(self) -> None:
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}

    @staticmethod
    def _put(table: dict[int, torch.Tensor], layer: int, column: int, state: torch.Tensor) -> None:
        buf = table.get(layer)
        if buf is None or buf.shape[0] <= column:
            grown = state.new_empty((max(column + 1, 8, 2 * (0 if buf is None else buf.shape[0])), *state.shape))
            if buf is not None:
                grown[: buf.shape[0]].copy_(buf)
            table[layer] = buf = grown
        buf[column].copy_(state)

    @staticmethod
    def _put_all(table: dict[int, torch.Tensor], layer: int, states: torch.Tensor) -> None:
        buf = table.get(layer)
        if buf is None or buf.shape[0] < states.shape[0] or buf.shape[1:] != states.shape[1:]:
            table[layer] = buf = states.new_empty((max(states.shape[0], 8), *states.shape[1:]))
        buf[: states.shape[0]].copy_(states)

    def record_conv_all(self, layer: int, states: torch.Tensor) -> None:
        self._put_all(self.conv, layer, states)  # [T, C, Kc-1]: after each of T tokens

    def record_ssm_all(self, layer: int, states: torch.Tensor) -> None:
        self._put_all(self.ssm, layer, states)  # [T, Hv, Dk, Dv]

    def record_conv(self, layer: int, column: int, conv: torch.Tensor) -> None:
        self._put(self.conv, layer, column, conv)  # [C, Kc-1] after token `column`

    def record_ssm(self, layer: int, column: int, ssm: torch.Tensor) -> None:
        self._put(self.ssm, layer, column, ssm)  # [Hv, Dk, Dv] after token `column`

    def record(self, layer: int, column: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.record_conv(layer, column, conv)
        self.record_ssm(layer, column, ssm)
