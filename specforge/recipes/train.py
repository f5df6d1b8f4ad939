"""The ``train`` recipe: EAGLE-3 training with training-time test. The draft learns from the
frozen target's hidden states, which come from the target running inside each step (online) or
from a capture on disk (``data.mode: offline``; :mod:`specforge.trainer.sources`).

Launch with ``torchrun --nproc_per_node=N scripts/train_eagle3.py --config ...`` (DDP on gloo for
CPU, nccl with gloo beside it for CUDA; add ``--nnodes`` for several machines) or
``specforge train --config ...``. The draft is replicated with DDP; ``train.zero_optimizer``
shards its AdamW state (ZeRO-1); in online mode ``train.target_sharding: fsdp`` shards the
frozen target's decoder layers (FSDP2).

It reads top to bottom: :func:`setup` (distributed, hidden-state source, data, vocab map, draft,
optimizer, resume), then :func:`train`'s loop in a fixed order (lr, micro-batches, clip, step,
log, eval, checkpoint), once for the supervised steps and once more for the on-policy phase
(``train.on_policy``: the loss on the current draft's replayed chain rounds,
:mod:`specforge.trainer.ttt`), then :meth:`TrainingRun.close`, which releases what setup opened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import math
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from tqdm import tqdm

from specforge.config import SpecForgeConfig, to_dict
from specforge.data.batching import StepBatches, split_train_eval
from specforge.data.chat import TokenizedSample
from specforge.data.vocab import save_vocab_map
from specforge.distributed import Distributed, setup_distributed
from specforge.errors import Interrupted, UserError
from specforge.families import family
from specforge.families.base import DraftFamily
from specforge.families.dispatch import pretrained_draft
from specforge.models.eagle3 import FROZEN_WEIGHTS
from specforge.recipes.stage import start_stage
from specforge.trainer.checkpoint import (
    checkpoint_steps,
    latest_sound_checkpoint,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
)
from specforge.trainer.metrics import MetricsLog
from specforge.trainer.optim import apply_lr, build_optimizer, set_lr
from specforge.trainer.sources import (
    HiddenStateSource,
    hidden_state_source,
    load_training_samples,
)
from specforge.trainer.stop import StopRequest
from specforge.trainer.ttt import TTTResult

logger = logging.getLogger(__name__)


@dataclass
class TrainClock:
    """Training's wall-clock seconds (a resumed run's included) against ``train.max_minutes``."""

    ranks: Distributed
    start_seconds: float
    """Seconds of training before this run (its checkpoint records them)."""
    budget: float
    """``train.max_minutes`` in seconds; 0: no budget."""
    started: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        """Training seconds so far on this rank."""
        return self.start_seconds + time.perf_counter() - self.started

    def spent(self) -> float:
        """The share of the budget spent (0 without one), agreed by the ranks so that they
        stop at the same step."""
        return self.ranks.agreed_max(self.elapsed()) / self.budget if self.budget else 0.0


@dataclass
class TrainResult:
    """What a training run ended with."""

    train: dict[str, float] = field(default_factory=dict)
    """The last logged training metrics (loss, ``acc_k``, lr, grad norm, tokens/s)."""
    eval: dict[str, float] = field(default_factory=dict)
    """The last evaluation on the held-out conversations (with ``tau_pred``)."""
    eval_data: dict[str, float] = field(default_factory=dict)
    """The last evaluation on ``train.eval_data_path``'s conversations, if given."""
    checkpoint: Path | None = None
    """The last checkpoint written (rank 0; ``None`` on other ranks)."""


