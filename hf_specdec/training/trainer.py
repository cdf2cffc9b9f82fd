"""One training loop for every drafter, on Accelerate.

``accelerate launch -m hf_specdec.cli train ...`` runs it in several processes (DDP on GPUs, gloo on CPUs, or
DeepSpeed ZeRO-1/2 through the Accelerate config) with the same result as one process taking the same global batch
(``processes x batch_size`` sequences per micro-batch): process ``i`` takes the ``i``-th of every ``processes``
consecutive micro-batches of the one shuffled order, losses are means over the global micro-batch
(:func:`mean_denominator`) and the logged metrics are reduced over the processes. Checkpoints (model, optimizer,
scheduler, RNG, step) are written every ``save_every`` steps with ``accelerator.save_state`` and the newest one is
resumed automatically.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

def mean_denominator(count: torch.Tensor, floor: float | None = 1) -> torch.Tensor:
    """What a loss summed over this process's micro-batch is divided by to be its share of the mean over the global
    micro-batch (all processes of :func:`train`); ``count``: how many items (tokens, or their weights; any shape)
    the sum runs over here.

    One process: ``count.clamp(min=floor)`` (``floor=None``: unclamped). ``N`` processes: the counts summed over
    them (an all-reduce: every process must call this as often, with the same shape), clamped, divided by ``N``:
    DDP / DeepSpeed averages the gradients over the processes, which turns ``local_sum * N / global_count`` into
    the global mean, whatever the token counts of the shards. Metrics divided by it are reduced by their mean over
    the processes (:func:`train` does). The process count is the process group's (:func:`processes`): no state
    of this module's."""
    n = processes()
    if n == 1:
        return count if floor is None else count.clamp(min=floor)
    total = count.detach().clone()
    torch.distributed.all_reduce(total)
    return (total if floor is None else total.clamp(min=floor)) / n


def processes() -> int:
    """The data-parallel processes this one trains with: the initialised process group's size (what
    ``accelerate launch`` sets up for :func:`train`), 1 without one."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def main_process_first():
    """Process 0 runs the block first, then the others (which find what it wrote, e.g. the feature cache); a
    no-op in one process. Yields whether this is process 0."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    with state.main_process_first():
        yield state.is_main_process


class _WithLoss(torch.nn.Module):
    """``model`` whose ``forward(batch)`` is ``loss_fn(model, batch)``: the loss functions call the model's
    submodules, so the loss must run inside the DDP / DeepSpeed wrapper's forward for the gradients to be
    averaged over the processes. It shares the model's parameters, buffers and submodules (the same dicts, no
    extra level): its state dict and checkpoints are the model's own."""

    def __init__(self, model, loss_fn):
        super().__init__()
        self._parameters, self._buffers, self._modules = model._parameters, model._buffers, model._modules
        object.__setattr__(self, "_wrapped", (model, loss_fn))  # not a submodule

    def forward(self, batch):
        model, loss_fn = self._wrapped
        return loss_fn(model, batch)

    def train(self, mode: bool = True):
        self._wrapped[0].train(mode)  # its own flag too (the submodules are shared)
        return super().train(mode)


@dataclass
class TrainConfig:
    epochs: float = 1.0
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)
    warmup_ratio: float = 0.03
    max_grad_norm: float = 0.5
    batch_size: int = 1
    grad_accum: int = 4
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    max_steps: int | None = None
    max_minutes: float | None = None  # stop (checkpoint saved, resumable) after this much training time in this run
    fit_minutes: bool = False  # the learning-rate schedule runs over max_minutes of this run (or the steps, if sooner)
    eval_features: tuple = ()  # feature cache folders evaluated on (held out): logged as "<folder>/<metric>"
    eval_every: int = 0  # optimizer steps between held-out evaluations (0: at the end only)


def _collate_pad(batch: list[dict]) -> dict:
    """Right-pad the variable-length fields of a batch; ``valid`` marks real tokens."""
    length = max(len(b["input_ids"]) for b in batch)
    out = {}
    for key in batch[0]:
        rows = []
        for b in batch:
            t = b[key]
            pad = length - t.shape[0]
            rows.append(torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) if pad else t)
        out[key] = torch.stack(rows)
    out["valid"] = torch.stack([torch.arange(length) < len(b["input_ids"]) for b in batch])
    return out


class ShardWindowShuffle(torch.utils.data.Sampler):
    """A shuffled order that reads a large feature cache as a stream: the shards in a random order, ``window`` at a
    time, the samples of each window shuffled together (``dataset.shard_ranges()``: ``(start, end)`` sample indices
    of each shard; ``window`` defaults to ``dataset.SHARDS_IN_MEMORY``). Only ``window`` shards need be in memory;
    the order depends on ``generator``'s seed alone."""

    def __init__(self, dataset, generator: torch.Generator, window: int | None = None):
        self.ranges = dataset.shard_ranges()
        self.generator = generator
        self.window = window or dataset.SHARDS_IN_MEMORY  # the shards the dataset keeps in memory

    def __len__(self):
        return sum(end - start for start, end in self.ranges)

    def __iter__(self):
        shards = torch.randperm(len(self.ranges), generator=self.generator).tolist()
        for i in range(0, len(shards), self.window):
            ids = torch.cat([torch.arange(*self.ranges[s]) for s in shards[i:i + self.window]])
            yield from ids[torch.randperm(len(ids), generator=self.generator)].tolist()


