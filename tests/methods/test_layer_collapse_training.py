from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

import tiny_models
from common import assert_close
from optimum_flatten.methods.layer_collapse import (
    AdamLC,
    LayerCollapseTrainer,
    ParametricActivation,
    attach_parametric_activations_,
    collapse_linearised_pair,
    collapse_penalty,
    collapse_ready,
    make_parametric_activation,
    parametric_activations,
    require_collapse_ready,
)
from optimum_flatten.utils.errors import NotCollapsibleError

WIDTH, HIDDEN, INIT_ALPHA = 4, 8, 0.3


class _Mlp(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(WIDTH, HIDDEN), act, nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class MeanLossRegressor(nn.Module):
    """Two residual MLPs and a head; returns the per-batch mean squared error like a model without loss kwargs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlps = nn.ModuleList([_Mlp(nn.GELU()), _Mlp(nn.ReLU())])
        self.head = nn.Linear(WIDTH, 1)

    def squared_errors(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for mlp in self.mlps:
            x = x + mlp(x)
        return (self.head(x).squeeze(-1) - labels).pow(2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.squared_errors(x, labels).mean()}


class ItemCountRegressor(MeanLossRegressor):
    """Normalises by `num_items_in_batch` (the whole accumulated batch), as transformers models with loss kwargs do."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
        errors = self.squared_errors(x, labels)
        count = kwargs.get("num_items_in_batch")
        return {"loss": errors.sum() / count if count is not None else errors.mean()}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, num_rows: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(num_rows, WIDTH, generator=g)
        self.labels = torch.randn(num_rows, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.labels[i]}


def _model(cls=MeanLossRegressor) -> nn.Module:
    model = cls()
    attach_parametric_activations_([(mlp, "act") for mlp in model.mlps], alpha=INIT_ALPHA)
    return model


def _args(tmp_path, batch: int, accumulation: int, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def _alphas(model: nn.Module) -> list[float]:
    return [module.alpha.item() for _, module in parametric_activations(model)]


def _train(tmp_path, cls, batch, accumulation, lc, lr=0.1, rows=4, **overrides):
    model = _model(cls)
    trainer = LayerCollapseTrainer(
        model=model,
        args=_args(tmp_path, batch, accumulation, **overrides),
        train_dataset=_Rows(rows),
        optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": lr}),
        lc=lc,
    )
    trainer.train()
    return model, trainer


# ----------------------------------------------------------------------------------------------- helpers
def test_attach_replaces_in_place_returns_the_modules_and_is_idempotent():
    model = MeanLossRegressor()
    x = torch.randn(3, WIDTH)
    with torch.no_grad():
        before = model.squared_errors(x, torch.zeros(3))
    attached = attach_parametric_activations_([(mlp, "act") for mlp in model.mlps])
    assert [model.mlps[0].act, model.mlps[1].act] == attached
    assert [m.family for m in attached] == ["gelu", "relu"]
    with torch.no_grad():
        assert torch.equal(model.squared_errors(x, torch.zeros(3)), before)
    again = attach_parametric_activations_([(model.mlps[0], "act")])
    assert again[0] is attached[0]
    assert [name for name, _ in parametric_activations(model)] == ["mlps.0.act", "mlps.1.act"]


def test_attach_checks_every_pair_before_replacing_any():
    model = MeanLossRegressor()
    model.mlps[1].act = nn.Tanh()
    with pytest.raises(TypeError, match=r"_Mlp\.act: LayerCollapse cannot linearise"):
        attach_parametric_activations_([(model.mlps[0], "act"), (model.mlps[1], "act")])
    assert isinstance(model.mlps[0].act, nn.GELU), "the first pair must stay untouched"
    with pytest.raises(ValueError, match="no attribute 'activation'"):
        attach_parametric_activations_([(model.mlps[0], "activation")])


def test_collapse_ready_and_the_error_above_threshold_states_alpha():
    modules = [make_parametric_activation(nn.GELU(), alpha=a) for a in (1.0, 1.0 - 5e-5, 0.99)]
    assert collapse_ready(modules) == [True, True, False]
    assert collapse_ready(modules, threshold=0.02) == [True, True, True]
    with pytest.raises(NotCollapsibleError, match=r"alpha = 0\.99 .*threshold 0\.0001"):
        require_collapse_ready(modules[2], name="mlps.1.act")
    w1, b1, w2, b2 = torch.randn(HIDDEN, WIDTH), torch.randn(HIDDEN), torch.randn(WIDTH, HIDDEN), None
    with pytest.raises(NotCollapsibleError, match=r"mlps\.1\.act"):
        collapse_linearised_pair(w1, b1, w2, b2, modules[2], name="mlps.1.act")
    weight, _ = collapse_linearised_pair(w1, b1, w2, b2, modules[0])
    assert_close(weight, (w2.double() @ w1.double()).float())
    with pytest.raises(ValueError, match="positive"):
        collapse_ready(modules, threshold=0.0)


# ----------------------------------------------------------------------------------------------- trainer
@pytest.mark.parametrize("cls", [MeanLossRegressor, ItemCountRegressor])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_reported_loss_is_task_loss_plus_regulariser_and_alphas_are_logged(tmp_path, cls, accumulation):
    lc = 0.7
    model, trainer = _train(tmp_path, cls, batch=4 // accumulation, accumulation=accumulation, lc=lc, lr=0.0)
    assert trainer.model_accepts_loss_kwargs == (cls is ItemCountRegressor)
    rows = _Rows(4)
    with torch.no_grad():
        task = model.squared_errors(rows.x, rows.labels).mean().item()
    regulariser = lc * 2 * (1 - torch.tensor(INIT_ALPHA).item()) ** 2
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert entry["loss"] == pytest.approx(task + regulariser, rel=1e-6)
    assert entry["lc_regularizer"] == pytest.approx(regulariser, rel=1e-6)
    assert entry["lc_alpha/mlps.0.act"] == pytest.approx(INIT_ALPHA)
    assert entry["lc_alpha/mlps.1.act"] == pytest.approx(INIT_ALPHA)
    # Evaluation reports the task loss only.
    assert trainer.evaluate(rows)["eval_loss"] == pytest.approx(task, rel=1e-6)


@pytest.mark.parametrize("cls", [MeanLossRegressor, ItemCountRegressor])
def test_accumulation_gives_the_same_update_as_one_big_batch(tmp_path, cls):
    accumulated, _ = _train(tmp_path / "a", cls, batch=2, accumulation=2, lc=1.5)
    single, _ = _train(tmp_path / "b", cls, batch=4, accumulation=1, lc=1.5)
    unregularised, _ = _train(tmp_path / "c", cls, batch=4, accumulation=1, lc=0.0)
    for (name, a), (_, b) in zip(accumulated.named_parameters(), single.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    # The regulariser did move α (by 2·lr·lc·(1 − α) more than the task alone).
    moved = [a - b for a, b in zip(_alphas(single), _alphas(unregularised), strict=True)]
    assert moved == pytest.approx([2 * 0.1 * 1.5 * (1 - INIT_ALPHA)] * 2, rel=1e-5)


def test_alpha_is_projected_into_unit_interval_after_each_step(tmp_path):
    # One SGD step moves α by about lr·2·lc·(1 − α) = 140 upwards; the projection brings it back to exactly 1.
    model, _ = _train(tmp_path, MeanLossRegressor, batch=4, accumulation=1, lc=10.0, lr=10.0)
    assert _alphas(model) == [1.0, 1.0]


def test_trainer_needs_parametric_activations(tmp_path):
    with pytest.raises(ValueError, match="attach_parametric_activations_"):
        LayerCollapseTrainer(model=MeanLossRegressor(), args=_args(tmp_path, 4, 1), train_dataset=_Rows(4), lc=1.0)


def test_collapse_penalty_is_the_sum_of_squared_distances():
    modules = [make_parametric_activation(nn.ReLU(), alpha=a) for a in (0.0, 0.5, 1.0)]
    assert collapse_penalty(modules).item() == pytest.approx(1.0 + 0.25)


# ------------------------------------------------------------------------------------------------ AdamLC
def test_adamlc_pulls_alpha_towards_one_without_task_gradient_and_never_decays_it():
    act = make_parametric_activation(nn.ReLU(), alpha=0.2)
    weight = nn.Parameter(torch.ones(3))
    optimizer = AdamLC([weight, act.alpha], lr=0.1, weight_decay=0.5, lc=1.0)
    weight.grad = torch.zeros(3)
    act.alpha.grad = torch.zeros(())
    optimizer.step()
    assert act.alpha.item() == pytest.approx(0.2 + 2 * 0.1 * 1.0 * 0.8)
    assert_close(weight.detach(), torch.full((3,), 1 - 0.1 * 0.5))  # decoupled decay on weights only
    act.alpha.grad = None  # the pull needs no gradient at all
    optimizer.step()
    assert act.alpha.item() == pytest.approx(0.36 + 2 * 0.1 * 0.64)
    alpha_groups = [g for g in optimizer.param_groups if g["collapse_alpha"]]
    assert len(alpha_groups) == 1 and alpha_groups[0]["weight_decay"] == 0.0

    still = make_parametric_activation(nn.ReLU(), alpha=0.2)
    no_pull = AdamLC([still.alpha], lr=0.1, weight_decay=0.5, lc=0.0)
    still.alpha.grad = torch.zeros(())
    before = still.alpha.item()
    no_pull.step()
    assert still.alpha.item() == before, "weight_decay=0.5 must not touch α"


def test_adamlc_saturates_at_exactly_one():
    act = make_parametric_activation(nn.GELU(), alpha=0.2)
    AdamLC([act.alpha], lr=1.0, lc=1.0).step()
    assert act.alpha.item() == 1.0
    assert collapse_ready([act]) == [True]


def test_adamlc_without_alphas_is_adamw():
    torch.manual_seed(0)
    ours, reference = nn.Linear(5, 3), nn.Linear(5, 3)
    reference.load_state_dict(ours.state_dict())
    mine = AdamLC(ours.parameters(), lr=0.01, weight_decay=0.1, lc=3.0)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in ours.parameters()]
        for p, q, grad in zip(ours.parameters(), reference.parameters(), grads, strict=True):
            p.grad, q.grad = grad.clone(), grad.clone()
        mine.step()
        torch_adamw.step()
    for p, q in zip(ours.parameters(), reference.parameters(), strict=True):
        assert_close(p.detach(), q.detach())


def test_adamlc_through_trainer_optimizer_cls_and_kwargs(tmp_path):
    def run(lc: float, out: str) -> tuple[nn.Module, Trainer]:
        model = _model()
        trainer = Trainer(
            model=model,
            args=_args(tmp_path / out, 4, 1, weight_decay=0.1),
            train_dataset=_Rows(4),
            optimizer_cls_and_kwargs=(AdamLC, {"lr": 0.01, "lc": lc}),
        )
        trainer.train()
        return model, trainer

    pulled, trainer = run(2.0, "lc")
    free, _ = run(0.0, "free")
    # Same task gradient at step 1, so the runs differ by the decoupled pull alone.
    moved = [a - b for a, b in zip(_alphas(pulled), _alphas(free), strict=True)]
    assert moved == pytest.approx([2 * 0.01 * 2.0 * (1 - INIT_ALPHA)] * 2, rel=1e-4)
    groups = trainer.optimizer.optimizer.param_groups if hasattr(trainer.optimizer, "optimizer") else []
    groups = groups or trainer.optimizer.param_groups
    alpha_ids = {id(m.alpha) for _, m in parametric_activations(pulled)}
    for group in groups:
        members = {id(p) for p in group["params"]}
        if members & alpha_ids:
            assert members <= alpha_ids and group["weight_decay"] == 0.0 and group["collapse_alpha"]
        else:
            assert not group["collapse_alpha"]
    assert any(g["weight_decay"] == 0.1 for g in groups), "the Trainer's decay group keeps its weight decay"
    assert all(isinstance(m, ParametricActivation) for _, m in parametric_activations(pulled))


def test_keep_embeddings_is_one_minus_cosine_of_mean_pooled_real_tokens():
    """The self-distillation loss against a naive reference: padding never counts, and the dense model's own
    embeddings give a loss of 0."""
    from optimum_flatten.methods.layer_collapse import KeepEmbeddings, mean_pooled

    encoder = tiny_models.tiny_bert().bert.eval()
    ids = torch.randint(3, tiny_models.VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():
        hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        reference = torch.stack([hidden[0].mean(0), hidden[1, :4].mean(0)])
        torch.testing.assert_close(mean_pooled(hidden, mask), reference)
        loss = KeepEmbeddings(encoder)
        assert abs(float(loss(ids, mask, 3.0 * reference)["loss"])) < 1e-6  # the cosine ignores the scale
        target = torch.randn(2, reference.shape[1], generator=torch.Generator().manual_seed(1))
        expected = 1 - torch.nn.functional.cosine_similarity(reference, target, dim=-1).mean()
        torch.testing.assert_close(loss(ids, mask, target)["loss"], expected)