@dataclass
class TrainingRun:
    """Everything :func:`setup` builds for the loop."""

    cfg: SpecForgeConfig
    ranks: Distributed
    device: str
    source: HiddenStateSource
    family: DraftFamily
    """``draft.type``'s family: what builds the draft, its objective and its metrics."""
    draft: nn.Module
    draft_config: object
    """The draft's geometry (its ``to_dict`` goes into every checkpoint)."""
    objective: nn.Module
    """The family's objective (the draft and its loss), wrapped in DDP when there are
    several ranks."""
    vocabulary: object
    """What the source reads of the draft's vocabulary (``hot_ids``, ``t2d``), as the family
    says."""
    optimizer: torch.optim.Optimizer
    batches: StepBatches
    eval_samples: list[TokenizedSample]
    eval_data_samples: list[TokenizedSample]
    """``train.eval_data_path``'s conversations (none without it)."""
    log: MetricsLog
    start_step: int
    start_seconds: float
    """Training wall-clock seconds before this run (a resumed run's checkpoint records them)."""
    identity: dict
    """What a checkpoint must match to be resumed: the data digest, the draft geometry."""
    on_policy_from: int | None = None
    """The step the on-policy phase started at, when the resumed checkpoint is of that phase."""
    on_policy_seconds: float = 0.0
    """The on-policy phase's wall-clock seconds before this run."""
    nonfinite_steps: int = 0
    """Steps skipped for a non-finite loss or gradient norm."""
    stop: StopRequest = field(default_factory=StopRequest)
    """A SIGINT or SIGTERM received while the steps run (:mod:`specforge.trainer.stop`)."""

    @property
    def unwrapped(self) -> nn.Module:
        return getattr(self.objective, "module", self.objective)

    def metrics(self, results: list) -> dict[str, float]:
        """Loss, per-position accuracy and ``tau_pred`` over several steps' results."""
        return self.family.metrics(results)

    def autocast(self):
        assert self.cfg.train.dtype != "auto", "train() resolves train.dtype when it starts"
        enabled = self.cfg.train.dtype == "bfloat16"
        device_type = torch.device(self.device).type
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=enabled)

    def close(self) -> None:
        """Close the metric writers and leave the process group this run joined. DDP's
        reducer holds the process group: it goes first, so that the group is torn down inside
        ``destroy_process_group`` (freed later, when the run was garbage-collected after the
        other rank had exited, gloo's destructor once waited for its worker threads forever)."""
        self.log.close()
        if self.objective is not self.unwrapped:
            self.objective = self.unwrapped
            gc.collect()  # the DDP module sits in reference cycles (its hooks)
        self.ranks.close()


def with_steps_known(cfg: SpecForgeConfig, steps_per_epoch: int) -> SpecForgeConfig:
    """``cfg`` with ``train.epochs`` and ``train.warmup_ratio`` turned into steps, now that one
    pass's optimizer steps are known (logged; the checkpoints record the steps)."""
    tc = cfg.train
    steps, warmup = tc.max_steps, tc.warmup_steps
    if tc.epochs is not None:
        steps = max(1, math.ceil(tc.epochs * steps_per_epoch))
        logger.info("train.epochs %g: %d steps (%d a pass)", tc.epochs, steps, steps_per_epoch)
    if tc.warmup_ratio is not None:
        warmup = round(tc.warmup_ratio * steps)
        logger.info("train.warmup_ratio %g: %d warmup steps", tc.warmup_ratio, warmup)
    return dataclasses.replace(
        cfg, train=dataclasses.replace(tc, max_steps=steps, warmup_steps=warmup)
    )


def split_samples(cfg: SpecForgeConfig, source: HiddenStateSource):
    """The training samples, the held-out ones, and ``train.eval_data_path``'s (or none)."""
    train_samples, eval_samples = split_train_eval(source.samples, cfg.train.eval_fraction)
    path = cfg.train.eval_data_path
    eval_data = load_training_samples(cfg, source.tokenizer, path) if path else []
    return train_samples, eval_samples, eval_data


