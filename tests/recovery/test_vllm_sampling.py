"""The teacher's text sampled by vLLM (`recovery.vllm_sampling`): what it is asked, what comes back, and what is
refused. vLLM is not installed here, so a stand-in package with vLLM's interface (``LLM``, ``SamplingParams``)
records what the child process gives it and samples from each row's own seed; the `gpu` test at the end runs the real
vLLM where it and a CUDA device exist."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch

import tiny_models
from common import dense_and_compressed_on_disk
from optimum_flatten.cli.main import main
from optimum_flatten.options.recovery import RecoveryConfig
from optimum_flatten.recovery import recover
from optimum_flatten.recovery.footprint import sampling_bytes
from optimum_flatten.recovery.resume import _check_same_options, options_fingerprint
from optimum_flatten.recovery.teacher_text import cache_key, sample_teacher_rows
from optimum_flatten.recovery.vllm_sampling import child_environment, sampling_params

TOKENIZER = tiny_models.CharTokenizer()

#: vLLM's interface as the child uses it: the engine's and each request's arguments go to the log file named by
#: FAKE_VLLM_LOG (with what the child's environment held), and each row is drawn from its request's seed alone.
FAKE_VLLM = textwrap.dedent(
    """
    import json, os
    import torch

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class _Completion:
        def __init__(self, token_ids):
            self.token_ids = token_ids

    class _Output:
        def __init__(self, token_ids):
            self.outputs = [_Completion(token_ids)]

    class LLM:
        def __init__(self, model, **kwargs):
            if os.environ.get("FAKE_VLLM_FAIL"):
                raise RuntimeError("no GPU vLLM supports\\nsecond line")
            self.engine = {"model": model, **kwargs}

        def generate(self, prompts, params, use_tqdm=True):
            log = {"engine": self.engine, "params": [p.kwargs for p in params], "prompts": prompts,
                   "use_tqdm": use_tqdm, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "RANK": os.environ.get("RANK"), "MASTER_PORT": os.environ.get("MASTER_PORT")}
            with open(os.environ["FAKE_VLLM_LOG"], "w") as f:
                json.dump(log, f)
            outputs = []
            for p in params:
                g = torch.Generator().manual_seed(p.kwargs["seed"])
                outputs.append(_Output(torch.randint(0, 96, (p.kwargs["max_tokens"],), generator=g).tolist()))
            return outputs
    """
)


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """The stand-in vLLM on the import path (a spawned child inherits it); returns the log file's path."""
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    log = tmp_path / "vllm_log.json"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return log


def _teacher_on_disk(tmp_path):
    """A tiny teacher loaded from a folder, as a user's teacher is (vLLM loads it again from there)."""
    from transformers import AutoModelForCausalLM

    tiny_models.tiny_llama_gqa().save_pretrained(tmp_path / "teacher")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "teacher")


def _ids(rows):
    return torch.stack([row["input_ids"] for row in rows])


def test_vllm_is_asked_for_plain_sampling_with_eos_ordinary_and_one_seed_a_row(tmp_path, fake_vllm, monkeypatch):
    teacher = _teacher_on_disk(tmp_path)
    monkeypatch.setenv("RANK", "0")  # as torchrun leaves it: the child must not see it
    monkeypatch.setenv("MASTER_PORT", "29500")
    rows, record = sample_teacher_rows(teacher, TOKENIZER, 5, 24, seed=3, progress=False, backend="vllm")
    log = json.loads(fake_vllm.read_text())
    assert log["engine"] == {
        "model": str(tmp_path / "teacher"), "dtype": "float32", "seed": 3, "generation_config": "vllm",
        "trust_remote_code": False,
    }  # fmt: skip
    assert log["RANK"] is None and log["MASTER_PORT"] is None and log["use_tqdm"] is False
    assert log["prompts"] == [{"prompt_token_ids": [TOKENIZER.bos_token_id]}] * 5
    for params in log["params"]:
        seed = params.pop("seed")
        assert params == sampling_params(23, 1.0, None, None)
        assert isinstance(seed, int)
    assert params["top_k"] == 0 and params["top_p"] == 1.0 and params["min_p"] == 0.0
    assert params["ignore_eos"] is True and params["min_tokens"] == 0 and params["max_tokens"] == 23
    assert len({p["seed"] for p in json.loads(fake_vllm.read_text())["params"]}) == 5  # one seed a row
    ids = _ids(rows)
    assert ids.shape == (5, 24) and (ids[:, 0] == TOKENIZER.bos_token_id).all()
    for row in rows:
        assert torch.equal(row["labels"], row["input_ids"]) and bool(row["attention_mask"].all())
    for index, params in enumerate(json.loads(fake_vllm.read_text())["params"]):  # each row is its seed's draw
        g = torch.Generator().manual_seed(params["seed"])
        assert torch.equal(ids[index, 1:], torch.randint(0, 96, (23,), generator=g))
    assert record["backend"] == "vllm" and record["batch_size"] is None and record["rows"] == 5
    assert record["peak_memory_bytes"] == 0 and "vLLM was given" in record["peak_memory"]  # no CUDA here
    again, _ = sample_teacher_rows(teacher, TOKENIZER, 5, 24, seed=3, progress=False, backend="vllm")
    held, _ = sample_teacher_rows(teacher, TOKENIZER, 5, 24, seed=3, progress=False, backend="vllm", stream="heldout")
    assert torch.equal(_ids(again), ids) and not torch.equal(_ids(held), ids)


