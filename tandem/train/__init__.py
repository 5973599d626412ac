"""Training draft heads for speculative decoding (``tandem train-draft``; docs/training.md).

One concept per module: ``config`` (flags), ``data`` (the target answers prompts), ``vocab`` (the
draft vocabulary), ``batches`` (padded batches), ``attention`` (dense target attention, TTT
attention), ``target`` (the frozen target's features and distributions), ``head`` (config and
initialisation), ``ttt`` (the unroll and its loss), ``schedule``, ``validate``, ``trainer`` (the loop,
checkpoints), ``export`` (the speculators / EAGLE-1 layouts), ``evaluate`` (engine measurement),
``report`` (TRAINING.md), ``run`` (all of it in order) and ``cli``.
"""
