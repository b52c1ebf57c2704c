"""What a replacement takes, as bytes (commlab.core.keepgoing.pack_heal; ps:// update=worker relays them through
its shards): the parameters, buffers and optimizer state come back bit for bit, and what cannot be read is
refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commlab.base.errors import ConfigError, ModelMismatch, ProtocolError
from commlab.core.keepgoing import pack_heal, unpack_heal


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    model[2].bias.requires_grad_(False)  # frozen: taken all the same
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01, betas=(0.8, 0.9))
    return model, opt


def _targets(model: nn.Module) -> list[torch.Tensor]:
    return [p.data for p in model.parameters()] + list(model.buffers())


def test_a_packed_state_comes_back_bit_for_bit_and_what_cannot_be_read_is_refused_by_name():
    donor, opt = _model(0)
    for _ in range(3):  # Adam's state (step, both moments) and BatchNorm's statistics move
        opt.zero_grad()
        donor(torch.randn(8, 5)).square().sum().backward()
        opt.step()
    raw = pack_heal(_targets(donor), {"optim": opt.state_dict()})
    taker, opt2 = _model(1)
    tree = unpack_heal(raw, _targets(taker), "rank 0")
    opt2.load_state_dict(tree["optim"])
    for a, b in zip(_targets(donor), _targets(taker)):
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    for i, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            assert torch.equal(v, opt2.state_dict()["state"][i][name]), (i, name)
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9)

    other = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ModelMismatch, match=r"rank 0 sends 9 parameters and buffers, this rank has 9; the first "
                                            r"difference at #4: \[\[\[3, 4\], 'float32'\]\] there, \[\[\[2, 4\]"):
        unpack_heal(raw, _targets(other), "rank 0")
    with pytest.raises(ProtocolError, match="the state from rank 0 holds .* bytes of tensors, its manifest says"):
        unpack_heal(raw[:-20], _targets(taker), "rank 0")
    with pytest.raises(ProtocolError, match="not made by commlab.core.keepgoing.pack_heal"):
        unpack_heal(raw[1:], _targets(taker), "rank 0")
    with pytest.raises(ConfigError, match="cannot send a object to a replacement"):
        pack_heal(_targets(donor), {"optim": {"odd": object()}})
