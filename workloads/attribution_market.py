"""A seeded market for attribution whose causal truth is known exactly.

Channels are campaign × slot of one advertiser. Every user has a conversion propensity
(lognormal) that drives organic conversions, and one active span (exponential length) in which
ads reach them: each channel serves a Poisson number of impressions per active day at uniform
times in the span; an impression is clicked with the channel's CTR. Causes are
independent and additive (each can produce a conversion, several may):

- an impression (view) causes a conversion with probability `view_effect`, after an
  exponential delay of mean `view_decay_h` (the effect decays with time since the touch);
  with frequency wear-out (`wearout` < 1) the user's k-th served impression of a campaign has
  `wearout`^(k−1) of the view and click effects: a budget buys frequency on the users a
  campaign reaches, so its returns diminish;
- a click causes one with probability `click_effect` after a delay of mean `click_decay_h`;
- an *interaction*: a user who saw both campaigns of `synergy` converts with probability
  `synergy_effect` (after the later of the two first touches); that conversion's credit is
  split half and half between the channels of those two touches (their Shapley split);
- organic conversions at the user's propensity rate: caused by no channel.

A *retargeting* campaign has zero effect. In the confounded market it targets users likely to
convert anyway: its reach grows with propensity and a share of its impressions lands in the
hours before the user's organic conversions. In the unconfounded market it serves at random.

`true_credit()` is the exact causal credit per channel of the realised data (conversions and
value caused by each channel, inside the simulated period). Users held out by
`schemas.holdout.is_holdout` get holdout impressions (no ad: no click, no effect, price 0).
`spend_multiplier` scales a channel's impressions (its budget), for re-simulating budget moves.
Events are written into the raw ClickHouse tables exactly as the streams sink writes them.

Channels outside adstream (`OutsideChannel`, `config.outside`) add touches (`Touch` rows) whose
effect has a known adstock and saturation (a media-mix model's shape), their daily spend (the
`outside_spend` rows `adstream spend import` writes), and the conversions they cause.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from schemas.holdout import HOLDOUT_AD_ID, holdout_draw

SLOTS = ("feed", "search", "splash")


@dataclass(frozen=True)
class Campaign:
    """A campaign's reach and effects per slot (rates are impressions per user per day)."""

    campaign_id: str
    rate: dict[str, float]
    ctr: dict[str, float]
    view_effect: dict[str, float]
    click_effect: dict[str, float]
    price: float  # per impression
    phase: tuple[float, float] = (1.0, 1.0)  # Beta(a, b) position of its impressions in a user's span
    view_decay_h: float | None = None  # mean delay of a view's effect (None: the market's)


def default_campaigns() -> tuple[Campaign, ...]:
    """Five campaigns × three slots: a funnel (upper-funnel video and prospecting early in a
    user's span with slow-acting views, search late), high-volume weak channels, rare strong
    ones, and a zero-effect retargeting campaign that serves late."""
    return (
        Campaign("cmp_brand", {"feed": 0.6, "search": 0.2, "splash": 0.3},
                 {"feed": 0.02, "search": 0.05, "splash": 0.01},
                 {"feed": 0.0015, "search": 0.004, "splash": 0.0005},
                 {"feed": 0.05, "search": 0.08, "splash": 0.03}, 0.004),
        Campaign("cmp_prospect", {"feed": 0.4, "search": 0.1, "splash": 0.3},
                 {"feed": 0.015, "search": 0.03, "splash": 0.008},
                 {"feed": 0.0004, "search": 0.002, "splash": 0.0001},
                 {"feed": 0.02, "search": 0.05, "splash": 0.01}, 0.002),
        Campaign("cmp_search", {"feed": 0.05, "search": 0.4, "splash": 0.02},
                 {"feed": 0.02, "search": 0.08, "splash": 0.01},
                 {"feed": 0.002, "search": 0.006, "splash": 0.001},
                 {"feed": 0.06, "search": 0.12, "splash": 0.04}, 0.01),
        Campaign("cmp_video", {"feed": 0.2, "search": 0.02, "splash": 0.4},
                 {"feed": 0.01, "search": 0.02, "splash": 0.015},
                 {"feed": 0.006, "search": 0.004, "splash": 0.005},
                 {"feed": 0.03, "search": 0.04, "splash": 0.03}, 0.006, (1.0, 3.0), 36.0),
        Campaign("cmp_retarget", {"feed": 0.5, "search": 0.1, "splash": 0.3},
                 {"feed": 0.03, "search": 0.05, "splash": 0.02},
                 {"feed": 0.0, "search": 0.0, "splash": 0.0},
                 {"feed": 0.0, "search": 0.0, "splash": 0.0}, 0.005, (6.0, 1.0)),
    )  # fmt: skip


