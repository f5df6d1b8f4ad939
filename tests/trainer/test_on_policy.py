"""The on-policy phase (``train.on_policy``): replayed chain rounds are the runtime's rounds, the
loss reads exactly their states, and the phase resumes as an uninterrupted run does."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specforge.config import ConfigError
from specforge.data.batching import collate
from specforge.data.chat import TokenizedSample
from specforge.families.dispatch import load_checkpoint_draft as load_draft
from specforge.models.target import target_hidden_states
from specforge.recipes.train import train
from specforge.serving.speculative import SpeculativeDecoder
from specforge.trainer.ttt import (
    TTTObjective,
    replay,
    replay_rounds,
    target_distribution,
    ttt_loss,
)
from tests.helpers import greedy_reference, tiny_draft, tiny_train_config

AUX = [1, 1, 0]


def test_replay_walks_rounds_from_each_runs_first_token():
    # one row, a run at 2..9: anchor 1 accepts 2 (next anchor 4), 4 accepts 0, 5 accepts the
    # whole depth 3 (anchor 9 would predict past the run: none)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    matched = torch.zeros(1, 11, 3, dtype=torch.bool)
    matched[0, 1, :2] = True  # 2 accepted, the third rejected
    matched[0, 4, 1:] = True  # a match after a miss counts for nothing
    matched[0, 5] = True
    rounds = replay_rounds(matched, mask)
    assert rounds.reach.tolist() == [[0, 3, 0, 0, 1, 3, 0, 0, 0, 0, 0]]
    # emitted: 3 + 1 + 3 (the last round's bonus would be past the run: 2 left after 5 + 3)
    assert (int(rounds.rounds), int(rounds.emitted)) == (3, 7)
    assert int(rounds.emitted) == int(mask.sum()) - 1  # the runtime's tokens after the prefill's


def greedy_samples(target, prompts, new_tokens):
    """The target's greedy answers to ``prompts`` as training samples (the answer under the
    loss mask), as a target-assisted rollout emits them."""
    samples = []
    for index, prompt in enumerate(prompts):
        ids = torch.tensor(greedy_reference(target, prompt[None], new_tokens))
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(prompt) :] = True
        samples.append(TokenizedSample(f"p{index}", ids, mask))
    return samples


def states(target, draft, batch):
    """The aux states and the target's distribution of ``batch``, as the online source has them."""
    found = target_hidden_states(target, batch.input_ids, batch.attention_mask, aux_layer_ids=AUX)
    dist = target_distribution(
        found.last_hidden_state,
        target.lm_head.weight,
        hot_ids=draft.hot_ids,
        t2d=draft.t2d,
    )
    return found.aux_hidden_states, dist


def fitted_draft(target, draft, samples, steps=40):
    """``draft`` trained a little (TTT) on ``samples``: accepted some rounds, rejected others."""
    batch = collate(samples)
    aux, dist = states(target, draft, batch)
    objective = TTTObjective(draft, ttt_length=3, step_weight=0.8)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    for _ in range(steps):
        objective(batch, aux, dist).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    draft.eval()


