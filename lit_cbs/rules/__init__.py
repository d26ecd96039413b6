"""Pure rules, no Lightning: functions of the amount trained, of a batch ratio, or of a series of losses.

- ``batch_schedules``: the global batch (samples) as a function of samples or tokens consumed.
- ``lr_schedules``: the learning rate as a function of tokens seen.
- ``scaling``: how the LR, the gradient-clip norm and other optimizer settings move when the batch
  changes by a ratio (``ScalingRule.factor``; ``LRRule`` for the LR).
- ``guard``: ``BatchGuard``, the rule that undoes a batch increase the training loss did not take
  (its settings a ``GuardConfig``).
- ``smoothing``: ``ema``, the exponential moving average the probe scores branches by and the analysis
  smooths loss curves with.
"""

__all__: list[str] = []  # a namespace: each module says what it offers (its own __all__)
