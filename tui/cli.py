"""The ``optplan`` command line (typer). Faces only: every decision is made by optplan.planner.

Every user-fixable problem (OptplanError) prints one line on stderr and exits 2, with no traceback
unless ``--debug`` is given (tui/cli_errors.py: the exit codes and messages); the flags several commands share are
typed once in tui/cli_options.py.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from optplan.estimators.errors import OptplanError
from optplan.tui.cli_errors import (
    EXIT_INTERRUPTED,
    Terminated,
    guard,
    interrupted_code,
    on_sigterm,
    usage_error_type,
    usage_message,
)
from optplan.tui.cli_options import (
    COMPILE_HELP,
    COMPILE_LOSS_HELP,
    FSDP_REDUCE_DTYPE_HELP,
    ArchOpt,
    ClusterOpt,
    FinetuneOpt,
    GpnOpt,
    GpuOpt,
    GpusOpt,
    HfClassOpt,
    HfOpt,
    JsonOpt,
    LoraAlphaOpt,
    LoraDropoutOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    NameOpt,
    OptModelFile,
    PlanSeqOpt,
    QuantOpt,
    SeqOpt,
    out_folder,
)
from optplan.tui.microbench_view import print_microbench
from optplan.tui.recommend_args import OPTIMIZERS, PRECISIONS, REDUCE_DTYPES, RecommendArgs
from optplan.tui.recommend_args import check_choice as _check_choice
from optplan.tui.recommend_args import check_finite as _check_finite

app = typer.Typer(
    name="optplan", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Plan how to train a PyTorch model fast without running out of memory.",
)

class _State:
    debug: bool = False


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


def _stdout() -> Console:
    return Console(highlight=False)


@app.callback()
def _main(ctx: typer.Context,
          debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False) -> None:
    ctx.obj = {"debug": debug}


@app.command()
def profile(ctx: typer.Context, model: OptModelFile = None, hf: HfOpt = None, hf_class: HfClassOpt = None,
            arch: ArchOpt = None, seq_len: SeqOpt = None, model_name: NameOpt = None,
            finetune: FinetuneOpt = "full", lora_rank: LoraRankOpt = None, lora_alpha: LoraAlphaOpt = None,
            lora_targets: LoraTargetsOpt = None, lora_dropout: LoraDropoutOpt = None, as_json: JsonOpt = False) -> None:
    """Profile a model file on the meta/fake device (or an --arch shape): parameters, FLOPs, activations."""
    from optplan.planner.api import resolve_model
    from optplan.planner.finetune import FinetuneChoice
    from optplan.tui.render import profile_table

    def body() -> None:
        choice = FinetuneChoice(finetune=finetune, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets,
                                lora_dropout=lora_dropout)
        choice.check(runs_a_model=model is not None or hf is not None)
        with _stderr().status("profiling the model in a child process..."):
            prof = resolve_model(model, arch=arch, seq_len=seq_len, model_name=model_name, hf=hf, hf_class=hf_class,
                                 lora=choice.lora_request())
        if as_json:
            typer.echo(prof.model_dump_json(indent=2))
        else:
            _stdout().print(profile_table(prof))

    guard(ctx, body)


def _catalogue_table() -> Any:
    """The GPU catalogue as a table: each ``--gpu`` name, its memory and the other names it answers to."""
    from rich import box
    from rich.table import Table

    from optplan.estimators.hardware import gpu_catalogue

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("--gpu", "memory", "also accepted"):
        table.add_column(col, overflow="fold")
    for name, spec in gpu_catalogue().items():
        table.add_row(name, f"{spec.memory_bytes / 2**30:.0f} GiB", ", ".join(spec.aliases))
    return table


@app.command()
def hardware(ctx: typer.Context, as_json: JsonOpt = False,
             microbench: Annotated[bool, typer.Option("--microbench", help="also measure matmul TFLOP/s per dtype, copy bandwidth and all-reduce bus bandwidth here")] = False,
             quick: Annotated[bool, typer.Option("--quick", help="smaller microbenchmarks (seconds)")] = False) -> None:
    """Show the GPUs detected through NVML and the catalogue entries they map to."""
    from optplan.planner.api import detect_hardware

    def body() -> None:
        report = detect_hardware()
        bench = None
        if microbench:
            from optplan.probes.microbench import run_microbench
            with _stderr().status("running microbenchmarks in child processes..."):
                bench = run_microbench(device="cuda" if report.available else "cpu", quick=quick,
                                       allreduce_nproc=len(report.devices) if len(report.devices) > 1 else 0)
        if as_json:
            if bench is None:
                typer.echo(report.model_dump_json(indent=2))
            else:
                typer.echo(json.dumps({"hardware": report.model_dump(mode="json"),
                                       "microbench": bench.model_dump(mode="json")}, indent=2))
            return
        out = _stdout()
        if not report.available:
            out.print(f"{report.reason}. Commands plan for --gpu (default H100-SXM) instead, one of:")
            out.print(_catalogue_table())
        else:
            out.print(f"driver {report.driver_version}: {len(report.devices)} GPU(s)")
            for d in report.devices:
                target = d.catalogue_name or "not in the catalogue (pass --gpu to plan)"
                out.print(f"  [{d.index}] {d.name}, {d.memory_total_bytes / 2**30:.1f} GiB -> {target}")
        if bench is not None:
            print_microbench(out, bench, report)

    guard(ctx, body)


@app.command()
def estimate(
    ctx: typer.Context, model: OptModelFile = None, hf: HfOpt = None, hf_class: HfClassOpt = None, arch: ArchOpt = None,
    params: Annotated[float | None, typer.Option("--params", help="a parameter count instead of a model: model states only, e.g. 7e9")] = None,
    dp: Annotated[int | None, typer.Option("--dp", help="data-parallel degree (default: gpus / (tp*pp*cp))")] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="tensor-parallel degree (default 1)")] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="pipeline stages (default 1)")] = None,
    vpp: Annotated[int | None, typer.Option("--vpp", help="virtual stages per pipeline rank (interleaved 1F1B)")] = None,
    cp: Annotated[int | None, typer.Option("--cp", help="context-parallel degree (default 1)")] = None,
    ep: Annotated[int | None, typer.Option("--ep", help="expert-parallel degree of MoE layers, out of dp x cp (default 1; Megatron)")] = None,
    etp: Annotated[int | None, typer.Option("--etp", help="expert tensor-parallel degree: each routed expert split over etp ranks (Megatron's --expert-tensor-parallel-size; default: --tp). --etp 1 with --tp > 1 folds the expert group over the tensor-parallel ranks")] = None,
    dispatcher: Annotated[str, typer.Option("--dispatcher", help="MoE token dispatcher with --ep: alltoall (NCCL) or deepep (DeepEP, Megatron's flex dispatcher)")] = "alltoall",
    ep_overlap: Annotated[bool, typer.Option("--ep-overlap", help="Megatron's all-to-all overlap with --ep (--overlap-moe-expert-parallel-comm): one micro-batch's dispatch/combine behind another's compute")] = False,
    comm_overlap: Annotated[bool, typer.Option("--comm-overlap", help="Megatron's tensor/data-parallel overlap: --tp-comm-overlap (needs --sp), --overlap-grad-reduce, --overlap-param-gather")] = False,
    async_tp: Annotated[bool, typer.Option("--async-tp", help="torch's async tensor parallelism (torchtitan's enable_async_tensor_parallel; --engine torch with --tp inside one node, --sp and --compile): part of each forward pass's collectives hidden behind its matmuls")] = False,
    sp: Annotated[bool | None, typer.Option("--sp/--no-sp", help="sequence parallelism (default: on when tp > 1, except on the torch engine)", show_default=False)] = None,
    zero: Annotated[int | None, typer.Option("--zero", help="DeepSpeed ZeRO stage 0-3")] = None,
    fsdp: Annotated[str | None, typer.Option("--fsdp", help="torch FSDP: full, grad_op or hybrid (HSDP)")] = None,
    pp_schedule: Annotated[str, typer.Option("--pp-schedule", help="pipeline schedule with --pp: 1f1b (Megatron-LM's; interleaved with --vpp) or dualpipe (DeepSeek-V3's DualPipe: two stages per rank, forward and backward chunks paired to hide the all-to-alls; priced, not exported; --engine megatron)")] = "1f1b",
    fsdp_grad_sync: Annotated[str, typer.Option("--fsdp-grad-sync", help="when FSDP reduce-scatters gradients under --gas: micro_batch (after each, FSDP2's default) or step (once, holding them unsharded: FSDP1 no_sync, accelerate without sync_each_batch)")] = "micro_batch",
    fsdp_reduce_dtype: Annotated[str, typer.Option("--fsdp-reduce-dtype", help=FSDP_REDUCE_DTYPE_HELP)] = "auto",
    offload: Annotated[str | None, typer.Option("--offload", help="none, optimizer or params (CPU)")] = None,
    mbs: Annotated[int, typer.Option("--mbs", help="micro-batch per GPU")] = 1,
    grad_accum: Annotated[int | None, typer.Option("--gas", "--grad-accum", help="gradient-accumulation steps")] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="samples per step (derives --gas)")] = None,
    precision: Annotated[str | None, typer.Option("--precision", help="fp32, amp-bf16, amp-fp16, bf16, fp16, bf16-pure, fp8 (default: bf16, or fp16 on GPUs without bf16)")] = None,
    optimizer: Annotated[str | None, typer.Option("--optimizer", help="adamw, adamw8bit, adafactor, sgd, paged_adamw, paged_adamw8bit")] = None,
    checkpointing: Annotated[str, typer.Option("--checkpointing", help="none, selective, full, or moe (recompute the MoE layers; Megatron)")] = "none",
    checkpoint_layers: Annotated[int | None, typer.Option("--checkpoint-layers", help="with --checkpointing full: checkpoint only the first N repeated blocks of each pipeline stage, the rest keep their activations (Megatron's --recompute-method block); default every block")] = None,
    flash: Annotated[bool, typer.Option("--flash/--no-flash", help="memory-efficient attention (no s x s scores)")] = True,
    compile_: Annotated[bool, typer.Option("--compile", help=COMPILE_HELP)] = False,
    compile_loss: Annotated[bool | None, typer.Option("--compile-loss/--eager-loss", help=COMPILE_LOSS_HELP)] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="torch, deepspeed or megatron (default: torch with --fsdp, megatron with tp/pp/cp, else deepspeed)")] = None,
    offload_optimizer: Annotated[str | None, typer.Option("--offload-optimizer", help="none, cpu, nvme (DeepSpeed)")] = None,
    offload_params: Annotated[str | None, typer.Option("--offload-params", help="none, cpu, nvme (DeepSpeed ZeRO-3)")] = None,
    gpu: GpuOpt = None, gpus: GpusOpt = None, gpus_per_node: GpnOpt = None, cluster: ClusterOpt = None,
    seq_len: SeqOpt = None,
    tokens: Annotated[float | None, typer.Option("--tokens", help="token budget: adds time, GPU-hours, energy")] = None,
    price: Annotated[float | None, typer.Option("--price", help="price per GPU-hour (USD), with --tokens")] = None,
    model_name: NameOpt = None, finetune: FinetuneOpt = "full", lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None, lora_targets: LoraTargetsOpt = None, lora_dropout: LoraDropoutOpt = None,
    quant: QuantOpt = None, as_json: JsonOpt = False,
) -> None:
    """Memory (worst rank) and time breakdown of one configuration, and whether (and why) it fits."""
    from optplan.planner.api import check_search_options, estimate_strategy, resolve_cluster, resolve_model
    from optplan.planner.derive import StrategyFlags, derive_strategy, file_defaults
    from optplan.planner.finetune import FinetuneChoice
    from optplan.tui.render import estimate_table

    def body() -> None:
        choice = FinetuneChoice(finetune=finetune, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                lora_targets=lora_targets, lora_dropout=lora_dropout, quant=quant)
        choice.check(runs_a_model=model is not None or hf is not None)
        if precision is not None:
            _check_choice("--precision", precision, PRECISIONS)
        _check_choice("--checkpointing", checkpointing, ("none", "selective", "full", "moe"))
        _check_finite("params", params)
        _check_finite("tokens", tokens)
        _check_finite("price", price, allow_zero=True)
        if seq_len is not None and seq_len < 1:
            raise OptplanError(f"--seq-len must be >= 1 (got {seq_len})")
        for flag, value, choices in (("--optimizer", optimizer, OPTIMIZERS), ("--fsdp", fsdp, ("full", "grad_op", "hybrid")),
                                     ("--offload", offload, ("none", "optimizer", "params")),
                                     ("--engine", engine, ("torch", "deepspeed", "megatron")),
                                     ("--offload-optimizer", offload_optimizer, ("none", "cpu", "nvme")),
                                     ("--offload-params", offload_params, ("none", "cpu", "nvme"))):
            if value is not None:
                _check_choice(flag, value, choices)
        if zero is not None and not 0 <= zero <= 3:
            raise OptplanError(f"--zero must be 0, 1, 2 or 3 (got {zero})")
        if params is not None and (arch is not None or model is not None or hf is not None):
            raise OptplanError("give exactly one of a model FILE, --hf, --arch or --params")
        target, notes = resolve_cluster(gpu=gpu, gpus=gpus, gpus_per_node=gpus_per_node, cluster_file=cluster)
        adapter_precisions = choice.precisions(target.gpu.supports_bf16)
        chosen = precision or (adapter_precisions[0] if adapter_precisions else
                               "bf16" if target.gpu.supports_bf16 else "fp16")
        if precision is None and chosen != "bf16" and not choice.adapters:
            notes.append(f"{target.gpu.name} has no bf16 math: precision fp16 (pass --precision to choose)")
        _check_choice("--dispatcher", dispatcher, ("alltoall", "deepep"))
        _check_choice("--fsdp-grad-sync", fsdp_grad_sync, ("micro_batch", "step"))
        _check_choice("--fsdp-reduce-dtype", fsdp_reduce_dtype, REDUCE_DTYPES)
        _check_choice("--pp-schedule", pp_schedule, ("1f1b", "dualpipe"))
        flags = StrategyFlags(dp=dp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dispatcher=dispatcher, ep_overlap=ep_overlap, comm_overlap=comm_overlap,
                              async_tp=async_tp, fsdp_grad_sync=fsdp_grad_sync, fsdp_reduce_dtype=fsdp_reduce_dtype,
                              pp_schedule=pp_schedule, sp=sp, zero=zero,
                              fsdp=fsdp, offload=offload,
                              offload_optimizer=offload_optimizer, offload_params=offload_params,
                              precision=chosen, optimizer=optimizer, mbs=mbs, gas=grad_accum,
                              global_batch=global_batch, checkpointing=checkpointing,
                              checkpoint_layers=checkpoint_layers, flash=flash, compile=compile_,
                              compile_loss=compile_loss,
                              engine=engine or ("torch" if choice.adapters and not zero else None),
                              quant=choice.quant_name())
        # validated before the (slow) profile so a bad flag fails at once
        strategy = derive_strategy(flags, target, gpus_given=gpus is not None or cluster is not None)
        choice.check_strategy(strategy)
        check_search_options(target, global_batch=None, precisions=[chosen])
        if price is not None and tokens is None:
            raise OptplanError("--price needs --tokens (the token budget to price)")
        if tokens is not None and not tokens > 0:
            raise OptplanError(f"--tokens must be positive (got {tokens:g})")
        with _stderr().status("profiling the model in a child process..."):
            prof = resolve_model(model, arch=arch, seq_len=seq_len, model_name=model_name, params=params, hf=hf,
                                 hf_class=hf_class, lora=choice.lora_request())
        defaults, default_notes = file_defaults(prof, target, flags, strategy,
                                                precision_given=precision is not None or bool(choice.adapters))
        notes.extend(default_notes)
        if defaults:
            strategy = derive_strategy(flags.model_copy(update=defaults), target,
                                       gpus_given=gpus is not None or cluster is not None)
        est = estimate_strategy(prof, target, strategy, tokens=tokens, price_per_gpu_hour=price)
        if as_json:
            typer.echo(est.model_dump_json(indent=2))
            return
        out = _stdout()
        for note in notes:
            out.print(f"note: {note}", style="dim")
        out.print(estimate_table(est))

    guard(ctx, body)


@app.command()
def chinchilla(
    ctx: typer.Context,
    params: Annotated[float | None, typer.Option("--params", help="model parameters, e.g. 7e9")] = None,
    compute: Annotated[float | None, typer.Option("--compute", help="training compute budget, FLOPs")] = None,
    tokens: Annotated[float | None, typer.Option("--tokens", help="training tokens")] = None,
    fit: Annotated[str | None, typer.Option("--fit", help="hoffmann or epoch (Approach 3); default: 20 tokens/param")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Compute-optimal parameters, tokens, FLOPs and predicted loss (Chinchilla); --params with --tokens: the loss
    of that model on that many tokens."""
    from optplan.estimators.scaling import LOSS_FITS, loss_at
    from optplan.estimators.scaling import chinchilla as optimum

    def body() -> None:
        if fit is not None and fit not in LOSS_FITS:
            raise OptplanError(f"unknown --fit {fit!r}: use one of {', '.join(LOSS_FITS)}")
        for flag, value in (("params", params), ("compute", compute), ("tokens", tokens)):
            _check_finite(flag, value)
        given = params is not None and tokens is not None and compute is None
        if given:  # the loss of this model on this budget, beside the compute-optimal split of the same FLOPs
            point = loss_at(params=params, tokens=tokens, fit=fit)  # type: ignore[arg-type]
            best = optimum(flops=point.flops, fit=fit)  # type: ignore[arg-type]
        else:
            point = optimum(params=params, flops=compute, tokens=tokens, fit=fit)  # type: ignore[arg-type]
        if as_json:
            typer.echo(point.model_dump_json(indent=2))
            return
        out = _stdout()
        law = "Hoffmann's" if fit in (None, "hoffmann") else "Epoch AI's"
        if given:
            out.print(f"{point.params:.3g} parameters on {point.tokens:.3g} tokens ({point.tokens / point.params:.3g} "
                      f"tokens/parameter): {point.flops:.3g} FLOPs, predicted loss {point.loss:.3f} nats/token "
                      f"({law} L(N, D)); compute-optimal for the same FLOPs: {best.params:.3g} parameters on "
                      f"{best.tokens:.3g} tokens, loss {best.loss:.3f}")
        else:
            how = "20 tokens per parameter (Approach 1)" if fit is None else f"the {fit} fit of L(N, D) (Approach 3)"
            out.print(f"compute-optimal by {how}: {point.params:.3g} parameters, {point.tokens:.3g} tokens, "
                      f"{point.flops:.3g} FLOPs, predicted loss {point.loss:.3f} nats/token")
        for why in point.outside_fit:
            out.print(f"note: {why}", style="dim")

    guard(ctx, body)


