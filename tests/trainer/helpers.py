import os
import subprocess
import sys
from pathlib import Path

from specforge.config import load_config

REPO = Path(__file__).parents[2]


def tiny_train_config(folder, data, output_dir, *extra):
    return load_config(
        None,
        [
            f"target.name_or_path={folder}",
            "target.dtype=float32",
            f"train.data_path={data}",
            f"output_dir={output_dir}",
            "train.dtype=float32",
            "train.lr=3e-3",
            "train.warmup_steps=3",
            "vocab.draft_vocab_size=64",
            "train.eval_fraction=0.2",
            "train.log_every=1",
            "train.ttt_length=3",
            *extra,
        ],
    )


def torchrun_train(nproc: int, out, folder, *extra: str):
    """Four steps of ``scripts/train_eagle3.py`` on the tiny target under torchrun; returns the
    step-4 draft weights and the ranks' stderr."""
    from safetensors.torch import load_file

    common = [
        f"output_dir={out}",
        f"target.name_or_path={folder}",
        "target.dtype=float32",
        "train.dtype=float32",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "vocab.draft_vocab_size=64",
        "train.eval_fraction=0.2",
        "train.ttt_length=3",
        "train.max_steps=4",
        "train.eval_every=100",
    ]
    done = torchrun(nproc, "scripts/train_eagle3.py", *common, *extra)
    return load_file(Path(out) / "checkpoints" / "step_4" / "draft.safetensors"), done.stderr


def torchrun(nproc: int, script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` under ``torchrun --standalone`` with ``nproc`` gloo ranks (1 thread each)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",
        script,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return done
