"""Hugging Face transformers models under lit_cbs, on real transformers objects: CausalLM trains a
Llama built from its config with the exact global-batch gradient through a batch change, the noise
scale finds its decoder layers, the plan counts it, a checkpoint reloads it, bad configs fail in one
line, the warmup guide's plain-Lightning example (docs/guides/warmup.md) runs, and 2 FSDP2 processes
shard it per decoder layer with activation checkpointing, a CBS probe and the guard
(recipes/train.py model=hf)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import subprocess_env
from recipe_runs import TORCHRUN_TRAIN, compose_config, train
from toys import PaddedData, PaddedSequences, SaveFirstStepGradients, quiet_fit, trainer_kwargs

from lit_cbs import BatchWarmup, ConstantBatch, GradientNoiseScale, LitCBSConfigError
from lit_cbs.analysis.curves import read_metrics_csv
from lit_cbs.data.synthetic import RandomTokenData
from lit_cbs.models.lm import CausalLM
from lit_cbs.run.memory import ModelShape

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers", reason='transformers is not installed: pip install -e ".[hf]"')

ROOT = Path(__file__).resolve().parents[2]
# Grouped-query attention (2 query heads, 1 key/value head) and a context of PaddedSequences' 8 tokens.
LLAMA = {
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 8,
}


def transformers_model(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``AutoModelForCausalLM`` of LLAMA in float64, holding CausalLM's weights ("model.lm." removed)."""
    config = transformers.LlamaConfig(**{key: value for key, value in LLAMA.items() if key != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    model.load_state_dict({name.removeprefix("model.lm."): value for name, value in weights.items()})
    return model


def test_batch_warmup_steps_a_transformers_llama_on_the_mean_over_the_steps_tokens(tmp_path):
    # Global batch 8 in micro-batches of 4 (accumulate 2) from the first step, padded sequences of 2..9 tokens:
    # the step's gradient is that of the mean loss over its 8 samples' counted tokens, computed by transformers alone.
    pl.seed_everything(0, verbose=False)
    warmup = BatchWarmup(ConstantBatch(8), lr_rule="none", seq_len=8)
    trainer = pl.Trainer(
        callbacks=[warmup, SaveFirstStepGradients(tmp_path / "step.pt")],
        **trainer_kwargs(max_steps=1, precision="64-true"),
    )
    module = CausalLM(LLAMA, ignore_index=0)
    quiet_fit(trainer, module, PaddedData(batch_size=4))
    assert trainer.accumulate_grad_batches == 2 and isinstance(module.model.lm, transformers.LlamaForCausalLM)
    recorded = torch.load(tmp_path / "step.pt", weights_only=True)

    step = PaddedSequences().tokens[:8]
    exact = reference_gradients(recorded["initial"], [step])
    assert recorded["grads"].keys() == exact.keys()
    # Llama's RMSNorm computes in float32 even in a float64 model: agreement is to float32's rounding.
    for name, grad in recorded["grads"].items():
        torch.testing.assert_close(grad, exact[name], rtol=1e-4, atol=1e-7)
    micro_means = reference_gradients(recorded["initial"], list(step.split(4)))  # what Lightning alone would average
    assert not all(torch.allclose(micro_means[name], exact[name], rtol=1e-4, atol=1e-7) for name in exact)


def reference_gradients(weights: dict[str, torch.Tensor], batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' own Llama: the mean over ``batches`` of each one's gradient of its mean loss per counted token."""
    reference = transformers_model(weights)
    for batch in batches:
        logits = reference(input_ids=batch[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), ignore_index=0)
        (loss / len(batches)).backward()
    return {f"model.lm.{name}": p.grad for name, p in reference.named_parameters()}


def test_a_micro_batch_of_no_sample_runs_every_layer_to_a_zero_gradient_and_a_finite_loss():
    # An epoch's last micro-batch can hold no sample on a rank; its backward must still reach every parameter
    # (FSDP2's reduce-scatter and DDP's all-reduce wait for each rank), with nothing added to the gradient.
    module = CausalLM(LLAMA)
    module.configure_model()
    loss = module.training_step(torch.zeros(0, 9, dtype=torch.long), 0)
    assert loss.item() == 0.0
    loss.backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    assert all(grad is not None and not grad.any() for grad in grads.values()), [
        n for n, g in grads.items() if g is None
    ]


def test_the_noise_scale_groups_the_decoder_layers_of_a_checkpointed_llama():
    gns = GradientNoiseScale(groups="blocks")
    trainer = pl.Trainer(callbacks=[gns], **trainer_kwargs(max_steps=4, accumulate_grad_batches=2))
    module = CausalLM(LLAMA, activation_checkpointing=True)
    quiet_fit(trainer, module, RandomTokenData(vocab_size=32, seq_len=8, batch_size=4, samples=64))
    # Parameter names hold checkpoint_wrapper's "_checkpoint_wrapped_module"; the layers are found from the modules.
    assert any("_checkpoint_wrapped_module" in name for name, _ in module.named_parameters())
    assert gns.group_names == ["embed_tokens", "block0", "block1", "norm", "lm_head"]
    assert gns.num_updates == 4
    measured = gns.last_measurement
    # Every trained parameter is in a group, so the groups' squared norms add up to the model's.
    total = sum(p.grad.double().square().sum() for p in module.parameters() if p.grad is not None)
    assert float(measured.big_grad_sq.sum()) == pytest.approx(float(total), rel=1e-5)


def test_the_plan_counts_the_transformers_model_it_would_train():
    cfg = compose_config("model=hf")
    plan = train.plan_of(cfg)
    built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.model.config))
    layer = sum(p.numel() for p in built.model.layers[0].parameters())
    assert plan.shape.parameters == built.num_parameters() == 234_048
    assert (plan.shape.block_parameters, plan.shape.root_parameters) == (layer, built.num_parameters() - 4 * layer)
    assert "model            4 layers x d_model 64, 234,048 parameters" in plan.report()
    # Untied head: the embedding is the one weight autocast does not cast.
    assert plan.shape.autocast_weights == built.num_parameters() - built.model.embed_tokens.weight.numel()
    assert ModelShape.measure(CausalLM(cfg.model.config).config).parameters == 234_048


def test_a_checkpoint_reloads_the_transformers_config_and_weights(tmp_path):
    trainer = pl.Trainer(**trainer_kwargs(max_steps=2))
    module = CausalLM(LLAMA)
    quiet_fit(trainer, module, RandomTokenData(vocab_size=32, seq_len=8, batch_size=4, samples=16))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    reloaded = CausalLM.load_from_checkpoint(tmp_path / "run.ckpt")
    assert isinstance(reloaded.config, transformers.LlamaConfig) and reloaded.config.num_key_value_heads == 1
    saved = module.state_dict()
    assert saved.keys() == reloaded.state_dict().keys()
    assert all(torch.equal(saved[name], value) for name, value in reloaded.state_dict().items())


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {**LLAMA, "hidden_sise": 16},
            r"field(s) ['hidden_sise'] are not LlamaConfig fields (transformers would keep them unused)",
        ),
        ({"model_type": "lama"}, r"model_type='lama' is not a transformers model type (did you mean llama"),
        (
            {"model_type": "vit"},
            r"model_type='vit' has no causal language model in transformers (AutoModelForCausalLM)",
        ),
    ],
)
def test_a_config_transformers_would_not_train_as_meant_is_refused(config, message):
    with pytest.raises(LitCBSConfigError, match=re.escape(message)):
        CausalLM(config)


def test_a_misspelt_key_in_the_recipe_stops_before_the_data_is_prepared(tmp_path):
    cfg = compose_config("model=hf", "+model.config.num_hidden_layer=2", f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(
        LitCBSConfigError,
        match=re.escape(
            "field(s) ['model.config.num_hidden_layer'] are not LlamaConfig fields (transformers would keep them "
            "unused); its fields include architectures, attention_bias, attention_dropout, bos_token_id,"
        ),
    ):
        train.build_run(cfg)
    assert not (tmp_path / "cache").exists()


def test_without_transformers_a_model_type_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "transformers", None
    )  # `import transformers` now fails as if it were not installed
    with pytest.raises(LitCBSConfigError, match=re.escape('but transformers is not installed: pip install -e ".[hf]"')):
        CausalLM({"model_type": "llama"})


def test_the_warmup_guide_example_warms_up_the_batch_of_a_plain_lightning_llama():
    guide = (ROOT / "docs" / "guides" / "warmup.md").read_text()
    (example,) = [
        block for block in re.findall(r"```python\n(.*?)```", guide, re.S) if "LlamaForCausalLM(config)" in block
    ]
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(example, "docs/guides/warmup.md", "exec"), namespace)
    (change,) = namespace["warmup"].history
    assert (change.old_global_batch, change.new_global_batch, change.tokens_seen) == (8, 16, 16_384)
    assert (change.new_accumulate, change.lr_factor) == (2, pytest.approx(2**0.5))
    assert namespace["trainer"].global_step == 32 + 32  # 16,384 tokens at 8 x 64, then 32,768 at 16 x 64
    assert namespace["gns"].group_names == ["embed_tokens", "block0", "block1", "norm", "lm_head"]


@pytest.mark.slow
def test_two_fsdp2_processes_shard_each_decoder_layer_and_train_with_a_probe_and_the_guard(prepared, tmp_path):
    run_dir = tmp_path / "run"
    record = tmp_path / "sharded.json"
    overrides = [
        "model=hf",
        "trainer=fsdp",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        "trainer.devices=2",
        "model.activation_checkpointing=true",
        f"data.path={prepared}",
        "data.batch_size=4",
        "max_tokens=49152",
        "lr_schedule.warmup_tokens=4096",
        "lr_schedule.decay_tokens=8192",
        "batch.schedule.batch_sizes=[8,16]",
        "batch.schedule.thresholds=[0,8192]",
        "batch.max_micro_batch_size=4",
        "batch.guard={min_steps: 4}",
        "callbacks.cbs_probe.geometric=[16384,4.0]",
        "callbacks.cbs_probe.window_tokens=8192",
        "callbacks.cbs_probe.multipliers=[1,2]",
        "callbacks.cbs_probe.heldout_batches=2",
        "callbacks.progress_bar=null",
        "trainer.enable_progress_bar=false",
        "+callbacks.sharding._target_=toys.RecordShardedModules",
        f"+callbacks.sharding.path={record}",
        f"hydra.run.dir={run_dir}",
    ]
    env = subprocess_env(PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", HYDRA_FULL_ERROR="1")
    result = subprocess.run(
        [*TORCHRUN_TRAIN, *overrides], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    sharded = json.loads(record.read_text())
    # fully_shard on each checkpoint-wrapped decoder layer, then on the root; every parameter a DTensor shard.
    assert sharded["sharded"] == ["model", *[f"model.lm.model.layers.{i}" for i in range(4)]]
    assert sharded["block_classes"] == ["FSDPCheckpointWrapper"] * 4 and sharded["not_dtensors"] == []
    metrics = read_metrics_csv(run_dir / "metrics.csv")
    assert metrics["tokens_seen"][1][-1] == 49152 and 0 < metrics["val/loss"][1][-1] < metrics["train/loss"][1][0]
    # The micro-batch stays 4 (batch.max_micro_batch_size=4): at 16 samples each rank accumulates 2.
    assert set(metrics["batch/accumulate"][1]) == {1, 2}
    (reading,) = [json.loads(line) for line in (run_dir / "cbs_probe.jsonl").read_text().splitlines()]
    assert reading["tokens"] == 16384 and set(reading["losses"]) == {"1", "2"}
    log = (run_dir / "train.log").read_text()
    assert "BatchWarmup guard: over the 8,192 tokens after 8 -> 16 at 8,192 tokens" in log  # the first increase judged
    assert len(list((run_dir / "checkpoints" / "last.ckpt").glob("*.distcp"))) == 2  # one shard per process
