import pytest
import torch

from specforge.models.eagle3 import DraftKVCache, Eagle3Config, Eagle3DraftModel, build_draft_model
from specforge.trainer.ttt import ttt_unroll
from tests.helpers import make_tiny_llama, tiny_draft

EXPECTED_PARAMETERS = {
    "embed_tokens.weight": (96, 64),
    "fc.weight": (64, 3 * 64),
    "midlayer.input_layernorm.weight": (64,),
    "midlayer.hidden_norm.weight": (64,),
    "midlayer.self_attn.q_proj.weight": (4 * 16, 2 * 64),
    "midlayer.self_attn.k_proj.weight": (2 * 16, 2 * 64),
    "midlayer.self_attn.v_proj.weight": (2 * 16, 2 * 64),
    "midlayer.self_attn.o_proj.weight": (64, 4 * 16),
    "midlayer.post_attention_layernorm.weight": (64,),
    "midlayer.mlp.gate_proj.weight": (128, 64),
    "midlayer.mlp.up_proj.weight": (128, 64),
    "midlayer.mlp.down_proj.weight": (64, 128),
    "norm.weight": (64,),
    "lm_head.weight": (32, 64),
    "d2t": (32,),
    "t2d": (96,),
}


def test_parameter_names_shapes_and_init():
    target, draft = tiny_draft(randomize_norms=False)
    state = draft.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == EXPECTED_PARAMETERS
    assert not draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    hot = torch.arange(32) + draft.d2t
    assert torch.equal(draft.lm_head.weight, target.get_output_embeddings().weight[hot])
    assert torch.equal(draft.norm.weight, target.model.norm.weight)
    assert draft.fc.bias is None and draft.t2d.dtype == torch.bool and draft.d2t.dtype == torch.long
    assert draft.config.rope_parameters == target.config.rope_parameters


def test_from_target_rejects_bad_sizes():
    target = make_tiny_llama(96)
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1..96, got 200"):
        Eagle3Config.from_target(target.config, draft_vocab_size=200)
    config = Eagle3Config.from_target(target.config, draft_vocab_size=32)
    with pytest.raises(ValueError, match="target_embedding has shape"):
        build_draft_model(
            config,
            target_embedding=torch.zeros(5, 64),
            target_lm_head=torch.zeros(96, 64),
            d2t=torch.zeros(32, dtype=torch.long),
            t2d=torch.zeros(96, dtype=torch.bool),
        )


def incremental_logits(draft: Eagle3DraftModel, ids, aux, prefix: int, steps: int):
    """Serve the draft as an engine does: prefill features 0..prefix-1 once, then one token per
    step at position prefix-1+k, feeding back the last hidden state (teacher-forced tokens)."""
    cache = DraftKVCache()
    positions = torch.arange(prefix)[None]
    logits, hidden = draft(
        ids[:, 1 : prefix + 1], draft.fuse(aux[:, :prefix]), positions, cache=cache
    )
    out = [logits[:, -1]]
    hidden = hidden[:, -1:]
    for k in range(1, steps):
        token = ids[:, prefix + k : prefix + k + 1]
        position = torch.tensor([[prefix - 1 + k]])
        logits, hidden = draft(token, hidden, position, cache=cache)
        out.append(logits[:, -1])
    return out


EAGLE31 = {"fc_norm": True, "norm_output": True}


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("ttt_length", [1, 4, 7])
def test_ttt_equals_incremental_serving_for_every_step(ttt_length, variant):
    """docs/design.md §3.3: TTT's step-k logits at position t equal serving's k-th chained step
    after a draft prefill over features 0..t (KV cache), for every k < ttt_length and every t;
    for the EAGLE-3 draft and for EAGLE 3.1's (per-aux norms before fc, the post-norm state fed
    back)."""
    torch.manual_seed(0)
    _, draft = tiny_draft(seed=1, **(EAGLE31 if variant == "eagle3.1" else {}))
    length = 16
    ids = torch.randint(0, 96, (2, length))
    aux = torch.randn(2, length, 3 * 64)
    attention_mask = torch.ones(2, length, dtype=torch.long)
    attention_mask[1, 12:] = 0  # right padding on row 1
    with torch.no_grad():
        ttt = [
            draft.logits(hidden)
            for hidden in ttt_unroll(
                draft,
                input_ids=ids,
                attention_mask=attention_mask,
                aux_hidden_states=aux,
                ttt_length=ttt_length,
            )
        ]
        for row, valid in ((0, length), (1, 12)):
            for t in range(valid - ttt_length):
                served = incremental_logits(
                    draft, ids[row : row + 1], aux[row : row + 1], prefix=t + 1, steps=ttt_length
                )
                for k in range(ttt_length):
                    torch.testing.assert_close(ttt[k][row, t], served[k][0], rtol=1e-5, atol=1e-5)


def test_kv_cache_crop_and_explicit_mask_match_causal():
    torch.manual_seed(0)
    _, draft = tiny_draft()
    ids, aux = torch.randint(0, 96, (1, 9)), torch.randn(1, 9, 192)
    with torch.no_grad():
        hidden = draft.fuse(aux)
        full, _ = draft(ids, hidden, torch.arange(9)[None], cache=DraftKVCache())
        cache = DraftKVCache()
        draft(ids[:, :5], hidden[:, :5], torch.arange(5)[None], cache=cache)
        draft(ids[:, 5:7], hidden[:, 5:7], torch.arange(5, 7)[None], cache=cache)  # rejected
        cache.crop(5)
        mask = torch.ones(4, 9, dtype=torch.bool).tril(5)[None, None]
        rest, _ = draft(
            ids[:, 5:], hidden[:, 5:], torch.arange(5, 9)[None], cache=cache, attention_mask=mask
        )
    torch.testing.assert_close(rest, full[:, 5:], rtol=1e-5, atol=1e-5)


def test_eagle31_adds_three_aux_norms_and_feeds_back_the_normed_state():
    """``fc_norm``: one RMSNorm per aux state before ``fc`` (what vLLM loads as
    ``model.fc_norm.{i}.weight``); ``norm_output``: the state handed on is ``norm``'s output,
    and the logits read it without a second norm."""
    _, draft = tiny_draft(seed=2, **EAGLE31)
    shapes = {k: tuple(v.shape) for k, v in draft.state_dict().items()}
    assert shapes == {**EXPECTED_PARAMETERS, **{f"fc_norm.{i}.weight": (64,) for i in range(3)}}
    with torch.no_grad():
        for i, norm in enumerate(draft.fc_norm):
            norm.weight.fill_(1.0 + i)
        aux = torch.randn(1, 5, 3 * 64)
        chunks = aux.chunk(3, dim=-1)
        normed = torch.cat([draft.fc_norm[i](c) for i, c in enumerate(chunks)], -1)
        torch.testing.assert_close(draft.fuse(aux), draft.fc(normed))
        assert not torch.allclose(draft.fuse(aux), draft.fc(aux))
        ids, positions = torch.randint(0, 96, (1, 5)), torch.arange(5)[None]
        logits, state = draft(ids, draft.fuse(aux), positions, cache=DraftKVCache())
        draft.config.norm_output = False  # the same weights, the pre-norm residual handed on
        plain_logits, residual = draft(ids, draft.fuse(aux), positions, cache=DraftKVCache())
        torch.testing.assert_close(state, draft.norm(residual))
        torch.testing.assert_close(logits, draft.lm_head(state))
        torch.testing.assert_close(logits, plain_logits)  # one norm before lm_head either way
