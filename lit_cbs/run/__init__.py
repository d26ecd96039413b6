"""What ``recipes/train.py`` needs besides the library: the job, its Hydra keys, plan=true, the report, resolvers."""

__all__: list[str] = []  # a namespace: recipes/ import its modules
