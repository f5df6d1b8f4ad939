"""Training levers: the draft started from the target's last layer, and the LK loss."""

import torch

from specforge.models.eagle3 import DraftKVCache, init_from_target_layer
from specforge.trainer.ttt import position_losses
from tests.helpers import tiny_draft


def test_init_from_target_layer_makes_the_draft_the_targets_last_layer():
    target, draft = tiny_draft(seed=3, randomize_norms=False)
    last = target.model.layers[-1]
    copied = init_from_target_layer(draft, dict(last.named_parameters()))
    assert "fc.weight" in copied and "midlayer.mlp.down_proj.weight" in copied
    assert torch.equal(draft.midlayer.mlp.up_proj.weight, last.mlp.up_proj.weight)
    hidden = draft.config.hidden_size
    assert torch.equal(
        draft.midlayer.self_attn.q_proj.weight[:, hidden:], last.self_attn.q_proj.weight
    )
    # with the embedding half silenced, step 0 is the target's last layer on the top aux state
    with torch.no_grad():
        for name in "qkv":
            getattr(draft.midlayer.self_attn, f"{name}_proj").weight[:, :hidden] = 0
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        # aux layers 0, 1, 2: the top one is the input of the last layer (3)
        aux = torch.cat([out.hidden_states[i + 1] for i in (0, 1, 2)], dim=-1)
        positions = torch.arange(9).expand(2, 9)
        logits, _ = draft(ids, draft.fuse(aux), positions, cache=DraftKVCache())
    torch.testing.assert_close(logits, out.logits[..., draft.hot_ids], rtol=1e-4, atol=1e-5)


def test_lk_loss_is_minus_log_acceptance_and_training_on_it_raises_acceptance():
    torch.manual_seed(0)
    target_probs = torch.randn(5, 32).softmax(-1)
    logits = torch.randn(5, 32, requires_grad=True)
    q = logits.softmax(-1)
    expected = -torch.minimum(target_probs, q).sum(-1).log()
    torch.testing.assert_close(position_losses(logits, target_probs, "lk"), expected)
    # zero when the draft is the target
    same = position_losses(target_probs.log(), target_probs, "lk")
    torch.testing.assert_close(same, torch.zeros(5), atol=1e-6, rtol=0)
    before = torch.minimum(target_probs, q).sum(-1).detach()
    optimizer = torch.optim.SGD([logits], lr=1.0)
    for _ in range(20):
        optimizer.zero_grad()
        position_losses(logits, target_probs, "lk").sum().backward()
        optimizer.step()
    after = torch.minimum(target_probs, logits.softmax(-1)).sum(-1)
    assert (after > before).all()
