"""Checkpoints of an RL run: the DeepSpeed engine state plus everything else a resumed run needs to continue as if
it had not stopped (sampling state, RNG states, learning curve, evaluations, best policy so far, early stopping, the extensions'
states), and
a fingerprint of the model and data that refuses a checkpoint written for another one.

The checkpoint folder also holds the best policy so far (:data:`BEST`, written by :mod:`pipeline.train.validation`).
Which folder a run uses (keyed by its params and code) is :func:`pipeline.train.worker.run_key`'s business.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from pipeline.core.atomic import DiskFullError, disk_errors, write_text
from pipeline.core.errors import AgentRLError

BEST = "best"  # the best policy so far, inside the run's checkpoint folder
LATEST = "latest"  # DeepSpeed's file naming the checkpoint to resume from


def fingerprint(module: torch.nn.Module, meta: dict) -> str:
    """16 hex digits over the module's parameter names and shapes and the policy's model config, tokenizer, data
    and vocabulary size (from its ``policy.json`` `meta`)."""
    shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in module.state_dict().items())
    base = json.dumps({k: meta.get(k) for k in ("model_config", "tokenizer", "data", "vocab_size")}, sort_keys=True,
                      default=str)
    return hashlib.sha256((shapes + base).encode()).hexdigest()[:16]


def load_checkpoint(engine, ckpt_dir: Path, expected: str) -> tuple[str, dict] | None:
    """The latest checkpoint in `ckpt_dir` loaded into `engine` (optimizer included): its path and client state, or
    None when there is none. A checkpoint of another model (fingerprint other than `expected`) is refused."""
    if not (ckpt_dir / LATEST).is_file():
        return None
    try:
        path, client = engine.load_checkpoint(str(ckpt_dir), load_optimizer_states=True)
    except Exception as exc:  # a mismatched checkpoint fails deep inside torch/DeepSpeed
        raise AgentRLError(f"cannot resume from {ckpt_dir}: {str(exc).splitlines()[0][:300]} (a checkpoint from "
                           f"another model? delete {ckpt_dir} to start over)") from None
    if client is None or client.get("fingerprint") != expected:
        raise AgentRLError(f"checkpoint in {ckpt_dir} was written for another model or configuration "
                           f"(fingerprint {client and client.get('fingerprint')} != {expected}); delete it "
                           f"to start over")
    return path, client


def save_checkpoint(engine, ckpt_dir: Path, update: int, *, sampler: dict, fingerprint: str, history: list,
                    evals: list, best: dict, early_stopping: dict, bc_rng: np.random.Generator, dist,
                    learner_state: dict | None = None, extensions: dict | None = None) -> None:
    """The engine state after `update` updates, tagged ``update-<n>``, with the run's state as client state (the
    behaviour-cloning RNG of every rank, gathered; each extension's state under its name).

    The ``latest`` file that names the checkpoint to resume from is written here, atomically, once every rank has
    written its part (DeepSpeed's own rewrites it in place, so a full disk could leave it empty). A rank whose write
    fails for lack of room raises :class:`~pipeline.core.atomic.DiskFullError` naming the checkpoint and removes the
    half-written tag folder: ``latest`` still names the previous checkpoint, untouched. The ranks that did not fail
    wait in DeepSpeed's closing barrier until the launcher stops them; one still writing when another removed the
    folder can leave its part behind, in a folder that ``latest`` does not name and that the rerun's save of the
    same update replaces."""
    tag = f"update-{update}"
    rng = dist.all_gather(bc_rng.bit_generator.state)
    try:
        with disk_errors(ckpt_dir / tag):
            engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False, client_state={
                "update": update, "sampler": sampler, "learner_state": learner_state, "fingerprint": fingerprint,
                "extensions": extensions or {},
                "torch_rng": torch.get_rng_state().tolist(), "history": history, "evals": evals, "best": best,
                "early_stopping": early_stopping, "bc_rng": rng})
    except DiskFullError:  # every rank that failed removes the tag folder: the last one to fail leaves none
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        raise
    if dist.is_main:
        write_text(ckpt_dir / LATEST, tag)
    dist.barrier()
