"""What only the Hydra recipes (``recipes/train.py``) need.

- ``plan``: the run worked out before it starts: steps, memory per device, probe cost, wall time.
- ``resolvers``: the OmegaConf resolvers ``conf/`` uses and ``register_resolvers()``.
- ``job``: each config group built under the Hydra key that sets it, so an error names that key; loggers;
  the job's exit.
- ``run_report``: the summary, batch history and plots a run leaves in its folder, and the line it starts with.
- ``report``: one self-contained HTML page per run (``python -m lit_cbs.run.report RUN_DIR``).
"""

__all__: list[str] = []  # a namespace: each module says what it offers (its own __all__)
