"""Print the README's test command (the one line of its bash blocks that ends in ``pytest``),
split at its last ``&&``: the install part, then the test part, one per line. ``.ci/run`` runs
them as written, so CI installs and tests the way the README tells a user to."""

import re
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_command(text: str) -> tuple[str, str]:
    """``(install, test)`` of the README's test command.

    Raises:
        SystemExit: the README has no such line, or more than one.
    """
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    found = [line for line in lines if line.rstrip().endswith("&& pytest")]
    if len(found) != 1:
        sys.exit(f"README.md: expected one test command ending in '&& pytest', found {found}")
    install, _, test = found[0].rpartition("&&")
    return install.strip(), test.strip()


if __name__ == "__main__":
    print("\n".join(test_command(README.read_text())))
