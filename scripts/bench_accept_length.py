"""Accept length and speedup of an exported draft on MT-Bench (or any question set).

    python scripts/bench_accept_length.py --target smollm2-135m --draft EXPORT_DIR \
        --questions question.jsonl --num-steps 5 --topk 1 --max-new-tokens 128 --output OUT_DIR
"""

import sys

from specforge.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