def setup(cfg: SpecForgeConfig) -> TrainingRun:
    """Distributed setup, the hidden-state source and data, the vocab map, the draft, its
    optimizer, and the resume state."""
    tc = cfg.train
    draft_family = family(cfg.draft.type)
    ranks = setup_distributed(cfg.target.device)
    device = ranks.device(cfg.target.device)
    torch.manual_seed(tc.seed)
    # 1. hidden states and data
    source = hidden_state_source(cfg, ranks, device)
    train_samples, eval_samples, eval_data = split_samples(cfg, source)
    # 2. the draft (and its vocabulary map, where the family has one), from the target or
    # from a draft on disk (train.from_pretrained)
    start = pretrained_draft if tc.from_pretrained else draft_family.build
    draft, draft_config, vocab_map = start(cfg, source, train_samples, device)
    vocabulary = draft_family.vocabulary(cfg, draft, draft_config, device)
    # 3. optimizer, resume, and the objective DDP wraps
    optimizer = build_optimizer(
        [p for p in draft.parameters() if p.requires_grad], tc, ranks.world_size
    )
    out = Path(cfg.output_dir)
    run_identity = {
        "data_sha256": samples_sha256(train_samples),
        "draft": draft_config.to_dict(),
        "frozen": frozen_parameters(draft),
    }
    resumed = resume(cfg, draft, optimizer, run_identity)
    objective: nn.Module = draft_family.objective(cfg, draft)
    if ranks.world_size > 1:
        objective = nn.parallel.DistributedDataParallel(objective)
    if ranks.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if vocab_map is not None:
            save_vocab_map(vocab_map, out / "vocab_map.safetensors")
    batches = StepBatches.from_config(
        train_samples, tc, world_size=ranks.world_size, rank=ranks.rank, pad_id=source.pad_id
    )
    cfg = with_steps_known(cfg, batches.steps_per_epoch)
    log = MetricsLog(cfg, ranks.is_main)
    log.start_at(resumed.step)
    return TrainingRun(
        cfg=cfg,
        ranks=ranks,
        device=device,
        source=source,
        family=draft_family,
        draft=draft,
        draft_config=draft_config,
        objective=objective,
        vocabulary=vocabulary,
        optimizer=optimizer,
        batches=batches,
        eval_samples=eval_samples,
        eval_data_samples=eval_data,
        log=log,
        start_step=resumed.step,
        start_seconds=resumed.train_seconds,
        identity=run_identity,
        on_policy_from=resumed.on_policy_from,
        on_policy_seconds=resumed.on_policy_seconds,
    )


def frozen_parameters(draft: nn.Module) -> list[str]:
    """The names of ``draft``'s weights that training leaves as they are."""
    return sorted(name for name, p in draft.named_parameters() if not p.requires_grad)


def samples_sha256(samples: list[TokenizedSample]) -> str:
    """A digest of the training samples (ids, tokens and loss masks): a resumed run must train
    on exactly the data its checkpoint was trained on."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(sample.id.encode() + b"\0")
        digest.update(sample.input_ids.numpy().tobytes() + sample.loss_mask.numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Resumed:
    """Where a run starts: step 0, or the newest intact checkpoint's step and clocks."""

    step: int = 0
    train_seconds: float = 0.0
    """Seconds of supervised training before it."""
    on_policy_from: int | None = None
    """The step the on-policy phase started at, for a checkpoint of that phase."""
    on_policy_seconds: float = 0.0


def resume(cfg: SpecForgeConfig, draft, optimizer, identity: dict) -> Resumed:
    """Where to start: step 0 for a fresh run, else the newest intact checkpoint's step and
    clocks (its weights, optimizer and RNG state loaded).

    Raises:
        UserError: a fresh run into a folder that holds checkpoints, no intact checkpoint to
            resume, or a checkpoint of other data or another draft geometry.
    """
    folder = Path(cfg.output_dir) / "checkpoints"
    for leftover in folder.glob(".step_*-*"):  # temp folders of a save that was killed
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    steps = checkpoint_steps(folder)
    if not steps:
        if cfg.train.resume:
            logger.warning("train.resume: %s holds no checkpoint: training from step 0", folder)
        return Resumed()
    if not cfg.train.resume:
        raise UserError(
            f"{folder} holds checkpoints of an earlier run (newest {steps[0][1].name}): pass "
            "--resume (train.resume=true) to continue it, or choose a new output_dir"
        )
    checkpoint = latest_sound_checkpoint(folder)
    if checkpoint is None:
        raise UserError(f"{folder}: no checkpoint is intact, nothing to resume from")
    saved = read_trainer_state(checkpoint).get("run", {})
    saved.setdefault("frozen", list(FROZEN_WEIGHTS))  # written before train.freeze_lm_head
    for key, what in (
        ("data_sha256", "the training data"),
        ("draft", "the draft geometry"),
        ("frozen", "the set of frozen weights (train.freeze_lm_head)"),
    ):
        if saved.get(key) != identity[key]:
            raise UserError(
                f"cannot resume {checkpoint}: {what} differs from the run that wrote it "
                "(use a new output_dir for the new run)"
            )
    state = load_checkpoint(checkpoint, model=draft, optimizer=optimizer)
    logger.info("resumed from %s (step %d)", checkpoint, state["step"])
    return Resumed(
        state["step"],
        float(state.get("train_seconds", 0.0)),
        state.get("on_policy_from"),
        float(state.get("on_policy_seconds", 0.0)),
    )


