"""The export contract, checked the way SGLang and vLLM actually read the directory."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from specforge.io import read_jsonl
from specforge.models.eagle3 import DraftKVCache
from specforge.serving.export import (
    ExportError,
    check_export_config,
    check_export_tensors,
    export_config_dict,
    export_tensors,
    load_exported_draft,
    write_export,
)
from tests.helpers import tiny_draft

STACKED = [  # (param, shard name, shard id): both engines' stacked-parameter mapping
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def engine_params(c, layer: str, prefix_lm_head: str = "") -> dict:
    """Parameter name -> (shape, {shard id: rows}) of an engine's fused EAGLE-3 module."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    return {
        "model.fc.weight": ((h, 3 * c.target_hidden_size), None),
        f"model.{layer}.input_layernorm.weight": ((h,), None),
        f"model.{layer}.hidden_norm.weight": ((h,), None),
        f"model.{layer}.post_attention_layernorm.weight": ((h,), None),
        f"model.{layer}.self_attn.qkv_proj.weight": (
            (q + 2 * kv, 2 * h),
            {"q": q, "k": kv, "v": kv},
        ),
        f"model.{layer}.self_attn.o_proj.weight": ((h, q), None),
        f"model.{layer}.mlp.gate_up_proj.weight": ((2 * i, h), {0: i, 1: i}),
        f"model.{layer}.mlp.down_proj.weight": ((h, i), None),
        "model.norm.weight": ((h,), None),
        f"{prefix_lm_head}lm_head.weight": ((c.draft_vocab_size, h), None),
        **{  # EAGLE 3.1: vLLM's per-aux norms before fc
            f"model.fc_norm.{i}.weight": ((c.target_hidden_size,), None)
            for i in range(3)
            if c.fc_norm
        },
    }


def sglang_load(tensors: dict, c):
    """SGLang 0.5 ``LlamaForCausalLMEagle3.load_weights``: d2t -> hot_token_id, t2d skipped,
    stacked mapping, ``model.`` prefix when the bare name is not a parameter; unknown names
    are dropped silently (returned here so the test can see them)."""
    params = engine_params(c, "midlayer")
    loads, dropped, hot = {}, [], None
    for name, weight in tensors.items():
        if "d2t" in name:
            hot = weight + torch.arange(weight.shape[0])
            continue
        if "t2d" in name:
            continue
        shard_id = None
        for fused, shard, sid in STACKED:
            if shard in name:
                name, shard_id = name.replace(shard, fused), sid
                break
        target = name if name in params else f"model.{name}"
        if target not in params:
            dropped.append(name)
            continue
        loads.setdefault(target, []).append((shard_id, tuple(weight.shape)))
    return params, loads, dropped, hot


def vllm_load(tensors: dict, c):
    """vLLM ``Eagle3LlamaForCausalLM.load_weights`` + ``LlamaModel.load_weights``: t2d skipped,
    d2t -> draft_id_to_target_id, ``model.`` prefix except lm_head, midlayer -> layers.0,
    stacked mapping; an unknown name is a KeyError."""
    params = engine_params(c, "layers.0")
    params["draft_id_to_target_id"] = ((c.draft_vocab_size,), None)
    loads = {}
    for name, weight in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        shard_id = None
        for fused, shard, sid in STACKED:
            if shard in name:
                name, shard_id = name.replace(shard, fused), sid
                break
        if name not in params:
            raise KeyError(name)
        loads.setdefault(name, []).append((shard_id, tuple(weight.shape)))
    return params, loads


def assert_each_parameter_loaded_once(params, loads, skip=()):
    for name, (shape, shards) in params.items():
        if name in skip:
            continue
        assert name in loads, f"{name} never loaded"
        if shards is None:
            assert loads[name] == [(None, shape)], name
        else:
            got = sorted(loads[name], key=str)
            want = sorted(((sid, (rows, shape[1])) for sid, rows in shards.items()), key=str)
            assert got == want, name


@pytest.fixture
def exported(tmp_path):
    target, draft = tiny_draft()
    out = write_export(
        tmp_path / "export",
        model=draft,
        target_config=target.config,
        aux_layer_ids=[1, 1, 0],
        dtype="float32",
    )
    return target, draft, out


