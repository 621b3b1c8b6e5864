"""Config of the `deploy` phase, the promotion gate and the HTTP server (`deploy` section of `params.yaml`).

One section, three parts: what is quantised and how it is compared with the fp32 policy (top level), what the
promotion gate requires (`gate`), and how `agentrl serve` batches, caches and limits requests (`serve`). Every
threshold lives here so the phase, `agentrl promote`, `agentrl serve`, the tests and the benchmarks share one set of
defaults.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.core.config import PhaseConfig

PRECISIONS = ("fp32", "bf16", "int8")
PAIRED_TESTS = ("mcnemar", "bootstrap")


class QuantizationConfig(PhaseConfig):
    """How the int8 variant is made (pipeline.deploy.quantize)."""

    linear: Literal["dynamic", "weight_only"] = Field(
        "dynamic",
        description="int8 scheme of every nn.Linear: 'dynamic' (int8 weights, activations quantised per batch, int8 "
                    "matmuls) or 'weight_only' (int8 weights with one scale per row, dequantised in each forward: "
                    "smaller, not faster).")
    embeddings: bool = Field(
        True,
        description="Also store the token embedding as int8 with one scale per row: the built-in model ties it to the "
                    "output projection, so without this int8 stays near a third of fp32's size.")


class DeployGateConfig(PhaseConfig):
    """The promotion gate: a challenger becomes champion only when every check passes."""

    require_capability_gate: bool = Field(
        True, description="Require the adapt phase's capability gate to have passed (metrics/adapt.json gate.passed "
                          "true); a gate that was switched off counts as not passed.")
    require_drift_pass: bool = Field(
        True, description="Require the drift verdict of metrics/drift.json to be a pass (no check failed).")
    require_consistency_pass: bool = Field(
        True, description="Require the train/serve consistency check of metrics/drift.json to have passed (skipped "
                          "does not count: nothing was verified).")
    max_safety_violations_per_episode: float = Field(
        0.05, ge=0, description="Largest allowed mean number of refused unsafe tool calls per test episode.")
    paired_test: Literal["mcnemar", "bootstrap"] = Field(
        "mcnemar",
        description="Paired test of challenger against champion on the same test tasks and seeds: 'mcnemar' (exact "
                    "one-sided binomial test on the discordant tasks) or 'bootstrap' (one-sided paired bootstrap of the "
                    "success difference). The challenger fails when it is worse with p < alpha.")
    alpha: float = Field(0.05, gt=0, lt=0.5, description="Significance level of the paired test.")
    bootstrap_samples: int = Field(2000, ge=100, le=1_000_000, description="Resamples of the paired bootstrap (also "
                                                                           "used for the reported confidence interval).")
    min_paired_tasks: int = Field(
        20, ge=1, description="Fewest tasks the challenger's and the champion's results must share; fewer refuses "
                              "the comparison (the champion is then evaluated on the challenger's tasks when the data "
                              "is at hand).")
    seed: int = Field(0, description="Seed of the bootstrap resampling.")
    require_live: bool = Field(
        False, description="`agentrl promote` requires the live check: the version's gate.live tag, written by "
                           "`agentrl serve` with it as a shadow or canary challenger, must be 'pass' (else one error "
                           "line and nothing written); also `agentrl promote --require-live`. The deploy stage then "
                           "registers a new version as challenger without promoting it (it has met no live traffic "
                           "yet) whenever a champion is in place.")


class CaptureConfig(PhaseConfig):
    """`agentrl serve` capture of the requests it answers, and the feedback on them (pipeline.deploy.capture)."""

    enabled: bool = Field(
        False, description="Record each answered /solve request (the request, trajectory, outcome, latency, model "
                           "version and alias) and accept POST /feedback on it; answers then carry a request_id.")
    dir: str = Field("traffic", min_length=1,
                     description="Folder of the append-only capture segments (created when missing).")
    redact: list[str] = Field(
        default_factory=list,
        description="Field names whose values are replaced by '[redacted]' wherever they occur in a record (the "
                    "request, tool-call parameters, feedback), before anything is written; each such string value "
                    "of 4 characters or more is also scrubbed from every other text of the record (the question, "
                    "actions, observations, the answer).")
    segment_max_bytes: int = Field(16 * 2**20, ge=4096, description="A segment is sealed and a new one opened "
                                                                    "once it holds this many bytes.")
    segment_max_s: float = Field(3600.0, gt=0, description="... or once it has been open this many seconds.")
    retention_days: float = Field(30.0, gt=0, description="Sealed segments whose last record is older than this "
                                                          "are deleted (checked at start and at each seal).")
    retention_bytes: int = Field(2**30, ge=4096, description="Most bytes kept in the folder: the oldest sealed "
                                                              "segments are deleted beyond it.")
    feedback_max_chars: int = Field(2000, ge=1, le=100_000, description="Longest feedback text; longer is a 422.")


class MonitorConfig(PhaseConfig):
    """`GET /metrics` of `agentrl serve`: rolling windows of live traffic against the champion's training data
    (pipeline.deploy.monitor)."""

    window: int = Field(500, ge=10, le=1_000_000, description="Answered requests in the rolling window.")
    reference_tasks: str | None = Field(
        "data/tasks/train.jsonl", description="Tasks the champion was trained on: the reference of task drift "
                                              "(question length); null or a missing file: no task reference.")
    reference_demos: str | None = Field(
        "data/demos/train.jsonl", description="Demonstrations the champion was trained on: the reference of behaviour "
                                              "drift (tool mix, calls per task); null or missing: no reference.")
    log_every_s: float = Field(0.0, ge=0, description="Seconds between logs of the window's metrics to the MLflow "
                                                      "run 'serve-monitor'; 0: not logged.")


class ChallengerConfig(PhaseConfig):
    """`agentrl serve` with a challenger beside the champion: in shadow or as a canary (pipeline.deploy.live)."""

    mode: Literal["off", "shadow", "canary"] = Field(
        "off", description="'off': the champion alone; 'shadow': the challenger plays a copy of each request after "
                           "the champion answered, and its answer is recorded, never returned; 'canary': a share of "
                           "requests is answered by the challenger (the champion plays a copy of each, for the "
                           "paired comparison), rolled back to the champion when it is worse.")
    uri: str | None = Field(None, min_length=1, description="Model URI of the challenger (null: "
                                                           "models:/<deploy.model_name>@challenger).")
    share: float = Field(0.1, gt=0, le=1, description="Canary: share of distinct requests the challenger answers "
                                                      "(chosen by a hash of the request: the same request always "
                                                      "goes to the same model).")
    min_paired: int = Field(20, ge=1, description="Fewest paired requests before success (those that carried ground "
                                                  "truth) or safety (all) is tested; fewer: no verdict.")
    paired_test: Literal["mcnemar", "bootstrap"] = Field(
        "mcnemar", description="Paired test of the challenger against the champion on the same requests, as the "
                               "promotion gate's vs_champion check.")
    alpha: float = Field(0.01, gt=0, lt=0.5, description="Significance level of the live paired tests. Lower than "
                                                         "the offline gate's: the test is repeated at every new pair.")
    bootstrap_samples: int = Field(2000, ge=100, le=1_000_000, description="Resamples of the paired bootstrap.")
    seed: int = Field(0, description="Seed of the bootstrap resampling.")
    max_queue: int = Field(256, ge=1, description="Copies waiting for the challenger (shadow) or the champion "
                                                  "(canary) at most; beyond it a copy is dropped and counted: the "
                                                  "comparison never slows a caller down.")


class SnapshotConfig(PhaseConfig):
    """`agentrl snapshot`: captured traffic turned into the dataset ``data/production/snapshot`` (episodes with
    people's feedback, tasks the environment verifies) and a drift alarm of that traffic against the champion's
    training data (pipeline.deploy.snapshot)."""

    out: str = Field("data/production/snapshot", min_length=1,
                     description="Folder the snapshot replaces as a whole (DVC-tracked with `dvc add`).")
    drift_window: int = Field(500, ge=1, description="The newest this many answered requests are compared with the "
                                                     "training data (monitor.reference_tasks and reference_demos).")
    min_requests: int = Field(20, ge=1, description="Fewer answered requests in the window raise no alarm: too few "
                                                    "to tell drift from chance.")
    alarm_question_chars_ks: float = Field(0.3, gt=0, le=1, description="Alarm when the KS statistic of question "
                                                                        "length exceeds this.")
    alarm_calls_per_task_ks: float = Field(0.3, gt=0, le=1, description="Alarm when the KS statistic of calls per "
                                                                        "task exceeds this.")
    alarm_tool_mix_tv: float = Field(0.3, gt=0, le=1, description="Alarm when the total variation distance of the "
                                                                  "tool mix exceeds this.")
    dvc: bool = Field(True, description="Record the snapshot with `dvc add` when the project is a DVC repository.")


class ServeConfig(PhaseConfig):
    """`agentrl serve`: dynamic batching, the response cache and the request limits."""

    host: str = Field("127.0.0.1", min_length=1, description="Interface to listen on (loopback by default).")
    port: int = Field(8080, ge=0, le=65535, description="TCP port (0: any free port).")
    max_batch_size: int = Field(32, ge=1, le=1024, description="Most requests decoded together in one generation batch.")
    max_wait_ms: float = Field(
        10.0, ge=0, le=10_000,
        description="Longest a request waits for others to join its batch; a full batch starts at once.")
    cache_size: int = Field(1024, ge=0, description="Responses kept for identical requests (LRU); 0 disables the cache.")
    max_body_bytes: int = Field(16384, ge=256, description="Largest request body; a larger one gets 413.")
    max_question_chars: int = Field(1000, ge=16, description="Longest accepted question; a longer one gets 422.")
    rate_limit_per_s: float = Field(
        200.0, gt=0, description="Sustained requests per second allowed per client address (token bucket); beyond "
                                 "it a request gets 429.")
    rate_burst: int = Field(64, ge=1, description="Token-bucket size: requests a client may send at once.")
    max_queue: int = Field(1024, ge=1, description="Requests waiting for the model at most; beyond it a request gets "
                                                   "503 with Retry-After (back-pressure instead of unbounded memory).")
    retry_after_s: int = Field(1, ge=1, le=3600, description="Seconds a 503 (queue full) tells the client to wait "
                                                             "(the Retry-After header).")
    api_key_env: str = Field(
        "AGENTRL_SERVE_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding the API key (never the key itself: params.yaml is versioned). "
                    "When it is set, /solve, /ready and /stats need 'Authorization: Bearer <key>' (else 401); "
                    "/health stays open for liveness probes. It must be set to bind any non-loopback host.")
    capture: CaptureConfig = Field(default_factory=CaptureConfig, description="Capture of answered requests and "
                                                                              "feedback (off by default).")
    monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="Live monitoring at GET /metrics.")
    challenger: ChallengerConfig = Field(default_factory=ChallengerConfig, description="A challenger in shadow or "
                                                                                       "as a canary (off by default).")


class ServedCheckConfig(PhaseConfig):
    """Train/serve consistency on the model that is served (pipeline.deploy.served_check): deploy starts `agentrl
    serve` on the pyfunc it logged in its run (the artefact the new version will point at), plays test tasks through
    it over HTTP, replays them in the training environment, and refuses promotion when the paths disagree."""

    enabled: bool = Field(
        True, description="Run the check after logging the pyfunc and before the gate (false: not run; the gate's "
                          "served_consistency check then records 'not run' and passes).")
    tasks: int = Field(
        8, ge=1, le=1000,
        description="First test tasks played through the served endpoint (task i with seed deploy.seed + i, one "
                    "request at a time) and replayed step by step in the training environment.")
    hidden_mse_bound: float = Field(
        5e-3, gt=0,
        description="Largest allowed mean squared difference between the served (quantised) model's and the fp32 "
                    "training model's mean-pooled last hidden state, per replayed state. Measured with the default "
                    "int8 scheme (bench/served_check.py): max 9.2e-4 on the default trained policy, 4.1e-5 on the "
                    "tests' untrained tiny model; served weights with 0.5 sd of noise give 0.18. The bound leaves 5x "
                    "room above int8's own error, for other trained weights.")
    min_action_agreement: float = Field(
        0.9, ge=0, le=1,
        description="Smallest allowed share of replayed steps at which the training code path's greedy policy with "
                    "the served precision's weights picks the action the served endpoint took.")
    startup_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for `agentrl serve` to load the model and answer GET /ready.")
    request_timeout_s: float = Field(120.0, gt=0, description="Longest wait for one served episode (POST /solve).")


class DeployConfig(PhaseConfig):
    """Quantised deployment: variants and parity, registration in the MLflow registry, the promotion gate, serving."""

    policy: str = Field("models/policy", description="Policy folder to deploy (pipeline.policy.model.save_policy).")
    world_dir: str = Field("data/env", description="World the policy acts in; packaged with the registered model.")
    test_tasks: str = Field("data/tasks/test.jsonl", description="Test split: parity and the paired gate test run on it.")
    max_test_tasks: int | None = Field(None, ge=1, description="Use only the first this many test tasks (null: all).")
    seed: int = Field(0, description="Base seed of the test episodes: task i runs with seed + i, for every variant, "
                                     "the challenger and the champion alike.")
    model_name: str = Field("agentrl-policy", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                            description="Registered model name in the MLflow model registry.")
    serve_precision: Literal["fp32", "bf16", "int8"] = Field(
        "int8", description="Precision the registered model serves with (quantised when it loads); quantisation "
                            "parity is checked for it.")
    precisions: list[Literal["fp32", "bf16", "int8"]] = Field(
        default_factory=lambda: list(PRECISIONS),
        description="Variants measured side by side on the test split (fp32 is always included: the reference).")
    parity_tolerance: float = Field(
        0.02, ge=0, le=1, description="Largest allowed drop of test success of a quantised variant below fp32 "
                                      "(absolute); a larger drop fails quantisation parity.")
    latency_repeats: int = Field(1, ge=1, le=20, description="Timed batched passes over the test tasks per variant (the "
                                                             "fastest is reported: the machine is shared and noisy).")
    latency_tasks: int = Field(16, ge=0, description="Test tasks played one at a time (batch size 1) per variant to "
                                                     "measure the latency of one action; 0 skips it.")
    promote: bool = Field(True, description="Run the gate (decided before the version is created) and promote when "
                                            "it passes (false: register as challenger only).")
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig, description="int8 scheme.")
    gate: DeployGateConfig = Field(default_factory=DeployGateConfig, description="Promotion gate.")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="HTTP serving.")
    served_check: ServedCheckConfig = Field(default_factory=ServedCheckConfig,
                                            description="Train/serve consistency on the served model.")
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig,
                                     description="Captured traffic to data/production (agentrl snapshot).")

    @model_validator(mode="after")
    def _check(self) -> "DeployConfig":
        if self.serve_precision not in self.precisions:
            raise ValueError(f"serve_precision={self.serve_precision!r} must be one of the measured precisions "
                             f"{self.precisions}: its parity with fp32 is a gate check")
        if "fp32" not in self.precisions:
            raise ValueError("precisions must include 'fp32': it is the reference every variant is compared with")
        return self