def evaluate(run: TrainingRun, samples: list[TokenizedSample] | None = None) -> dict[str, float]:
    """TTT metrics (with ``tau_pred``) on ``samples`` (by default the held-out ones), one
    sample per forward."""
    run.unwrapped.eval()
    results = []
    with torch.no_grad(), run.autocast():
        for sample in run.eval_samples if samples is None else samples:
            batch = run.source.eval_batch(sample).to(run.device)
            aux, target_dist = run.source.states(batch, run.vocabulary)
            results.append(run.unwrapped(batch, aux, target_dist))
    run.unwrapped.train()
    return run.metrics(results)


def evaluate_all(run: TrainingRun, result: TrainResult, step: int) -> None:
    """Evaluate on the held-out split and on ``train.eval_data_path``, logging each."""
    if run.eval_samples:
        result.eval = evaluate(run)
        run.log.log(step, "eval", result.eval)
    if run.eval_data_samples:
        result.eval_data = evaluate(run, run.eval_data_samples)
        run.log.log(step, "eval_data", result.eval_data)


def save(run: TrainingRun, step: int, clocks: dict[str, float | int]) -> Path | None:
    """Write checkpoint ``step`` with the phases' ``clocks`` (``train_seconds``, and in the
    on-policy phase ``on_policy_from`` / ``on_policy_seconds``) (rank 0; every rank takes part
    in consolidating ZeRO state)."""
    path = None
    if isinstance(run.optimizer, ZeroRedundancyOptimizer):
        run.optimizer.consolidate_state_dict(to=0)
    if run.ranks.is_main:
        path = save_checkpoint(
            Path(run.cfg.output_dir) / "checkpoints",
            step,
            model=run.draft,
            optimizer=run.optimizer,
            draft_config=run.draft_config.to_dict(),
            state={
                "aux_layer_ids": run.source.aux_layer_ids,
                "draft_type": run.family.name,
                "config": to_dict(run.cfg),
                "run": run.identity,
                **{k: round(v, 3) if isinstance(v, float) else v for k, v in clocks.items()},
            },
        )
    run.ranks.barrier()
    return path


def checkpoint(run: TrainingRun, result: TrainResult, step: int, clocks: dict, due: bool) -> None:
    """Write checkpoint ``step`` when it is ``due``, or when a SIGINT or SIGTERM arrived on any
    rank (:mod:`specforge.trainer.stop`); after a signal, stop.

    Raises:
        Interrupted: a signal arrived; the message names the checkpoint and how to resume.
    """
    stopped = int(run.ranks.agreed_max(run.stop.signum))
    if due or stopped:
        result.checkpoint = save(run, step, clocks)
    if stopped:
        # the quickstart resumes by itself: the same command, nothing added
        how = "" if run.cfg.train.resume else " with --resume (train.resume=true)"
        raise Interrupted(
            f"stopped by {signal.Signals(stopped).name} after step {step}, checkpoint "
            f"{result.checkpoint}: run the same command{how} to continue from it",
            stopped,
        )


def accumulate(
    run: TrainingRun, micro_batches, on_policy: bool = False
) -> tuple[list[TTTResult], int]:
    """Forward and backward over one optimizer step's micro-batches (gradients summed, DDP
    synchronising on the last); returns their results and real-token count."""
    results, tokens = [], 0
    extra = {"on_policy": True} if on_policy else {}
    for index, batch in enumerate(micro_batches):
        batch = batch.to(run.device)
        aux, target_dist = run.source.states(batch, run.vocabulary)
        last = index == len(micro_batches) - 1
        no_sync = not last and run.ranks.world_size > 1
        with run.objective.no_sync() if no_sync else contextlib.nullcontext():
            with run.autocast():
                result = run.objective(batch, aux, target_dist, **extra)
            (result.loss / len(micro_batches)).backward()
        result.loss = result.loss.detach()
        results.append(result)
        tokens += batch.num_tokens
    return results, tokens


