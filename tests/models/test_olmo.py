"""lit_cbs.models.olmo: the OLMo-style decoder (causal attention with RoPE, SwiGLU, meta-device init) and its
presets."""

import math

import pytest
import torch
import torch.nn.functional as F

from lit_cbs.models import PRESETS, OLMo, OLMoConfig, get_config
from lit_cbs.models.olmo import Block, apply_rotary, rotary_cos_sin


def small_config(**changes) -> OLMoConfig:
    fields = dict(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, mlp_hidden=48, context_length=16, tie_embeddings=True
    )
    fields.update(changes)
    return OLMoConfig(**fields)


def test_forward_shape_and_dtype():
    torch.manual_seed(0)
    model = OLMo(small_config())
    logits = model(torch.randint(0, 64, (3, 10)))
    assert logits.shape == (3, 10, 64)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_causal_future_tokens_do_not_change_earlier_logits(tie_embeddings):
    torch.manual_seed(0)
    model = OLMo(small_config(tie_embeddings=tie_embeddings)).eval()
    tokens = torch.randint(0, 64, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 64
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    head_dim, seq_len = 16, 40
    q, k = torch.randn(head_dim), torch.randn(head_dim)
    cos, sin = rotary_cos_sin(seq_len, head_dim, 10000.0, torch.device("cpu"))
    # the same q and k vectors at every position: [1, 1, seq_len, head_dim]
    rq = apply_rotary(q.expand(1, 1, seq_len, head_dim), cos, sin)[0, 0]
    rk = apply_rotary(k.expand(1, 1, seq_len, head_dim), cos, sin)[0, 0]
    for offset in (0, 3, 17):
        scores = [rq[i + offset] @ rk[i] for i in range(seq_len - offset)]
        torch.testing.assert_close(torch.stack(scores), scores[0].expand(len(scores)), rtol=1e-5, atol=1e-5)
    # rotation keeps norms, and different offsets give different scores
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(seq_len))
    assert not torch.isclose(rq[5] @ rk[0], rq[9] @ rk[0])


@pytest.mark.parametrize(
    "name, expected", [("olmo_1b", 1.18e9), ("olmo_7b", 6.89e9), ("tiny", 233_472), ("tiny4x", 868_352)]
)
def test_preset_parameter_counts_on_meta_device(name, expected):
    with torch.device("meta"):
        model = OLMo(get_config(name))
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() == pytest.approx(expected, rel=0.01)


def test_tiny_parameter_count_exact():
    config = get_config("tiny")
    model = OLMo(config)
    d, h, layers, vocab = 64, 176, 4, 256
    per_block = 4 * d * d + 3 * d * h
    assert model.num_parameters() == 2 * vocab * d + layers * per_block == 233_472
    assert model.num_parameters(exclude_embeddings=True) == layers * per_block
    assert not config.tie_embeddings and model.lm_head is not None


def test_tiny4x_is_about_four_tiny_models_with_tinys_shape():
    tiny, tiny4x = get_config("tiny"), get_config("tiny4x")
    model = OLMo(tiny4x)
    d, h, layers, vocab = 128, 352, 4, 256
    assert model.num_parameters() == 2 * vocab * d + layers * (4 * d * d + 3 * d * h) == 868_352
    assert 3.5 < model.num_parameters() / OLMo(tiny).num_parameters() < 4
    # Same depth, head size, context and vocabulary: only the width differs.
    assert (tiny4x.n_layers, tiny4x.d_model // tiny4x.n_heads, tiny4x.context_length, tiny4x.vocab_size) == (
        tiny.n_layers,
        tiny.d_model // tiny.n_heads,
        tiny.context_length,
        tiny.vocab_size,
    )


def test_untied_counts_both_embeddings_and_flops_formula():
    with torch.device("meta"):
        model = OLMo(get_config("olmo_7b"))
    c = model.config
    assert model.num_parameters() - model.num_parameters(exclude_embeddings=True) == 2 * c.vocab_size * c.d_model
    n = model.num_parameters(exclude_embeddings=True) + c.vocab_size * c.d_model
    assert model.flops_per_token(2048) == 6 * n + 12 * c.n_layers * c.d_model * 2048


def test_blocks_are_a_module_list_of_blocks():
    model = OLMo(small_config())
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == 2 and all(isinstance(b, Block) for b in model.blocks)


def test_meta_build_then_to_empty_and_reset_parameters():
    config = small_config(n_layers=8, d_model=64, mlp_hidden=128)
    with torch.device("meta"):
        model = OLMo(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    std = config.init_std
    assert model.embedding.weight.std().item() == pytest.approx(std, rel=0.1)
    assert model.blocks[0].attention.q_proj.weight.std().item() == pytest.approx(std, rel=0.1)
    residual_std = std / math.sqrt(2 * config.n_layers)
    assert model.blocks[0].mlp.down_proj.weight.std().item() == pytest.approx(residual_std, rel=0.1)
    assert model.embedding.weight.abs().max().item() <= 3 * std
    assert torch.isfinite(model(torch.randint(0, 64, (2, 8)))).all()


def test_per_layer_reset_matches_model_init():
    """Lightning's meta-device materialisation calls reset_parameters on each layer that owns weights."""
    config = small_config()
    torch.manual_seed(1)
    reference = OLMo(config)
    with torch.device("meta"):
        model = OLMo(config)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.reset_parameters()
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(actual, expected, msg=name)


def test_sequence_longer_than_context_raises():
    model = OLMo(small_config(context_length=8))
    with pytest.raises(ValueError, match="context_length=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(d_model=30, n_heads=4), "d_model=30 must be divisible by n_heads=4"),
        (dict(d_model=12, n_heads=4), "head dim .* = 3 must be even"),
        (dict(n_layers=0), "n_layers=0 must be a positive int"),
        (dict(vocab_size=-1), "vocab_size=-1"),
        (dict(rope_theta=0.0), "rope_theta=0.0 must be > 0"),
        (dict(init_std=-0.1), "init_std=-0.1 must be > 0"),
    ],
)
def test_bad_config_raises_value_error(changes, match):
    with pytest.raises(ValueError, match=match):
        small_config(**changes)


def test_non_int_config_field_raises_type_error():
    with pytest.raises(TypeError, match="d_model=32.0 must be a positive int"):
        small_config(d_model=32.0)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="olmo_1b, olmo_7b, tiny, tiny4x"):
        get_config("olmo_3b")
    assert set(PRESETS) == {"tiny", "tiny4x", "olmo_1b", "olmo_7b"}


def test_get_config_returns_a_copy():
    config = get_config("tiny")
    config.n_layers = 1
    assert PRESETS["tiny"].n_layers == 4


def test_sgd_steps_reduce_loss_on_a_repeated_batch():
    torch.manual_seed(0)
    model = OLMo(get_config("tiny"))
    batch = torch.randint(0, 256, (4, 33))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def loss() -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    first = loss()
    assert first.item() == pytest.approx(math.log(256), rel=0.05)  # small init: near-uniform predictions
    for _ in range(10):
        optimizer.zero_grad()
        value = loss()
        value.backward()
        optimizer.step()
    assert loss().item() < first.item() - 0.2
