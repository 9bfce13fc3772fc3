"""Step 2 of LayerCollapse: train the prepared activations towards the identity while the task loss trains the rest.

Two ways to pull every α towards 1, as in the paper (Shabgahi et al., arXiv:2311.17943):

- `LayerCollapseTrainer`: a `transformers.Trainer` whose loss gains ``lc·Σ(1 − α)²``, scaled so that the regulariser
  weighs the same per optimizer step whatever the gradient accumulation.
- `AdamLC`: Adam whose pull of α towards 1 is a decoupled step, like AdamW's weight decay but towards 1, so that the
  pull is not rescaled by Adam's per-parameter step size. Use it with a plain Trainer through
  ``Trainer(optimizer_cls_and_kwargs=(AdamLC, {"lr": ..., "lc": ...}))``.

`train_to_linear` runs the pull-then-land `LinearisationSchedule` that the command line, the examples and the
benchmarks use. Importing this module imports `transformers.Trainer` (and through it datasets / peft when they are
installed), so the package loads it only when one of its names is asked for (`optimum_flatten.methods.layer_collapse`
resolves them lazily): registering the method for `FlattenQuantizer` does not import a trainer.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from ...options.methods.layer_collapse import LinearisationSchedule
from ...utils.torch_utils import keeping_use_cache
from .activation import CollapseAlpha, ParametricActivation, parametric_activations

logger = logging.getLogger(__name__)

#: Log keys: per-layer α under ``lc_alpha/<module name>``, the regulariser value under ``lc_regularizer``.
ALPHA_LOG_PREFIX = "lc_alpha/"
REGULARIZER_LOG_KEY = "lc_regularizer"


# ------------------------------------------------------------------------------------------------- penalty
def collapse_penalty(modules: Iterable[ParametricActivation]) -> torch.Tensor:
    """``Σ (1 − α)²`` over the modules (differentiable); multiply by lc for the paper's regulariser."""
    terms = [(1.0 - module.current_alpha()).pow(2) for module in modules]
    if not terms:
        raise ValueError("collapse_penalty got no ParametricActivation; attach some first.")
    total = terms[0]
    for term in terms[1:]:  # α of a model split over devices live on several devices
        total = total + term.to(total.device)
    return total


# ------------------------------------------------------------------------------------------------- trainer
class _ProjectAlphas(TrainerCallback):
    """Clamps every α back into [0, 1] right after each optimizer step, whatever the optimizer."""

    def __init__(self, modules: Callable[[], list[tuple[str, ParametricActivation]]]) -> None:
        self._modules = modules

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for _, module in self._modules():
            module.project_()