@dataclass(frozen=True)
class OutsideChannel:
    """A channel outside adstream (UTM source / medium / campaign) with known adstock and saturation.

    It spends `daily_spend` a day (times a seeded day-to-day factor, mean 1, and the channel's
    `spend_multiplier`) and buys touches at `cost_per_touch`, each landing on a user active that
    day at a uniform time (a click or a view: `interaction`). Its effect follows a media-mix
    model's shape exactly: adstock A_d = s_d + `decay`·A_{d−1} (geometric carry-over of spend)
    and a Hill saturation, so the conversions it causes on day d are Poisson with mean
    `beta` · A_dᵃ / (A_dᵃ + Kᵃ) (a = `shape`, K = `half_saturation`). Each caused conversion goes
    to the user of one of its touches, drawn with the adstock's weights (a touch k days old
    weighs decay^k), at a uniform time after the touch within day d: causal credit to this channel.
    """

    source: str
    medium: str
    campaign: str | None
    daily_spend: float
    cost_per_touch: float
    beta: float  # caused conversions a day at full saturation
    half_saturation: float  # adstocked spend at half of beta
    shape: float = 1.0
    decay: float = 0.5
    interaction: str = "click"
    spend_jitter: float = 0.3  # day-to-day spend factor: lognormal with this sigma (mean 1)

    @property
    def name(self) -> str:
        """The channel's name as attribution gives it at campaign granularity (`OUTSIDE_SQL`)."""
        tail = f"/{self.campaign}" if self.campaign else ""
        return f"{self.source}/{self.medium}{tail}"

    def response(self, adstock: np.ndarray) -> np.ndarray:
        """Expected caused conversions a day at adstocked spend `adstock` (the true curve)."""
        a = np.power(np.maximum(adstock, 0.0), self.shape)
        return np.asarray(self.beta * a / (a + self.half_saturation**self.shape), dtype=np.float64)


def default_outside(effect: float = 1.0) -> tuple[OutsideChannel, ...]:
    """Three outside channels: paid search near saturation, email cheap and unsaturated with a
    long carry-over, social views with a weak effect (`effect` scales each one's ceiling `beta`)."""
    return (
        OutsideChannel("google", "cpc", "brand", 60.0, 0.05, 9.0 * effect, 40.0, 1.5, 0.3),
        OutsideChannel("newsletter", "email", None, 8.0, 0.004, 4.0 * effect, 40.0, 1.0, 0.7),
        OutsideChannel("facebook", "social", "spring", 30.0, 0.01, 1.5 * effect, 30.0, 1.0, 0.5, "view"),
    )


@dataclass(frozen=True)
class AttributionMarketConfig:
    """The market's knobs; the defaults give ~15 channels and a few thousand conversions."""

    seed: int = 0
    n_users: int = 20_000
    days: float = 14.0
    start: int = 1_793_491_200  # 2026-11-01 00:00 UTC
    confounded: bool = False
    base_rate: float = 0.004  # organic conversions per user per day at propensity 1
    propensity_sigma: float = 1.0
    view_decay_h: float = 12.0
    click_decay_h: float = 48.0
    click_delay_s: float = 30.0
    synergy: tuple[str, str] = ("cmp_brand", "cmp_video")
    synergy_effect: float = 0.03
    retarget_campaign: str = "cmp_retarget"
    retarget_gamma: float = 1.5  # confounded reach ∝ propensity^gamma
    retarget_before_share: float = 0.6  # confounded: share of its impressions just before a conversion
    retarget_lead_h: float = 6.0
    value_mean: float = 50.0
    active_days: float = 3.0  # mean length of a user's active span (ads reach them only then)
    holdout_share: float = 0.0
    holdout_salt: str = "adstream-holdout"
    spend_multiplier: dict[str, float] = field(default_factory=dict)  # channel "cmp:slot" → factor
    campaigns: tuple[Campaign, ...] = field(default_factory=default_campaigns)
    outside: tuple[OutsideChannel, ...] = ()  # channels outside adstream (`default_outside()`)
    advertiser_id: str = "adv_attr"
    prefix: str = "am"
    # day-to-day budget of each campaign: a lognormal factor (mean 1) per campaign and day, drawn
    # from its own generator (0: none, the draws stay as they were); a media-mix model needs it
    daily_jitter: float = 0.0
    # frequency wear-out: each further served impression of a campaign to the same user keeps this
    # share of the previous one's effect (view and click), so a campaign's budget, which buys
    # frequency on the users it reaches, has diminishing returns (1: none, the draws stay as they were)
    wearout: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.wearout <= 1:
            raise ValueError(f"wearout {self.wearout!r} must be in (0, 1]")