def fitted_schedule(done: float, ramp: float, total: int) -> float:
    """The learning-rate factor of ``--fit-minutes`` when the fraction ``done`` of the run is over (the larger of
    the steps' and the minutes' fractions): a linear warm-up over the first ``ramp``, then a cosine decay to 0 at
    1; never 0 on the first of ``total`` steps."""
    if done < ramp:
        return max(done, 1 / total) / ramp
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (done - ramp) / (1 - ramp))))


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = [(int(m.group(1)), p) for p in out_dir.glob("checkpoint-*") if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
             and (p / "done").exists()]
    return max(found)[1] if found else None


def train(model, loss_fn: Callable, dataset, out_dir, config: TrainConfig, save_model: Callable | None = None,
          progress: bool = True) -> dict:
    """Train ``model`` on ``dataset`` minimising ``loss_fn(model, batch) -> (loss, metrics dict)``.

    ``config.eval_features`` (held-out feature caches) are evaluated every ``config.eval_every`` steps and at the
    end: ``loss_fn``'s metrics over each whole set, logged as ``"<parent>/<folder>/<metric>"`` lines of
    ``log.jsonl`` with the step and the training seconds so far (agreement per hour of compute).

    ``save_model(model, folder)`` writes a usable model (default: ``model.save_pretrained``). Returns the last
    logged metrics (means over the processes). Under ``accelerate launch``, ``config.batch_size`` is per process;
    ``loss_fn`` should normalise with :func:`mean_denominator` for the result not to depend on the process count.
    """
    from accelerate import Accelerator, DistributedType
    from accelerate.utils import DistributedDataParallelKwargs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # unused parameters: a loss may leave some out (DFlash on a micro-batch without a label)
    accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum, cpu=not torch.cuda.is_available(),
                              step_scheduler_with_optimizer=False,
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    sharded = accelerator.distributed_type == DistributedType.FSDP or (
        accelerator.distributed_type == DistributedType.DEEPSPEED
        and accelerator.state.deepspeed_plugin.hf_ds_config.is_zero3())
    if sharded:
        raise ValueError("FSDP and DeepSpeed ZeRO-3 shard the weights being trained, which the saved models need "
                         "whole: use DDP or DeepSpeed ZeRO-1/2.")
    return _train(accelerator, model, loss_fn, dataset, out, config, save_model, progress, _eval_sets(config))


def _eval_sets(config: TrainConfig) -> dict:
    from .features import FeatureShards

    return {"/".join(Path(f).parts[-2:]): FeatureShards(f) for f in config.eval_features}