def test_replayed_rounds_and_the_loss_states_are_the_runtimes_rounds():
    """Over the target's greedy answers, the replay finds the rounds the runtime ran (anchors
    and accepted counts, so its accept length), and the on-policy loss counts at step ``k``
    exactly the rounds that drafted a ``k``-th token whose verification decided acceptance."""
    torch.manual_seed(0)
    target, draft = tiny_draft(seed=3)
    prompts = [torch.randint(0, 96, (n,)) for n in (5, 9, 7, 6)]
    samples = greedy_samples(target, prompts, 40)
    fitted_draft(target, draft, samples)
    depth, runtime = 3, []
    decoder = SpeculativeDecoder(target, draft, aux_layer_ids=AUX, num_steps=depth)
    for sample, prompt in zip(samples, prompts, strict=True):
        tokens, stats = decoder.generate(prompt[None], max_new_tokens=40)
        assert tokens == sample.input_ids[len(prompt) :].tolist()  # lossless
        runtime.append(stats)
    accepted = [a for stats in runtime for a in stats.accepted_per_round]
    assert 0 < sum(accepted) < depth * len(accepted)  # some rounds accept, some reject
    batch = collate(samples)
    aux, dist = states(target, draft, batch)
    inputs = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "loss_mask": batch.loss_mask,
        "aux_hidden_states": aux,
        "target_dist": dist,
    }
    with torch.no_grad():
        rounds = replay(draft, **inputs, depth=depth)
    drafted = [0] * depth  # per step k: rounds that drafted a k-th token inside the answer
    for row, (prompt, stats) in enumerate(zip(prompts, runtime, strict=True)):
        anchors, t, length = [], len(prompt) - 1, len(samples[row].input_ids)
        reach = rounds.reach[row]
        for a, verified in zip(stats.accepted_per_round, stats.depth_per_round, strict=True):
            anchors.append(t)
            # the runtime's last rounds verify only what is left of max_new_tokens; training's
            # answers end at an end-of-turn token the runtime cannot foresee, so the replay
            # drafts on as a round there would: the same rounds, each reaching as far
            expected = min(a + 1, depth)
            assert reach[t] == expected if verified == depth else reach[t] >= expected
            for k in range(min(int(reach[t]), length - (t + 2))):
                drafted[k] += 1
            t += min(a, length - (t + 2)) + 1  # the last round's tokens past the answer cut
        assert reach.nonzero().flatten().tolist() == anchors
    assert int(rounds.rounds) == sum(s.verifications for s in runtime)
    assert int(rounds.emitted) == sum(s.emitted for s in runtime)
    with torch.no_grad():
        result = ttt_loss(draft, **inputs, ttt_length=depth, reach=rounds.reach)
    assert [int(n) for n in result.step_counted] == drafted


def test_on_policy_phase_trains_resumes_exactly_and_serves_losslessly(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    steps = [
        "train.max_steps=3",
        "train.on_policy.steps=3",
        "train.on_policy.depth=3",
        "train.save_every=1",
        "train.eval_every=100",
        "vocab.draft_vocab_size=263",
    ]
    full = train(tiny_train_config(folder, data, tmp_path / "full", *steps))
    assert full.checkpoint == tmp_path / "full" / "checkpoints" / "step_6"
    state = json.loads((full.checkpoint / "trainer_state.json").read_text())
    assert state["on_policy_from"] == 3 and state["on_policy_seconds"] > 0
    logged = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").open()]
    phases = [(r["step"], r["split"]) for r in logged if r["split"] in ("train", "on_policy")]
    assert phases == [(1, "train"), (2, "train"), (3, "train")] + [
        (step, "on_policy") for step in (4, 5, 6)
    ]
    assert all(
        r["lr"] == pytest.approx(3e-4) and r["tau_replay"] >= 1
        for r in logged
        if r["split"] == "on_policy"
    )
    # interrupted inside the phase, its last checkpoint lost: resumed from step 4
    interrupted = tmp_path / "interrupted"
    train(tiny_train_config(folder, data, interrupted, *steps), stop_after_step=5)
    for path in (interrupted / "checkpoints" / "step_5").iterdir():
        path.unlink()
    (interrupted / "checkpoints" / "step_5").rmdir()
    resumed = train(tiny_train_config(folder, data, interrupted, *steps, "train.resume=true"))
    a = load_file(full.checkpoint / "draft.safetensors")
    b = load_file(resumed.checkpoint / "draft.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)
    supervised = load_file(tmp_path / "full" / "checkpoints" / "step_3" / "draft.safetensors")
    assert any(not torch.equal(a[key], supervised[key]) for key in a)  # the phase trained
    # the phase's draft serves as any EAGLE-3 draft: losslessly
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    draft = load_draft(resumed.checkpoint, target.get_input_embeddings().weight).eval()
    prompt = torch.tensor([[5, 17, 40, 2, 9]])
    decoder = SpeculativeDecoder(target, draft, aux_layer_ids=state["aux_layer_ids"], num_steps=3)
    tokens, _ = decoder.generate(prompt, max_new_tokens=24)
    assert tokens == greedy_reference(target, prompt, 24)[prompt.shape[1] :]


def test_an_on_policy_phase_for_a_dflash_draft_is_refused(tmp_path):
    """Refused when the stage starts, before the target or the data is read."""
    cfg = tiny_train_config(
        tmp_path,
        tmp_path / "missing.jsonl",
        tmp_path / "o",
        "draft.type=dflash",
        "train.on_policy.steps=2",
    )
    with pytest.raises(ConfigError, match="train.on_policy.steps=2 does nothing for draft.type"):
        train(cfg)
