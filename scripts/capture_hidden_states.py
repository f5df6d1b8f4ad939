"""Capture the target's hidden states for offline training (sharded safetensors + manifest).

    torchrun --nproc_per_node=N scripts/capture_hidden_states.py \
        --config configs/smollm2-135m-eagle3.yaml
"""

import sys

from specforge.cli import main

if __name__ == "__main__":
    sys.exit(main(["capture", *sys.argv[1:]]))