def test_directory_layout_and_config(exported):
    target, draft, out = exported
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "freq_32.pt",
        "model.safetensors",
        "specforge-export.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] == 32
    assert config["max_position_embeddings"] == target.config.max_position_embeddings
    assert config["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert config["rope_scaling"] is None and "eagle_config" not in config  # default aux ids
    assert "fc_norm" not in config and "norm_output" not in config  # an EAGLE-3 draft
    freq = torch.load(out / "freq_32.pt", weights_only=True)
    assert freq.dtype == torch.int64 and torch.equal(freq, torch.arange(32) + draft.d2t)


def test_sglang_loads_every_parameter_exactly_once(exported):
    target, draft, out = exported
    tensors = load_file(str(out / "model.safetensors"))
    params, loads, dropped, hot = sglang_load(tensors, draft.config)
    assert dropped == []
    assert_each_parameter_loaded_once(params, loads)
    assert torch.equal(hot, torch.arange(32) + draft.d2t)


def test_vllm_loads_every_parameter_exactly_once(exported):
    target, draft, out = exported
    tensors = load_file(str(out / "model.safetensors"))
    params, loads = vllm_load(tensors, draft.config)
    assert_each_parameter_loaded_once(params, loads)


def test_exported_directory_serves_the_same_logits(exported):
    target, draft, out = exported
    loaded = load_exported_draft(
        out, target_config=target.config, target_embedding=target.get_input_embeddings().weight
    )
    ids, aux = torch.randint(0, 96, (1, 7)), torch.randn(1, 7, 192)
    with torch.no_grad():
        a, _ = draft(ids, draft.fuse(aux), torch.arange(7)[None], cache=DraftKVCache())
        b, _ = loaded(ids, loaded.fuse(aux), torch.arange(7)[None], cache=DraftKVCache())
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_custom_aux_layers_are_written_in_both_conventions():
    target, draft = tiny_draft()
    config = export_config_dict(
        draft.config, aux_layer_ids=[0, 2, 3], num_target_layers=4, dtype="bfloat16"
    )
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # SGLang
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM: HF indices


def test_renamed_or_missing_tensors_are_rejected():
    _, draft = tiny_draft()
    tensors = export_tensors(draft, torch.bfloat16)
    renamed = dict(tensors)
    renamed["midlayer.self_attn.qproj.weight"] = renamed.pop("midlayer.self_attn.q_proj.weight")
    with pytest.raises(ExportError, match="unexpected tensor 'midlayer.self_attn.qproj.weight'"):
        check_export_tensors(renamed, draft.config, torch.bfloat16)
    missing = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    with pytest.raises(ExportError, match="missing tensor 'lm_head.weight'"):
        check_export_tensors(missing, draft.config, torch.bfloat16)
    prefixed = {f"model.{k}": v for k, v in tensors.items()}
    with pytest.raises(ExportError, match="unexpected tensor 'model.fc.weight'"):
        check_export_tensors(prefixed, draft.config, torch.bfloat16)
    colliding = torch.zeros(32, dtype=torch.long)
    colliding[0] = 1  # draft ids 0 and 1 both map to target id 1
    bad_map = dict(tensors, d2t=colliding)
    with pytest.raises(ExportError, match="not injective"):
        check_export_tensors(bad_map, draft.config, torch.bfloat16)
    wrong_dtype = dict(tensors, d2t=tensors["d2t"].int())
    with pytest.raises(ExportError, match="d2t: dtype torch.int32"):
        check_export_tensors(wrong_dtype, draft.config, torch.bfloat16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tie_word_embeddings": True}, "tie_word_embeddings must be false"),
        ({"max_position_embeddings": 1024}, "max_position_embeddings 1024 != target's 2048"),
        ({"rope_theta": 500000.0}, "rope_theta/rope_scaling"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}, "rope_parameters"),
        ({"vocab_size": 95}, "vocab_size 95 != target's 96"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"target_hidden_size": 32}, "target_hidden_size 32"),
    ],
)
def test_config_mismatches_with_the_target_are_rejected(change, message):
    target, draft = tiny_draft()
    config = export_config_dict(
        draft.config, aux_layer_ids=[1, 1, 0], num_target_layers=4, dtype="bfloat16"
    )
    check_export_config(config, target.config)  # the unchanged one passes
    config.update(change)
    with pytest.raises(ExportError, match=message):
        check_export_config(config, target.config)