def evaluate(model, dataset, batch_size: int = 4) -> dict:
    """The metrics of ``model(batch) -> (loss, metrics)`` (a model wrapped with its loss, as :func:`train` runs
    it) over all of ``dataset``, without gradients, in eval mode: each the mean over the batches weighted by their
    loss-mask tokens."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=_collate_pad)
    was_training = model.training
    model.eval()
    sums: dict = {}
    weight = 0.0
    device = next(model.parameters()).device  # the batches come from the CPU; the model may be on a GPU
    try:
        with torch.no_grad():
            for batch in loader:
                batch = {k: v.to(device) for k, v in batch.items()}
                tokens = float((batch["valid"] & batch["loss_mask"].bool()).sum())
                loss, metrics = model(batch)
                for k, v in {"loss": float(loss), **metrics}.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * tokens
                weight += tokens
    finally:
        model.train(was_training)
    return {k: v / max(weight, 1.0) for k, v in sums.items()}


def _train(accelerator, model, loss_fn, dataset, out, config, save_model, progress, eval_sets):
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    set_seed(config.seed)
    # one shuffled order (the same seed in every process) whatever the process count: accelerate gives process i
    # the i-th of every N consecutive batches, so N processes of batch_size b take, micro-batch by micro-batch, the
    # samples one process of batch_size N * b takes
    # epoch e shuffles with seed + e, so a run resumed inside an epoch takes the batches the uninterrupted run takes
    shuffle = torch.Generator()
    # feature shards are read a window of shards at a time (a large cache streams from disk instead of loading a
    # whole shard for every sample); other datasets are shuffled whole
    order = dict(sampler=ShardWindowShuffle(dataset, shuffle)) if hasattr(dataset, "shard_ranges") else dict(
        shuffle=True, generator=shuffle)
    loader = torch.utils.data.DataLoader(dataset, batch_size=config.batch_size, collate_fn=_collate_pad, **order)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    raw = model
    model, optimizer, loader = accelerator.prepare(_WithLoss(model, loss_fn), optimizer, loader)
    steps_per_epoch = math.ceil(len(loader) / config.grad_accum)  # this process's share of the batches
    # max_steps=0: no training step (the held-out evaluation of an --init-from drafter)
    total = config.max_steps if config.max_steps is not None else max(1, int(steps_per_epoch * config.epochs))
    warmup = max(1, int(total * config.warmup_ratio))

    def schedule(step):
        if fitted:  # warm-up and decay over the fraction done of the steps or of the minutes, whichever is larger
            done = step / total
            if started is not None:
                done = max(done, (clock() - elapsed) / (config.max_minutes * 60))
            return fitted_schedule(done, config.warmup_ratio, total)
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    fitted = config.fit_minutes and bool(config.max_minutes)
    started = None  # the schedule reads the clock once training starts

    # stepped once per optimizer step below (the accelerator's own stepping would step it once per process)
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))
    write_model = save_model or (lambda m, f: m.save_pretrained(f))

    step = 0
    resume = latest_checkpoint(out)
    if resume is not None:
        accelerator.load_state(str(resume))
        step = json.loads((resume / "trainer_state.json").read_text())["step"]
        accelerator.print(f"resumed from {resume} (step {step})")

    def save(tag: str):
        folder = out / tag
        accelerator.save_state(str(folder))  # every process (its RNG states)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (folder / "trainer_state.json").write_text(json.dumps({"step": step, "config": asdict(config),
                                                                   **clocks()}))
            write_model(raw, folder / "model")
            (folder / "done").write_text("ok")

    # training seconds (wall clock; CPU time of this process) of the runs before: the log's clocks run on over resumes
    elapsed, elapsed_cpu = 0.0, 0.0
    if resume is not None:
        before = json.loads((resume / "trainer_state.json").read_text())
        elapsed, elapsed_cpu = before.get("seconds", 0.0), before.get("cpu_seconds", 0.0)

    def log(line: dict):
        if accelerator.is_main_process:
            with open(out / "log.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

    evaluating = [0.0, 0.0]  # wall and CPU seconds spent evaluating in this run: not training time

    def run_evals():
        start, cpu, spent = time.perf_counter(), time.process_time(), clocks()  # the training time so far
        for name, data in eval_sets.items():
            scores = evaluate(model, data, config.batch_size)
            log({f"{name}/{k}": v for k, v in scores.items()} | {"step": step, **spent})
        evaluating[0] += time.perf_counter() - start
        evaluating[1] += time.process_time() - cpu

    def clock():
        return elapsed + time.perf_counter() - started - evaluating[0]

    def clocks():
        return {"seconds": clock(), "cpu_seconds": elapsed_cpu + time.process_time() - started_cpu - evaluating[1]}

    bar = tqdm(total=total, initial=step, desc="train", disable=not (progress and accelerator.is_main_process),
               file=sys.stderr)
    metrics: dict = {}
    running: dict = {}
    started, started_cpu = time.perf_counter(), time.process_time()

    def out_of_time():
        return config.max_minutes is not None and clock() - elapsed >= config.max_minutes * 60

    model.train()
    epoch = step // max(steps_per_epoch, 1)
    while step < total:
        shuffle.manual_seed(config.seed + epoch)
        epoch_loader = loader
        skip = (step % steps_per_epoch) * config.grad_accum if step else 0
        if skip:
            epoch_loader = accelerator.skip_first_batches(loader, skip)
        for batch in epoch_loader:
            with accelerator.accumulate(model):
                loss, batch_metrics = model(batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            for k, v in {"loss": float(loss.detach()), **batch_metrics}.items():
                running.setdefault(k, []).append(float(v))
            if accelerator.sync_gradients:
                step += 1
                bar.update(1)
                if step % config.log_every == 0 or step == total:
                    metrics = _reduce_mean(accelerator, {k: sum(v) / len(v) for k, v in running.items()})
                    metrics.update(step=step, lr=scheduler.get_last_lr()[0], **clocks())
                    running = {}
                    bar.set_postfix({k: round(v, 4) for k, v in metrics.items() if k in ("loss", "acc0", "acc1")})
                    log(metrics)
                if step % config.save_every == 0:
                    save(f"checkpoint-{step}")
                if eval_sets and config.eval_every and step % config.eval_every == 0 and step < total:
                    run_evals()
                if step >= total or out_of_time():
                    break
        epoch += 1
        if out_of_time():
            break
    bar.close()
    save(f"checkpoint-{step}")
    if eval_sets:
        run_evals()
    if step < total:  # stopped by the time limit: final/ is this step's model; the same command continues
        accelerator.print(f"stopped at step {step} of {total} after {config.max_minutes} minutes; run the same "
                          "command again to continue")
        metrics = dict(metrics, complete=False)
    if accelerator.is_main_process:
        write_model(raw, out / "final")
    accelerator.wait_for_everyone()  # the callers read final/ back
    return metrics


def _reduce_mean(accelerator, metrics: dict) -> dict:
    """``metrics`` (floats) averaged over the processes: the global-batch values of losses and rates normalised
    with :func:`mean_denominator`."""
    if accelerator.num_processes == 1:
        return metrics
    keys = sorted(metrics)  # the same order in every process
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=accelerator.device)
    reduced = dict(zip(keys, accelerator.reduce(values, reduction="mean").tolist()))
    return {k: reduced[k] for k in metrics}
