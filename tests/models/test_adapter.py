"""The target adapter on real (tiny, random) HF models of several families: what it finds, what
it measures, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from specforge.config import TargetConfig
from specforge.errors import UserError
from specforge.models.adapter import (
    check_logits,
    draft_rope_parameters,
    final_norm,
    find_decoder,
    norm_eps,
    norm_scale,
    serving_refusal,
    tree_refusal,
)
from specforge.models.eagle3 import Eagle3Config
from specforge.models.target import load_target, load_target_head, target_head
from specforge.serving.export import ExportError, check_export_config, export_config_dict
from specforge.trainer.ttt import target_distribution
from tests.architectures import save_tiny_target
from tests.helpers import StubDraft, greedy_reference, make_tiny_tokenizer


def tiny(name: str, tmp_path, **target):
    folder = save_tiny_target(name, make_tiny_tokenizer(), tmp_path / name)
    cfg = TargetConfig(name_or_path=str(folder), dtype="float32", **target)
    model, _ = load_target(cfg)
    return model, cfg


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama", lambda w: w),  # RMSNorm: w
        ("gemma", lambda w: 1 + w),  # Gemma's norm scales by (1 + w)
        ("stablelm", lambda w: w),  # LayerNorm: its weight (the bias is left behind)
    ],
)
def test_final_norm_scale_is_what_the_norm_applies(tmp_path, name, expected):
    model, cfg = tiny(name, tmp_path)
    weight = final_norm(model).weight.detach()
    with torch.no_grad():
        weight.uniform_(-0.5, 0.5)  # make the difference between w and 1 + w visible
    head = target_head(model)
    torch.testing.assert_close(head.norm, expected(weight), atol=1e-4, rtol=1e-4)


def test_norm_scale_probes_where_the_norm_is(tmp_path):
    """A target on another device than the CPU (online training on CUDA failed here): the
    probe follows the norm's weight. The meta device stands in for a GPU."""
    model, _ = tiny("llama", tmp_path)
    norm = final_norm(model).to("meta")
    scale = norm_scale(norm, norm.weight.shape[0])
    assert scale.device.type == "meta" and scale.shape == norm.weight.shape


def test_norm_scale_probes_where_the_given_tensors_are(tmp_path):
    """The decoder layer's norms are measured from tensors passed by name (the draft's
    initialisation from the target's last layer): on CUDA the probe stayed on the CPU and online
    training failed at start-up. The meta device stands in for a GPU."""
    model, _ = tiny("llama", tmp_path)
    norm = find_decoder(model)[0].layers[-1].input_layernorm
    params = {"weight": norm.weight.detach().to("meta")}
    scale = norm_scale(norm, norm.weight.shape[0], params)
    assert scale.device.type == "meta" and scale.shape == norm.weight.shape


def test_norm_without_weights_scales_by_one(tmp_path):
    model, _ = tiny("olmo", tmp_path)  # OLMo's LayerNorm has no parameters
    torch.testing.assert_close(target_head(model).norm, torch.ones(64), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["granite", "cohere", "minicpm3", "gemma2", "gemma3"])
def test_training_targets_are_the_models_own_distribution(tmp_path, name):
    """The TTT target distribution (online head and offline head alike) is the softmax of the
    model's own logits, whatever it does after lm_head."""
    model, cfg = tiny(name, tmp_path)
    ids = torch.randint(3, 200, (1, 12))
    expected = model(input_ids=ids).logits.float().softmax(-1)
    decoder, _ = find_decoder(model)
    hidden = decoder(input_ids=ids).last_hidden_state
    vocab = expected.shape[-1]
    hot = torch.arange(vocab)
    for head in (target_head(model), load_target_head(cfg)):
        if name == "gemma3":  # the multimodal class does not soft-cap: the capture records it
            head.transform = check_logits(model)
        dist = target_distribution(
            hidden,
            head.lm_head,
            hot_ids=hot,
            t2d=torch.ones(vocab, dtype=torch.bool),
            bias=head.lm_head_bias,
            transform=head.transform,
        )
        torch.testing.assert_close(dist.probs, expected, atol=1e-5, rtol=1e-4)
    assert not target_head(model).transform.identity or name == "gemma3"


def test_offline_head_matches_the_loaded_model(tmp_path):
    """GPT-NeoX saves its lm_head as ``embed_out``: the offline head reads the renamed tensor,
    and its final norm and bias-free head equal the loaded model's."""
    model, cfg = tiny("gpt_neox", tmp_path)
    online, offline = target_head(model), load_target_head(cfg)
    torch.testing.assert_close(offline.lm_head, online.lm_head)
    torch.testing.assert_close(offline.embed_tokens, online.embed_tokens)
    torch.testing.assert_close(offline.norm, online.norm)
    assert offline.last_layer.keys() == online.last_layer.keys()