@dataclass
class MarketData:
    """The generated events as columns, and the causal ledger."""

    channels: tuple[str, ...]
    imp: dict[str, np.ndarray]  # user, t (s), channel, holdout
    clk: dict[str, np.ndarray]  # user, t, imp (index into imp)
    conv: dict[str, np.ndarray]  # user, t, value, cause (channel index, -1 organic, -2 synergy)
    synergy_channels: np.ndarray  # (n_conv, 2): the two channels of a synergy conversion, else -1
    config: AttributionMarketConfig
    # outside touches: user, t, channel (index into `channels`, after the own ones); and per
    # outside channel its daily spend and adstock (rows: channels of `config.outside`)
    touch: dict[str, np.ndarray] = field(default_factory=dict)
    outside_spend: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    outside_adstock: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))

    def true_credit(self) -> tuple[np.ndarray, np.ndarray]:
        """Conversions and value caused by each channel (synergy split 50/50), in-period only."""
        k = len(self.channels)
        cause = self.conv["cause"]
        val = self.conv["value"]
        direct = cause >= 0
        credit: np.ndarray = np.bincount(cause[direct], minlength=k).astype(np.float64)
        value: np.ndarray = np.bincount(cause[direct], weights=val[direct], minlength=k).astype(np.float64)
        syn = cause == -2
        for j in (0, 1):
            ch = self.synergy_channels[syn, j]
            credit += 0.5 * np.bincount(ch, minlength=k)
            value += 0.5 * np.bincount(ch, weights=val[syn], minlength=k)
        return credit, value

    def expected_credit(self) -> tuple[np.ndarray, np.ndarray]:
        """Expected conversions and value caused by each channel in the period, given the touches
        that were served: `true_credit` with its coin flips (clicks, effects, delays, outside
        Poisson draws) replaced by their probabilities.

        One re-simulation's realised credit moves by tens of conversions with any change of
        budget (the draws after a changed Poisson count all shift): two plans 2 % apart in one
        channel differed by 40 true conversions. The expectation given the touches keeps only
        the noise of the touch counts, so budget plans can be compared by it.
        """
        cfg = self.config
        k, own = len(self.channels), len(SLOTS) * len(cfg.campaigns)
        T = cfg.days * 86400.0
        ch, t = self.imp["channel"], self.imp["t"]
        served = ~self.imp["holdout"]
        left = np.maximum(T - t, 0.0)
        camps = [(c, s) for c in cfg.campaigns for s in SLOTS]
        v_decay = np.array([(c.view_decay_h or cfg.view_decay_h) * 3600.0 for c, _ in camps])
        view = np.array([c.view_effect[s] for c, s in camps])[ch] * -np.expm1(-left / v_decay[ch])
        # a click's effect: the click's delay then the effect's, two exponential waits
        click = np.array([c.ctr[s] * c.click_effect[s] for c, s in camps])[ch] * _two_waits_cdf(
            left, cfg.click_delay_s, cfg.click_decay_h * 3600.0
        )
        wear = wear_factor(cfg, self.imp["user"], ch // len(SLOTS), served)
        credit: np.ndarray = np.bincount(ch[served], weights=((view + click) * wear)[served], minlength=k)
        cid = {c.campaign_id: i for i, c in enumerate(cfg.campaigns)}
        first_a, first_b = (
            _first_touch(self.imp["user"], t, served & (ch // len(SLOTS) == cid[name]), cfg.n_users)
            for name in cfg.synergy
        )
        both = (first_a >= 0) & (first_b >= 0)
        a, b = first_a[both], first_b[both]
        wait = np.maximum(T - np.maximum(t[a], t[b]), 0.0) / (cfg.view_decay_h * 3600.0)
        syn = cfg.synergy_effect * -np.expm1(-wait)
        for x in (a, b):  # the interaction's credit, half to each campaign's first touch
            credit += 0.5 * np.bincount(ch[x], weights=syn, minlength=k)
        credit[own:] += self.outside_expected()
        return credit, credit * cfg.value_mean

    def outside_expected(self, multiplier: dict[str, float] | None = None) -> np.ndarray:
        """Each outside channel's expected caused conversions in the period, on the same days with
        its daily spend scaled by `multiplier` (name → factor; the adstock scales with it): a
        budget move's outcome without redrawing the day-to-day spend, which a re-simulation
        redraws for all but the first outside channel."""
        mult = multiplier or {}
        return np.array(
            [float(o.response(mult.get(o.name, 1.0) * self.outside_adstock[j]).sum())
             for j, o in enumerate(self.config.outside)]
        )  # fmt: skip

    def spend(self) -> np.ndarray:
        """Spend per channel (served impressions × price; an outside channel's daily spend)."""
        price = np.array([c.price for c in self.config.campaigns for _ in SLOTS])
        served = ~self.imp["holdout"]
        n_own = price.shape[0]
        counts = np.bincount(self.imp["channel"][served], minlength=n_own)
        own = np.asarray(counts * price, dtype=np.float64)
        return np.concatenate([own, self.outside_spend.sum(axis=1) if self.outside_spend.size else []])

    @property
    def n_events(self) -> int:
        touches = self.touch["t"].shape[0] if self.touch else 0
        return int(self.imp["t"].shape[0] + self.clk["t"].shape[0] + self.conv["t"].shape[0] + touches)


def channel_names(cfg: AttributionMarketConfig) -> tuple[str, ...]:
    """The channels in slot_campaign form (`campaign:slot`), as attribution names them, then the
    outside channels (`source/medium[/campaign]`)."""
    own = tuple(f"{c.campaign_id}:{s}" for c in cfg.campaigns for s in SLOTS)
    return own + tuple(o.name for o in cfg.outside)


def wear_factor(cfg: AttributionMarketConfig, user: np.ndarray, campaign: np.ndarray, served: np.ndarray
                ) -> np.ndarray:  # fmt: skip
    """Each impression's share of its channel's effect: `cfg.wearout` to the power of the served
    impressions of its campaign that the user saw before it (rows sorted by user, then time)."""
    out = np.ones(user.shape[0])
    if cfg.wearout == 1.0 or not served.any():
        return out
    idx = np.flatnonzero(served)
    key = user[idx] * len(cfg.campaigns) + campaign[idx]
    order = np.argsort(key, kind="stable")  # stable: time order within each (user, campaign)
    k = key[order]
    at = np.arange(k.shape[0])
    start = np.maximum.accumulate(np.where(np.r_[True, k[1:] != k[:-1]], at, 0))
    out[idx[order]] = cfg.wearout ** (at - start).astype(np.float64)
    return out


def _two_waits_cdf(x: np.ndarray, m1: float, m2: float) -> np.ndarray:
    """P(E1 + E2 ≤ x) for independent exponential waits of means m1 and m2."""
    if abs(m1 - m2) < 1e-9 * max(m1, m2):
        return np.asarray(1.0 - np.exp(-x / m1) * (1.0 + x / m1))
    return np.asarray(1.0 - (m2 * np.exp(-x / m2) - m1 * np.exp(-x / m1)) / (m2 - m1))


def _cat(xs: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)


def _outside(
    cfg: AttributionMarketConfig, rng: np.random.Generator, span: tuple[np.ndarray, np.ndarray], first: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The outside channels' touches, caused conversions (user, t, cause), daily spend, adstock."""
    days = int(np.ceil(cfg.days))
    start, end = span
    spend = np.zeros((len(cfg.outside), days))
    adstock = np.zeros((len(cfg.outside), days))
    tu, tt, tc, cu, ct, cc = [], [], [], [], [], []
    for j, o in enumerate(cfg.outside):
        mult = cfg.spend_multiplier.get(o.name, 1.0)
        jitter = rng.lognormal(-0.5 * o.spend_jitter**2, o.spend_jitter, days)
        spend[j] = o.daily_spend * jitter * mult
        carry = 0.0
        t_all, u_all, d_all = [], [], []
        for d in range(days):
            carry = spend[j, d] + o.decay * carry
            adstock[j, d] = carry
            lo, hi = d * 86400.0, min((d + 1) * 86400.0, cfg.days * 86400.0)
            active = np.flatnonzero((start < hi) & (end > lo))
            n = rng.poisson(spend[j, d] / o.cost_per_touch) if active.size else 0
            users = active[rng.integers(0, active.size, n)] if n else np.zeros(0, np.int64)
            a, b = np.maximum(start[users], lo), np.minimum(end[users], hi)
            t_all.append(a + rng.random(n) * (b - a))
            u_all.append(users)
            d_all.append(np.full(n, d))
            # the day's caused conversions, each on one touch so far (weights decay^age in days)
            caused = rng.poisson(float(o.response(adstock[j, d : d + 1])[0]))
            done_t, done_u, done_d = np.concatenate(t_all), np.concatenate(u_all), np.concatenate(d_all)
            if caused and done_t.size:
                w = o.decay ** (d - done_d).astype(float)
                pick = rng.choice(done_t.size, caused, p=w / w.sum())
                t0 = np.maximum(done_t[pick], lo)
                cu.append(done_u[pick])
                ct.append(t0 + rng.random(caused) * (hi - t0))
                cc.append(np.full(caused, first + j))
        tu += u_all
        tt += t_all
        tc.append(np.full(sum(x.size for x in u_all), first + j))
    touch = {"user": _cat(tu, np.int64), "t": _cat(tt, np.float64), "channel": _cat(tc, np.int64)}
    order = np.lexsort((touch["t"], touch["user"]))
    touch = {k: v[order] for k, v in touch.items()}
    conv = {"user": _cat(cu, np.int64), "t": _cat(ct, np.float64), "cause": _cat(cc, np.int64)}
    return touch, conv, spend, adstock


def simulate(cfg: AttributionMarketConfig) -> MarketData:
    """Generate one market run (deterministic in `cfg.seed`)."""
    rng = np.random.default_rng([cfg.seed, 20])
    T = cfg.days * 86400.0
    n = cfg.n_users
    names = channel_names(cfg)
    prop = rng.lognormal(0.0, cfg.propensity_sigma, n)
    prop /= prop.mean()
    # organic conversions first: the confounded retargeting aims at them
    n_org = rng.poisson(cfg.base_rate * cfg.days * prop)
    org_user = np.repeat(np.arange(n), n_org)
    org_t = rng.uniform(0, T, org_user.shape[0])

    # each user is reachable during one active span (start uniform, exponential length)
    span_start = rng.uniform(-cfg.active_days * 86400.0, T, n)
    span_end = np.minimum(T, span_start + rng.exponential(cfg.active_days * 86400.0, n))
    span_start = np.maximum(0.0, span_start)
    span_days = np.maximum(0.0, span_end - span_start) / 86400.0
    users, times, chans = [], [], []
    day_factor = daily_factors(cfg)
    thin_rng = np.random.default_rng([cfg.seed, 23])
    for ci, camp in enumerate(cfg.campaigns):
        for si, slot in enumerate(SLOTS):
            ch = ci * len(SLOTS) + si
            mult = cfg.spend_multiplier.get(names[ch], 1.0)
            reach = np.ones(n)
            retarget = camp.campaign_id == cfg.retarget_campaign
            if retarget and cfg.confounded:
                reach = prop**cfg.retarget_gamma
                reach /= reach.mean()
            top = float(day_factor[ci].max()) if day_factor is not None else 1.0
            counts = rng.poisson(camp.rate[slot] * span_days * mult * reach * top)
            u = np.repeat(np.arange(n), counts)
            t = span_start[u] + rng.beta(*camp.phase, u.shape[0]) * (span_end[u] - span_start[u])
            if day_factor is not None:  # thinned to the day's budget (its own generator)
                day = np.minimum((t // 86400).astype(np.int64), day_factor.shape[1] - 1)
                kept = thin_rng.random(u.shape[0]) < day_factor[ci, day] / top
                u, t = u[kept], t[kept]
            if retarget and cfg.confounded and org_user.shape[0]:
                # a share lands in the hours before one of the user's organic conversions
                pick = rng.random(u.shape[0]) < cfg.retarget_before_share
                has = np.zeros(n, dtype=bool)
                has[org_user] = True
                pick &= has[u]
                order = np.argsort(org_user, kind="stable")
                first = np.searchsorted(org_user[order], u[pick])
                cnt = np.bincount(org_user, minlength=n)[u[pick]]
                which = order[first + (rng.random(first.shape[0]) * cnt).astype(np.int64)]
                lead = rng.exponential(cfg.retarget_lead_h * 3600.0, which.shape[0])
                t[pick] = np.clip(org_t[which] - lead, 0, T - 1)
            users.append(u)
            times.append(t)
            chans.append(np.full(u.shape[0], ch, dtype=np.int64))
    iu, it, ich = np.concatenate(users), np.concatenate(times), np.concatenate(chans)
    order = np.lexsort((ich, it, iu))
    iu, it, ich = iu[order], it[order], ich[order]
    camp_of = ich // len(SLOTS)
    hold = np.zeros(iu.shape[0], dtype=bool)
    if cfg.holdout_share > 0:
        cids = [c.campaign_id for c in cfg.campaigns]
        # the draw per (user, campaign) pair, as serving makes it
        pairs, inv = np.unique(iu * len(cids) + camp_of, return_inverse=True)
        draw = np.array(
            [holdout_draw(f"u{p // len(cids):06d}", cids[p % len(cids)], cfg.holdout_salt) for p in pairs]
        )
        hold = draw[inv] < cfg.holdout_share

    ctr = np.array([c.ctr[s] for c in cfg.campaigns for s in SLOTS])
    v_eff = np.array([c.view_effect[s] for c in cfg.campaigns for s in SLOTS])
    c_eff = np.array([c.click_effect[s] for c in cfg.campaigns for s in SLOTS])
    served = ~hold
    wear = wear_factor(cfg, iu, camp_of, served)
    clicked = served & (rng.random(iu.shape[0]) < ctr[ich])
    ck_idx = np.flatnonzero(clicked)
    ck_t = it[ck_idx] + rng.exponential(cfg.click_delay_s, ck_idx.shape[0])

    v_decay = np.array([c.view_decay_h or cfg.view_decay_h for c in cfg.campaigns for _ in SLOTS]) * 3600.0
    view_hit = served & (rng.random(iu.shape[0]) < v_eff[ich] * wear)
    vc_t = it[view_hit] + rng.exponential(v_decay[ich[view_hit]])
    click_hit = rng.random(ck_idx.shape[0]) < c_eff[ich[ck_idx]] * wear[ck_idx]
    cc_t = ck_t[click_hit] + rng.exponential(cfg.click_decay_h * 3600.0, int(click_hit.sum()))

    # interaction: first served touch of each synergy campaign per user
    cid = {c.campaign_id: i for i, c in enumerate(cfg.campaigns)}
    a, b = cid[cfg.synergy[0]], cid[cfg.synergy[1]]
    first_a = _first_touch(iu, it, served & (camp_of == a), n)
    first_b = _first_touch(iu, it, served & (camp_of == b), n)
    both = np.flatnonzero((first_a >= 0) & (first_b >= 0))
    syn_hit = both[rng.random(both.shape[0]) < cfg.synergy_effect]
    syn_t = np.maximum(it[first_a[syn_hit]], it[first_b[syn_hit]]) + rng.exponential(
        cfg.view_decay_h * 3600.0, syn_hit.shape[0]
    )
    syn_ch = np.stack([ich[first_a[syn_hit]], ich[first_b[syn_hit]]], axis=1)

    # outside channels draw from their own generator: the own market's draws stay as they were
    out_rng = np.random.default_rng([cfg.seed, 21])
    touch, oc, o_spend, o_adstock = _outside(
        cfg, out_rng, (span_start, span_end), len(SLOTS) * len(cfg.campaigns)
    )
    conv_user = np.concatenate([org_user, iu[view_hit], iu[ck_idx[click_hit]], oc["user"], syn_hit])
    conv_t = np.concatenate([org_t, vc_t, cc_t, oc["t"], syn_t])
    cause = np.concatenate([
        np.full(org_user.shape[0], -1), ich[view_hit], ich[ck_idx[click_hit]], oc["cause"],
        np.full(syn_hit.shape[0], -2),
    ])  # fmt: skip
    syn_pairs = np.full((conv_user.shape[0], 2), -1, dtype=np.int64)
    syn_pairs[conv_user.shape[0] - syn_hit.shape[0] :] = syn_ch
    keep = conv_t < T
    value = rng.lognormal(np.log(cfg.value_mean) - 0.125, 0.5, conv_user.shape[0] - oc["user"].shape[0])
    # the outside conversions' values from their own generator (the own draws stay as they were)
    at = org_user.shape[0] + iu[view_hit].shape[0] + ck_idx[click_hit].shape[0]
    value = np.insert(value, at, out_rng.lognormal(np.log(cfg.value_mean) - 0.125, 0.5, oc["user"].shape[0]))
    order = np.argsort(conv_t[keep], kind="stable")
    return MarketData(
        names,
        {"user": iu, "t": it, "channel": ich, "holdout": hold},
        {"user": iu[ck_idx], "t": ck_t, "imp": ck_idx},
        {
            "user": conv_user[keep][order], "t": conv_t[keep][order], "value": value[keep][order],
            "cause": cause[keep][order],
        },
        syn_pairs[keep][order],
        cfg,
        touch,
        o_spend,
        o_adstock,
    )  # fmt: skip


def daily_factors(cfg: AttributionMarketConfig) -> np.ndarray | None:
    """Each campaign's budget factor per day (campaigns × days; mean 1), None without jitter."""
    if cfg.daily_jitter <= 0:
        return None
    rng = np.random.default_rng([cfg.seed, 22])
    sigma = cfg.daily_jitter
    return rng.lognormal(-0.5 * sigma**2, sigma, (len(cfg.campaigns), int(np.ceil(cfg.days))))


def _first_touch(user: np.ndarray, t: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    """Index of each user's earliest touch among `mask` (−1 if none); rows are sorted by (user, t)."""
    idx = np.flatnonzero(mask)
    out = np.full(n, -1, dtype=np.int64)
    # rows are sorted by user then time: the first row of each user within idx is its earliest
    u = user[idx]
    first = np.ones(idx.shape[0], dtype=bool)
    first[1:] = u[1:] != u[:-1]
    out[u[first]] = idx[first]
    return out


IMPRESSION_COLUMNS = (
    "event_id", "ts", "ts_ms", "user_id", "request_id", "ad_id", "campaign_id", "advertiser_id", "slot",
    "position", "price", "kafka_partition", "kafka_offset",
)  # fmt: skip
CLICK_COLUMNS = ("event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id", "campaign_id",
                 "kafka_partition", "kafka_offset")  # fmt: skip
TOUCH_COLUMNS = ("event_id", "ts", "ts_ms", "user_id", "advertiser_id", "source", "medium", "campaign",
                 "interaction", "cost", "kafka_partition", "kafka_offset")  # fmt: skip
SPEND_COLUMNS = ("day", "advertiser_id", "source", "medium", "campaign", "spend", "version")
CONVERSION_COLUMNS = ("event_id", "ts", "ts_ms", "user_id", "campaign_id", "advertiser_id", "value",
                      "kafka_partition", "kafka_offset")  # fmt: skip


def raw_columns(data: MarketData) -> dict[str, tuple[tuple[str, ...], list[list[Any]]]]:
    """The events as columns of the raw tables (impressions, clicks, conversions), sink layout."""
    cfg = data.config
    p = cfg.prefix
    imp, clk, conv = data.imp, data.clk, data.conv
    n_i, n_c, n_v = imp["t"].shape[0], clk["t"].shape[0], conv["t"].shape[0]
    slots = np.array(SLOTS, dtype=object)[imp["channel"] % len(SLOTS)]
    camps = np.array([c.campaign_id for c in cfg.campaigns], dtype=object)[imp["channel"] // len(SLOTS)]
    price = np.array([c.price for c in cfg.campaigns for _ in SLOTS])[imp["channel"]]
    hold = imp["holdout"]
    users = np.array([f"u{u:06d}" for u in range(cfg.n_users)], dtype=object)
    imp_ids = np.array([f"{p}i{i:09d}" for i in range(n_i)], dtype=object)
    ad_ids = np.where(hold, HOLDOUT_AD_ID, camps + "_ad")
    ts_i = cfg.start + imp["t"]
    ts_c = cfg.start + clk["t"]
    ts_v = cfg.start + conv["t"]
    zeros = [0] * max(n_i, n_c, n_v)
    impressions = [
        imp_ids.tolist(), ts_i.astype(np.int64).tolist(), (ts_i * 1000).astype(np.int64).tolist(),
        users[imp["user"]].tolist(), imp_ids.tolist(), ad_ids.tolist(), camps.tolist(),
        [cfg.advertiser_id] * n_i, slots.tolist(), zeros[:n_i], np.where(hold, 0.0, price).tolist(),
        zeros[:n_i], list(range(n_i)),
    ]  # fmt: skip
    clicks = [
        [f"{p}c{i:09d}" for i in range(n_c)], ts_c.astype(np.int64).tolist(),
        (ts_c * 1000).astype(np.int64).tolist(),
        users[clk["user"]].tolist(), imp_ids[clk["imp"]].tolist(), ad_ids[clk["imp"]].tolist(),
        camps[clk["imp"]].tolist(), zeros[:n_c], list(range(n_c)),
    ]  # fmt: skip
    conversions = [
        [f"{p}v{i:09d}" for i in range(n_v)], ts_v.astype(np.int64).tolist(),
        (ts_v * 1000).astype(np.int64).tolist(),
        users[conv["user"]].tolist(), ["cmp_site"] * n_v, [cfg.advertiser_id] * n_v, conv["value"].tolist(),
        zeros[:n_v], list(range(n_v)),
    ]  # fmt: skip
    out = {
        "impressions": (IMPRESSION_COLUMNS, impressions),
        "clicks": (CLICK_COLUMNS, clicks),
        "conversions": (CONVERSION_COLUMNS, conversions),
    }
    if data.touch and data.touch["t"].shape[0]:
        out["touches"] = (TOUCH_COLUMNS, _touch_columns(data, users))
    return out


def _touch_columns(data: MarketData, users: np.ndarray) -> list[list[Any]]:
    cfg, tch = data.config, data.touch
    n = tch["t"].shape[0]
    own = len(SLOTS) * len(cfg.campaigns)
    chans = [cfg.outside[c - own] for c in tch["channel"].tolist()]
    ts = cfg.start + tch["t"]
    return [
        [f"{cfg.prefix}t{i:09d}" for i in range(n)], ts.astype(np.int64).tolist(),
        (ts * 1000).astype(np.int64).tolist(), users[tch["user"]].tolist(), [cfg.advertiser_id] * n,
        [o.source for o in chans], [o.medium for o in chans], [o.campaign for o in chans],
        [o.interaction for o in chans], [o.cost_per_touch for o in chans], [0] * n, list(range(n)),
    ]  # fmt: skip


def spend_rows(data: MarketData) -> list[tuple[Any, ...]]:
    """The outside channels' daily spend as rows of `outside_spend` (as `adstream spend import`)."""
    from datetime import UTC, datetime, timedelta

    first = datetime.fromtimestamp(data.config.start, UTC).date()
    return [
        (first + timedelta(days=d), data.config.advertiser_id, o.source, o.medium, o.campaign or "",
         float(data.outside_spend[j, d]), 1)
        for j, o in enumerate(data.config.outside) for d in range(data.outside_spend.shape[1])
    ]  # fmt: skip


def outside_lift_csv(data: MarketData, holdout: float = 0.2, seed: int = 0) -> str:
    """The outside channels' lift experiments as a lift file (`adstream attribution mmm
    --lift-file`), as a geo test would report them: each channel turned off in a `holdout` share
    of the market for the whole period, the incremental conversions a day at its mean daily spend
    (x 0, delta_x that spend) estimated by the difference of the two regions' daily rates.

    The estimate is the channel's expected caused conversions a day (`outside_expected`) plus a
    normal error with the difference's Poisson standard error on the market's conversions,
    sqrt(B / T · (1 / (1 − h) + 1 / h)) (B conversions a day, T days, h the holdout): the least
    noise such a test can have (real geo tests add the regions' own variation)."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout {holdout!r} must be in (0, 1)")
    cfg = data.config
    days = float(cfg.days)
    t = data.conv["t"]
    per_day = float(np.count_nonzero((t >= 0) & (t < days * 86400.0))) / days
    se = float(np.sqrt(per_day / days * (1.0 / (1.0 - holdout) + 1.0 / holdout)))
    caused = data.outside_expected() / days
    rng = np.random.default_rng([cfg.seed, seed, 0x11F7])
    lines = ["channel,x,delta_x,delta_y,sigma"]
    for j, o in enumerate(cfg.outside):
        est = float(caused[j]) + se * float(rng.standard_normal())
        lines.append(f"{o.name},0,{float(data.outside_spend[j].mean()):.6g},{est:.6g},{se:.6g}")
    return "\n".join(lines) + "\n"


def write_raw(backend: Any, data: MarketData, batch: int = 200_000) -> int:
    """Insert the events into the raw tables (columnar, in batches); returns the rows written."""
    total = 0
    for table, (cols, columns) in raw_columns(data).items():
        n = len(columns[0])
        for lo in range(0, n, batch):
            backend.insert_columnar(table, cols, [c[lo : lo + batch] for c in columns])
        total += n
    if data.config.outside:
        backend.insert("outside_spend", SPEND_COLUMNS, spend_rows(data))
    return total


def period(cfg: AttributionMarketConfig) -> tuple[int, int]:
    """[since, until) of the simulated period in epoch seconds."""
    return cfg.start, cfg.start + int(cfg.days * 86400)


def resimulate(cfg: AttributionMarketConfig, multiplier: dict[str, float]) -> MarketData:
    """The same market with channel budgets scaled (same seed: common random numbers)."""
    return simulate(replace(cfg, spend_multiplier=multiplier))
