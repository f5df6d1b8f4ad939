from specforge.config import load_config


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
