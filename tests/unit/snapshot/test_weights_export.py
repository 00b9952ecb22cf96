"""The weights file for use outside ddpkit: a plain state dict that loads strictly, tied weights
included."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

from ddpkit.training import _validation as export


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight (as GPT-2 and nanoGPT do)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 11, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.wte(idx)))


def test_tied_weights_are_written_under_both_names_and_load_strictly(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    trained = TiedLM()
    with torch.no_grad():
        trained.wte.weight.add_(1.0)  # not what a fresh model starts from
    state = trained.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()
    # Control: safetensors refuses the state dict as it is (the two names share memory).
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.save(state)
    path = tmp_path / "final.safetensors"
    export.save_weights(path, state, "safetensors", {"step": 7})
    loaded = safetensors.load_file(str(path))
    fresh = TiedLM()
    fresh.load_state_dict(loaded, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
    assert fresh.lm_head.weight is fresh.wte.weight  # the fresh model's own tie survives the load
    with open(path, "rb") as f:  # the header: 8 bytes of length, then JSON
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    meta = header["__metadata__"]
    assert meta["format"] == "pt" and json.loads(meta["tied"]) == {"lm_head.weight": "wte.weight"}
    assert json.loads(meta["step"]) == 7


def test_the_pt_format_is_the_state_dict_itself(tmp_path):
    model = TiedLM()
    path = tmp_path / "final_weights.pt"
    export.save_weights(path, model.state_dict(), "pt")
    loaded = torch.load(path, weights_only=True)
    TiedLM().load_state_dict(loaded, strict=True)
    assert loaded.keys() == model.state_dict().keys()


def test_views_of_one_buffer_are_copied_apart(tmp_path):
    pytest.importorskip("safetensors")
    fused = torch.arange(12.0).reshape(3, 4)
    state = {"q": fused[0], "k": fused[1], "v": fused[2]}
    path = tmp_path / "w.safetensors"
    export.save_weights(path, state, "safetensors")
    from safetensors.torch import load_file

    loaded = load_file(path)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_safetensors_missing_falls_back_to_pt_saying_so(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name)
    )
    fmt, notice = export.resolve_format("safetensors")
    assert fmt == "pt" and notice is not None and "ddpkit[safetensors]" in notice
    assert export.resolve_format("pt") == ("pt", None) and export.resolve_format(None) == (
        None,
        None,
    )
