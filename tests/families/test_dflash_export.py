"""The DFlash export: what SGLang's config parsing and vLLM's DFlash loader read (replayed
here), every vLLM parameter loaded exactly once, a broken export refused with every problem
named, and the loaded directory serving the draft's own proposals losslessly."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge.families import family
from specforge.families.dflash.export import load_exported_dflash, write_dflash_export
from specforge.serving.export import ExportError
from specforge.serving.speculative import SpeculativeDecoder
from tests.families.test_dflash_model import VOCAB, tiny_dflash
from tests.helpers import greedy_reference
from tests.serving.test_export import STACKED, assert_each_parameter_loaded_once

DFLASH = family("dflash")


def sglang_dflash_config(config: dict) -> dict:
    """SGLang's DFlash config parsing: ``dflash_config`` first, the top level second, the
    draft's ``num_hidden_layers``; an integer, non-negative mask token id."""
    dflash = config.get("dflash_config") or {}
    parsed = {
        "num_hidden_layers": int(config["num_hidden_layers"]),
        "block_size": int(dflash.get("block_size", config.get("block_size"))),
        "target_layer_ids": [int(i) for i in dflash.get("target_layer_ids", [])],
        "mask_token_id": dflash.get("mask_token_id", config.get("mask_token_id")),
    }
    assert isinstance(parsed["mask_token_id"], int) and parsed["mask_token_id"] >= 0
    assert parsed["target_layer_ids"], "SGLang would fall back to its own layer choice"
    return parsed


def vllm_dflash_load(tensors: dict, config: dict):
    """vLLM's ``DFlashQwen3ForCausalLM.load_weights``: ``model.`` prefix except lm_head/d2t,
    q/k/v -> qkv_proj, gate/up -> gate_up_proj; ``fc`` sized by the aux layers it reads first
    (``eagle_aux_hidden_state_layer_ids``) times the target's hidden size."""
    h, d = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    inner = config["intermediate_size"]
    aux = config["eagle_aux_hidden_state_layer_ids"]
    params = {
        "model.fc.weight": ((h, len(aux) * config["target_hidden_size"]), None),
        "model.hidden_norm.weight": ((h,), None),
        "model.norm.weight": ((h,), None),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        params |= {
            f"{layer}.input_layernorm.weight": ((h,), None),
            f"{layer}.post_attention_layernorm.weight": ((h,), None),
            f"{layer}.self_attn.qkv_proj.weight": ((q + 2 * kv, h), {"q": q, "k": kv, "v": kv}),
            f"{layer}.self_attn.o_proj.weight": ((h, q), None),
            f"{layer}.self_attn.q_norm.weight": ((d,), None),
            f"{layer}.self_attn.k_norm.weight": ((d,), None),
            f"{layer}.mlp.gate_up_proj.weight": ((2 * inner, h), {0: inner, 1: inner}),
            f"{layer}.mlp.down_proj.weight": ((h, inner), None),
        }
    loads = {}
    for name, weight in tensors.items():
        name = "model." + name
        shard_id = None
        for fused, shard, sid in STACKED:
            if shard in name:
                name, shard_id = name.replace(shard, fused), sid
                break
        if name not in params:
            raise KeyError(name)
        loads.setdefault(name, []).append((shard_id, tuple(weight.shape)))
    return params, loads


@pytest.fixture
def exported(tmp_path):
    target, draft = tiny_dflash(block_size=4, layers=2)
    out = write_dflash_export(
        tmp_path / "export", model=draft, target_config=target.config, dtype="float32"
    )
    return target, draft, out


def test_the_engines_read_the_draft_s_layers_block_and_mask(exported):
    target, draft, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    parsed = sglang_dflash_config(config)
    assert parsed == {
        "num_hidden_layers": 2,
        "block_size": 4,
        "target_layer_ids": draft.config.target_layer_ids,
        "mask_token_id": VOCAB - 1,
    }
    # vLLM reads the same layers first as HF hidden_states indices
    assert config["eagle_aux_hidden_state_layer_ids"] == [
        i + 1 for i in draft.config.target_layer_ids
    ]
    assert config["rope_parameters"] == draft.config.rope_parameters
    assert config["tie_word_embeddings"] is False


def test_vllm_loads_every_parameter_exactly_once(exported):
    _, _, out = exported
    tensors = load_file(str(out / "model.safetensors"))
    assert not any("embed_tokens" in n or "lm_head" in n for n in tensors)  # the target's
    params, loads = vllm_dflash_load(tensors, json.loads((out / "config.json").read_text()))
    assert_each_parameter_loaded_once(params, loads)


def test_the_loaded_export_serves_the_draft_s_own_blocks(exported):
    target, draft, out = exported
    loaded = load_exported_dflash(
        out,
        target_config=target.config,
        target_embedding=target.get_input_embeddings().weight,
        target_lm_head=target.get_output_embeddings().weight,
    )
    prompt = torch.randint(0, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(3))
    reference = greedy_reference(target, prompt, 20)[7:]
    layers = draft.config.target_layer_ids
    runs = []
    for model in (draft, loaded):
        decoder = SpeculativeDecoder(
            target, model, proposer=DFLASH.proposer, aux_layer_ids=layers, num_steps=3
        )
        tokens, stats = decoder.generate(prompt, max_new_tokens=20)
        assert tokens == reference
        runs.append(stats.accepted_per_round)
    assert runs[0] == runs[1]  # the same proposals, round by round


def test_a_broken_export_is_refused_naming_every_problem(exported, tmp_path):
    target, _, out = exported
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["layers.1.self_attn.q_norm.weight"]
    tensors["layers.0.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"][:-1]
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    embedding = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    with pytest.raises(ExportError) as refused:
        load_exported_dflash(
            out, target_config=target.config, target_embedding=embedding, target_lm_head=head
        )
    assert "missing tensor 'layers.1.self_attn.q_norm.weight'" in str(refused.value)
    assert "layers.0.mlp.up_proj.weight: shape" in str(refused.value)
    config["dflash_config"]["target_layer_ids"] = [1, 9]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError) as refused:
        load_exported_dflash(
            out, target_config=target.config, target_embedding=embedding, target_lm_head=head
        )
    message = str(refused.value)
    assert "target_layer_ids [1, 9] are outside the target's 6 layers" in message
    assert "eagle_aux_hidden_state_layer_ids must be" in message


