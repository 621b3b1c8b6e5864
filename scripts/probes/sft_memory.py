"""How much stays resident after the adapt stage's SFT loop returns, and what frees it (session 25 memory probe).

    python scripts/probes/sft_memory.py STEPS {compiled,eager}

Runs STEPS steps of SFT with the adapt stage's own sampler and config from models/adapted (full fine-tuning), then
prints the resident size after the loop, after a heap trim, after gc, after torch._dynamo.reset() and after the
gradients are dropped. Session 25: 300 compiled steps left 1,574 MiB resident after the trim (647 at the start),
600 steps 1,639 MiB; nothing after the trim freed more than 20 MiB. With ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 the
300 steps did not finish in 15 minutes.
"""
import gc, json, resource, sys
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.core.config import load_section
from pipeline.env.config import EnvConfig
from pipeline.adapt.config import AdaptConfig
from pipeline.adapt import sft
from pipeline.policy.model import load_policy, autocast_context, resident_mib, release_free_memory
import pipeline.adapt.main as A
mx = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def show(w): print(f"{w}: rss {resident_mib():.0f} MiB, maxrss {mx():.0f}", flush=True)
if len(sys.argv) != 3 or sys.argv[2] not in ("compiled", "eager") or not sys.argv[1].isdigit() or int(sys.argv[1]) < 1:
    raise SystemExit("usage: python scripts/probes/sft_memory.py STEPS {compiled,eager} (STEPS >= 1), from the repository root")
if not Path("models/adapted/policy.json").is_file():
    raise SystemExit("models/adapted: no adapted policy here (run from the repository root after `dvc repro adapt`)")
steps = int(sys.argv[1]); compiled = sys.argv[2] == "compiled"
params = "params.yaml"; data = Path("data")
cfg = load_section(AdaptConfig, "adapt", params); env_cfg = load_section(EnvConfig, "env", params)
inputs = A.load_inputs(data, "validation")
model, tok, _ = load_policy("models/adapted")
pool = sft.NamePool.from_entities(json.loads((data / "env" / "entities.json").read_text()))
sampler = sft.DemoSampler(tok, inputs["demos"], {t.task_id: t.to_dict() for t in inputs["train"]},
                          env_cfg.history_window, cfg.sft.max_len, cfg.sft.entity_augmentation, pool)
for p in model.parameters(): p.requires_grad_(True)
show("start")
rng = np.random.default_rng([cfg.seed, 2])
res = sft.train_lm(model, sft.item_batches(sampler.lengths, sampler, cfg.sft.batch_size, rng, tok.pad_token_id),
                   steps, cfg.sft.lr, warmup=cfg.sft.warmup_steps, autocast=lambda: autocast_context("auto"), compile=compiled)
show("after train_lm")
release_free_memory(); show("after trim")
gc.collect(); release_free_memory(); show("after gc + trim")
import torch._dynamo; torch._dynamo.reset(); gc.collect(); release_free_memory(); show("after dynamo reset + gc + trim")
for p in model.parameters(): p.grad = None
gc.collect(); release_free_memory(); show("after grads dropped + trim")