def test_cli_exports_a_training_checkpoint(tmp_path, peaked_target_dir, caplog):
    from specforge.cli import main
    from specforge.recipes.train import train
    from tests.helpers import tiny_train_config

    folder, data = peaked_target_dir
    result = train(tiny_train_config(folder, data, tmp_path / "run", "train.max_steps=2"))
    out = tmp_path / "export"
    with caplog.at_level(logging.WARNING):
        assert main(["export", str(result.checkpoint), str(out)]) == 0
    # the 4-layer target's default aux layers repeat one: vLLM could not serve it
    assert "the aux layers [1, 1, 0] repeat a layer: vLLM collects" in caplog.text
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "freq_64.pt", "tokenizer.json"} <= names
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["t2d"].dtype == torch.bool
    checkpoint = load_file(str(result.checkpoint / "draft.safetensors"))
    torch.testing.assert_close(tensors["fc.weight"], checkpoint["fc.weight"].bfloat16())
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    # SGLang launch advice from the run's last held-out evaluation (cond_acc_0 .. _2)
    evals = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["split"] == "eval"]
    advice = json.loads((out / "sglang_advice.json").read_text())
    assert advice["conditional_acceptance"] == [
        round(evals[-1][f"cond_acc_{k}"], 4) for k in range(3)
    ]
    assert advice["tiers"]["7"]["extrapolated"] and not advice["tiers"]["3"]["extrapolated"]
    assert "--speculative-num-steps" in (out / "sglang_advice.md").read_text()


def test_an_eagle31_export_carries_its_switches_and_serves_the_same_logits(tmp_path):
    """``fc_norm`` / ``norm_output`` go to ``config.json`` at the top level and the three aux
    norms to ``model.safetensors``, where vLLM's loader finds each parameter once; the built-in
    runtime loads the same directory back into an EAGLE 3.1 draft with equal logits."""
    target, draft = tiny_draft(fc_norm=True, norm_output=True)
    with torch.no_grad():
        for norm in draft.fc_norm:
            norm.weight.uniform_(0.5, 1.5)
    out = write_export(
        tmp_path / "export", model=draft, target_config=target.config, aux_layer_ids=[1, 1, 0]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    tensors = load_file(str(out / "model.safetensors"))
    params, loads = vllm_load(tensors, draft.config)
    assert {f"model.fc_norm.{i}.weight" for i in range(3)} <= set(params)
    assert_each_parameter_loaded_once(params, loads)
    loaded = load_exported_draft(
        out,
        target_config=target.config,
        target_embedding=target.get_input_embeddings().weight,
        dtype=torch.bfloat16,
    ).float()
    assert loaded.config.fc_norm and loaded.config.norm_output
    ids, aux = torch.randint(0, 96, (1, 7)), torch.randn(1, 7, 192)
    with torch.no_grad():
        a, _ = draft.to(torch.bfloat16).float()(
            ids, draft.fuse(aux), torch.arange(7)[None], cache=DraftKVCache()
        )
        b, _ = loaded(ids, loaded.fuse(aux), torch.arange(7)[None], cache=DraftKVCache())
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    del tensors["fc_norm.1.weight"]
    with pytest.raises(ExportError, match="missing tensor 'fc_norm.1.weight'"):
        check_export_tensors(tensors, draft.config, torch.bfloat16)


def test_training_with_the_eagle31_variant_exports_it(tmp_path, peaked_target_dir):
    from specforge.cli import main

    folder, data = peaked_target_dir
    out = tmp_path / "run"
    code = main(
        ["train", "--draft-variant", "eagle3.1", f"output_dir={out}", "train.max_steps=2"]
        + [f"target.name_or_path={folder}", "target.dtype=float32", "train.dtype=float32"]
        + [f"train.data_path={data}", "vocab.draft_vocab_size=64", "train.eval_fraction=0.2"]
    )
    assert code == 0
    assert main(["export", f"output_dir={out}"]) == 0
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert "fc_norm.2.weight" in load_file(str(out / "export" / "model.safetensors"))
