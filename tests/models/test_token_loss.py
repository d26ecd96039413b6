"""Token-weighted loss on padded data: the optimizer step's gradient is the mean over every counted
token of the step for any accumulation and on 2 DDP processes, also inside CBS probe branches."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from launch import in_process_ddp
from toys import PaddedData, PaddedSequences, SaveFirstStepGradients, quiet_fit, trainer_kwargs

from lit_cbs import CBSProbeCallback, GradientNoiseScale, LitCBSConfigError
from lit_cbs.models.lm import CausalLM

MODEL = {
    "vocab_size": 32,
    "d_model": 16,
    "n_layers": 1,
    "n_heads": 2,
    "mlp_hidden": 32,
    "context_length": 8,
    "tie_embeddings": False,
}
STEP = 8  # samples per optimizer step


def fit_first_step(tmp_path, micro: int, accumulate: int, **trainer_args) -> dict:
    pl.seed_everything(0, verbose=False)
    path = tmp_path / "first_step.pt"
    trainer = pl.Trainer(
        callbacks=[SaveFirstStepGradients(path)],
        **trainer_kwargs(max_steps=1, precision="64-true", accumulate_grad_batches=accumulate, **trainer_args),
    )
    quiet_fit(trainer, CausalLM(MODEL, ignore_index=0), PaddedData(batch_size=micro))
    return torch.load(path, weights_only=True)


def gradients(initial: dict, batches: list[torch.Tensor]) -> dict:
    """The mean over ``batches`` of each one's gradient of its mean loss per counted token."""
    module = CausalLM(MODEL, ignore_index=0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # built as Lightning's "64-true" builds it (its RoPE tables too)
    try:
        module.configure_model()
    finally:
        torch.set_default_dtype(default)
    module.load_state_dict(initial, strict=False)
    for batch in batches:
        loss_sum, tokens = module._loss_sum(batch)
        (loss_sum / tokens / len(batches)).backward()
    return {name: p.grad for name, p in module.named_parameters()}


@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_the_step_gradient_is_the_mean_over_its_counted_tokens_for_any_accumulation(tmp_path, accumulate):
    recorded = fit_first_step(tmp_path, micro=STEP // accumulate, accumulate=accumulate)
    step = PaddedSequences().tokens[:STEP]
    exact = gradients(recorded["initial"], [step])
    assert recorded["grads"].keys() == exact.keys()
    for name, grad in recorded["grads"].items():
        torch.testing.assert_close(grad, exact[name], rtol=1e-10, atol=1e-12)
    if accumulate > 1:  # the mean of micro-batch means, which the padding makes another gradient
        micro_means = gradients(recorded["initial"], list(step.split(STEP // accumulate)))
        assert not all(torch.allclose(micro_means[name], exact[name], rtol=1e-3) for name in exact)


@pytest.mark.slow
def test_on_two_ddp_processes_the_token_count_is_agreed_across_ranks(tmp_path):
    # Rank r reads samples r, r + 2, ...: micro-batches of 2, accumulate 2, so the step is samples 0-7.
    recorded = fit_first_step(tmp_path, micro=2, accumulate=2, devices=2, strategy=in_process_ddp())
    exact = gradients(recorded["initial"], [PaddedSequences().tokens[:STEP]])
    for name, grad in recorded["grads"].items():
        torch.testing.assert_close(grad, exact[name], rtol=1e-10, atol=1e-12)


def test_a_probe_branch_at_k1_trains_as_the_token_weighted_main_run():
    probe = CBSProbeCallback(every_tokens=288, multipliers=(1, 2), window_tokens=144)  # 2 steps of 8 x 9 tokens
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[probe], **trainer_kwargs(max_steps=8, precision="64-true", accumulate_grad_batches=2)
    )
    quiet_fit(trainer, CausalLM(MODEL, ignore_index=0), PaddedData(batch_size=4, n=64))
    assert probe.history
    for reading in probe.history:
        assert reading.losses["1"] == pytest.approx(reading.main_loss, rel=1e-12)


def test_the_noise_scale_refuses_a_token_weighted_loss_at_the_first_micro_batch():
    trainer = pl.Trainer(callbacks=[GradientNoiseScale()], **trainer_kwargs(max_steps=2, accumulate_grad_batches=2))
    with pytest.raises(
        LitCBSConfigError, match=r"GradientNoiseScale measures each micro-batch's mean loss.*token_mean_loss"
    ):
        trainer.fit(CausalLM(MODEL, ignore_index=0), PaddedData(batch_size=4))
    assert trainer.global_step == 0


def test_an_ignore_index_outside_the_vocabulary_is_refused():
    with pytest.raises(LitCBSConfigError, match=r"ignore_index=-100 must be a token id in \[0, 32\)"):
        CausalLM(MODEL, ignore_index=-100)
