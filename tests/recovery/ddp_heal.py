"""One healing run of the tiny model, the same on every process: run as a script under torchrun for the DDP side of
tests/recovery/test_ddp.py, imported by the test for its one-process reference.

Every process builds the same tiny Llama from the same seed, compresses it with FlattenGPT 6 -> 4 (deterministic
given the weights and the text) and heals it from a copy of the dense weights. Rank 0 writes the healed state_dict
and the log of each mode to ``OUT/<mode>.pt``, of a guarded `full` run to ``OUT/guarded.pt`` and of a stopped and
resumed one to ``OUT/resumed.pt``.

    python -m torch.distributed.run --nproc_per_node 2 tests/recovery/ddp_heal.py OUT
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import torch  # noqa: E402

import tiny_models  # noqa: E402
from common import compress  # noqa: E402
from optimum_flatten.recovery import RecoveryConfig, recover  # noqa: E402
from optimum_flatten.recovery.gate import full_tensor  # noqa: E402

#: Global rows per optimiser step, the same in every run; a DDP run of N processes reads GLOBAL_BATCH / N rows each.
GLOBAL_BATCH = 4
SEQLEN = 32
STEPS = 4
#: The rate of every run that does not give its own.
LEARNING_RATE = 5e-3

#: mode -> how a run of N processes shapes its batch. `full` keeps accelerate's default (the batch size is per
#: process, the N per-process batches of one step are N consecutive batches of the one seeded order); `changed`
#: sets split_batches (the batch size is global, each step's batch is cut in N).
MODES: dict[str, bool] = {"full": False, "changed": True}

#: A guard (`RecoveryConfig.guard_text`) unlike the training text: at `LEARNING_RATE` its objective is below the
#: start's up to step 2 and above it at steps 3 and 4, while the training text's held-out objective falls at every
#: step, so the guarded gate keeps step 2 where an unguarded one keeps step 4.
GUARD = ["0123456789 ABCDEFGHIJ !?#%&" * 4] * 8

#: FSDP2 with each decoder layer its own unit (accelerate adds the embedding, the final norm with the LM head, and
#: the root).
FSDP_CONFIG: dict[str, Any] = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


def heal(
    mode: str,
    processes: int,
    split: bool | None = None,
    fsdp: bool = False,
    **options: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """(compressed state before healing, healed state, log) of `mode` for a run of `processes` processes.

    `split` overrides the mode's batch shape (`MODES`); `fsdp` asks the Trainer for FSDP2, each decoder layer a
    unit (what `fsdp_heal.py` launches); `options` override the `RecoveryConfig` below (a rate that overshoots, so
    that the gate keeps an earlier state or stops early). The healed state is gathered whole on every process (a
    sharded model's parameters are DTensors), as `recover`'s docstring tells FSDP users to.
    """
    torch.manual_seed(0)
    dense = tiny_models.tiny_llama_gqa()
    model = copy.deepcopy(dense)
    quantizer = compress(model, "flattengpt", num_layers_to_remove=2, linear_replacement="lstsq")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    split = MODES[mode] if split is None else split
    per_device = GLOBAL_BATCH if split else GLOBAL_BATCH // processes
    settings: dict[str, Any] = dict(
        mode=mode,
        max_tokens=STEPS * GLOBAL_BATCH * SEQLEN,  # the budget is global: the same steps whatever `processes`
        seqlen=SEQLEN,
        per_device_train_batch_size=per_device,
        kd_alpha=0.5,  # half KL to the dense copy, half LM loss: on random tiny weights the KL alone barely moves
        learning_rate=LEARNING_RATE,
        heldout_rows=4,
        eval_every=1,
        patience=0,
        extra_training_args={
            "disable_tqdm": True,
            "use_cpu": True,
            "accelerator_config": {"split_batches": split},
            **({"fsdp": True, "fsdp_config": FSDP_CONFIG} if fsdp else {}),
        },
    )
    config = RecoveryConfig(**{**settings, **options})
    healed, log = recover(
        model,
        tiny_models.CharTokenizer(),
        tiny_models.sample_texts(),
        config,
        teacher=dense,
        report=dict(quantizer.report),
    )
    after = {k: full_tensor(v.detach()).clone() for k, v in healed.state_dict().items()}
    # How many parameters came back as shards (DTensors): all of them under FSDP2, none under DDP or alone.
    sharded = sum(type(p).__name__ == "DTensor" for p in healed.parameters())
    return before, after, {**log, "sharded_parameters": sharded}


#: The step a stopped run of `heal_stopped_then_resumed` ends on; its newest checkpoint is then that of step 2.
STOP_AT = 3


class Stopped(RuntimeError):
    """Stands for the job being killed."""


def heal_stopped_then_resumed(
    processes: int, folder: Path
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """`heal("full", processes)` checkpointed every 2 steps, stopped as step `STOP_AT` ends on every process, then
    resumed from the checkpoint of step 2 (`recovery.resume`)."""
    import torch.distributed as dist

    from optimum_flatten.recovery.resume import CheckpointState

    def stopping(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == STOP_AT:
            raise Stopped(f"stopped at step {STOP_AT}")
        return control

    CheckpointState.on_step_end = stopping  # type: ignore[method-assign]
    try:
        heal("full", processes, checkpoint_dir=str(folder), save_every=2)
    except Stopped:
        pass
    finally:
        del CheckpointState.on_step_end  # the callback's own (TrainerCallback's) again
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written every checkpoint before any process resumes
    return heal("full", processes, checkpoint_dir=str(folder), save_every=2)  # the same line again: it resumes


def main(out: str) -> None:
    import torch.distributed as dist

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    main_process = int(os.environ.get("RANK", "0")) == 0
    for mode in MODES:
        before, after, log = heal(mode, processes)
        if main_process:
            torch.save({"before": before, "after": after, "log": log}, Path(out) / f"{mode}.pt")
    before, after, log = heal("full", processes, guard_text=GUARD)
    if main_process:
        torch.save({"before": before, "after": after, "log": log}, Path(out) / "guarded.pt")
    before, after, log = heal_stopped_then_resumed(processes, Path(out) / "checkpoints")
    if main_process:
        torch.save({"before": before, "after": after, "log": log}, Path(out) / "resumed.pt")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
