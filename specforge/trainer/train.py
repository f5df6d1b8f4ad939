"""EAGLE-3 training: the TTT loss trains the draft on the target's hidden states, which come
from the frozen target running inside each step (online) or from a capture on disk
(``data.mode: offline``; :mod:`specforge.trainer.sources`). Launch with ``torchrun
--nproc_per_node=N scripts/train_eagle3.py --config ...`` (DDP on gloo for CPU, nccl for CUDA;
add ``--nnodes`` for several machines) or ``specforge train --config ...``.

The recipe reads top to bottom: setup (distributed, hidden-state source, data, vocab map, draft,
optimizer, resume), then one loop in a fixed order: lr, micro-batches (target states, TTT loss,
backward), clip, step, log, eval, checkpoint.

Scaling out: the draft is replicated with DDP; ``train.zero_optimizer`` shards its AdamW state
(ZeRO-1); in online mode ``train.target_sharding: fsdp`` shards the frozen target's decoder
layers with FSDP2.

Predicted accept length (eval): with ``c_k`` the conditional accuracy of draft step ``k`` given
that steps ``0..k-1`` at the same position were all right (``step_chain_correct[k] /
step_prev_correct[k]``), a chain draft of ``K = ttt_length`` tokens verified greedily emits on
average ``tau_pred = 1 + sum_{k<K} prod_{j<=k} c_j`` tokens per target forward (the bonus token
counted), teacher-forced tokens assumed. The export/benchmark stage measures the real ``tau``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from tqdm import tqdm

from specforge.config import SpecForgeConfig, to_dict
from specforge.data.vocab import (
    end_of_turn_ids,
    save_vocab_map,
    vocab_map_from_samples,
)
from specforge.io import write_jsonl_atomic
from specforge.models.eagle3 import Eagle3Config, Eagle3DraftModel, build_draft_model
from specforge.trainer.batching import Batch, StepBatches, split_train_eval
from specforge.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from specforge.trainer.distributed import setup_distributed
from specforge.trainer.sources import hidden_state_source
from specforge.trainer.ttt import TTTResult, ttt_loss

logger = logging.getLogger(__name__)


class TTTObjective(nn.Module):
    """The draft plus its TTT loss as one module, so DDP sees the whole step in ``forward``."""

    def __init__(self, draft: Eagle3DraftModel, ttt_length: int, step_weight: float):
        super().__init__()
        self.draft = draft
        self.ttt_length = ttt_length
        self.step_weight = step_weight

    def forward(self, batch: Batch, aux_hidden_states, target) -> TTTResult:
        return ttt_loss(
            self.draft,
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            loss_mask=batch.loss_mask,
            aux_hidden_states=aux_hidden_states,
            target=target,
            ttt_length=self.ttt_length,
            step_weight=self.step_weight,
        )


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(max_steps - warmup_steps, 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def summarize(results: list[TTTResult], ttt_length: int) -> dict[str, float]:
    """Aggregate per-step counts of several TTT results (summed across ranks if distributed)."""
    fields = ("step_correct", "step_counted", "step_prev_correct", "step_chain_correct")
    counts = torch.tensor(
        [[float(sum(getattr(r, f)[k] for r in results)) for k in range(ttt_length)] for f in fields]
    )
    losses = torch.tensor([float(sum(float(r.loss) for r in results)), float(len(results))])
    if dist.is_initialized():
        dist.all_reduce(counts)
        dist.all_reduce(losses)
    correct, counted, prev, chain = counts
    metrics = {"loss": float(losses[0] / losses[1].clamp(min=1))}
    tau, survive = 1.0, 1.0
    for k in range(ttt_length):
        metrics[f"acc_{k}"] = float(correct[k] / counted[k].clamp(min=1))
        conditional = float(chain[k] / prev[k].clamp(min=1))
        metrics[f"cond_acc_{k}"] = conditional
        survive *= conditional
        tau += survive
    metrics["tau_pred"] = tau
    return metrics


class MetricsLog:
    """``metrics.jsonl`` (rank 0), plus optional TensorBoard / offline wandb."""

    def __init__(self, cfg: SpecForgeConfig, enabled: bool):
        self.enabled = enabled
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        self.writers: list[Any] = []
        if not enabled:
            return
        if cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard extra

            self.writers.append(SummaryWriter(str(Path(cfg.output_dir) / "tensorboard")))
        if cfg.train.wandb:
            import wandb  # the wandb extra

            self.wandb = wandb.init(mode="offline", dir=cfg.output_dir, config=to_dict(cfg))

    def truncate_after(self, step: int) -> None:
        """On resume: drop records past the checkpoint's step (they will be logged again)."""
        if self.enabled and self.path.exists():
            records = [json.loads(line) for line in self.path.read_text().splitlines()]
            write_jsonl_atomic(self.path, (r for r in records if r["step"] <= step))

    def log(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "split": split, **{k: round(v, 6) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        for writer in self.writers:
            for key, value in metrics.items():
                writer.add_scalar(f"{split}/{key}", value, step)
        if getattr(self, "wandb", None) is not None:
            self.wandb.log({f"{split}/{k}": v for k, v in metrics.items()}, step=step)


def train(cfg: SpecForgeConfig, *, stop_after_step: int | None = None) -> dict[str, Any]:
    """Train an EAGLE-3 draft against ``cfg.target``: online (the target runs in the step) or,
    with ``data.mode: offline``, from the hidden states ``specforge capture`` stored.

    Args:
        cfg: the recipe.
        stop_after_step: end after this many optimizer steps (a checkpoint is written there);
            the LR schedule still spans ``train.max_steps``. For time-sliced jobs and tests.

    Returns:
        The last train and eval metrics and the checkpoint path.
    """
    tc = cfg.train
    out = Path(cfg.output_dir)
    ranks = setup_distributed(cfg.target.device)
    device = ranks.device(cfg.target.device)
    torch.manual_seed(tc.seed)

    # 1. setup: target states (online or offline), data, vocab map, draft, optimizer
    source = hidden_state_source(cfg, ranks, device)
    head = source.head
    aux_layer_ids = source.aux_layer_ids
    train_samples, eval_samples = split_train_eval(source.samples, tc.eval_fraction)
    vocab_map, _ = vocab_map_from_samples(
        train_samples,
        vocab_size=head.config.vocab_size,
        draft_vocab_size=cfg.vocab.draft_vocab_size,
        end_of_turn=end_of_turn_ids(source.tokenizer, source.generation_config),
    )
    draft_config = Eagle3Config.from_target(
        head.config, draft_vocab_size=vocab_map.draft_vocab_size
    )
    draft = build_draft_model(
        draft_config,
        target_embedding=head.embed_tokens.float().cpu(),
        target_lm_head=head.lm_head.float().cpu(),
        d2t=vocab_map.d2t,
        t2d=vocab_map.t2d,
        target_norm=head.norm.float().cpu(),
        seed=tc.seed,
    ).to(device)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    # the fused AdamW kernel runs on CPU and CUDA (~4x the default's speed on this draft)
    adamw = {"lr": tc.lr, "weight_decay": tc.weight_decay, "fused": True}
    if tc.zero_optimizer and ranks.world_size > 1:
        optimizer = ZeroRedundancyOptimizer(trainable, optimizer_class=torch.optim.AdamW, **adamw)
    else:
        optimizer = torch.optim.AdamW(trainable, **adamw)
    start_step = 0
    checkpoints = out / "checkpoints"
    if tc.resume and (latest := latest_checkpoint(checkpoints)) is not None:
        start_step = load_checkpoint(latest, model=draft, optimizer=optimizer)["step"]
        logger.info("resumed from %s (step %d)", latest, start_step)
    unwrapped = TTTObjective(draft, tc.ttt_length, tc.step_weight)
    objective = unwrapped
    if ranks.world_size > 1:
        objective = nn.parallel.DistributedDataParallel(unwrapped)
    if ranks.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_vocab_map(vocab_map, out / "vocab_map.safetensors")
    batches = StepBatches(
        train_samples,
        seed=tc.seed,
        batch_size=tc.batch_size,
        max_tokens_per_batch=tc.max_tokens_per_batch,
        world_size=ranks.world_size,
        rank=ranks.rank,
        grad_accumulation=tc.grad_accumulation,
        pad_id=source.pad_id,
    )
    autocast = torch.autocast(
        device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=tc.dtype == "bfloat16"
    )
    log = MetricsLog(cfg, ranks.is_main)
    log.truncate_after(start_step)

    def evaluate() -> dict[str, float]:
        draft.eval()
        results = []
        with torch.no_grad(), autocast:
            for sample in eval_samples:
                batch = source.eval_batch(sample).to(device)
                aux, target = source.states(batch, draft)
                results.append(unwrapped(batch, aux, target))
        draft.train()
        return summarize(results, tc.ttt_length)

    def checkpoint(step: int) -> Path | None:
        path = None
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.consolidate_state_dict(to=0)  # every rank takes part
        if ranks.is_main:
            path = save_checkpoint(
                checkpoints,
                step,
                model=draft,
                optimizer=optimizer,
                draft_config=draft_config.to_dict(),
                state={"aux_layer_ids": aux_layer_ids, "config": to_dict(cfg)},
            )
        ranks.barrier()
        return path

    # 2. the loop
    end_step = min(tc.max_steps, stop_after_step or tc.max_steps)
    train_metrics: dict[str, float] = {}
    eval_metrics: dict[str, float] = {}
    if start_step == 0 and eval_samples:
        eval_metrics = evaluate()
        log.log(0, "eval", eval_metrics)
    progress = tqdm(
        range(start_step, end_step),
        initial=start_step,
        total=end_step,
        desc="train",
        disable=not ranks.is_main,
    )
    window: list[TTTResult] = []
    window_tokens, window_start = 0, time.perf_counter()
    last_checkpoint = None
    draft.train()
    step_batches = source.step_batches(batches, range(start_step, end_step))
    for step, micro_batches in zip(progress, step_batches, strict=True):
        factor = lr_factor(
            step, warmup_steps=tc.warmup_steps, max_steps=tc.max_steps, min_lr_ratio=tc.min_lr_ratio
        )
        for group in optimizer.param_groups:
            group["lr"] = tc.lr * factor
        for index, batch in enumerate(micro_batches):
            batch = batch.to(device)
            aux, target = source.states(batch, draft)
            last = index == len(micro_batches) - 1
            sync = (
                contextlib.nullcontext() if last or ranks.world_size == 1 else objective.no_sync()
            )
            with sync:
                with autocast:
                    result = objective(batch, aux, target)
                (result.loss / len(micro_batches)).backward()
            result.loss = result.loss.detach()
            window.append(result)
            window_tokens += batch.num_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, tc.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if done % tc.log_every == 0 or done == end_step:
            train_metrics = summarize(window, tc.ttt_length)
            elapsed = time.perf_counter() - window_start
            train_metrics.update(
                lr=tc.lr * factor,
                grad_norm=float(grad_norm),
                tokens_per_s=window_tokens * ranks.world_size / elapsed,
            )
            log.log(done, "train", train_metrics)
            progress.set_postfix(
                {
                    k: f"{v:.3f}"
                    for k, v in train_metrics.items()
                    if k == "loss" or k.startswith("acc_")
                }
            )
            window, window_tokens, window_start = [], 0, time.perf_counter()
        if eval_samples and (done % tc.eval_every == 0 or done == end_step):
            eval_metrics = evaluate()
            log.log(done, "eval", eval_metrics)
        if done % tc.save_every == 0 or done == end_step:
            last_checkpoint = checkpoint(done)
    progress.close()
    return {"train": train_metrics, "eval": eval_metrics, "checkpoint": last_checkpoint}
