"""The shipped recipes (YAML), readable from an installed package; ``configs/`` in a checkout
links here."""
