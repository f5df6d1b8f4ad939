"""Export a training checkpoint for SGLang / vLLM.

    python scripts/export_draft.py outputs/smollm2-135m-eagle3/checkpoints/step_1500 \
        outputs/smollm2-135m-eagle3/export
"""

import sys

from specforge.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
