"""Compressions of the tiny model, the same on every process: run as a script under torchrun for the 2-process side of
tests/calibration/test_distributed.py, imported by the test for its one-process reference.

Every process builds the same tiny Llama from the same seed and compresses it; under a gloo process group each rank
calibrates on its share of the batches (calibration/distributed.py). Rank 0 writes, per case, the plan, the
compressed state_dict and the report to ``OUT/<case>.pt``; every rank saves the FlattenGPT model to
``OUT/checkpoint`` (only rank 0 may write it), and tries a method that does not shard (its refusal goes to
``OUT/refusal.txt``).

    python -m torch.distributed.run --nproc_per_node 2 tests/calibration/ddp_calibrate.py OUT
"""

from __future__ import annotations

import contextlib
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

#: Unpacked short texts (10 to 25 characters) in batches of 2: 5 batches of padded rows, shared 2 + 3 by two ranks
#: (an uneven share; the last batch, lstsq_down's held-out one, is on rank 1).
CALIBRATION: dict[str, Any] = {
    "dataset": [text[: 10 + 3 * (i % 6)] for i, text in enumerate(tiny_models.sample_texts())],
    "nsamples": 10,
    "seqlen": 24,
    "batch_size": 2,
    "packing": False,
}

#: case -> (method, options)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "shortgpt": ("shortgpt", {}),
    "shortgpt_lstsq": ("shortgpt", {"linear_replacement": "lstsq"}),
    "replaceme": ("replaceme", {}),
    "replaceme_down": ("replaceme", {"estimator": "lstsq_down"}),
    # The window over the budget, two starts' statistics within it: the one-pass walk (its probe on each rank's
    # first batch, the ranking summed over the ranks).
    "replaceme_one_pass": ("replaceme", {"held_states_gb": 4e-5}),
    "flattengpt": ("flattengpt", {}),
    # Half the rows the model's own: every rank samples all of them, as one process does, before the share-out.
    "replaceme_down_own_text": ("replaceme", {"estimator": "lstsq_down", "own_text": 0.5}),
    # The same where each rank has other free memory, so another sampling batch of its own (`_uneven_memory`): the
    # ranks agree on one, or they would calibrate on other rows.
    "replaceme_down_own_text_uneven_memory": ("replaceme", {"estimator": "lstsq_down", "own_text": 0.5}),
}


def run(case: str) -> tuple[Any, Any, dict[str, Any]]:
    """(model, quantizer, what is compared) of `case`."""
    method, options = CASES[case]
    model = tiny_models.tiny_llama_gqa()
    with _uneven_memory() if case.endswith("uneven_memory") else contextlib.nullcontext():
        quantizer = compress(model, method, num_layers_to_remove=2, **CALIBRATION, **options)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, quantizer, {"plan": quantizer.plan.to_dict(), "state": state, "report": dict(quantizer.report)}


def _uneven_memory() -> Any:
    """The sampler's batch as the free memory would size it on a rank with 1 + 3·rank rows' worth free (one process:
    rank 0's)."""
    from unittest import mock

    from optimum_flatten.recovery import own_calibration, teacher_text

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    stack = contextlib.ExitStack()
    for module in (own_calibration, teacher_text):  # where the rule is read: by the ranks' agreement, by the sampler
        stack.enter_context(mock.patch.object(module, "default_batch_size", lambda model, seqlen: 1 + 3 * rank))
    return stack


class _RecordingApi:
    """Records an upload in a file instead of sending it (huggingface_hub.HfApi's two calls)."""

    def __init__(self, record: Path) -> None:
        self.record = record

    def create_repo(self, repo_id: str, **_: Any) -> None:
        pass

    def upload_folder(self, repo_id: str, folder_path: str, **_: Any) -> str:
        self.record.write_text(folder_path)
        return f"https://huggingface.co/{repo_id}"


def main(out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in CASES:
        model, quantizer, result = run(case)
        if rank == 0:
            torch.save(result, Path(out) / f"{case}.pt")
        if case == "flattengpt":
            quantizer.save(model, Path(out) / "checkpoint", tiny_models.tiny_hf_tokenizer())
            # Every rank asks to push; rank 0 alone saves and uploads (to a stand-in for the Hub's API).
            api = _RecordingApi(Path(out) / f"uploaded_by_rank_{rank}.txt")
            quantizer.push_to_hub(model, "nobody/flattened", local_dir=Path(out) / f"pushed_{rank}", api=api)
    try:
        compress(tiny_models.tiny_llama_gqa(), "sleb", num_layers_to_remove=2, **CALIBRATION)
    except ValueError as error:
        (Path(out) / f"refusal_{rank}.txt").write_text(str(error))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
