"""An optimiser step's healing loss is the mean over every position it scores, however its rows are cut into
micro-batches (`recovery.distillation_trainer`).

Alpaca records are one right-padded row each, so rows score very different numbers of positions. One batch of 4
rows, two accumulated batches of 2 and four of 1 must train the same weights (plain SGD, one step: what is left is
float round-off) and log the same loss. Under a mean per micro-batch, a token of a short row weighed more than one
of a long row once the rows were split, and the three runs parted (relative weight changes differed by 30-70%).
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress
from optimum_flatten.recovery import RecoveryConfig, recover

#: Rows of about 165 to 465 characters (the Alpaca prompt alone is about 160), each one row: the rows' scored
#: positions differ by a factor of up to 3. (The tiny model's RoPE has no length limit.)
RECORDS = [
    {"instruction": f"Question {i}: say it.", "input": "", "output": "Yes. " * length}
    for i, length in enumerate([1, 60, 9, 30])
]


@pytest.fixture(scope="module")
def compressed() -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    torch.manual_seed(0)
    dense = tiny_models.tiny_llama_gqa()
    model = copy.deepcopy(dense)
    quantizer = compress(model, "flattengpt", num_layers_to_remove=2, linear_replacement="lstsq")
    return dense, model, dict(quantizer.report)


def heal(compressed, per_device: int, accumulation: int) -> tuple[dict[str, torch.Tensor], dict]:
    dense, model, report = compressed
    config = RecoveryConfig(
        mode="full",
        max_steps=1,
        seqlen=480,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        kd_alpha=0.5,
        learning_rate=0.5,
        heldout_rows=0,
        logging_steps=1,
        extra_training_args={"optim": "sgd", "lr_scheduler_type": "constant", "use_cpu": True, "disable_tqdm": True},
    )
    healed, log = recover(
        copy.deepcopy(model), tiny_models.CharTokenizer(), RECORDS, config, teacher=dense, report=report
    )
    return {k: v.detach().clone() for k, v in healed.state_dict().items()}, log


def test_the_step_is_the_same_however_its_padded_rows_are_cut_into_micro_batches(compressed):
    before = compressed[1].state_dict()
    whole, whole_log = heal(compressed, 4, 1)
    assert whole_log["data_kind"] == "alpaca" and whole_log["steps"] == 1
    moved = max(float((whole[k] - before[k]).abs().max()) for k in whole)
    assert moved > 1e-3, "the step changed nothing: the comparison would prove nothing"
    for per_device, accumulation in [(2, 2), (1, 4)]:
        split, log = heal(compressed, per_device, accumulation)
        shape = f"{per_device}x{accumulation}"
        for name, tensor in whole.items():
            torch.testing.assert_close(
                split[name], tensor, atol=1e-6, rtol=1e-5, msg=lambda m, n=name, s=shape: f"{s} {n}: {m}"
            )
        assert log["loss_history"][0]["loss"] == pytest.approx(whole_log["loss_history"][0]["loss"], rel=1e-5)
