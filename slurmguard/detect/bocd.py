"""Batched Bayesian online change-point detection (BOCD) with verification.

The model is Adams & MacKay's recursion (Falcon appendix 9.1) with a
Normal-Gamma conjugate prior on the *log* step time, a constant hazard H and a
truncated run length. Working in log space makes a 10% slowdown the same
additive shift (0.095) whatever the job's step time, so one prior fits every
job.

Why not the papers' rule "P(r_t = 0 | x_1:t) > 0.9": in the Adams-MacKay
recursion the change-point joint is H * sum_r P(r_{t-1}, x_1:t-1) pi_t(r) and the
growth joints are (1 - H) * P(r_{t-1}, x_1:t-1) pi_t(r); normalising gives
P(r_t = 0 | x_1:t) = H exactly, at every step, whatever the data. That rule can
never fire (the benchmark measures it). The detector therefore fires on the
posterior mass of runs that started within the last `short_run` samples,
P(r_t < k) > change_probability ("short_mass"), or when the MAP run length
drops below the age of the current level ("map_drop", the default: unlike the
short-mass rule it has no window of opportunity, so a change the posterior
becomes sure of only after k samples is still caught; the benchmark shows the
FNR difference). A candidate is then *verified* (Greyhound 4.2): the typical step
time after the candidate differs from the one before by at least
`verify_min_change`, otherwise it is jitter. A verified change resets the
series so that its next change is measured against the new level.

Layout and cost: all series advance together. Per series and run length only
mu, beta and alpha*log(beta) are stored (kappa and alpha depend on the run
length alone); the predictive density needs one log and one exp per cell, the
state is double-buffered with one spare column so the run-length shift costs no
copy, and runs longer than the cap share the last slot, whose statistics forget
exponentially (a window of about `max_run_length` samples).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import lgamma, log, pi
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from slurmguard.config import BocdPolicy

Rule = Literal["short_mass", "map_drop", "r0"]

#: Prior pseudo-count on the mean of a new run: vague, because the level after a
#: change is unknown (a new run must be able to sit 10-100% away from the old).
KAPPA0 = 0.01
#: Prior shape of the precision; beta0 = ALPHA0 * prior_cv**2.
ALPHA0 = 1.0


@dataclass(frozen=True)
class ChangePoint:
    """A change of the step-time level of one series.

    index: sample index (0-based) of the first sample of the new level.
    detected_at: sample index at which the change was reported.
    direction: "slower" (step time went up) or "faster".
    mean_before/after: arithmetic means (seconds) over the verification windows.
    level_before/after: medians used by the verification (seconds), robust to a
    GC pause or checkpoint inside a window.
    """

    series: int
    index: int
    detected_at: int
    direction: Literal["slower", "faster"]
    mean_before: float
    mean_after: float
    level_before: float
    level_after: float

    @property
    def relative_change(self) -> float:
        """(after - before) / before of the verified levels."""
        return self.level_after / self.level_before - 1.0

    @property
    def delay(self) -> int:
        """Samples between the change and its report (0 = on the first slow sample)."""
        return self.detected_at - self.index

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "detected_at": self.detected_at,
            "direction": self.direction,
            "mean_before": round(self.mean_before, 6),
            "mean_after": round(self.mean_after, 6),
            "median_before": round(self.level_before, 6),
            "median_after": round(self.level_after, 6),
            "relative_change": round(self.relative_change, 4),
        }


class BatchBocd:
    """BOCD over `n_series` step-time series at once: the candidate generator
    of the step detector (`advance`, `map_candidates`, `restart`), and on its
    own the baselines the benchmark compares against.

    Feed one sample per series per call to `update` (seconds, NaN = no sample
    for that series this time); it returns the change points verified by this
    sample. Thresholds come from `policy` (Policy().detection.bocd by default).

    verify=False gives the plain-BOCD baseline (every fire is reported);
    verify=True the earlier detector, kept as a baseline: BOCD on raw log step
    times plus a fixed 10% check of the after-window median (it has no model of
    step patterns, checkpoints or hiccups, which is what slurmguard.detect.steps
    adds).
    rule: policy.rule by default ("map_drop"), "short_mass", or "r0" (the literal
    P(r_t = 0) > change_probability rule, kept to show that it never fires).
    """

    def __init__(
        self,
        n_series: int,
        policy: BocdPolicy | None = None,
        *,
        verify: bool = True,
        rule: Rule | None = None,
        dtype: type = np.float32,
    ) -> None:
        p = policy or BocdPolicy()
        if n_series < 1:
            raise ValueError("n_series must be >= 1")
        self.policy = p
        self.n = n_series
        self.R = R = p.max_run_length
        self.k = min(p.short_run, R - 1)
        self.verify = verify
        self.rule = rule or p.rule
        self.dtype = dt = np.dtype(dtype)
        self.H = float(p.hazard)
        self.W = p.verify_window
        self.min_after = p.verify_min_after if verify else 1
        # a level needs this many samples before a change against it is believed
        self.min_before = max(3, (self.W + 1) // 2)
        self.beta0 = ALPHA0 * p.prior_cv**2

        # Per-slot constants. Slot j holds a run of j+1 samples; the last slot
        # stands for "R or more" with fixed kappa/alpha (exponential forgetting).
        npts = np.arange(1, R + 1, dtype=np.float64)
        kappa = KAPPA0 + npts
        alpha = ALPHA0 + npts / 2.0
        # per-slot constants as (R, 1) columns: the state is run-length major
        self._a = (kappa / (2.0 * (kappa + 1.0))).astype(dt)[:, None]
        self._b = (1.0 / (kappa + 1.0)).astype(dt)[:, None]
        self._C = np.array(
            [
                lgamma(al + 0.5) - lgamma(al) - 0.5 * log(2 * pi * (ka + 1) / ka)
                for al, ka in zip(alpha, kappa)
            ],
            dtype=dt,
        )
        # alpha of the slot a sample moves *into*: j -> j+1 (last slot stays).
        alpha_next = np.append(alpha[1:], alpha[-1])
        self._alpha_next = alpha_next.astype(dt)[:, None]
        self._alpha = alpha.astype(dt)
        self._alpha_last = float(alpha[-1])
        # Forgetting factor of the last slot: keeps its alpha (and kappa) fixed.
        self._lam = float(alpha[-1] / (alpha[-1] + 0.5))
        k0 = KAPPA0
        self._a0 = k0 / (2.0 * (k0 + 1.0))
        self._C0 = lgamma(ALPHA0 + 0.5) - lgamma(ALPHA0) - 0.5 * log(2 * pi * (k0 + 1) / k0)
        self._H0 = ALPHA0 * log(self.beta0)
        self._logH = log(self.H)
        self._log1mH = log1m = log(1.0 - self.H)
        # Fold log(1 - H) into the per-slot constant (one add fewer per cell).
        self._Cg = (self._C + log1m).astype(dt)[:, None]

        # Double-buffered state, (R+1, n_series), run length major: the update
        # of old row j lands in new row j+1, so the run-length shift is free and
        # every operation runs on contiguous blocks (reductions over run
        # lengths become adds of whole rows); row R is scratch.
        shape = (R + 1, n_series)
        self._bufs = [{name: np.zeros(shape, dt) for name in ("P", "mu", "beta", "hh")} for _ in range(2)]
        self._cur = 0
        self._d = np.empty((R, n_series), dt)
        self._t = np.empty((R, n_series), dt)
        self.mu0 = np.zeros(n_series, dt)
        self.count = np.zeros(n_series, np.int64)  # samples seen per series
        self.regime_start = np.zeros(n_series, np.int64)  # index of first sample of the current level
        self.pending = np.full(n_series, -1, np.int64)  # candidate change index, -1 = none
        self.rejected = np.full(n_series, -1, np.int64)  # last candidate found to be jitter
        # the MAP rule can name a change up to R samples back: keep R + W samples
        self.hcap = R + self.W + 2
        self.hist = np.full((n_series, self.hcap), np.nan, np.float64)
        self.max_r0 = 0.0  # largest P(r_t = 0 | x) seen (Adams-MacKay convention)
        self._rows = np.arange(n_series)
        for b in self._bufs:  # a valid (prior) state, so a first update is harmless
            b["P"][0] = 1.0
            b["beta"][:] = self.beta0
            b["hh"][:R] = (self._alpha * self._H0 / ALPHA0)[:, None]
            b["hh"][R] = self._H0

    # ------------------------------------------------------------------ state
    @property
    def posterior(self) -> np.ndarray:
        """Run-length posterior, shape (R, n_series): row j = run of j+1 samples."""
        return self._bufs[self._cur]["P"][: self.R]

    def _reset_rows(self, rows: np.ndarray, logs: np.ndarray) -> None:
        """Restart `rows` as one run holding the samples `logs` (NaN-padded, log space)."""
        if rows.size == 0:
            return
        b = self._bufs[self._cur]
        m = np.sum(~np.isnan(logs), axis=1)
        mean = np.nanmean(logs, axis=1)
        ss = np.nansum((logs - mean[:, None]) ** 2, axis=1)
        j = np.clip(m - 1, 0, self.R - 1)
        dt = self.dtype
        b["P"][:, rows] = 0.0
        b["P"][j, rows] = 1.0
        b["mu"][:, rows] = mean[None, :].astype(dt)
        b["beta"][:, rows] = dt.type(self.beta0)
        b["hh"][: self.R, rows] = (self._alpha * np.float32(self._H0 / ALPHA0)).astype(dt)[:, None]
        beta = self.beta0 + 0.5 * ss
        b["beta"][j, rows] = beta.astype(dt)
        b["hh"][j, rows] = (self._alpha[j] * np.log(beta)).astype(dt)
        self.mu0[rows] = mean.astype(dt)

    def _window(self, rows: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """History samples [start, stop) per row (absolute indices), NaN-padded to W."""
        width = self.W
        offs = np.arange(width)
        idx = stop[:, None] - width + offs[None, :]
        valid = (idx >= start[:, None]) & (idx >= 0) & (idx >= self.count[rows, None] - self.hcap)
        vals = self.hist[rows[:, None], np.mod(idx, self.hcap)]
        return np.where(valid, vals, np.nan)

    def _window_fwd(self, rows: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """First W samples of [start, stop) per row, NaN-padded."""
        offs = np.arange(self.W)
        idx = start[:, None] + offs[None, :]
        valid = idx < stop[:, None]
        vals = self.hist[rows[:, None], np.mod(idx, self.hcap)]
        return np.where(valid, vals, np.nan)

    # ------------------------------------------------------------------ update
    def update(self, x: np.ndarray) -> list[ChangePoint]:
        """Advance every series by one sample (seconds; NaN = none). Returns verified changes."""
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.n,):
            raise ValueError(f"expected {self.n} samples, got shape {x.shape}")
        missing = ~np.isfinite(x) | (x <= 0)
        any_missing = bool(missing.any())
        y = np.log(np.where(missing, 1.0, x)).astype(self.dtype)
        if any_missing:
            y = np.where(missing, self.mu0, y)
        new_rows = np.nonzero((self.count == 0) & ~missing)[0]
        self.advance(y, missing if any_missing else None)
        # record the sample
        ok = ~missing
        pos = np.mod(self.count, self.hcap)
        self.hist[self._rows[ok], pos[ok]] = x[ok]
        self.count[ok] += 1
        if new_rows.size:
            self.regime_start[new_rows] = 0
            self._reset_rows(new_rows, y[new_rows, None].astype(np.float64))
        return self._detect(ok)

    def advance(self, y: np.ndarray, missing: np.ndarray | None = None) -> None:
        """One Adams-MacKay step on log-space samples `y`; rows flagged in
        `missing` keep their state (their y must still be finite)."""
        self._kernel(y)
        if missing is not None and missing.any():
            cur = self._bufs[self._cur]
            old = self._bufs[1 - self._cur]
            mrows = np.nonzero(missing)[0]
            for name in cur:
                cur[name][:, mrows] = old[name][:, mrows]

    def restart(self, rows: np.ndarray, logs: np.ndarray) -> None:
        """Restart `rows` as one run holding the log-space samples `logs` (NaN-padded rows)."""
        self._reset_rows(np.asarray(rows), np.asarray(logs, dtype=np.float64))

    def candidates(self, age: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The candidate rule (self.rule) for levels `age` samples old: (fired,
        run length j, so the change is at the sample j before the last)."""
        if self.rule == "map_drop":
            return self.map_candidates(age)
        jstar = np.zeros(self.n, np.int64)
        if self.rule == "short_mass":
            # P(r_t < k) > change_probability, over runs younger than the level
            P = self.posterior
            k = self.k
            head = P[:k]
            lim = np.minimum(age - 1, k)
            mask = np.arange(k)[:, None] < lim[None, :]
            mass = np.where(mask, head, 0).sum(axis=0)
            fire = mass > self.policy.change_probability
            if fire.any():
                fr = np.nonzero(fire)[0]
                jstar[fr] = np.argmax(np.where(mask[:, fr], head[:, fr], -1), axis=0)
            return fire, jstar
        # "r0": the literal rule, P(r_t = 0) = H never reaches the threshold
        return np.zeros(self.n, bool) | (self.policy.change_probability < self.H), jstar

    def map_candidates(self, age: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The MAP run-length drop rule for levels `age` samples old: (fired, run
        length j of the MAP run, so the change is at the sample j before the last)."""
        P = self.posterior
        R = self.R
        jstar = np.zeros(self.n, np.int64)
        fire = np.maximum.reduce(P[: R - 1], axis=0) > P[R - 1]
        young = np.nonzero(age - 1 < R - 1)[0]
        if young.size:
            jm = np.argmax(P[:, young], axis=0)
            fire[young] = jm < age[young] - 1
            jstar[young] = jm
        old_fired = np.nonzero(fire & (age - 1 >= R - 1))[0]
        if old_fired.size:
            jstar[old_fired] = np.argmax(P[:, old_fired], axis=0)
        return fire, jstar

    def _kernel(self, y: np.ndarray) -> None:
        """One Adams-MacKay step for all series (in place, double-buffered)."""
        R = self.R
        old = self._bufs[self._cur]
        new = self._bufs[1 - self._cur]
        P, mu, beta, hh = (old[k][:R] for k in ("P", "mu", "beta", "hh"))
        d, t = self._d, self._t
        # clip to a factor e^10 around the regime level: absurd samples stay finite
        d0 = np.clip(y.astype(np.float64) - self.mu0, -10.0, 10.0)
        y = (self.mu0 + d0).astype(self.dtype)
        yc = y[None, :]
        # predictive of y under every run length, and the grown statistics
        np.subtract(yc, mu, out=d)
        np.multiply(d, self._b, out=t)
        np.add(mu, t, out=new["mu"][1:])
        np.multiply(d, d, out=d)
        np.multiply(d, self._a, out=d)
        bnew = new["beta"][1:]
        np.add(beta, d, out=bnew)
        lb = self._t
        np.log(bnew, out=lb)
        hnew = new["hh"][1:]
        np.multiply(lb, self._alpha_next, out=hnew)
        # log pi_j + log(1-H) - ref for every slot; lp0 = prior predictive
        lp0 = self._C0 + self._H0 - (ALPHA0 + 0.5) * np.log(self.beta0 + self._a0 * d0 * d0)
        lp = self._d
        np.subtract(hh, hnew, out=lp)
        np.add(lp, self._Cg, out=lp)
        # reference: the larger of the prior and the long-run densities, so
        # exp() neither overflows nor underflows for every slot at once
        ref = np.maximum(lp0, lp[R - 1])
        lp0 = lp0 - ref
        np.subtract(lp, ref.astype(self.dtype)[None, :], out=lp)
        np.exp(lp, out=lp)
        Pn = new["P"][1:]
        np.multiply(lp, P, out=Pn)  # (1-H) * P * pi / ref
        growth = np.add.reduce(Pn, axis=0).astype(np.float64)
        cp = self.H * np.exp(lp0)  # H * sum(P) * pi0 / ref
        z = growth + cp
        if self.rule == "r0":
            # Adams-MacKay's r_t = 0 joint is H * sum_r P pi_r; normalised it is H.
            evid = growth / (1.0 - self.H)
            r0 = (self.H * evid) / (self.H * evid + growth)
            self.max_r0 = max(self.max_r0, float(np.max(r0)))
        inv = (1.0 / z).astype(self.dtype)
        np.multiply(Pn, inv[None, :], out=Pn)
        newP = new["P"]
        newP[0] = (cp / z).astype(self.dtype)
        # merge the continuing long run (row R) into the last slot
        wa = newP[R - 1].astype(np.float64)
        wb = newP[R].astype(np.float64)
        ws = wa + wb
        fa = np.divide(wa, ws, out=np.ones_like(ws), where=ws > 0)
        mu_l = new["mu"][R - 1] * fa + new["mu"][R] * (1 - fa)
        beta_b = self.beta0 + self._lam * (new["beta"][R] - self.beta0)
        beta_l = new["beta"][R - 1] * fa + beta_b * (1 - fa)
        new["mu"][R - 1] = mu_l
        new["beta"][R - 1] = beta_l
        new["hh"][R - 1] = self._alpha_last * np.log(beta_l)
        newP[R - 1] = ws
        # the new run (one sample) under the prior
        new["mu"][0] = ((KAPPA0 * self.mu0 + y) / (KAPPA0 + 1.0)).astype(self.dtype)
        b0 = self.beta0 + self._a0 * d0 * d0
        new["beta"][0] = b0
        new["hh"][0] = self._alpha[0] * np.log(b0)
        self._cur = 1 - self._cur

    # ------------------------------------------------------------------ decide
    def _detect(self, ok: np.ndarray) -> list[ChangePoint]:
        n = self.count
        fire, jstar = self.candidates(n - self.regime_start)
        fire &= ok & (self.pending < 0)
        if fire.any():
            rows = np.nonzero(fire)[0]
            cand = (n[rows] - 1) - jstar[rows]
            good = cand - self.regime_start[rows] >= self.min_before
            # a rejected candidate is re-verified only while its after-window grows
            good &= (cand != self.rejected[rows]) | (n[rows] - cand <= self.W)
            self.pending[rows[good]] = cand[good]
        ready = (self.pending >= 0) & ok & (n - self.pending >= self.min_after)
        if not ready.any():
            return []
        rows = np.nonzero(ready)[0]
        cpi = self.pending[rows]
        before = self._window(rows, np.maximum(self.regime_start[rows], cpi - self.W), cpi)
        after = self._window_fwd(rows, cpi, n[rows])
        lb = row_medians(before)
        la = row_medians(after)
        rel = la / lb - 1.0
        if self.verify:
            # A real level change moves (nearly) every sample after it; a GC
            # pause or a checkpoint moves one. So a slowdown must hold for all
            # but the m//4 largest of the m samples after it (all of them when
            # m < 4), a speed-up for all but the m//4 smallest.
            thr = self.policy.verify_min_change
            srt = np.sort(after, axis=1)  # NaN padding sorts last
            m = np.sum(np.isfinite(after), axis=1)
            q = m // 4
            lo = srt[np.arange(rows.size), q]
            hi = srt[np.arange(rows.size), np.maximum(m - 1 - q, 0)]
            accept = np.where(rel > 0, lo >= lb * (1.0 + thr), hi <= lb / (1.0 + thr))
            accept &= np.isfinite(lb)
        else:
            accept = np.isfinite(lb)
        self.pending[rows] = -1
        self.rejected[rows[~accept]] = cpi[~accept]
        out: list[ChangePoint] = []
        acc = np.nonzero(accept)[0]
        if acc.size:
            mb = np.nanmean(before[acc], axis=1)
            ma = np.nanmean(after[acc], axis=1)
            for i, a in enumerate(acc):
                r = int(rows[a])
                out.append(
                    ChangePoint(
                        series=r,
                        index=int(cpi[a]),
                        detected_at=int(n[r] - 1),
                        direction="slower" if rel[a] > 0 else "faster",
                        mean_before=float(mb[i]),
                        mean_after=float(ma[i]),
                        level_before=float(lb[a]),
                        level_after=float(la[a]),
                    )
                )
            arows = rows[acc]
            self.regime_start[arows] = cpi[acc]
            # restart from the samples of the new level (all since the change)
            span = self._window(arows, cpi[acc], n[arows])
            self._reset_rows(arows, np.log(span))
        return out

    def run(self, series: np.ndarray) -> list[ChangePoint]:
        """Feed a (n_series, T) matrix column by column; all verified changes."""
        return feed_columns(self.update, self.n, series)


def feed_columns(
    update: Callable[[np.ndarray], list[ChangePoint]], n: int, series: ArrayLike
) -> list[ChangePoint]:
    """Feed an (n, T) matrix (a 1-D series when n is 1) to a detector's update,
    one column (one iteration of every series) at a time; all changes found."""
    a = np.asarray(series, dtype=np.float64)
    if a.ndim == 1 and n == 1:
        a = a.reshape(1, -1)
    if a.ndim != 2 or a.shape[0] != n:
        raise ValueError(f"expected shape ({n}, T), got {a.shape}")
    out: list[ChangePoint] = []
    for t in range(a.shape[1]):
        out.extend(update(a[:, t]))
    return out


def row_medians(a: np.ndarray) -> np.ndarray:
    """Row medians of a NaN-padded 2-D array (np.nanmedian is slow on short rows)."""
    srt = np.sort(a, axis=1)  # NaN sorts last
    m = np.sum(np.isfinite(a), axis=1)
    r = np.arange(a.shape[0])
    lo = srt[r, np.maximum((m - 1) // 2, 0)]
    hi = srt[r, np.maximum(m // 2, 0)]
    return np.where(m > 0, 0.5 * (lo + hi), np.nan)


def detect_changepoints(
    step_times: ArrayLike, policy: BocdPolicy | None = None, *, verify: bool = True, rule: Rule | None = None
) -> list[ChangePoint]:
    """Change points of one step-time series (seconds per iteration).

    verify=True (the default) runs the step detector (slurmguard.detect.steps,
    the one the agent and the controller run) with `policy` and the default
    warm-up/learning lengths; verify=False is the plain-BOCD baseline (every
    MAP run-length drop, or `rule`'s fire, is a change).
    """
    if verify:
        from slurmguard.detect.steps import DetectorConfig, detect_steps

        base = DetectorConfig.from_policy()
        cfg = base if policy is None else DetectorConfig.from_parts(policy, base.warmup, base.learn)
        return detect_steps(step_times, cfg).change_points
    x = np.asarray(step_times, dtype=np.float64).reshape(1, -1)
    det = BatchBocd(1, policy, verify=False, rule=rule)
    return det.run(x)
