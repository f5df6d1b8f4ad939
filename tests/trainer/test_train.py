import json
import re

import pytest
import torch
from safetensors.torch import load_file

from specforge.config import ConfigError
from specforge.data.batching import StepBatches, epoch_micro_batches, split_train_eval
from specforge.data.chat import TokenizedSample
from specforge.recipes.train import train
from specforge.trainer.optim import lr_factor
from tests.helpers import tiny_train_config, torchrun_train


def metrics(output_dir, split):
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def test_loss_decreases_and_accuracy_rises_on_memorizable_data(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    out = tmp_path / "run"
    cfg = tiny_train_config(
        folder,
        data,
        out,
        "train.max_steps=150",
        "train.eval_every=150",
        "vocab.draft_vocab_size=263",
    )
    result = train(cfg)
    train_log = metrics(out, "train")
    first = sum(r["loss"] for r in train_log[:5]) / 5
    last = sum(r["loss"] for r in train_log[-5:]) / 5
    assert last < 0.7 * first
    evals = metrics(out, "eval")
    assert [r["step"] for r in evals] == [0, 150]
    assert evals[-1]["acc_0"] > evals[0]["acc_0"] + 0.1
    assert evals[-1]["tau_pred"] > evals[0]["tau_pred"]
    assert result.checkpoint == out / "checkpoints" / "step_150"
    assert {p.name for p in result.checkpoint.iterdir()} == {
        "draft.safetensors",
        "draft_config.json",
        "optimizer.pt",
        "rng.pt",
        "trainer_state.json",
    }
    assert "embed_tokens.weight" not in load_file(result.checkpoint / "draft.safetensors")


def test_a_frozen_lm_head_stays_as_it_started_while_the_layer_trains(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    steps = ["train.max_steps=3", "train.save_every=1", "train.eval_every=100"]
    frozen = tmp_path / "frozen"
    train(tiny_train_config(folder, data, frozen, *steps, "train.freeze_lm_head=true"))
    trained = tmp_path / "trained"
    train(tiny_train_config(folder, data, trained, *steps))
    first, last = (
        load_file(frozen / "checkpoints" / f"step_{n}" / "draft.safetensors") for n in (1, 3)
    )
    assert torch.equal(first["lm_head.weight"], last["lm_head.weight"])
    assert not torch.equal(first["fc.weight"], last["fc.weight"])
    # both runs start from the same draft: the default run moves its head
    unfrozen = load_file(trained / "checkpoints" / "step_3" / "draft.safetensors")
    assert not torch.equal(unfrozen["lm_head.weight"], last["lm_head.weight"])


@pytest.mark.parametrize("batching", [[], ["train.batch_tokens=96"]], ids=["count", "tokens"])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, peaked_target_dir, batching):
    folder, data = peaked_target_dir
    steps = ["train.max_steps=8", "train.save_every=3", "train.eval_every=100", *batching]
    full = train(tiny_train_config(folder, data, tmp_path / "full", *steps))
    interrupted = tmp_path / "interrupted"
    train(tiny_train_config(folder, data, interrupted, *steps), stop_after_step=4)
    assert (interrupted / "checkpoints" / "step_3").is_dir()
    # drop the step-4 checkpoint: resume from step 3, as after a kill between checkpoints
    for path in (interrupted / "checkpoints" / "step_4").iterdir():
        path.unlink()
    (interrupted / "checkpoints" / "step_4").rmdir()
    resumed = train(tiny_train_config(folder, data, interrupted, *steps, "train.resume=true"))
    logged = [
        (r["step"], r["split"])
        for r in map(json.loads, (interrupted / "metrics.jsonl").read_text().splitlines())
    ]
    assert len(logged) == len(set(logged)) and (8, "train") in logged  # no step logged twice
    a = load_file(full.checkpoint / "draft.safetensors")
    b = load_file(resumed.checkpoint / "draft.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


def test_lr_schedule_warms_up_then_decays():
    factors = [lr_factor(s, warmup_steps=4, max_steps=20, min_lr_ratio=0.1) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert (
        factors[-1] > 0.1 and lr_factor(20, warmup_steps=4, max_steps=20, min_lr_ratio=0.1) == 0.1
    )


def test_a_time_budget_decays_the_schedule_early():
    common = {"warmup_steps": 4, "max_steps": 100, "min_lr_ratio": 0.1}
    by_steps = lr_factor(10, **common)
    assert lr_factor(10, **common, time_fraction=0.01) == by_steps  # steps are further along
    assert lr_factor(10, **common, time_fraction=0.5) < by_steps
    assert lr_factor(10, **common, time_fraction=1.0) == pytest.approx(0.1)
    assert lr_factor(2, **common, time_fraction=1.0) == 0.75  # warmup is by steps


def test_max_minutes_ends_training_and_a_rerun_adds_no_step(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    out = tmp_path / "run"
    settings = ["train.max_steps=50", "train.save_every=100", "train.eval_every=100"]
    # a budget of 6 ms: the first step ends past it
    cfg = tiny_train_config(folder, data, out, *settings, "train.max_minutes=0.0001")
    result = train(cfg)
    assert result.checkpoint == out / "checkpoints" / "step_1"
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    assert state["train_seconds"] >= 0.006
    assert [r["step"] for r in metrics(out, "eval")] == [0, 1]  # evaluated as at max_steps
    rerun = train(
        tiny_train_config(
            folder, data, out, *settings, "train.max_minutes=0.0001", "train.resume=true"
        )
    )
    assert rerun.checkpoint is None
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"]
    # a larger budget on resume goes on from the checkpoint, counting the time already spent
    more = train(
        tiny_train_config(folder, data, out, *settings, "train.max_minutes=10", "train.resume=true")
    )
    assert more.checkpoint == out / "checkpoints" / "step_50"
    later = json.loads((more.checkpoint / "trainer_state.json").read_text())
    assert later["train_seconds"] > state["train_seconds"]


def test_max_minutes_not_spent_stops_no_step_early(tmp_path, peaked_target_dir):
    """Logged, evaluated and saved at every step, each step checks the clock again after its
    save: a budget left over takes every step."""
    folder, data = peaked_target_dir
    out = tmp_path / "run"
    every = ["train.max_steps=3", "train.log_every=1", "train.eval_every=1", "train.save_every=1"]
    result = train(tiny_train_config(folder, data, out, *every, "train.max_minutes=10"))
    assert result.checkpoint == out / "checkpoints" / "step_3"
    assert [r["step"] for r in metrics(out, "eval")] == [0, 1, 2, 3]


@pytest.mark.parametrize("batch_tokens", [None, 9])
def test_global_batch_is_the_same_for_ranks_or_accumulation(batch_tokens):
    from specforge.data.chat import TokenizedSample

    samples = [
        TokenizedSample(str(i), torch.arange(i % 5 + 2), torch.ones(i % 5 + 2, dtype=torch.bool))
        for i in range(20)
    ]
    common = {
        "seed": 3,
        "batch_size": 1,
        "max_tokens_per_batch": None,
        "batch_tokens": batch_tokens,
    }
    single = StepBatches(samples, world_size=1, rank=0, grad_accumulation=2, **common)
    ranks = [
        StepBatches(samples, world_size=2, rank=r, grad_accumulation=1, **common) for r in (0, 1)
    ]
    for step in range(25):  # crosses epochs
        one = [b.input_ids.tolist() for b in single.for_step(step)]
        two = [r.for_step(step)[0].input_ids.tolist() for r in ranks]
        assert one == two


def test_the_sampled_answers_to_one_prompt_share_their_split():
    """``regenerate.num_samples`` writes ``<id>#s<k>`` per answer: all of a prompt's answers
    are held out or none (one in training would leak the held-out prompt)."""
    samples = [
        TokenizedSample(id=f"synth-0-{p}#s{k}", input_ids=[], loss_mask=[])
        for p in range(400)
        for k in range(3)
    ]
    train_part, held_out = split_train_eval(samples, 0.1)
    held_prompts = {s.id.split("#")[0] for s in held_out}
    assert 0 < len(held_prompts) < 400
    assert len(held_out) == 3 * len(held_prompts)
    assert not held_prompts & {s.id.split("#")[0] for s in train_part}
    # a dataset too small for the fraction still holds out one whole prompt
    few = [TokenizedSample(id=f"q#s{k}", input_ids=[], loss_mask=[]) for k in range(2)]
    few += [TokenizedSample(id="r", input_ids=[], loss_mask=[])]
    train_part, held_out = split_train_eval(few, 0.0001)
    assert [s.id for s in held_out] in (["r"], ["q#s0", "q#s1"])
    assert len(train_part) == 3 - len(held_out)


def test_token_budget_splits_micro_batches():
    from specforge.data.chat import TokenizedSample

    samples = [
        TokenizedSample(str(i), torch.arange(10), torch.ones(10, dtype=torch.bool))
        for i in range(8)
    ]
    batches = epoch_micro_batches(samples, epoch=0, seed=0, batch_size=4, max_tokens_per_batch=20)
    assert all(len(b) == 2 for b in batches) and len(batches) == 4


def test_token_budget_batches_hold_similar_lengths_within_the_budget():
    """``train.batch_tokens``: every sample once an epoch, each micro-batch within the budget
    (rows x its longest) unless one sample alone passes it, lengths grouped (little padding),
    the batches' order reshuffled each epoch and the same for the same seed."""
    lengths = [3 + (i * 37) % 60 for i in range(200)] + [150]
    samples = [
        TokenizedSample(str(i), torch.arange(n), torch.ones(n, dtype=torch.bool))
        for i, n in enumerate(lengths)
    ]

    def epoch(number, seed=0):
        return epoch_micro_batches(
            samples,
            epoch=number,
            seed=seed,
            batch_size=1,
            max_tokens_per_batch=None,
            batch_tokens=128,
        )

    first = epoch(0)
    assert sorted(i for b in first for i in b) == list(range(len(samples)))
    for batch in first:
        widths = [lengths[i] for i in batch]
        assert max(widths) * len(batch) <= 128 or len(batch) == 1
    assert [200] in first  # longer than the budget: alone
    padded = sum(max(lengths[i] for i in b) * len(b) for b in first)
    assert padded < 1.1 * sum(lengths)
    assert epoch(0) == first and epoch(1) != first and epoch(0, seed=1) != first
    # about the budget's tokens a step, where batch_size 1 gave one sample a step
    assert len(first) < len(samples) / 3


@pytest.mark.integration
def test_two_process_ddp_matches_one_process(tmp_path, peaked_target_dir):
    """torchrun with 2 gloo ranks x batch 1 == 1 process with 2 accumulated micro-batches."""
    folder, data = peaked_target_dir

    def run(nproc, out, *extra):
        return torchrun_train(nproc, out, folder, f"train.data_path={data}", *extra)

    single, _ = run(1, tmp_path / "single", "train.grad_accumulation=2")
    ddp, _ = run(2, tmp_path / "ddp")
    # the frozen target sharded with FSDP2 and the draft's optimizer state with ZeRO-1
    sharded, log = run(
        2, tmp_path / "sharded", "train.target_sharding=fsdp", "train.zero_optimizer=true"
    )
    assert "sharded with FSDP2 over 2 ranks" in log
    for key in single:
        torch.testing.assert_close(ddp[key], single[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sharded[key], single[key], rtol=1e-5, atol=1e-6)


def test_eval_data_on_the_held_out_conversations_reproduces_the_held_out_evaluation(
    tmp_path, peaked_target_dir
):
    """``train.eval_data_path`` is evaluated like the held-out split, at the same steps: given
    exactly the held-out conversations, it logs the held-out metrics."""
    folder, data = peaked_target_dir
    records = [json.loads(line) for line in data.read_text().splitlines()]
    probes = [TokenizedSample(id=r["id"], input_ids=[], loss_mask=[]) for r in records]
    _, held_out = split_train_eval(probes, 0.2)
    held_out_ids = {s.id for s in held_out}
    eval_data = tmp_path / "eval_data.jsonl"
    eval_data.write_text("".join(json.dumps(r) + "\n" for r in records if r["id"] in held_out_ids))
    out = tmp_path / "run"
    steps = ["train.max_steps=6", "train.eval_every=3", f"train.eval_data_path={eval_data}"]
    result = train(tiny_train_config(folder, data, out, *steps))
    evals, extra = metrics(out, "eval"), metrics(out, "eval_data")
    assert [r["step"] for r in extra] == [r["step"] for r in evals] == [0, 3, 6]
    assert [r["tau_pred"] for r in extra] == [r["tau_pred"] for r in evals]
    assert result.eval_data == result.eval and result.eval_data["acc_0"] > 0


def test_eval_data_with_offline_shards_is_refused(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    with pytest.raises(ConfigError, match=r"train.eval_data_path \(.*\) needs the target"):
        tiny_train_config(
            folder, data, tmp_path / "run", "data.mode=offline", f"train.eval_data_path={data}"
        )


@pytest.mark.integration
def test_a_compiled_ttt_step_trains_as_the_eager_one(tmp_path, peaked_target_dir):
    """``train.compile: true`` (torch.compile of the draft's TTT step) gives the eager run's
    losses and weights, under token-budget batches of several rows and lengths."""
    folder, data = peaked_target_dir
    common = ["train.max_steps=4", "train.log_every=1", "train.batch_tokens=96"]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runs = {
        mode: train(
            tiny_train_config(folder, data, tmp_path / mode, *common, f"train.compile={mode}")
        )
        for mode in ("false", "true")
    }
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # it did compile
    eager, compiled = (metrics(tmp_path / mode, "train") for mode in ("false", "true"))
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=1e-4)
    a, b = (load_file(runs[m].checkpoint / "draft.safetensors") for m in ("false", "true"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)


def test_a_pass_from_kept_target_states_trains_as_one_through_the_target(
    tmp_path, peaked_target_dir, caplog
):
    """``train.state_cache_gb``: over two and a half passes at one conversation a step in
    float32, the weights equal a run whose target runs every step, and the later passes'
    batches came from the kept states (the held-out evaluations' too)."""
    folder, data = peaked_target_dir
    common = ["train.max_steps=25", "train.eval_every=10"]
    plain = train(tiny_train_config(folder, data, tmp_path / "plain", *common))
    with caplog.at_level("INFO", logger="specforge.recipes.train"):
        kept = train(
            tiny_train_config(folder, data, tmp_path / "kept", *common, "train.state_cache_gb=1")
        )
    report = next(r.getMessage() for r in caplog.records if "state_cache_gb" in r.getMessage())
    found = re.search(r"(\d+) batches from them, (\d+) through", report)
    hits, misses = int(found[1]), int(found[2])
    assert hits > misses > 0
    assert [r["loss"] for r in metrics(tmp_path / "kept", "train")] == [
        r["loss"] for r in metrics(tmp_path / "plain", "train")
    ]
    a, b = (load_file(run.checkpoint / "draft.safetensors") for run in (plain, kept))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