class LayerCollapseTrainer(Trainer):
    """A Trainer whose training loss is ``task loss + lc·Σ(1 − α)²`` over the model's ParametricActivations.

    Gradient accumulation: the Trainer either divides each micro-batch loss by the number of micro-batches k (a
    per-batch mean loss), or leaves it as it is because the model already normalised it by the item count of the
    whole accumulated batch (`num_items_in_batch`). The regulariser is added after the task loss is computed, as
    ``lc·Σ(1 − α)²`` in the first case and ``lc·Σ(1 − α)² / k`` in the second, so that the k micro-batches of one
    optimizer step add up to exactly one ``lc·Σ(1 − α)²``, the same as without accumulation. The decision mirrors
    `Trainer.training_step` (``loss_is_scaled_for_ga``, ``model_accepts_loss_kwargs``, ``compute_loss_func``) and k
    is the Trainer's ``current_gradient_accumulation_steps`` (smaller for a short last step). The regulariser is
    added in training only, so evaluation losses stay task losses.

    Every log entry with a training ``loss`` also gets ``lc_alpha/<module name>`` per activation and
    ``lc_regularizer`` (lc·Σ(1 − α)² at logging time). After every optimizer step α is projected into [0, 1].

    Args:
        *args, **kwargs: As for `transformers.Trainer`.
        lc: Strength of the regulariser (≥ 0; 0 when `AdamLC` does the pulling).

    Raises:
        ValueError: lc < 0, or the model holds no ParametricActivation.
    """

    def __init__(self, *args: Any, lc: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not lc >= 0:
            raise ValueError(f"lc must be >= 0, got {lc}.")
        self.lc = float(lc)
        self._activation_cache: tuple[int, list[tuple[str, ParametricActivation]]] | None = None
        if not self.collapse_activations():
            raise ValueError(
                "LayerCollapseTrainer found no ParametricActivation in the model; replace the MLP activations first "
                "with attach_parametric_activations_([(mlp, 'act'), ...])."
            )
        self.add_callback(_ProjectAlphas(self.collapse_activations))

    def collapse_activations(self) -> list[tuple[str, ParametricActivation]]:
        """(name, module) of every ParametricActivation of the current model (re-read if the model is replaced)."""
        if self._activation_cache is None or self._activation_cache[0] != id(self.model):
            self._activation_cache = (id(self.model), parametric_activations(self.model))
        return self._activation_cache[1]

    def regularizer_scale(self, num_items_in_batch: torch.Tensor | int | None) -> float:
        """The factor on ``lc·Σ(1 − α)²`` per micro-batch that makes it count once per optimizer step."""
        if self.loss_is_scaled_for_ga is not None:
            already_scaled = self.loss_is_scaled_for_ga
        else:
            already_scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not already_scaled:
            return 1.0  # training_step divides the whole loss by the number of micro-batches
        micro_batches = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        return 1.0 / micro_batches

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not model.training or self.lc == 0:
            return result
        loss, outputs = result if return_outputs else (result, None)
        penalty = self.lc * collapse_penalty(module for _, module in self.collapse_activations())
        loss = loss + (penalty * self.regularizer_scale(num_items_in_batch)).to(loss.device)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            activations = self.collapse_activations()
            with torch.no_grad():
                for name, module in activations:
                    logs[f"{ALPHA_LOG_PREFIX}{name}"] = float(module.current_alpha())
                logs[REGULARIZER_LOG_KEY] = self.lc * float(collapse_penalty(m for _, m in activations))
        super().log(logs, start_time)


#: The two ways `build_layer_collapse_trainer` pulls α towards 1.
PULLS = ("regularizer", "adamlc")


def build_layer_collapse_trainer(
    model: nn.Module,
    train_dataset: Any,
    args: Any,
    *,
    lc: float,
    pull: str = "regularizer",
    eval_dataset: Any = None,
    data_collator: Any = None,
    **trainer_kwargs: Any,
) -> LayerCollapseTrainer:
    """Step 2 of LayerCollapse: a Trainer that fine-tunes a prepared model while pulling every α towards 1.

    Both pulls return a `LayerCollapseTrainer`, so either way every training log entry carries
    ``lc_alpha/<module name>`` per MLP (and ``lc_regularizer``) and α is projected into [0, 1] after each step:

    - ``pull="regularizer"``: the loss gains ``lc·Σ(1 − α)²`` and the optimizer is the one `args` selects.
    - ``pull="adamlc"``: the loss is the task loss and the optimizer is `AdamLC` with ``lr = args.learning_rate``,
      Adam's betas / epsilon from `args`, weight decay from `args` (through the Trainer's param groups, none on α),
      and the decoupled pull ``α ← α + 2·lr·lc·(1 − α)``. With ``2·lr·lc ≥ 1`` α reaches 1 in one step.

    Args:
        model: A model prepared with `prepare_layer_collapse_`.
        train_dataset: Rows the model's forward accepts (e.g. ``{"input_ids", "labels"}`` for a causal LM).
        args: `transformers.TrainingArguments` (use ``report_to=[]`` to keep the run local).
        lc: Strength of the pull (≥ 0).
        pull: ``"regularizer"`` or ``"adamlc"``.
        eval_dataset, data_collator: As for `transformers.Trainer`.
        **trainer_kwargs: Passed on to the Trainer (callbacks, processing_class, ...); ``optimizers`` and
            ``optimizer_cls_and_kwargs`` are refused with ``pull="adamlc"``, which sets the optimizer itself.

    Returns:
        The trainer; call ``.train()``, then collapse with `FlattenQuantizer` (method ``"layer_collapse"``).

    Raises:
        ValueError: unknown `pull`, lc < 0, a conflicting optimizer, or no prepared MLP in the model.
    """
    if pull not in PULLS:
        raise ValueError(f"pull must be one of {list(PULLS)}, got {pull!r}.")
    if not lc >= 0:
        raise ValueError(f"lc must be >= 0, got {lc}.")
    if pull == "adamlc":
        conflicting = sorted({"optimizers", "optimizer_cls_and_kwargs"} & set(trainer_kwargs))
        if conflicting:
            raise ValueError(
                f"pull='adamlc' sets the optimizer (AdamLC), so {conflicting} cannot be passed too; use "
                "pull='regularizer' to train with your own optimizer."
            )
        optimizer_kwargs = {
            "lr": args.learning_rate,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
            "lc": float(lc),
        }
        trainer_kwargs["optimizer_cls_and_kwargs"] = (AdamLC, optimizer_kwargs)
    trainer = LayerCollapseTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=data_collator,
        lc=float(lc) if pull == "regularizer" else 0.0,
        **trainer_kwargs,
    )
    names = [name for name, _ in trainer.collapse_activations()]
    logger.info("layer_collapse training (%s, lc=%g) over the activations %s", pull, lc, names)
    return trainer


