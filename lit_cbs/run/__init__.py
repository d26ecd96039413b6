"""What a recipe run (``python recipes/train.py +recipe=NAME``) needs besides the library: ``job`` (the
configuration built group by group, its errors named by Hydra key, the job's exit), ``plan`` (``plan=true``),
``report`` (the summary, plots and report.html a run leaves) and ``resolvers`` (those ``conf/`` uses)."""

__all__: list[str] = []  # a namespace: recipes/ import its modules
