"""Prepare conversations: read, optionally self-distill with the target, print statistics.

python scripts/prepare_data.py --config configs/smollm2-135m-eagle3.yaml --regenerate
"""

import sys

from specforge.cli import main

if __name__ == "__main__":
    sys.exit(main(["prepare", *sys.argv[1:]]))