def test_specforge_bench_serves_a_dflash_export(tmp_path, tiny_target_dir, capsys):
    from transformers import AutoModelForCausalLM

    from specforge.cli import main
    from specforge.families.dflash.model import DFlashConfig, build_dflash_model

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    config = DFlashConfig.from_target(target.config, mask_token_id=0, block_size=4)
    draft = build_dflash_model(
        config,
        target_embedding=target.get_input_embeddings().weight,
        target_lm_head=target.get_output_embeddings().weight,
    )
    out = write_dflash_export(
        tmp_path / "export", model=draft, target_config=target.config, dtype="float32"
    )
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["hi", "more"]}))
    arguments = ["--target", str(tiny_target_dir), "--draft", str(out), "--questions"]
    options = ["--num-steps", "3", "--max-new-tokens", "8", "--output", str(tmp_path / "b")]
    assert main(["bench", *arguments, str(questions), *options]) == 0
    result = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert result["all_match"] is True and result["turns"] == 2
    assert result["settings"]["draft_family"] == "dflash"
    assert result["sglang_advice"] is None  # EAGLE-3 launch flags would not fit it
    # settings the block draft cannot run: one line naming them, before any model loads
    missing = f"target.name_or_path={tmp_path / 'no-target'}"  # checked after, never reached
    for flags, message in (
        (["--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6"], "drafts chains only"),
        (["--num-steps", "5"], "drafts at most 3 tokens a round"),
    ):
        argv = ["bench", "--draft", str(out), "--questions", str(questions), *flags]
        assert main([*argv, missing]) == 2
        assert message in capsys.readouterr().err


def test_a_scaled_logit_target_gives_the_block_draft_its_own_logits(tmp_path):
    """A Granite target divides its logits by ``logits_scaling``: the served block draft's
    head (the target's, shared) carries the same scale, as its training's does, so its logits
    are the target's own transformed ones, not ``logits_scaling`` times sharper."""
    from transformers import AutoModelForCausalLM

    from specforge.families.dflash.model import DFlashConfig, build_dflash_model
    from specforge.models.adapter import logit_transform
    from tests.architectures import tiny_config

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config("granite", VOCAB, VOCAB - 2)).eval()
    scale = logit_transform(target.config).scale
    assert scale == 0.25
    config = DFlashConfig.from_target(target.config, mask_token_id=VOCAB - 1, block_size=4)
    draft = build_dflash_model(
        config,
        target_embedding=target.get_input_embeddings().weight.detach(),
        target_lm_head=target.get_output_embeddings().weight.detach() * scale,
        seed=0,
    )
    out = write_dflash_export(tmp_path / "export", model=draft, target_config=target.config)
    served = DFLASH.load_export(out, target=target, dtype="float32")
    hidden = torch.randn(3, config.hidden_size)
    expected = logit_transform(target.config)(target.get_output_embeddings()(hidden))
    torch.testing.assert_close(served.lm_head(hidden), expected)
