"""Exports: one module per target, each a pure function Strategy (+ profile) -> text.

``deepspeed`` (ds_config.json), ``launch`` (launch.sh for torchrun), ``files`` (atomic writing).
The checks by each target's own loader live in ``optplan.planner.validate``. Nothing heavy is
imported here: deepspeed is imported only by the validator, when it runs.
"""
