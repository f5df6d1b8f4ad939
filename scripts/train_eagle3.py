"""Train an EAGLE-3 draft with training-time test.

torchrun --nproc_per_node=1 scripts/train_eagle3.py --config configs/smollm2-135m-eagle3.yaml
"""

import sys

from specforge.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
