"""``ddpkit check`` on the programs of the issue that made it run what the script runs: the Hugging
Face-style fine-tune and the contrastive model of ``examples/`` on the Trainer, each checked as it
is (its config's global-batch dropout and per-sample seeding, its warm-up stepped), each with
controls that must fail (a real per-rank difference of each kind); a switch the model refuses, said
in a line; and a correct ReLU CNN with global BatchNorm, which float32 rounding alone used to fail,
against a per-rank learning rate."""

import re
import sys
from pathlib import Path

import pytest

import ddpkit.tools._check as check
from ddpkit.tools._check import CAUSES, CheckConfig, run_check
from ddpkit.tools._compare import Tolerance

pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).parents[1] / "scripts"


def _report(script: Path | str, *args: str, **kwargs) -> tuple[int, str]:
    code, lines = run_check(CheckConfig(script=str(script), script_args=args, **kwargs))
    return code, "\n".join(lines)


def _named(report: str) -> list[str]:
    return [c.key for c in CAUSES if f"cause: {c.what}" in report]


def _example(tmp_path: Path, name: str, beside: str, *edits: tuple[str, str]) -> Path:
    """A copy of ``examples/<name>`` with ``edits`` made, and of ``examples/<beside>`` as it is (the
    script it imports, or that imports it)."""
    (tmp_path / beside).write_text((ROOT / "examples" / beside).read_text())
    text = (ROOT / "examples" / name).read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    (tmp_path / name).write_text(text)
    for stem in (Path(name).stem, Path(beside).stem):  # imported by an earlier check in here
        sys.modules.pop(stem, None)
    return tmp_path / name