@app.command()
def recommend(
    ctx: typer.Context, model: OptModelFile = None, hf: HfOpt = None, hf_class: HfClassOpt = None, arch: ArchOpt = None,
    params: Annotated[float | None, typer.Option("--params", help="a parameter count instead of a model: model states only, e.g. 7e9")] = None,
    gpu: GpuOpt = None, gpus: GpusOpt = None, gpus_per_node: GpnOpt = None, cluster: ClusterOpt = None,
    gpus_range: Annotated[str | None, typer.Option("--gpus-range", help="plan the GPU count too, LO:HI (e.g. 8:1024)")] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="samples per optimizer step (held fixed)")] = None,
    global_batch_tokens: Annotated[float | None, typer.Option("--global-batch-tokens", help="tokens per optimizer step (held fixed; a multiple of --seq-len)")] = None,
    seq_len: SeqOpt = None,
    precision: Annotated[list[str] | None, typer.Option("--precision", help="limit the precisions searched (repeatable; fp8, bf16-pure only when named)")] = None,
    optimizer: Annotated[list[str] | None, typer.Option("--optimizer", help="optimizers to search (repeatable; default the model's, else adamw)")] = None,
    checkpointing: Annotated[list[str] | None, typer.Option("--checkpointing", help="limit the activation checkpointing searched: none, selective, full (every block), partial (full checkpointing of the fewest first blocks of each stage that fit; searched with full), moe (repeatable; default: all that apply, partial included)")] = None,
    engine: Annotated[list[str] | None, typer.Option("--engine", help="engines to search: deepspeed, torch, megatron (repeatable; megatron is searched for --arch by default)")] = None,
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="search CPU offload plans")] = True,
    compile_: Annotated[bool, typer.Option("--compile", help=COMPILE_HELP)] = False,
    fsdp_reduce_dtype: Annotated[str, typer.Option("--fsdp-reduce-dtype", help=FSDP_REDUCE_DTYPE_HELP + "; the torch FSDP plans whose recipe takes it, not searched")] = "auto",
    objective: Annotated[str, typer.Option("--objective", help="throughput, time or cost (time and cost need --tokens)")] = "throughput",
    tokens: Annotated[float | None, typer.Option("--tokens", help="token budget to train: time, GPU-hours, cost")] = None,
    price: Annotated[float | None, typer.Option("--price", help="price per GPU-hour (USD)")] = None,
    deadline: Annotated[str | None, typer.Option("--deadline", help="train within this time (30d, 720h): with --objective time, the fewest GPUs that meet it")] = None,
    method: Annotated[str, typer.Option("--method", help="auto (enumerate up to 20,000 points, else screen the layouts), enumerate, screen, nsga2 or tpe")] = "auto",
    trials: Annotated[int | None, typer.Option("--trials", help="trials for nsga2/tpe (default min(space, 3000))")] = None,
    seed: Annotated[int, typer.Option("--seed", help="sampler seed (the search is deterministic for a seed)")] = 0,
    storage: Annotated[str | None, typer.Option("--storage", help="Optuna storage: a journal file, a .db (SQLite) file or a database URL (default: optplan-study.log under --out)")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="write plan.json, PLAN.md and the launch files here", parser=out_folder)] = None,
    launcher: Annotated[str, typer.Option("--launcher", help="launch.sh starts torchrun or the deepspeed launcher")] = "torchrun",
    force: Annotated[bool, typer.Option("--force", help="overwrite existing files in --out")] = False,
    probe: Annotated[bool | None, typer.Option("--probe/--no-probe", help="run the best candidates for a few real steps (default: on when a GPU is present)", show_default=False)] = None,
    probe_budget: Annotated[float, typer.Option("--probe-budget", help="total seconds for all probes")] = 600.0,
    probe_timeout: Annotated[float, typer.Option("--probe-timeout", help="seconds before one probe is killed")] = 300.0,
    probe_top_k: Annotated[int, typer.Option("--probe-top-k", help="how many candidates to probe")] = 4,
    probe_steps: Annotated[int, typer.Option("--probe-steps", help="timed steps per probe (after 2 warm-up steps)")] = 5,
    probe_nproc: Annotated[int | None, typer.Option("--probe-nproc", help="local processes per probe (default: local GPUs, 1 on CPU)")] = None,
    calibration: Annotated[bool, typer.Option("--calibration/--no-calibration", help="start from the calibration an earlier probe run stored for this GPU, model and torch")] = True,
    model_name: NameOpt = None, finetune: FinetuneOpt = "full", lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None, lora_targets: LoraTargetsOpt = None, lora_dropout: LoraDropoutOpt = None,
    quant: QuantOpt = None, as_json: JsonOpt = False,
) -> None:
    """Search parallel layout, engine, sharding, offload, precision, micro-batch and checkpointing; print the best plan."""
    args = RecommendArgs.model_validate({k: v for k, v in locals().items() if k in RecommendArgs.model_fields})
    from optplan.planner.api import export_plan
    from optplan.tui.recommend_run import global_batch_for, prepare_recommend, profile_for, run_recommend
    from optplan.tui.render import print_recommendation

    def body() -> None:
        prepared = prepare_recommend(args)
        with _stderr().status("profiling the model in a child process..."):
            prof = profile_for(prepared)
        global_batch_for(prepared, prof)  # a bad --global-batch-tokens fails before the search
        try:
            with _plan_progress(quiet=as_json) as on_progress:
                rec = run_recommend(prepared, prof, on_progress=on_progress)
        except KeyboardInterrupt as err:
            if prepared.storage is None:
                raise
            what = "terminated" if isinstance(err, Terminated) else "interrupted"
            raise type(err)(f"{what}: the study in {prepared.storage} resumes when you run the same "
                            "command again") from None
        written: list[Path] = []
        skipped: list[str] = []
        if out is not None and rec.fits:
            written, skipped = export_plan(rec, out, force=force, options=prepared.export_options)
        if as_json:
            doc = rec.model_dump(mode="json")
            if out is not None:  # what --out holds now, as the table's "wrote"/"not written" lines say
                doc["written"] = [str(path) for path in written]
                doc["not_written"] = list(skipped)
            typer.echo(json.dumps(doc, indent=2))
        else:
            console = _stdout()
            print_recommendation(console, rec, prof)
            for path in written:
                console.print(f"wrote {path}")
            for why in skipped:
                console.print(f"not written: {why}", style="dim")
        if out is not None and not rec.fits:
            _stderr().print("nothing written: no plan fits", style="yellow")
        if not rec.fits:
            raise typer.Exit(code=1)

    guard(ctx, body)


