"""Training metrics: per-step accuracies and the predicted accept length from TTT results, and
the log they go to (``metrics.jsonl`` on rank 0, plus optional TensorBoard / offline wandb).

Predicted accept length: with ``c_k`` the conditional accuracy of draft step ``k`` given that
steps ``0..k-1`` at the same position were all right (``step_chain_correct[k] /
step_prev_correct[k]``), a chain draft of ``K = ttt_length`` tokens verified greedily emits on
average ``tau_pred = 1 + sum_{k<K} prod_{j<=k} c_j`` tokens per target forward (the bonus token
counted), teacher-forced tokens assumed. ``specforge bench`` measures the real ``tau``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specforge.config import SpecForgeConfig, to_dict
from specforge.io import append_jsonl, read_jsonl, write_jsonl_atomic
from specforge.trainer.ttt import TTTResult


def ttt_metrics(results: list[TTTResult]) -> dict[str, float]:
    """Loss, ``acc_k``, ``cond_acc_k`` and ``tau_pred`` over several TTT results of one unroll
    length (summed across ranks when distributed), and ``tau_replay`` where they replayed
    chain rounds (:func:`~specforge.trainer.ttt.replay_rounds`: the accept length the runtime's
    greedy chain would have on these sequences)."""
    ttt_length = len(results[0].step_correct)
    fields = ("step_correct", "step_counted", "step_prev_correct", "step_chain_correct")
    counts = torch.tensor(
        [[float(sum(getattr(r, f)[k] for r in results)) for k in range(ttt_length)] for f in fields]
    )
    losses = torch.tensor([float(sum(float(r.loss) for r in results)), float(len(results))])
    replayed = [r.replayed for r in results if r.replayed is not None]
    rounds = torch.tensor(
        [float(sum(r.emitted for r in replayed)), float(sum(r.rounds for r in replayed))]
    )
    if dist.is_initialized():
        dist.all_reduce(counts)
        dist.all_reduce(losses)
        dist.all_reduce(rounds)
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
    if replayed:
        metrics["tau_replay"] = float(rounds[0] / rounds[1].clamp(min=1))
    return metrics


def _json_value(value: float) -> float | None:
    """A metric as JSON allows it: rounded, and ``null`` for NaN or infinity."""
    return round(value, 6) if math.isfinite(value) else None


class MetricsLog:
    """``<output_dir>/metrics.jsonl`` (rank 0), plus optional TensorBoard / offline wandb.
    :meth:`close` releases the writers."""

    def __init__(self, cfg: SpecForgeConfig, enabled: bool):
        self.enabled = enabled
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        self.writers: list[Any] = []
        self.wandb = None
        if not enabled:
            return
        if cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard extra

            self.writers.append(SummaryWriter(str(Path(cfg.output_dir) / "tensorboard")))
        if cfg.train.wandb:
            import wandb  # the wandb extra

            self.wandb = wandb.init(mode="offline", dir=cfg.output_dir, config=to_dict(cfg))

    def start_at(self, step: int) -> None:
        """Drop records a (re)started run at ``step`` will write again: those past the
        checkpoint's step, and at step 0 everything (the step-0 evaluation reruns)."""
        if self.enabled and self.path.exists():
            records = read_jsonl(self.path, repair=True)
            kept = [r for r in records if r["step"] <= step] if step > 0 else []
            write_jsonl_atomic(self.path, kept)

    def log(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        values = {k: _json_value(v) for k, v in metrics.items()}
        append_jsonl(self.path, [{"step": step, "split": split, **values}])
        for writer in self.writers:
            for key, value in metrics.items():
                writer.add_scalar(f"{split}/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"{split}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
