"""What only the Hydra recipes (``recipes/train.py``) need.

- ``plan``: the run worked out before it starts: steps, memory per device, probe cost, wall time.
- ``resolvers``: the OmegaConf resolvers ``conf/`` uses and ``register_resolvers()``.
- ``run_report``: the batch history, plots and summary a run leaves in its folder.
- ``report``: one self-contained HTML page per run (``python -m lit_cbs.recipes.report RUN_DIR``).
"""