def _options_of(source: Callable[..., None], *, drop: tuple[str, ...]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the options of ``source`` (less ``drop``): typer reads the signature and annotations."""
    signature = inspect.signature(source, eval_str=True)
    params = [p for name, p in signature.parameters.items() if name not in drop]

    def decorate(func: Callable[..., None]) -> Callable[..., None]:
        func.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        func.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
        return func

    return decorate


@app.command()
@_options_of(recommend, drop=("as_json",))
def dashboard(ctx: typer.Context, **options: Any) -> None:
    """The same search as recommend, live in a terminal UI: overview, trials and Pareto front, the plan, exports, GPUs."""
    args = RecommendArgs.model_validate({k: v for k, v in options.items() if k in RecommendArgs.model_fields})

    def body() -> None:
        from optplan.tui.recommend_run import prepare_recommend

        prepared = prepare_recommend(args, check_out=False)  # bad options fail here, before the app starts
        from optplan.tui.app import create_app

        dashboard_app = create_app(args, prepared=prepared)
        dashboard_app.show_tracebacks = bool(ctx.obj and ctx.obj.get("debug"))
        outcome = dashboard_app.run()
        if dashboard_app.crash is not None:  # a bug: guard() says so in one line, exit 3
            raise dashboard_app.crash
        if outcome is not None and outcome.error is not None:
            raise OptplanError(outcome.error)
        if outcome is not None and outcome.storage is not None and not outcome.finished:
            _stderr().print(f"search stopped; the study in {outcome.storage} resumes when you run the same "
                            "command again", style="yellow")

    guard(ctx, body)


@contextlib.contextmanager
def _plan_progress(*, quiet: bool = False) -> Iterator[Callable[[Any], None]]:
    """A spinner while searching and a progress bar while probing (stderr); probe outcomes as lines."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = _stderr()
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True,
                        disable=quiet or not console.is_terminal)  # off a terminal rich ends with a blank line
    tasks: dict[str, Any] = {}

    def on_progress(event: Any) -> None:
        stage = event.stage
        if stage not in tasks:
            tasks[stage] = progress.add_task("searching" if stage == "search" else stage, total=event.total or None)
        progress.update(tasks[stage], completed=event.done, total=event.total or None,
                        description=(f"searching {event.message}" if stage == "search" else event.message or stage)[:70])
        if stage == "probe" and event.done and not quiet and ": " in event.message:
            progress.console.print(f"probe {event.message}", markup=False, highlight=False)

    with progress:
        tasks["search"] = progress.add_task("searching...", total=None)
        yield on_progress