def check_finite(run: TrainingRun, step: int, results, grad_norm, micro_batches) -> bool:
    """Whether the step's loss and gradient norm are finite. A non-finite step is skipped;
    more than ``train.max_nonfinite_steps`` of them stop the run.

    Raises:
        UserError: naming the step and the samples of its batches.
    """
    finite = bool(torch.isfinite(grad_norm)) and all(bool(torch.isfinite(r.loss)) for r in results)
    if finite:
        return True
    run.nonfinite_steps += 1
    ids = [i for batch in micro_batches for i in batch.sample_ids]
    logger.warning("step %d: non-finite loss or gradient norm (samples %s): skipped", step, ids)
    if run.nonfinite_steps > run.cfg.train.max_nonfinite_steps:
        raise UserError(
            f"step {step}: the loss or gradient norm is not finite (samples {', '.join(ids)}); "
            f"{run.nonfinite_steps} such steps, train.max_nonfinite_steps is "
            f"{run.cfg.train.max_nonfinite_steps}. Check the data (and the capture: "
            "`specforge capture --verify`) or lower train.lr"
        )
    return False


@dataclass
class Phase:
    """One stretch of :func:`_loop`: the supervised steps, or the on-policy phase after them
    (``train.on_policy``)."""

    name: str
    """``train`` or ``on_policy`` (the metrics' split)."""
    first: int
    """The step it starts at."""
    end: int
    """The step it ends at, at the latest."""
    budget_minutes: float | None
    start_seconds: float
    """Its seconds before this run (a resumed run's)."""
    lr: Callable[[int, float], float]
    """The learning rate of a step, given the share of the budget spent."""
    on_policy_from: int | None = None
    """The on-policy phase's first step (checkpoints record it); ``None`` when supervised."""

    def clocks(self, run: TrainingRun, seconds: float) -> dict[str, float | int]:
        """What a checkpoint of this phase records of the clocks, ``seconds`` into it."""
        if self.on_policy_from is None:
            return {"train_seconds": seconds}
        return {
            "train_seconds": run.start_seconds,
            "on_policy_from": self.on_policy_from,
            "on_policy_seconds": seconds,
        }


def train(cfg: SpecForgeConfig, *, stop_after_step: int | None = None) -> TrainResult:
    """Train a draft as ``cfg`` describes (see the module docstring): the supervised steps,
    then ``train.on_policy.steps`` on-policy ones.

    Args:
        cfg: the recipe.
        stop_after_step: end after this many optimizer steps, both phases counted (a
            checkpoint is written there); the LR schedule still spans ``train.max_steps``. For
            time-sliced jobs and tests.

    Returns:
        The last train and eval metrics and the last checkpoint.
    """
    run = setup(start_stage(cfg))
    cfg, tc = run.cfg, run.cfg.train  # train.epochs and train.warmup_ratio now in steps
    stop = stop_after_step or tc.max_steps + tc.on_policy.steps
    if run.start_step >= stop:
        logger.warning(
            "the resumed checkpoint is at step %d, past the %d steps this run asks for "
            "(train.max_steps + train.on_policy.steps): nothing to train; raise train.max_steps "
            "to continue it",
            run.start_step,
            stop,
        )
    try:
        with run.stop:
            result, done, finished = TrainResult(), run.start_step, True
            if run.on_policy_from is None:  # not resumed inside the on-policy phase
                supervised = Phase(
                    "train",
                    run.start_step,
                    min(tc.max_steps, stop),
                    tc.max_minutes,
                    run.start_seconds,
                    lambda step, spent: set_lr(run.optimizer, tc, step, spent),
                )
                result, done, out_of_time = _loop(run, supervised, result)
                finished = out_of_time or done >= tc.max_steps
            if finished and tc.on_policy.steps and done < stop:
                first = run.on_policy_from if run.on_policy_from is not None else done
                phase = Phase(
                    "on_policy",
                    done,
                    min(first + tc.on_policy.steps, stop),
                    tc.on_policy.max_minutes,
                    run.on_policy_seconds if run.on_policy_from is not None else 0.0,
                    lambda step, spent: apply_lr(run.optimizer, on_policy_lr(tc)),
                    on_policy_from=first,
                )
                result, _, _ = _loop(run, phase, result)
            return result
    finally:
        cache = getattr(run.source, "cache", None)
        if cache is not None:
            logger.info(
                "train.state_cache_gb: %d conversations kept (%.2f GiB); %d batches from them, "
                "%d through the target",
                len(cache),
                cache.used_bytes / 2**30,
                cache.hits,
                cache.misses,
            )
        run.close()


