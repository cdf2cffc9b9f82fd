"""One training loop for every drafter, on Accelerate.

``accelerate launch -m hf_specdec.cli train ...`` runs it on many GPUs (DDP, or DeepSpeed / FSDP through the
Accelerate config) unchanged; here it runs as one CPU process. Checkpoints (model, optimizer, scheduler, RNG, step)
are written every ``save_every`` steps with ``accelerator.save_state`` and the newest one is resumed automatically.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch


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


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = [(int(m.group(1)), p) for p in out_dir.glob("checkpoint-*") if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
             and (p / "done").exists()]
    return max(found)[1] if found else None


def train(model, loss_fn: Callable, dataset, out_dir, config: TrainConfig, save_model: Callable | None = None,
          progress: bool = True) -> dict:
    """Train ``model`` on ``dataset`` minimising ``loss_fn(model, batch) -> (loss, metrics dict)``.

    ``save_model(model, folder)`` writes a usable model (default: ``model.save_pretrained``). Returns the last
    logged metrics.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum, cpu=not torch.cuda.is_available())
    set_seed(config.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=config.batch_size, shuffle=True, collate_fn=_collate_pad,
                                         generator=torch.Generator().manual_seed(config.seed))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(len(loader) / config.grad_accum)
    total = config.max_steps or max(1, int(steps_per_epoch * config.epochs))
    warmup = max(1, int(total * config.warmup_ratio))

    def schedule(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step = 0
    resume = latest_checkpoint(out)
    if resume is not None:
        accelerator.load_state(str(resume))
        step = json.loads((resume / "trainer_state.json").read_text())["step"]
        accelerator.print(f"resumed from {resume} (step {step})")

    def save(tag: str):
        folder = out / tag
        accelerator.save_state(str(folder))
        if accelerator.is_main_process:
            (folder / "trainer_state.json").write_text(json.dumps({"step": step, "config": asdict(config)}))
            (save_model or (lambda m, f: m.save_pretrained(f)))(accelerator.unwrap_model(model), folder / "model")
            (folder / "done").write_text("ok")

    bar = tqdm(total=total, initial=step, desc="train", disable=not (progress and accelerator.is_main_process),
               file=sys.stderr)
    metrics: dict = {}
    running: dict = {}
    started = time.perf_counter()
    model.train()
    epoch = step // max(steps_per_epoch, 1)
    while step < total:
        epoch_loader = loader
        skip = (step % steps_per_epoch) * config.grad_accum if step else 0
        if skip:
            epoch_loader = accelerator.skip_first_batches(loader, skip)
        for batch in epoch_loader:
            with accelerator.accumulate(model):
                loss, batch_metrics = loss_fn(model, batch)
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
                    metrics = {k: sum(v) / len(v) for k, v in running.items()}
                    metrics.update(step=step, lr=scheduler.get_last_lr()[0],
                                   seconds=time.perf_counter() - started)
                    running = {}
                    bar.set_postfix({k: round(v, 4) for k, v in metrics.items() if k in ("loss", "acc0", "acc1")})
                    if accelerator.is_main_process:
                        with open(out / "log.jsonl", "a") as f:
                            f.write(json.dumps(metrics) + "\n")
                if step % config.save_every == 0:
                    save(f"checkpoint-{step}")
                if step >= total:
                    break
        epoch += 1
    bar.close()
    save(f"checkpoint-{step}")
    if accelerator.is_main_process:
        (save_model or (lambda m, f: m.save_pretrained(f)))(accelerator.unwrap_model(model), out / "final")
    return metrics