@app.command("validate")
def validate_cmd(
    ctx: typer.Context,
    target: Annotated[Path, typer.Argument(help="the folder recommend --out wrote, or one of ds_config.json, launch.sh, accelerate.yaml", show_default=False)],
    model: Annotated[Path, typer.Argument(help="the model file the plan is for", show_default=False)],
    timeout: Annotated[float, typer.Option("--timeout", help="seconds before one run is killed")] = 600.0,
    steps: Annotated[int, typer.Option("--steps", help="timed steps per run (after one warm-up step)")] = 3,
    nproc: Annotated[int | None, typer.Option("--nproc", help="local processes (default: local GPUs, 1 on CPU)")] = None,
    jobs: Annotated[int, typer.Option("--jobs", help="files run at once when each runs as one process: their start-ups overlap, they take the device in turn")] = 1,
    seq_len: PlanSeqOpt = None, model_name: NameOpt = None, as_json: JsonOpt = False,
) -> None:
    """Run the exported launch configs for a few steps: started, fits, step time against the prediction (on the planned GPU)."""
    from optplan.planner.api import resolve_model
    from optplan.planner.probe_stage import local_devices
    from optplan.planner.validate_run import files_to_run, planned_seq_len, validate_exports

    def body() -> None:
        _check_finite("timeout", timeout)
        for flag, count in (("steps", steps), ("nproc", nproc), ("jobs", jobs)):
            if count is not None and count < 1:
                raise OptplanError(f"--{flag} must be >= 1 (got {count})")
        files_to_run(target)  # a bad target fails before profiling
        seq = seq_len if seq_len is not None else planned_seq_len(target)  # the plan's, not the model's default
        with _stderr().status("profiling the model in a child process..."):
            prof = resolve_model(model, arch=None, seq_len=seq, model_name=model_name, params=None)
        with _stderr().status("running the exported configs..."):
            report = validate_exports(target, prof, model_name=model_name, local=local_devices(nproc),
                                      timeout_s=timeout, timed_steps=steps, jobs=jobs)
        if as_json:
            typer.echo(json.dumps(report.model_dump(mode="json"), indent=2))
        else:
            out = _stdout()
            for run in report.runs:
                out.print(run.line(), style="green" if run.ok else "red", markup=False)
                for note in run.notes:
                    out.print(f"  note: {note}", style="dim", markup=False)
        if not report.ok:
            raise typer.Exit(code=1)

    guard(ctx, body)


