"""Exports: one module per target, each a pure function ExportPlan -> text plus a validator.

``context`` (ExportPlan, file names), ``deepspeed`` (ds_config.json; validated in ``optplan.planner.validate``),
``accelerate`` (accelerate.yaml), ``launch`` (launch.sh for torchrun or the deepspeed launcher, hostfile),
``slurm`` (slurm.sbatch), ``megatron`` (Megatron-LM pretrain_gpt.py arguments), ``hf``
(hf_training_args.json), ``lightning`` (lightning.json), ``report`` (plan.json, PLAN.md), ``registry``
(``--to`` name -> builder), ``files`` (atomic, all-or-nothing writing). Nothing heavy is imported here:
deepspeed, accelerate, transformers and lightning are imported only by the validators, when they run.
"""
