"""specrt's benchmark harness (``specrt.bench``): the benches that measure specrt against
what a user would run instead, the serving load runs, and what they share.

Run one with ``python -m specrt.bench.NAME --help``; ``python -m specrt.bench`` lists them.
Nothing in the product imports this package: it sits above :mod:`specrt.cli` and imports
the product like any user would. The workers in :mod:`specrt.bench.workers` run in other
virtualenvs and import nothing of specrt's harness.
"""