def test_unknown_logit_transform_is_refused(tmp_path):
    """A model class (as remote code may bring) that doubles its logits, undeclared."""
    from transformers import LlamaForCausalLM

    class DoublingLlama(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model, _ = tiny("llama", tmp_path)
    doubling = DoublingLlama(model.config).eval()
    doubling.load_state_dict(model.state_dict())
    check_logits(model)
    with pytest.raises(UserError, match="llama.*logits differ"):
        check_logits(doubling)


def test_missing_decoder_is_named(tmp_path):
    model, _ = tiny("llama", tmp_path)
    model.config.num_hidden_layers = 7
    with pytest.raises(UserError, match="llama.*cannot find the decoder's 7 layers"):
        find_decoder(model)


def test_norm_eps_under_any_name(tmp_path):
    model, _ = tiny("stablelm", tmp_path)  # layer_norm_eps, no rms_norm_eps
    assert norm_eps(model.config) == model.config.layer_norm_eps


def test_nested_rope_gives_the_full_attention_theta(tmp_path):
    model, _ = tiny("gemma3_text", tmp_path)
    rope = draft_rope_parameters(model.config)
    assert rope["rope_theta"] == 1_000_000.0
    config = Eagle3Config.from_target(model.config, draft_vocab_size=64)
    assert config.rope_parameters == rope and config.hidden_act == "silu"
    # the draft's own rotary embedding runs at that theta
    llama = config.to_llama_config()
    assert llama.rope_parameters["rope_theta"] == 1_000_000.0


def test_export_check_refuses_a_fallback_rope_and_a_non_silu_activation(tmp_path):
    model, _ = tiny("gemma3_text", tmp_path)
    config = Eagle3Config.from_target(model.config, draft_vocab_size=64)
    exported = export_config_dict(
        config, aux_layer_ids=[1, 1, 0], num_target_layers=4, dtype="float32"
    )
    check_export_config(exported, model.config)
    exported["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    exported["hidden_act"] = "gelu_pytorch_tanh"
    with pytest.raises(ExportError, match="full-attention RoPE") as err:
        check_export_config(exported, model.config)
    assert "SiLU only" in str(err.value)


def test_tree_on_eager_llama_is_lossless(tmp_path):
    """Eager attention adds the mask to the scores: the tree mask must come as -inf, not as a
    bool (a plain Llama on eager attention)."""
    model, _ = tiny("llama", tmp_path, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    from specforge.serving.speculative import SpeculativeDecoder

    torch.manual_seed(0)
    prompt = torch.randint(3, 200, (1, 20))
    reference = greedy_reference(model, prompt, 24)
    stub = StubDraft(reference, lambda t: t % 3 == 0, 263)
    decoder = SpeculativeDecoder(
        model, stub, aux_layer_ids=[1, 1, 0], num_steps=3, topk=2, num_draft_tokens=6
    )
    tokens, stats = decoder.generate(prompt, max_new_tokens=24)
    assert tokens == reference[20:] and max(stats.accepted_per_round) >= 2


def test_tree_on_flash_attention_is_refused_with_the_reason(tmp_path):
    model, _ = tiny("llama", tmp_path)
    model.config._attn_implementation = "flash_attention_2"
    assert "tree drafting needs attention masks" in tree_refusal(model)
    model.config._attn_implementation = "sdpa"
    assert tree_refusal(model) is None


def test_attention_implementation_is_configurable_and_checked(tmp_path):
    folder = save_tiny_target("llama", make_tiny_tokenizer(), tmp_path / "t")
    with pytest.raises(UserError, match="cannot run attention 'no_such_attention'"):
        load_target(
            TargetConfig(
                name_or_path=str(folder), dtype="float32", attn_implementation="no_such_attention"
            )
        )
    eager, _ = load_target(
        TargetConfig(name_or_path=str(folder), dtype="float32", attn_implementation="eager")
    )
    assert eager.config._attn_implementation == "eager"


def test_a_target_configured_without_cache_is_still_served(tmp_path):
    model, _ = tiny("llama", tmp_path)
    model.config.use_cache = False  # the probe asks for the cache explicitly
    assert serving_refusal(model) is None


@pytest.mark.parametrize("bend", ["scale", "softcap"])
def test_an_undeclared_transform_is_refused_in_bfloat16_too(tmp_path, bend):
    """In bfloat16 a loose check would pass a model that scales its logits by 1.04x or
    soft-caps them at a moderate value without declaring it; verification would then use a
    distribution that is not the model's. The check holds each logit to bfloat16 rounding."""
    from transformers import LlamaForCausalLM

    model, _ = tiny("llama", tmp_path)
    model = model.to(torch.bfloat16)
    check_logits(model)  # the plain model passes in bfloat16
    largest = model(input_ids=torch.arange(1, 9)[None] * 7).logits.abs().max().item()

    class BentLlama(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if bend == "scale":
                out.logits = out.logits * 1.04
            else:  # a cap at three times the largest logit bends the top ones by ~3.6%
                cap = 3 * largest
                out.logits = torch.tanh(out.logits / cap) * cap
            return out

    bent = BentLlama(model.config).to(torch.bfloat16).eval()
    bent.load_state_dict(model.state_dict())
    with pytest.raises(UserError, match="llama.*logits differ"):
        check_logits(bent)
