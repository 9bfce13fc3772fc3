"""Modes 'changed' and 'local' after LayerCollapse: the plan is the identity and the change is in the MLPs, so both
used to say "nothing to heal" about a model that is not its teacher; they are refused, naming the modes that heal."""

from __future__ import annotations

import pytest

import tiny_models
from common import compress, tiny_recovery_config
from optimum_flatten.methods.layer_collapse import prepare_layer_collapse_
from optimum_flatten.recovery import recover


@pytest.mark.parametrize("mode", ["changed", "local"])
def test_a_layer_collapse_model_is_refused_by_modes_that_read_the_plan(mode):
    model = tiny_models.tiny_gpt2()
    for activation in prepare_layer_collapse_(model, num_mlps=2).values():
        activation.alpha.data.fill_(1.0)  # trained to linear, as LayerCollapse's training leaves them
    report = compress(model, "layer_collapse", nsamples=4, seqlen=16).report
    config = tiny_recovery_config(mode=mode)
    with pytest.raises(ValueError, match=rf"mode='{mode}' reads the layers .* a LayerCollapse model keeps every layer"):
        recover(
            model,
            tiny_models.CharTokenizer(),
            tiny_models.sample_texts(),
            config,
            teacher=tiny_models.tiny_gpt2(),
            report=report,
        )
