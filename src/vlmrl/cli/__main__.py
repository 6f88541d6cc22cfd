"""`python -m vlmrl.cli ...`: the same as the `vlmrl` console script (used by accelerate launches)."""

from vlmrl.cli.app import app

app()
