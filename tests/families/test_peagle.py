"""The P-EAGLE family: training-time test on the mask inputs equals the serving forward that
drafts a chain in one pass; the runtime serves it losslessly (greedy, and sampled in
distribution), refuses what one forward cannot do; ``specforge train`` / ``export`` / ``bench``
run it end to end, and the export is what vLLM's parallel drafting loads."""

import json

import pytest
import torch

from specforge.cli import main
from specforge.errors import UserError
from specforge.families import family
from specforge.families.peagle.model import PEagleDraftModel
from specforge.models.eagle3 import DraftKVCache
from specforge.recipes.train import train
from specforge.serving.speculative import SpeculativeDecoder
from specforge.trainer.ttt import ttt_unroll
from tests.helpers import bench_tiny_export, greedy_reference, tiny_draft, tiny_train_config
from tests.serving.test_export import assert_each_parameter_loaded_once, vllm_load

PEAGLE = family("peagle")
VOCAB, DEPTH = 96, 4


def tiny_peagle(seed: int = 0, **switches):
    """A tiny target and a P-EAGLE draft over it (mask token 95, trained depth 4)."""
    return tiny_draft(
        seed,
        model_class=PEagleDraftModel,
        mask_token_id=VOCAB - 1,
        parallel_draft_tokens=DEPTH,
        **switches,
    )


def parallel_logits(draft: PEagleDraftModel, ids, aux, prefix: int, steps: int):
    """Serve the draft as vLLM's parallel drafting does: the context (features 0..prefix-1,
    tokens 1..prefix) and ``steps - 1`` mask positions after it in one forward; the last
    context position's logits and each mask position's."""
    hidden = torch.cat([draft.fuse(aux[:, :prefix]), draft.mask_inputs((1, steps - 1))[1]], 1)
    tokens = torch.cat([ids[:, 1 : prefix + 1], draft.mask_inputs((1, steps - 1))[0]], 1)
    positions = torch.arange(prefix + steps - 1)[None]
    logits, _ = draft(tokens, hidden, positions, cache=DraftKVCache())
    return [logits[:, prefix - 1 + k] for k in range(steps)]


@pytest.mark.parametrize("variant", [{}, {"fc_norm": True, "norm_output": True}])
def test_ttt_on_the_mask_inputs_equals_the_one_forward_chain(variant):
    """Step k of the unroll at position t (its mask inputs at RoPE t + k, attending to the
    context up to t and to its own earlier steps) equals the one serving forward's position
    t + k, for every t and k (EAGLE-3 and EAGLE 3.1 layers)."""
    torch.manual_seed(0)
    _, draft = tiny_peagle(seed=2, **variant)
    length = 14
    ids, aux = torch.randint(0, VOCAB, (1, length)), torch.randn(1, length, 3 * 64)
    with torch.no_grad():
        ttt = [
            draft.logits(hidden)
            for hidden in ttt_unroll(
                draft,
                input_ids=ids,
                attention_mask=torch.ones(1, length, dtype=torch.long),
                aux_hidden_states=aux,
                ttt_length=DEPTH,
            )
        ]
        for t in range(length - DEPTH):
            served = parallel_logits(draft, ids, aux, prefix=t + 1, steps=DEPTH)
            for k in range(DEPTH):
                torch.testing.assert_close(ttt[k][0, t], served[k][0], rtol=1e-5, atol=1e-5)


def decoder(target, draft, **settings):
    return SpeculativeDecoder(
        target, draft, proposer=PEAGLE.proposer, aux_layer_ids=[1, 1, 0], **settings
    )


def test_the_runtime_serves_it_losslessly_and_drafts_in_one_forward_a_round():
    target, draft = tiny_peagle()
    runtime = decoder(target, draft, num_steps=DEPTH)
    calls = []
    draft.register_forward_hook(lambda *_: calls.append(1))
    for seed in range(4):
        prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))
        tokens, stats = runtime.generate(prompt, max_new_tokens=20)
        assert tokens == greedy_reference(target, prompt, 20)[5:]
        # the prefill, then per round one catch-up and one forward for the whole chain
        assert len(calls) <= 1 + 2 * stats.verifications
        calls.clear()


def test_sampling_keeps_the_target_distribution_of_the_first_token():
    """Rejection sampling over the mask positions' distributions: the emitted first two tokens
    follow the target's own sampling distribution (many seeded draws, a chi-square test)."""
    from scipy.stats import chisquare

    target, draft = tiny_peagle(seed=3)
    runtime = decoder(target, draft, num_steps=3, temperature=1.0)
    prompt = torch.tensor([[5, 17, 40]])
    counts = torch.zeros(VOCAB)
    for seed in range(400):
        tokens, _ = runtime.generate(
            prompt, max_new_tokens=2, generator=torch.Generator().manual_seed(seed)
        )
        counts[tokens[1]] += 1
    # the first token is the prefill's; the second, the first one verified, follows the
    # target's law given the first, mixed over the first's law
    probs = torch.zeros(VOCAB)
    with torch.no_grad():
        p1 = target(prompt).logits[0, -1].softmax(-1)
        for token in range(VOCAB):
            seq = torch.cat([prompt, torch.tensor([[token]])], 1)
            probs += p1[token] * target(seq).logits[0, -1].softmax(-1)
    seen = probs > 0.01
    expected = torch.cat([probs[seen], probs[~seen].sum()[None]]) * 400
    observed = torch.cat([counts[seen], counts[~seen].sum()[None]])
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_steps": "auto"}, "num_steps 1..4"),
        ({"num_steps": 2, "topk": 2, "num_draft_tokens": 4}, "topk 1"),
        ({"num_steps": DEPTH + 1}, "as deep as it was trained to"),
    ],
)
def test_what_one_forward_cannot_draft_is_refused(settings, message):
    target, draft = tiny_peagle()
    with pytest.raises(UserError, match=message):
        decoder(target, draft, **settings)


def test_it_trains_exports_what_vllm_loads_and_benches_losslessly(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    out = tmp_path / "run"
    steps = ["draft.type=peagle", "train.max_steps=30", "train.eval_every=100"]
    result = train(tiny_train_config(folder, data, out, *steps))
    evals = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["split"] == "eval"
    ]
    assert evals[-1]["loss"] < evals[0]["loss"] and "acc_2" in evals[-1]
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    assert state["draft_type"] == "peagle"
    export = tmp_path / "export"
    assert main(["export", str(result.checkpoint), str(export), "--dtype", "float32"]) == 0
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["parallel_drafting"] is True and config["parallel_draft_tokens"] == 3
    assert 0 <= config["mask_token_id"] < config["vocab_size"]
    from safetensors.torch import load_file

    tensors = load_file(export / "model.safetensors")
    mask = tensors.pop("mask_hidden")  # vLLM copies it into its (1, fc input) buffer
    assert mask.numel() == 3 * config["target_hidden_size"]
    params, loads = vllm_load(tensors, PEAGLE.draft_config(export))  # every other name
    assert_each_parameter_loaded_once(params, loads)
    report = bench_tiny_export(tmp_path, folder, export, "--num-steps", "auto")
    assert report["all_match"] is True and report["settings"]["draft_family"] == "peagle"
    assert report["settings"]["num_steps"] == 3  # auto: the depth it was trained to
