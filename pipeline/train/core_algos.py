"""The RL maths as pure functions of tensors (docs/design.md §2, §3.4, §3.5).

Shapes: token-level tensors are ``(batch, seq)``, where `batch` counts episodes and `seq` their (padded) token
positions; `mask` is the rollout's action mask, 1 exactly on tokens the policy sampled and 0 on prompt, tool-output
and padding tokens. Everything downstream respects the mask: advantages, losses and statistics are computed over
masked positions only, so values written under the mask cannot change a result (tests prove it).

Losses return ``(loss, metrics)`` with metric names namespaced as the tracker logs them. The advantage estimators
built from these pieces (GAE, the GRPO and RLOO group baselines) are registered by name in
:mod:`pipeline.train.estimators`, where an unknown name fails listing the valid ones.

References: PPO clipped surrogate and value clipping (Schulman et al. 2017; cleanrl `ppo.py`); GAE (Schulman et al.
2016), computed over action tokens only, skipping observation tokens as verl does for multi-turn rollouts; GRPO group
baseline (Shao et al. 2024) and RLOO leave-one-out baseline (Ahmadian et al. 2024); approximate KL ``k3``
(Schulman, "Approximating KL divergence", 2020); truncated importance sampling ``w = min(c, π_train/π_sample)``
(Espeholt et al. 2018, IMPALA/V-trace), for rollouts from a stale policy (docs/design.md §1.4, §2.3); weight-space
ensembling of the RL policy with its start (WiSE-FT, Wortsman et al. 2022).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is 1 (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def loss_weights(mask: torch.Tensor, episode: torch.Tensor, n_episodes: int, mode: str = "token-mean") -> torch.Tensor:
    """Per-token weights that set how the policy loss averages, to be used as the `mask` of the loss functions.

    Args: mask (rows, seq) the loss mask (0/1); episode (rows,) the episode of each row (an episode re-based into
    several segments has several rows); n_episodes the number of episodes.

    - ``token-mean``: `mask` itself; every action token of the batch counts the same, so a long episode weighs as much
      as its number of tokens (verl's ``loss_agg_mode="token-mean"``).
    - ``seq-mean-token-mean``: each token gets 1/(its episode's masked tokens), so every episode counts once, whatever
      its length, and a masked mean with these weights is the mean over episodes of each episode's token mean. Failed
      episodes that ramble (invalid actions, repeated calls) then no longer outweigh short successful ones.
    """
    if mode == "token-mean":
        return mask
    if mode != "seq-mean-token-mean":
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(LOSS_AGGREGATIONS)}")
    per_episode = torch.zeros(n_episodes, dtype=mask.dtype).index_add_(0, episode, mask.sum(1))
    return mask / per_episode[episode].clamp(min=1.0)[:, None]


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean)/std over masked positions; masked-out positions are returned as 0."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def token_rewards(episode_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each episode's scalar reward on its last action token. (batch,) , (batch, seq) -> (batch, seq)."""
    seq = mask.shape[1]
    positions = torch.arange(seq, device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=episode_rewards.dtype, device=mask.device)
    has = last >= 0
    out[has, last[has]] = episode_rewards[has]
    return out


def turn_ids(mask: torch.Tensor) -> torch.Tensor:
    """Index of the turn each action token belongs to; −1 where `mask` is 0. A turn is one sampled action: a run of
    consecutive action tokens (observations, masked 0, separate the runs). (..., seq) -> (..., seq), long.

    >>> turn_ids(torch.tensor([0, 1, 1, 0, 0, 1, 0, 1])).tolist()
    [-1, 0, 0, -1, -1, 1, -1, 2]
    """
    m = mask > 0
    starts = m & ~torch.nn.functional.pad(m, (1, 0))[..., :-1]
    idx = torch.cumsum(starts.long(), dim=-1) - 1
    return torch.where(m, idx, torch.full_like(idx, -1))


def turn_token_rewards(turn_rewards: torch.Tensor, episode: torch.Tensor, turn: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """Each turn's reward on the last action token of that turn (per-turn credit for GAE, docs/design.md §2.2).

    Args: turn_rewards (episodes, turns) r_{e,t}; episode (rows,) the episode of each row; turn (rows, seq) the turn
    index of each token (:func:`turn_ids` of the whole episode, so a turn keeps its index in a later row); mask
    (rows, seq). Returns (rows, seq), zero except at the last token of each turn.
    """
    m = mask > 0
    nxt = torch.nn.functional.pad(turn, (0, 1), value=-1)[:, 1:]
    last = m & (nxt != turn)
    ep = episode[:, None].expand_as(turn)
    out = torch.zeros(mask.shape, dtype=turn_rewards.dtype)
    out[last] = turn_rewards[ep[last], turn[last]]
    return out


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float | torch.Tensor,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over action tokens only.

    Args: rewards, values, mask: (batch, seq); gamma a float or a (batch, seq) discount per token (applied from the
    token to the next action token, :func:`turn_end_discounts`). Positions with mask 0 (prompt, observations, padding) are skipped: the
    recursion jumps from one action token to the next action token, so an observation in between neither
    discounts nor bootstraps. After the last action token the episode is over (value 0).
    Returns: (advantages, returns), both (batch, seq), zero where mask is 0.
    """
    batch, seq = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    lastgaelam = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    m = mask.to(rewards.dtype)
    for t in reversed(range(seq)):
        g = gamma[:, t] if isinstance(gamma, torch.Tensor) else gamma
        delta = rewards[:, t] + g * next_value - values[:, t]
        gae_t = delta + g * lam * lastgaelam
        # Where the token is not an action, carry the running quantities through unchanged.
        lastgaelam = m[:, t] * gae_t + (1 - m[:, t]) * lastgaelam
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        adv[:, t] = gae_t * m[:, t]
    returns = (adv + values) * m
    return adv, returns


def last_rows(episode: torch.Tensor) -> torch.Tensor:
    """Whether each row is the last of its episode (an episode's token segments are rows in order, see
    ``batch.collate_records``). (rows,) long -> (rows,) bool.

    >>> last_rows(torch.tensor([0, 0, 1, 2, 2, 2])).tolist()
    [False, True, True, False, False, True]
    """
    rows = torch.arange(episode.numel(), device=episode.device)
    last = torch.full((int(episode.max()) + 1,), -1, dtype=torch.long, device=episode.device)
    last = last.scatter_reduce(0, episode, rows, reduce="amax")
    return rows == last[episode]


def compute_gae_over_segments(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, episode: torch.Tensor,
                              gamma: float | torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_gae` for episodes that span several rows (token segments, in row order within an episode): the
    recursion runs over each episode's action tokens across its rows, so the last action of a segment bootstraps from
    the first action of the next segment instead of ending the episode there.

    Args: rewards, values, mask (rows, seq); episode (rows,) the episode of each row. With one row per episode this
    is :func:`compute_gae` exactly. Returns (advantages, returns), (rows, seq), zero where mask is 0.
    """
    m = mask > 0
    order = torch.argsort(episode, stable=True)
    r_sorted, t_idx = torch.nonzero(m[order], as_tuple=True)  # episode by episode, rows in order, then positions
    rows = order[r_sorted]
    ep = episode[rows]
    n_ep = int(episode.max()) + 1 if episode.numel() else 0
    counts = torch.bincount(ep, minlength=n_ep)
    pos = torch.arange(ep.numel(), device=ep.device) - (torch.cumsum(counts, 0) - counts)[ep]
    width = int(counts.max()) if ep.numel() else 0
    flat = lambda x: torch.zeros(n_ep, width, dtype=rewards.dtype, device=rewards.device).index_put_(  # noqa: E731
        (ep, pos), x[rows, t_idx].to(rewards.dtype))
    adv_e, ret_e = compute_gae(flat(rewards), flat(values), flat(m),
                               flat(gamma) if isinstance(gamma, torch.Tensor) else gamma, lam)
    adv, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
    adv[rows, t_idx] = adv_e[ep, pos]
    returns[rows, t_idx] = ret_e[ep, pos]
    return adv, returns


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """R_t = Σ_{t'≥t} γ^(t'−t) r_t' along the last dimension (per-turn credit, docs/design.md §2.2)."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[..., t] + gamma * running
        out[..., t] = running
    return out


def stepwise_discounted_returns(rewards: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
    """G_t = r_t + γ_t·G_{t+1} along the last dimension, with a discount of its own after every step (event-based
    credit, docs/design.md §2.2: the discount applies at key decisions). γ_t ≡ γ is :func:`discounted_returns`.

    >>> stepwise_discounted_returns(torch.tensor([1.0, 0.0, 2.0, 3.0]), torch.tensor([1.0, 0.5, 1.0, 1.0])).tolist()
    [3.5, 2.5, 5.0, 3.0]
    """
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[..., t] + gammas[..., t] * running
        out[..., t] = running
    return out


def event_discounts(events: torch.Tensor, gamma: float, event_gamma: float) -> torch.Tensor:
    """The discount after each step: γ·γ_e where the step carries a key event, γ elsewhere (bool in, float out).

    >>> event_discounts(torch.tensor([False, True, True]), 1.0, 0.5).tolist()
    [1.0, 0.5, 0.5]
    """
    return torch.where(events, gamma * event_gamma, gamma).to(torch.float32)


def turn_end_discounts(turn_gammas: torch.Tensor, episode: torch.Tensor, turn: torch.Tensor, mask: torch.Tensor,
                       gamma: float) -> torch.Tensor:
    """Per-token discounts for GAE over action tokens with a per-turn discount: each turn's γ_t on its last action
    token (the step to the next turn's first token), `gamma` on every other token.

    Args: turn_gammas (episodes, turns); episode (rows,); turn (rows, seq) as :func:`turn_token_rewards`; mask (rows,
    seq). Returns (rows, seq).

    >>> turn_end_discounts(torch.tensor([[0.5, 1.0]]), torch.tensor([0]), torch.tensor([[-1, 0, 0, -1, 1]]),
    ...                    torch.tensor([[0, 1, 1, 0, 1]]), 1.0).tolist()
    [[1.0, 1.0, 0.5, 1.0, 1.0]]
    """
    ends = turn_token_rewards(turn_gammas - gamma, episode, turn, mask)
    return torch.full(mask.shape, float(gamma), dtype=turn_gammas.dtype) + ends


def truncated_importance_weights(logp_train: torch.Tensor, logp_sample: torch.Tensor, mask: torch.Tensor,
                                 c: float) -> tuple[torch.Tensor, dict]:
    """w = min(c, π_train/π_sample) per token, no gradient (a correction factor, not a learned quantity).

    Returns the weights (batch, seq), 0 where mask is 0, and their statistics. Only where `mask` is non-zero matters,
    not its value: a weighted mask (:func:`loss_weights`) weighs the loss, not the correction.
    """
    with torch.no_grad():
        ratio = torch.exp((logp_train - logp_sample).clamp(max=20.0))
        m = mask > 0
        w = torch.clamp(ratio, max=c) * m
        stats = {
            "offpolicy/is_weight_mean": float(w[m].mean()) if m.any() else 1.0,
            "offpolicy/is_weight_max": float(ratio[m].max()) if m.any() else 1.0,
            "offpolicy/is_truncated_frac": float((ratio[m] > c).float().mean()) if m.any() else 0.0,
        }
    return w, stats


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    clip_eps: float, is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate: mean over action tokens of max(−A·r, −A·clip(r, 1−ε, 1+ε)), r = π/π_old.

    `is_weights` (optional, no grad) multiply each token's term: the truncated importance correction for rollouts
    sampled by a stale policy (`old_logp` is then the behaviour policy's log-probability).
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.max(pg_loss1, pg_loss2)
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = masked_mean(per_token, mask)
    with torch.no_grad():
        approx_kl = masked_mean((ratio - 1) - log_ratio, mask)  # k3 estimator
        clipfrac = masked_mean(((ratio - 1.0).abs() > clip_eps).float(), mask)
    return loss, {"losses/policy_loss": float(loss.detach()), "losses/approx_kl": float(approx_kl),
                  "losses/clipfrac": float(clipfrac)}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_eps: float | None) -> tuple[torch.Tensor, dict]:
    """0.5 · max((V − R)², (V_clipped − R)²) over action tokens; V_clipped = V_old + clip(V − V_old, ±ε)."""
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        per_token = unclipped
    else:
        clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
        per_token = torch.max(unclipped, (clipped - returns) ** 2)
    loss = 0.5 * masked_mean(per_token, mask)
    return loss, {"losses/value_loss": float(loss.detach())}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical over the last dimension: (..., vocab) -> (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(token_t | tokens_<t) of softmax(logits / temperature) at every position t ≥ 1 (position 0 gets 0):
    logits (B, T, V), ids (B, T) -> (B, T), float32."""
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return F.pad(lp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) of the distribution that predicted each position t ≥ 1 (position 0
    gets 0): (B, T, V) -> (B, T), float32."""
    return F.pad(entropy_from_logits(logits[:, :-1] / temperature), (1, 0))


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """k3 estimate of KL(π ‖ π_ref) per token, averaged over action tokens (non-negative, low variance)."""
    log_ratio = ref_logp - logp
    per_token = torch.exp(log_ratio) - 1 - log_ratio
    loss = masked_mean(per_token, mask)
    return loss, {"losses/kl_ref": float(loss.detach())}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var[R − V] / Var[R] over action tokens (cleanrl's `explained_var`); nan when Var[R] = 0."""
    var_r = masked_var(returns, mask)
    if float(var_r) == 0.0:
        return float("nan")
    return float(1 - masked_var(returns - values, mask) / var_r)


def interpolate_weights(start: dict[str, torch.Tensor], current: dict[str, torch.Tensor],
                        alpha: float) -> dict[str, torch.Tensor]:
    """Weight-space ensemble θ = θ_start + α·(θ_current − θ_start) of two state dicts of one architecture (WiSE-FT,
    Wortsman et al. 2022), computed in float32 and returned in `current`'s dtypes. α = 1 gives `current`, 0 `start`;
    tensors that are not floating point (counters, integer buffers) are taken from `current`. Both dicts must have
    the same keys and shapes."""
    if start.keys() != current.keys():
        raise ValueError(f"interpolate_weights: the state dicts differ in keys "
                         f"({sorted(start.keys() ^ current.keys())[:5]})")
    out = {}
    for k, cur in current.items():
        if not cur.is_floating_point():
            out[k] = cur.clone()
            continue
        s = start[k].to(cur.device, torch.float32)
        if s.shape != cur.shape:
            raise ValueError(f"interpolate_weights: {k} has shape {tuple(s.shape)} against {tuple(cur.shape)}")
        out[k] = (s + alpha * (cur.float() - s)).to(cur.dtype)
    return out
