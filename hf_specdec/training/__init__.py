"""Drafter training: cache the frozen target's features once, then train on the cached shards (Accelerate).

``hf-specdec train eagle3|dflash|medusa ...`` and ``hf-specdec train draft ...`` (a distilled student for the
``assisted`` method) share the data pipeline (:mod:`.data`, :mod:`.features`) and the loop (:mod:`.trainer`).

The trainers, re-exported here: :mod:`.drafters` (EAGLE-3, DFlash, Medusa), :mod:`.posthoc` (MTP, parallel MTP
heads, the LayerSkip exit adapter), :mod:`.layerskip_recipe` (the target itself) and :mod:`.distillation` (the
``assisted`` student); the feature cache they share is built by :func:`.corpus.shared_features`.
"""

from __future__ import annotations

from .corpus import prepare_features, shared_features
from .distillation import distillation_loss, train_draft
from .drafters import train_dflash, train_eagle3, train_medusa
from .layerskip_recipe import train_layerskip
from .posthoc import train_exit_adapter, train_mtp, train_parallel_mtp
from .trainer import TrainConfig, main_process_first, mean_denominator, train