def on_policy_lr(tc) -> float:
    """The on-policy phase's constant learning rate (``train.on_policy.lr``)."""
    return tc.on_policy.lr if tc.on_policy.lr is not None else tc.lr * tc.min_lr_ratio


def window_metrics(run: TrainingRun, window, tokens: int, start: float, lr, grad_norm) -> dict:
    """The metrics of the steps since the last log (``window``: their results, ``tokens``
    trained on this rank since ``start``), with the last step's learning rate and gradient
    norm and the window's throughput."""
    seconds = time.perf_counter() - start
    steps = len(window) // run.cfg.train.grad_accumulation
    return run.metrics(window) | {
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": tokens * run.ranks.world_size / seconds,
        "tokens_per_step": tokens * run.ranks.world_size / steps,
        "seconds_per_step": seconds / steps,
    }


def _loop(run: TrainingRun, phase: Phase, result: TrainResult) -> tuple[TrainResult, int, bool]:
    """Run ``phase``'s steps; returns the result, the steps done and whether its budget ended
    it."""
    tc = run.cfg.train
    budget = 60 * phase.budget_minutes if phase.budget_minutes else 0
    clock = TrainClock(run.ranks, phase.start_seconds, budget)
    on_policy = phase.on_policy_from is not None
    if clock.budget and phase.start_seconds >= clock.budget:
        logger.info("%s: its minutes were spent before step %d", phase.name, phase.first)
        return result, phase.first, True
    if phase.first == 0:
        evaluate_all(run, result, 0)
    steps = range(phase.first, phase.end)
    progress = tqdm(
        steps,
        initial=phase.first,
        total=phase.end,
        desc=phase.name,
        disable=not run.ranks.is_main,
    )
    trainable = [p for p in run.draft.parameters() if p.requires_grad]
    window: list[TTTResult] = []
    window_tokens, window_start = 0, time.perf_counter()
    run.unwrapped.train()
    step_batches = run.source.step_batches(run.batches, steps)
    spent, has_eval = clock.spent(), bool(run.eval_samples or run.eval_data_samples)
    done, out_of_time = phase.first, False
    for step, micro_batches in zip(progress, step_batches, strict=True):
        # 1. learning rate of this step
        lr = phase.lr(step, spent)
        # 2. forward and backward over the micro-batches (gradient accumulation)
        results, tokens = accumulate(run, micro_batches, on_policy)
        window += results
        window_tokens += tokens
        # 3. clip, 4. optimizer step (none after a non-finite loss or gradient)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, tc.max_grad_norm)
        if check_finite(run, step, results, grad_norm, micro_batches):
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        done = step + 1
        spent = clock.spent()
        out_of_time = spent >= 1
        last = done == phase.end or out_of_time
        logged = done % tc.log_every == 0 or last
        evaluated = has_eval and (done % tc.eval_every == 0 or last)
        saved = done % tc.save_every == 0 or last
        # 5. log
        if logged:
            result.train = window_metrics(run, window, window_tokens, window_start, lr, grad_norm)
            run.log.log(done, phase.name, result.train)
            shown = {k: v for k, v in result.train.items() if k == "loss" or k.startswith("acc_")}
            progress.set_postfix({k: f"{v:.3f}" for k, v in shown.items()})
            window, window_tokens, window_start = [], 0, time.perf_counter()
        # 6. evaluate
        if evaluated:
            evaluate_all(run, result, done)
        # 7. checkpoint (its seconds include this step's evaluation), and on a signal stop
        checkpoint(run, result, done, phase.clocks(run, clock.elapsed()), saved)
        if clock.budget and not last and logged and saved and evaluated == has_eval:
            # a periodic evaluation and save that used up the budget make this step the last
            # (another step would only evaluate and save again)
            out_of_time = clock.spent() >= 1
        if out_of_time:
            logger.info(
                "%s: its %s minutes spent: stopped after step %d of %d",
                phase.name,
                phase.budget_minutes,
                done,
                phase.end,
            )
            break
    progress.close()
    if not on_policy:
        run.start_seconds = clock.elapsed()  # the supervised seconds the next phase records
    return result, done, out_of_time
