"""Offline training: the same TTT loss and gradients as online, from a capture on disk."""

import pytest
import torch
from safetensors.torch import load_file

from specforge.data.batching import collate
from specforge.data.vocab import vocab_map_from_samples
from specforge.distributed import Distributed
from specforge.errors import UserError
from specforge.models.eagle3 import Eagle3Config, build_draft_model
from specforge.recipes.capture import capture
from specforge.recipes.train import train
from specforge.trainer.sources import OfflineShards, OnlineTarget, attach_hidden_states
from specforge.trainer.ttt import ttt_loss
from tests.helpers import tiny_train_config, torchrun_train


def offline_config(folder, data, out, *extra):
    return tiny_train_config(
        folder, data, out, "capture.dtype=float32", "capture.shard_size_mb=0.05", *extra
    )


def draft_for(source, seed=0):
    """A draft over a 64-token vocabulary built from the source's samples."""
    head = source.head
    vocab_map, _ = vocab_map_from_samples(
        source.samples, vocab_size=head.config.vocab_size, draft_vocab_size=64, end_of_turn=[]
    )
    config = Eagle3Config.from_target(head.config, draft_vocab_size=64)
    return build_draft_model(
        config,
        target_embedding=head.embed_tokens.float(),
        target_lm_head=head.lm_head.float(),
        d2t=vocab_map.d2t,
        t2d=vocab_map.t2d,
        target_norm=head.norm.float(),
        seed=seed,
    )


def test_online_and_offline_give_the_same_loss_and_gradients(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    cfg = offline_config(folder, data, tmp_path / "run")
    capture(cfg)
    online = OnlineTarget(cfg, Distributed(), "cpu")
    offline = OfflineShards(cfg, Distributed(), "cpu")
    assert online.aux_layer_ids == offline.aux_layer_ids
    by_id = {s.id: s for s in offline.samples}
    samples = [by_id[s.id] for s in online.samples[:3]]  # a padded batch of 3
    for a, b in zip(online.samples[:3], samples, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    batch = collate(samples, offline.pad_id)
    offline_batch = attach_hidden_states(collate(samples, offline.pad_id), samples, offline.store)

    results, grads = [], []
    for source, b in ((online, batch), (offline, offline_batch)):
        draft = draft_for(source)
        aux, target_dist = source.states(b, draft)
        result = ttt_loss(
            draft,
            input_ids=b.input_ids,
            attention_mask=b.attention_mask,
            loss_mask=b.loss_mask,
            aux_hidden_states=aux,
            target_dist=target_dist,
            ttt_length=3,
        )
        result.loss.backward()
        results.append(result)
        grads.append({n: p.grad for n, p in draft.named_parameters() if p.requires_grad})
    on, off = results
    torch.testing.assert_close(off.loss, on.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(off.step_losses), torch.stack(on.step_losses))
    assert [int(c) for c in off.step_correct] == [int(c) for c in on.step_correct]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6)


def test_offline_training_matches_online_training(tmp_path, peaked_target_dir, caplog):
    """Also with ``train.state_cache_gb`` set, which offline training does not use (and says)."""
    folder, data = peaked_target_dir
    steps = ["train.max_steps=6", "train.eval_every=3", "train.save_every=3"]
    online = train(tiny_train_config(folder, data, tmp_path / "online", *steps))
    cfg = offline_config(
        folder, data, tmp_path / "offline", "data.mode=offline", "train.state_cache_gb=1", *steps
    )
    capture(cfg)
    offline = train(cfg)
    assert "train.state_cache_gb (1.0) keeps the target's states of the online mode" in caplog.text
    assert offline.checkpoint.name == online.checkpoint.name == "step_6"
    a = load_file(online.checkpoint / "draft.safetensors")
    b = load_file(offline.checkpoint / "draft.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)
    for split in ("train", "eval"):
        for key, value in getattr(online, split).items():
            if key not in ("tokens_per_s", "seconds_per_step"):  # clock readings
                assert getattr(offline, split)[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_offline_training_refuses_a_capture_of_other_settings(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    cfg = offline_config(folder, data, tmp_path / "run", "data.mode=offline")
    capture(cfg)
    other = offline_config(
        folder, data, tmp_path / "run", "data.mode=offline", "target.aux_layer_ids=[0,2,3]"
    )
    with pytest.raises(ValueError, match=r"aux_layer_ids: captured \[1, 1, 0\], given \[0, 2, 3\]"):
        train(other)
    missing = offline_config(folder, data, tmp_path / "elsewhere", "data.mode=offline")
    with pytest.raises(UserError, match="rerun `specforge capture`"):
        train(missing)


@pytest.mark.integration
def test_two_process_offline_training_matches_one_process(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    capture_dir = tmp_path / "capture"
    capture(offline_config(folder, data, tmp_path / "c", f"capture.output={capture_dir}"))
    offline = ["data.mode=offline", f"capture.output={capture_dir}", "train.num_workers=1"]

    def run(nproc, out, *extra):
        return torchrun_train(nproc, out, folder, *offline, *extra)[0]

    single = run(1, tmp_path / "single", "train.grad_accumulation=2")
    ddp = run(2, tmp_path / "ddp")
    for key in single:
        torch.testing.assert_close(ddp[key], single[key], rtol=1e-5, atol=1e-6)


def test_offline_resume_reproduces_an_uninterrupted_run(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    capture_dir = f"capture.output={tmp_path / 'capture'}"
    steps = ["data.mode=offline", capture_dir, "train.max_steps=7", "train.save_every=3"]
    capture(offline_config(folder, data, tmp_path / "c", capture_dir))
    full = train(offline_config(folder, data, tmp_path / "full", *steps))
    interrupted = tmp_path / "interrupted"
    train(offline_config(folder, data, interrupted, *steps), stop_after_step=3)
    resumed = train(offline_config(folder, data, interrupted, *steps, "train.resume=true"))
    a = load_file(full.checkpoint / "draft.safetensors")
    b = load_file(resumed.checkpoint / "draft.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7)