@app.command("calibrate")
def calibrate_cmd(
    ctx: typer.Context,
    results: Annotated[list[Path], typer.Argument(help="measurements.json files written by an exported train.py, or results files (fidelity.json, grid.json) written by benchmarks/gpu_campaign.py", show_default=False)],
    cache: Annotated[Path | None, typer.Option("--cache", help="calibration cache file (default: the one probes write, under $OPTPLAN_CACHE_DIR)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Fold measured runs (train.py's measurements.json, campaign results) into the calibration cache that later plans for that GPU use."""
    from optplan.planner.calibrate import save_calibration
    from optplan.planner.results import calibrations_from_results

    def body() -> None:
        fits = calibrations_from_results(results)
        if not fits:
            raise OptplanError("no successful measured run in " + ", ".join(map(str, results)) +
                               ": nothing to calibrate (runs must be on a catalogued GPU, or on the CPU under optplan's live-tensor "
                               "tracker: python -m optplan.probes.runtime_child --train-script train.py -- ARGS)")
        written = {fit.calibration.key: str(save_calibration(fit.calibration, path=cache)) for fit in fits}
        if as_json:
            typer.echo(json.dumps({"calibrations": [f.model_dump(mode="json") for f in fits],
                                   "cache": sorted(set(written.values()))}, indent=2))
            return
        out = _stdout()
        for fit in fits:
            out.print(fit.line(), markup=False)
        out.print(f"wrote {len(fits)} calibration(s) to {', '.join(sorted(set(written.values())))}", markup=False)

    guard(ctx, body)


@app.command("export")
def export_cmd(
    ctx: typer.Context,
    plan_file: Annotated[Path, typer.Argument(help="plan.json written by optplan recommend --out", show_default=False)],
    to: Annotated[list[str], typer.Option("--to", help="deepspeed, accelerate, torchrun, slurm, hf, lightning, train, finetune or all (repeatable)")],
    out: Annotated[Path, typer.Option("--out", help="folder to write the files to", parser=out_folder)],
    launcher: Annotated[str, typer.Option("--launcher", help="launch.sh starts torchrun or the deepspeed launcher")] = "torchrun",
    fsdp_version: Annotated[int, typer.Option("--fsdp-version", help="accelerate FSDP config version (1 or 2)")] = 2,
    train_script: Annotated[str, typer.Option("--train-script", help="the training script launch files start")] = "train.py",
    force: Annotated[bool, typer.Option("--force", help="overwrite existing files")] = False,
) -> None:
    """Write launch configs for a saved plan, each checked by its trainer's own loader."""
    from optplan.planner.api import export_plan_file
    from optplan.planner.export.registry import ExportOptions

    def body() -> None:
        _check_choice("--launcher", launcher, ("torchrun", "deepspeed"))
        if fsdp_version not in (1, 2):
            raise OptplanError(f"--fsdp-version must be 1 or 2 (got {fsdp_version})")
        options = ExportOptions(launcher=launcher, fsdp_version=fsdp_version, train_script=train_script)  # type: ignore[arg-type]
        written, skipped = export_plan_file(plan_file, to, out, force=force, options=options)
        console = _stdout()
        for path in written:
            console.print(f"wrote {path}")
        for why in skipped:
            console.print(f"not written: {why}", style="dim")

    guard(ctx, body)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: usage errors become one line on stderr and exit code 2."""
    # bitsandbytes (imported by the exporters' checks through peft/transformers) warns on import about optional
    # CPU kernels; with no handler Python prints it to stderr, which must hold only optplan's own lines
    logging.getLogger("bitsandbytes").addHandler(logging.NullHandler())
    usage_error = usage_error_type()
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread (an embedding caller): leave SIGTERM alone
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        _run(argv, usage_error)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def debug_first(argv: list[str]) -> list[str]:
    """``argv`` with a ``--debug`` given after the subcommand (``optplan recommend m.py --debug``) moved before it,
    where the option lives; a ``--debug`` after ``--`` (arguments passed on) stays."""
    end = argv.index("--") if "--" in argv else len(argv)
    if "--debug" not in argv[1:end]:
        return argv
    head = [a for a in argv[:end] if a != "--debug"]
    return ["--debug", *head, *argv[end:]]


def _run(argv: list[str] | None, usage_error: type[Exception]) -> None:
    argv = debug_first(list(sys.argv[1:] if argv is None else argv))
    try:
        code = app(args=argv, standalone_mode=False)
    except usage_error as err:
        if type(err).__name__ == "NoArgsIsHelpError":
            app(args=["--help"], standalone_mode=False)
            sys.exit(0)
        ctx = getattr(err, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        sys.stderr.write(f"error: {usage_message(err)}{hint}\n")
        sys.exit(2)
    except typer.Abort:
        sys.stderr.write("error: interrupted\n")
        sys.exit(EXIT_INTERRUPTED)
    except KeyboardInterrupt as err:
        sys.stderr.write(f"error: {err or 'interrupted'}\n")
        sys.exit(interrupted_code(err))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
