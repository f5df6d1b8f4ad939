import pytest
import torch

from specforge.config import TargetConfig
from specforge.models.target import (
    check_aux_layer_ids,
    default_aux_layer_ids,
    embedded_gguf_path,
    load_target,
    load_target_head,
    resolve_target_path,
    target_hidden_states,
)
from tests.helpers import make_tiny_llama


def test_default_aux_layer_ids_match_the_engines():
    assert default_aux_layer_ids(30) == [1, 14, 26]  # SmolLM2-135M
    assert default_aux_layer_ids(32) == [1, 15, 28]  # Llama-3.1-8B
    assert default_aux_layer_ids(4) == [1, 1, 0]
    with pytest.raises(ValueError, match="got 3"):
        default_aux_layer_ids(3)


def test_check_aux_layer_ids_rejects_out_of_range():
    with pytest.raises(ValueError, match="aux layer id 8 is outside"):
        check_aux_layer_ids([1, 2, 8], 8)
    with pytest.raises(ValueError, match="exactly 3"):
        check_aux_layer_ids([1, 2], 8)


@pytest.mark.parametrize("aux_layer_ids", [[1, 3, 4], [0, 2, 5], [5, 1, 3]])
def test_capture_equals_hf_hidden_states_at_id_plus_one(aux_layer_ids):
    """docs/design.md §3.1: aux id i == HF output_hidden_states[i + 1]; last == post-norm output."""
    model = make_tiny_llama(96, num_layers=8, seed=1).float()
    torch.manual_seed(0)
    input_ids = torch.randint(0, 96, (2, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding on the second row

    captured = target_hidden_states(model, input_ids, attention_mask, aux_layer_ids=aux_layer_ids)
    with torch.no_grad():
        reference = model(input_ids, attention_mask=attention_mask, output_hidden_states=True)

    hidden = model.config.hidden_size
    assert captured.aux_hidden_states.shape == (2, 11, 3 * hidden)
    for slot, layer_id in enumerate(aux_layer_ids):
        got = captured.aux_hidden_states[..., slot * hidden : (slot + 1) * hidden]
        torch.testing.assert_close(got, reference.hidden_states[layer_id + 1], rtol=0, atol=0)
    torch.testing.assert_close(
        captured.last_hidden_state, reference.hidden_states[-1], rtol=0, atol=0
    )
    # The target's logits follow from the captured last hidden state and lm_head.
    torch.testing.assert_close(
        model.lm_head(captured.last_hidden_state), reference.logits, rtol=1e-5, atol=1e-5
    )


def test_capture_leaves_no_hooks_behind():
    model = make_tiny_llama(64, num_layers=4)
    target_hidden_states(model, torch.randint(0, 64, (1, 5)), aux_layer_ids=[1, 1, 0])
    assert all(not layer._forward_hooks for layer in model.model.layers)


def test_load_target_from_local_folder(tiny_target_dir, tiny_target):
    model, tokenizer = load_target(TargetConfig(str(tiny_target_dir), dtype="float32"))
    reference, _ = tiny_target
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    ids = torch.randint(0, len(tokenizer), (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_target_head_reads_the_last_layer_for_offline_initialisation(tiny_target_dir, tiny_target):
    head = load_target_head(TargetConfig(str(tiny_target_dir), dtype="float32"))
    reference, _ = tiny_target
    last = dict(reference.model.layers[-1].named_parameters())
    assert set(head.last_layer) == set(last)
    for name, weight in last.items():
        torch.testing.assert_close(head.last_layer[name], weight.float())
    torch.testing.assert_close(head.norm, reference.model.norm.weight.float())


def test_load_target_rejects_unknown_dtype(tiny_target_dir):
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        load_target(TargetConfig(str(tiny_target_dir)), dtype="fp8")


def test_non_embedded_names_pass_through():
    assert (
        resolve_target_path("meta-llama/Llama-3.1-8B-Instruct")
        == "meta-llama/Llama-3.1-8B-Instruct"
    )
    with pytest.raises(ValueError, match="unknown embedded target"):
        embedded_gguf_path("gpt-5")


def test_cache_keyword_follows_the_installed_transformers_without_deprecation_warnings():
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns, then goes
    in 5.40): every call site passes the keyword the forward itself declares."""
    import inspect
    import warnings

    from specforge.models.kv_cache import cache_kwargs, growing_cache, output_cache

    model = make_tiny_llama(64, num_layers=2)
    (keyword,) = cache_kwargs(model, None)
    assert keyword in inspect.signature(type(model).forward).parameters
    cache = growing_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model(torch.randint(0, 64, (1, 5)), use_cache=True, **cache_kwargs(model, cache))
        states = target_hidden_states(
            model, torch.randint(0, 64, (1, 2)), aux_layer_ids=[0, 1, 1], past_key_values=cache
        )
    assert output_cache(out) is cache and cache.get_seq_length() == 7
    assert states.aux_hidden_states.shape[:2] == (1, 2)
