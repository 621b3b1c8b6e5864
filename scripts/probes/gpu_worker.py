"""`pipeline.train.worker` as one rank of `scripts/probes/gpu_train.py` (``deepspeed --module scripts.probes.gpu_worker``).

Three things differ from the worker itself, all for the device machine. MLflow and Great Expectations are not
installed there (the probe carries only the packages the train path imports, as wheels): tracking is off
(``AGENTRL_TRACKING=off``, `pipeline.core.tracking`, set here unless the caller set it), and where ``great_expectations`` cannot be imported the demonstrations'
validation (suite ``demos``, which the env stage already ran when it wrote them, on the machine that built ``data/``)
is skipped, said once on the output (``VALIDATION skipped``). And the rank prints what the probe reads back: the DeepSpeed engine's precision (``ENGINE bf16=... param_dtype=...``) when it is
made, and the peak GPU memory at exit (``GPU_PEAK_MIB``). Nothing else is changed: the worker's own `main` runs.
"""

from __future__ import annotations

import atexit
import os
import sys

import torch

import pipeline.train.distributed as distributed
from pipeline.core.tracking import TRACKING_ENV

os.environ.setdefault(TRACKING_ENV, "off")  # no MLflow on the device machine
_make_engine = distributed.make_engine


def _reporting_make_engine(*args, **kwargs):
    engine = _make_engine(*args, **kwargs)
    dtype = next(engine.module.parameters()).dtype
    print(f"ENGINE bf16={engine.bfloat16_enabled()} param_dtype={dtype} device={engine.device}", flush=True)
    return engine


distributed.make_engine = _reporting_make_engine  # the trainer imports it from the module at call time

try:
    import great_expectations  # noqa: F401
except ImportError:
    import pipeline.core.validation as validation

    class _Skipped:
        def raise_if_failed(self) -> None:
            return None

    def _skip(records, suite, dataset=None, **params):
        print(f"VALIDATION skipped: great_expectations is not installed here ({suite}: {dataset})", flush=True)
        return _Skipped()

    validation.validate_records = _skip  # sft.load_demos imports it from the module at call time


@atexit.register
def _peak() -> None:
    if torch.cuda.is_available():
        print(f"GPU_PEAK_MIB {torch.cuda.max_memory_allocated() / 2**20:.0f}", flush=True)


if __name__ == "__main__":
    from pipeline.train.worker import main

    sys.exit(main())