class KeepEmbeddings(nn.Module):
    """A sentence encoder plus the loss that keeps its embeddings: 1 − cos(mean-pooled states, target embedding).

    An encoder's forward (``BertModel``) has no loss, and LayerCollapse training needs one. Rows carry the dense
    model's embedding as ``labels`` (`mean_pooled` of it, normalised or not: the cosine ignores scale), so the
    encoder learns to compute what it computed before while α is pulled to 1: self-distillation, no labelled data.
    Pass it as `train_to_linear(..., trained=KeepEmbeddings(encoder))`.
    """

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> dict:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        pooled = mean_pooled(hidden, attention_mask)
        return {"loss": (1 - torch.nn.functional.cosine_similarity(pooled, labels, dim=-1)).mean()}


def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean of the states over real (unmasked) tokens: the sentence embedding of all-MiniLM-L6-v2 and kin."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def train_to_linear(
    model: nn.Module,
    train_dataset: Sequence[dict[str, Any]],
    schedule: LinearisationSchedule | None = None,
    *,
    trained: nn.Module | None = None,
) -> dict[str, Any]:
    """Runs `schedule` on a model prepared with `prepare_layer_collapse_`; returns the per-phase log.

    Each phase reads its own rows of `train_dataset` in order (phase 1 the first ``pull_steps·batch_size``, phase
    2 the next), cycling when there are fewer. `trained` is what the Trainer runs (default `model`): a wrapper that
    computes the loss, for a model whose forward has none (a sentence encoder trained to keep its embeddings).

    Raises:
        ValueError: the model holds no prepared MLP, or `train_dataset` is empty.
    """
    from transformers import TrainingArguments

    schedule = schedule or LinearisationSchedule()
    if not len(train_dataset):
        raise ValueError("train_to_linear needs training rows; got none.")
    activations = parametric_activations(model)
    log: dict[str, Any] = {"activations": [name for name, _ in activations], "rows": len(train_dataset)}
    phases = (
        ("pull", schedule.pull_steps, schedule.learning_rate, schedule.pull_per_step),
        ("snap", schedule.snap_steps, schedule.snap_learning_rate, 1.0),
    )
    offset = 0
    for phase, steps, lr, pull in phases:
        if steps == 0:
            continue
        size = schedule.batch_size
        rows = [train_dataset[i % len(train_dataset)] for i in range(offset * size, (offset + steps) * size)]
        with tempfile.TemporaryDirectory() as scratch:
            args = TrainingArguments(
                output_dir=scratch,
                max_steps=steps,
                per_device_train_batch_size=size,
                learning_rate=lr,
                lr_scheduler_type="constant",
                warmup_steps=0,
                weight_decay=0.0,
                logging_steps=schedule.logging_steps or max(1, steps // 4),
                save_strategy="no",
                report_to="none",
                seed=schedule.seed,
                dataloader_num_workers=0,
                remove_unused_columns=trained is None,
                **{"dataloader_pin_memory": torch.cuda.is_available(), **schedule.extra_training_args},
            )
            with keeping_use_cache(model):
                trainer = build_layer_collapse_trainer(trained or model, rows, args, lc=pull / (2 * lr), pull="adamlc")
                result = trainer.train()
        offset += steps
        log[phase] = {
            "steps": steps,
            "learning_rate": lr,
            "lc": pull / (2 * lr),
            "train_loss": result.training_loss,
            "alpha_after": [float(module.current_alpha().detach()) for _, module in activations],
        }
    model.eval()
    return log


# --------------------------------------------------------------------------------------------------- AdamLC
def is_collapse_alpha(parameter: torch.Tensor) -> bool:
    """Whether a parameter is the α of a ParametricActivation."""
    return isinstance(parameter, CollapseAlpha)


class AdamLC(torch.optim.Optimizer):
    """Adam with decoupled weight decay (AdamW) plus a decoupled pull of every α towards 1.

    Per step, for each α (found by its type, `CollapseAlpha`, or listed in `alpha_params`) with learning rate η:

    1. ``α ← α + 2·η·lc·(1 − α)``: a step of size η on ``lc·(1 − α)²``, applied directly rather than through Adam's
       moments, exactly as AdamW applies ``θ ← θ − η·wd·θ`` (it is AdamW's decay with the target 1 instead of 0).
       Adam would normalise the regulariser's gradient by its own running magnitude and make the pull's strength
       depend on the task gradient's noise; decoupled, lc means the same whatever the loss. This is also the
       update of the authors' public code (their modified AdamW). It does not need a task gradient.
    2. the Adam step from the task gradient (when there is one), without weight decay: decaying α towards 0
       would push the activation back to its nonlinear start, against the pull.
    3. ``α ← clamp(α, 0, 1)`` (projection).

    Other parameters get the plain AdamW step (decay first, ``θ ← θ·(1 − η·wd)``, then Adam; skipped without a
    gradient). Param groups are split internally into α and non-α groups, so the two Trainer groups (decay / no decay)
    work as they are. With ``2·η·lc ≥ 1`` the pull reaches 1 in one step (then stays there).

    Args:
        params: Parameters or param groups, as for torch optimizers.
        lr: Learning rate η.
        betas, eps: Adam's moment decays and denominator epsilon.
        weight_decay: Decoupled weight decay for the non-α parameters.
        lc: Strength of the pull of α towards 1 (≥ 0); a group may override it with its own ``"lc"``.
        alpha_params: Extra parameters to treat as α (e.g. after pickling, which drops the CollapseAlpha type).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        lc: float = 0.0,
        alpha_params: Iterable[torch.Tensor] | None = None,
    ) -> None:
        for label, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("lc", lc)):
            if not value >= 0:
                raise ValueError(f"{label} must be >= 0, got {value}.")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}.")
        extra = {id(p) for p in alpha_params or ()}
        groups = _split_alpha_groups(params, lambda p: is_collapse_alpha(p) or id(p) in extra)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, lc=lc, collapse_alpha=False)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for parameter in group["params"]:
                if group["collapse_alpha"]:
                    self._alpha_step_(parameter, group)
                elif parameter.grad is not None:
                    if group["weight_decay"]:
                        parameter.mul_(1.0 - group["lr"] * group["weight_decay"])
                    self._adam_step_(parameter, group)
        return loss

    def _alpha_step_(self, alpha: torch.Tensor, group: dict[str, Any]) -> None:
        pull = 2.0 * group["lr"] * group["lc"]
        if pull:
            alpha.add_(1.0 - alpha, alpha=pull)
        if alpha.grad is not None:
            self._adam_step_(alpha, group)
        alpha.clamp_(0.0, 1.0)

    def _adam_step_(self, parameter: torch.Tensor, group: dict[str, Any]) -> None:
        grad = parameter.grad
        if grad.is_sparse:
            raise RuntimeError("AdamLC does not support sparse gradients; use dense embeddings or torch SparseAdam.")
        state = self.state[parameter]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias_correction1 = 1.0 - beta1 ** state["step"]
        bias_correction2 = 1.0 - beta2 ** state["step"]
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
        parameter.addcdiv_(exp_avg, denom, value=-group["lr"] / bias_correction1)


def _split_alpha_groups(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], is_alpha: Callable[[torch.Tensor], bool]
) -> list[dict[str, Any]]:
    """Each incoming group split into its non-α part and its α part (weight decay 0, ``collapse_alpha=True``)."""
    params = list(params)
    groups = [dict(g) for g in params] if params and isinstance(params[0], dict) else [{"params": params}]
    result = []
    for group in groups:
        members = list(group["params"]) if not isinstance(group["params"], torch.Tensor) else [group["params"]]
        options = {key: value for key, value in group.items() if key != "params"}
        others = [p for p in members if not is_alpha(p)]
        alphas = [p for p in members if is_alpha(p)]
        if others:
            result.append({**options, "params": others, "collapse_alpha": False})
        if alphas:
            result.append({**options, "params": alphas, "weight_decay": 0.0, "collapse_alpha": True})
    return result