def test_a_failing_vllm_is_reported_in_its_own_words(tmp_path, fake_vllm, monkeypatch):
    teacher = _teacher_on_disk(tmp_path)
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(RuntimeError, match=r"with vLLM failed: RuntimeError: no GPU vLLM supports$"):
        sample_teacher_rows(teacher, TOKENIZER, 2, 16, seed=0, progress=False, backend="vllm")


def test_the_backend_is_in_the_cache_key_and_transformers_keys_are_as_before():
    teacher = tiny_models.tiny_llama_gqa()
    settings = {"seed": 0, "stream": "train", "temperature": 1.0}
    plain = cache_key(teacher, TOKENIZER, 4, 16, settings, None)
    assert "backend" not in plain  # caches written before vLLM was offered keep their key
    rows_a = sample_teacher_rows(teacher, TOKENIZER, 2, 16, seed=0, progress=False)[1]
    assert "backend" not in rows_a


def test_vllm_is_refused_in_one_line_where_it_is_missing_and_before_any_weight_changes():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    model = tiny_models.tiny_llama_gqa()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small = dict(seqlen=32, per_device_train_batch_size=2, heldout_rows=4, eval_every=1, max_tokens=256)
    config = RecoveryConfig(**small, sampling_backend="vllm", mode="full")
    with pytest.raises(ImportError, match=r"^sampling_backend='vllm' needs vLLM installed \(pip install vllm"):
        recover(model, TOKENIZER, "teacher", config, teacher=tiny_models.tiny_llama_gqa())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="sampling_backend is 'transformers' or 'vllm'"):
        RecoveryConfig(sampling_backend="sglang")


def test_vllm_needs_a_teacher_it_can_load_from_a_path(fake_vllm):
    teacher = tiny_models.tiny_llama_gqa()  # built from a config: no folder to load from
    with pytest.raises(ValueError, match=r"loads the teacher from its folder or Hub id, and this teacher has none"):
        sample_teacher_rows(teacher, TOKENIZER, 2, 16, seed=0, progress=False, backend="vllm")


def test_the_child_sees_only_the_teachers_gpu_and_none_of_the_launchers_variables(monkeypatch):
    import os

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with child_environment(torch.device("cuda", 1)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6" and "LOCAL_RANK" not in os.environ
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6" and os.environ["LOCAL_RANK"] == "1"
    with child_environment(torch.device("cpu")):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


def test_checkpoints_from_before_the_backend_existed_resume_and_the_footprint_leaves_vllm_out():
    model = tiny_models.tiny_llama_gqa()
    plain = RecoveryConfig(teacher_text=1.0)
    saved = options_fingerprint(plain)
    del saved["sampling_backend"]  # written before the option existed
    _check_same_options(saved, plain, "checkpoint-4")
    with pytest.raises(ValueError, match="sampling_backend: 'transformers' then, 'vllm' now"):
        _check_same_options(saved, RecoveryConfig(teacher_text=1.0, sampling_backend="vllm"), "checkpoint-4")
    assert sampling_bytes(model, plain) > 0
    assert sampling_bytes(model, RecoveryConfig(teacher_text=1.0, sampling_backend="vllm")) == 0


def test_cli_recover_samples_with_vllm(tmp_path, fake_vllm, capsys):
    """`optimum-flatten recover --sampling-backend vllm`: the teacher's folder goes to vLLM, the rows it returns
    are what healing trains on, and the report says who sampled them."""
    tokenizer = tiny_models.tiny_hf_tokenizer()
    dense, compressed = dense_and_compressed_on_disk(tmp_path, tokenizer)
    out = tmp_path / "healed"
    code = main([
        "recover", str(compressed), "--teacher", str(dense), "--dataset", "teacher", "--output", str(out),
        "--seqlen", "32", "--per-device-train-batch-size", "2", "--heldout-rows", "2", "--eval-every", "1",
        "--max-tokens", "128", "--mode", "full", "--sampling-backend", "vllm",
    ])  # fmt: skip
    assert code == 0
    recovery = json.loads((out / "flatten_report.json").read_text())["recovery"]
    assert recovery["teacher_text"]["backend"] == "vllm" and recovery["teacher_text"]["rows"] == 4
    log = json.loads(fake_vllm.read_text())  # the last call: the held-out rows
    assert log["engine"]["model"] == str(dense) and len(log["params"]) == 2
    assert "gate:" in capsys.readouterr().out


@pytest.mark.gpu
def test_real_vllm_samples_rows_that_continue_their_start(tmp_path):
    """Where vLLM and a CUDA device exist: the real engine, a tiny Llama from a folder."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    teacher = _teacher_on_disk(tmp_path).to("cuda")
    rows, record = sample_teacher_rows(teacher, TOKENIZER, 8, 64, seed=0, progress=False, backend="vllm")
    ids = _ids(rows)
    assert ids.shape == (8, 64) and (ids[:, 0] == TOKENIZER.bos_token_id).all()
    assert int(ids.max()) < teacher.config.vocab_size and record["peak_memory_bytes"] > 0
    again, _ = sample_teacher_rows(teacher, TOKENIZER, 8, 64, seed=0, progress=False, backend="vllm")
    assert torch.equal(_ids(again), ids)