def test_the_hf_style_finetune_passes_as_it_runs_and_a_rank_of_its_own_fails(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, report = _report(ROOT / "examples" / "hf_finetune_trainer.py")
    assert code == 0 and "OK: 2 ranks train the same model as one process" in report, report
    # Control: each rank its own learning rate, under the warm-up from lr 0 (no weight moves at
    # the first step): a difference no switch removes.
    lr = ("lr=args.learning_rate,", "lr=args.learning_rate * (1 + ddpkit.get_runtime().rank),")
    script = _example(tmp_path, "hf_finetune_trainer.py", "hf_finetune.py", lr)
    code, report = _report(script)
    assert code == 1 and "UNEXPLAINED" in report and not _named(report), report
    # Control: the config's global-batch dropout off: each rank draws its own masks.
    off = ("global_batch_dropout=True,", "global_batch_dropout=False,")
    script = _example(tmp_path, "hf_finetune_trainer.py", "hf_finetune.py", off)
    code, report = _report(script)
    assert code == 1 and _named(report) == ["dropout"], report


def test_the_contrastive_model_passes_as_it_runs_and_a_gather_without_gradients_fails(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    code, report = _report(ROOT / "examples" / "contrastive_trainer.py")
    assert code == 0 and "OK: 2 ranks train the same model as one process" in report, report
    # Control: the other ranks' embeddings gathered without their gradients.
    detached = (
        "every1, every2 = ddpkit.gather_tensors(z1, grad=True), "
        "ddpkit.gather_tensors(z2, grad=True)",
        "every1, every2 = ddpkit.gather_tensors(z1), ddpkit.gather_tensors(z2)\n"
        "    first = ddpkit.get_runtime().rank * len(z1)\n"
        "    every1 = torch.cat([every1[:first], z1, every1[first + len(z1) :]])\n"
        "    every2 = torch.cat([every2[:first], z2, every2[first + len(z2) :]])",
    )
    _example(tmp_path, "contrastive.py", "contrastive_trainer.py", detached)
    code, report = _report(tmp_path / "contrastive_trainer.py")
    assert code == 1 and "UNEXPLAINED" in report and not _named(report), report
    # Control: BatchNorm over each rank's slice.
    per_rank = ("sync_batchnorm=True,", "sync_batchnorm=False,")
    script = _example(tmp_path, "contrastive_trainer.py", "contrastive.py", per_rank)
    code, report = _report(script)
    assert code == 1 and _named(report) == ["batchnorm"], report


_ATTENTION = f"""
import sys
sys.path.insert(0, {str(SCRIPTS)!r})
import torch.nn.functional as F
from torch import nn
from check_common import sgd, toy_data
from ddpkit.tools._workload import Workload


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 3)
        self.attention = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x):
        h = self.inp(x).view(len(x), 2, 8).repeat(1, 1, 2)
        return self.out(self.dropout(self.attention(h, h, h)[0].mean(1)))


def ddpkit_workload():
    return Workload(model=Attention(), dataset=toy_data(), optimizer=sgd, batch_size=8)
"""


def test_a_switch_the_model_refuses_is_a_line_of_the_report_not_a_traceback(tmp_path):
    script = tmp_path / "attention.py"
    script.write_text(_ATTENTION)
    code, report = _report(script, steps=2)
    assert code == 1 and "Traceback" not in report, report
    assert "not switched: dropout (global-batch dropout refused this model: " in report, report
    assert "attention (nn.MultiheadAttention, dropout=0.1" in report
    assert "dropout drawing per rank may, which could not be switched off here" in report


def _in_float32(cfg, reference, one_process):
    """The check's judgement as it was: in float32, the fixed tolerance."""
    return check._Judged(False, Tolerance(cfg.rtol), []), reference, one_process(frozenset())


@pytest.mark.parametrize("judged", ["float64", "control-float32"])
def test_a_relu_cnn_whose_float32_rounding_crosses_a_relu_passes_and_a_per_rank_lr_fails(
    monkeypatch, judged
):
    # At seed 1 float32 rounding moves a ReLU input across 0 (seen: 4.3e-03 after 4 steps).
    if judged != "float64":
        monkeypatch.setattr(check, "_judged", _in_float32)
    code, report = _report(SCRIPTS / "check_relu_cnn.py", seed=1)
    if judged == "float64":
        assert code == 0, report
        code, report = _report(SCRIPTS / "check_relu_cnn.py", "--per-rank-lr", seed=1)
        assert code == 1 and "UNEXPLAINED" in report, report
    else:
        assert code == 1 and "UNEXPLAINED" in report, report


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_correct_relu_cnn_passes_every_seed_and_a_per_rank_lr_fails_every_seed():
    # 10 seeds; the same runs judged as before (float32, a fixed 1e-4) differ at some of them
    # (seen: seeds 1, 3, 7 and 9, from 9.9e-4 to 4.3e-3).
    in_float32 = []
    for seed in range(10):
        code, report = _report(SCRIPTS / "check_relu_cnn.py", seed=seed)
        assert code == 0, f"seed {seed}\n{report}"
        rounding = re.search(r"in the script's arithmetic (\S+), rounding", report)
        in_float32.append(float(rounding.group(1)))
        code, report = _report(SCRIPTS / "check_relu_cnn.py", "--per-rank-lr", seed=seed)
        assert code == 1 and "UNEXPLAINED" in report, f"seed {seed}\n{report}"
    print(f"\nfloat32 differences by seed: {in_float32}")
    assert sum(d > 1e-4 for d in in_float32) >= 1, in_float32


LM_TINY = ("--max-chars", "20000", "--val-chars", "4000", "--layers", "1", "--width", "32")


@pytest.mark.slow
def test_the_language_model_example_passes_as_it_runs_and_a_rank_of_its_own_fails(
    tmp_path, monkeypatch
):
    # examples/lm.py as it is: per-token losses (count_fn), 2 micro-batches a step, a warm-up
    # stepped by the Trainer, clipping.
    monkeypatch.chdir(tmp_path)
    code, report = _report(ROOT / "examples" / "lm.py", *LM_TINY)
    assert code == 0 and "OK: 2 ranks train the same model as one process" in report, report
    # Control: each rank its own learning rate.
    script = tmp_path / "lm.py"
    text = (ROOT / "examples" / "lm.py").read_text()
    script.write_text(text.replace("    lr=args.lr,\n", "    lr=args.lr * (1 + rt.rank),\n"))
    assert script.read_text() != text
    code, report = _report(script, *LM_TINY)
    assert code == 1 and "UNEXPLAINED" in report, report
