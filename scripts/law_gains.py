"""Derive the exponential and PI laws' gains from how the KL answers beta on a calibration seed.

Two fixed-beta runs of ``configs/ppo_fixed.yaml`` (beta 0.1 and 0.03, 150 batches) on seed 10,
which the studies (seeds 0, 1, 2) never use, are the plant measurements. Each run's batch KL is
fitted with a first-order lag after a dead time, ``K (1 - exp(-(t - theta) / tau))`` for
``t > theta`` (batches); the two levels ``K`` give the slope ``g`` of the KL against log beta.
The SIMC rules (Skogestad 2003, "Simple analytic rules for model reduction and PID controller
tuning", J. Process Control 13) then give, for a closed-loop time constant ``tau_c``:

- integral-only control (the exponential law, ``log beta += k (KL - target)`` per batch) of the
  lag taken as a pure delay ``theta + tau``: ``k = 1 / (g (tau_c + theta + tau))``;
- PI control (the PI law on ``e = (KL - target) / target``): ``K_c = tau / (g (tau_c + theta))``
  per nat, integral time ``tau_I = min(tau, 4 (tau_c + theta))``, so ``kp = target K_c`` and
  ``ki = kp / tau_I`` per batch.

Both laws get ``tau_c = theta + tau``. docs/controllers.md ("Gains of the control laws") says why.
Last, every law of ``rlkl_lightning.kl.controllers`` with the configs' settings steers the fitted
model (with the measured batch-to-batch noise, 20 seeds): the settle batch and overshoot it
predicts for the law study.

    python scripts/law_gains.py                 # runs the two calibration runs (or reuses them)
    python scripts/law_gains.py --out DIR       # where their event files go (default below)
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SEED = 10  # not one of the studies' seeds 0, 1, 2
BETAS = (0.1, 0.03)  # the fixed configs' beta, and the frontier's low beta
TARGET = 6.0  # nats per sequence, the configs' kl.target


def fit_lag(kl: np.ndarray) -> tuple[float, float, float]:
    """Least-squares ``(K, tau, theta)`` of ``K (1 - exp(-(t - theta) / tau))``, ``t = 1..n``.

    ``tau`` runs over 2-60 batches and ``theta`` over 0-15 in steps of half a batch; ``K`` is
    solved for exactly at each pair.
    """
    kl = np.asarray(kl, dtype=float)
    t = np.arange(1, len(kl) + 1)[None, None, :]
    tau = np.arange(2.0, 60.01, 0.5)[:, None, None]
    theta = np.arange(0.0, 15.01, 0.5)[None, :, None]
    shape = np.clip(1.0 - np.exp(-(t - theta) / tau), 0.0, None)  # [taus, thetas, n]
    level = (shape @ kl) / (shape**2).sum(-1)
    residual = ((kl - level[..., None] * shape) ** 2).sum(-1)
    i, j = np.unravel_index(np.argmin(residual), residual.shape)
    return float(level[i, j]), float(tau[i, 0, 0]), float(theta[0, j, 0])


def gains(g: float, tau: float, theta: float, target: float = TARGET) -> dict[str, float]:
    """SIMC gains of the exponential (``k``) and PI (``kp``, ``ki``) laws for this plant.

    Args:
        g: Nats per sequence the equilibrium KL falls per unit of log beta.
        tau: The KL's lag, in batches.
        theta: Its dead time, in batches.
        target: The KL target, nats per sequence.
    """
    tau_c = theta + tau
    k = 1.0 / (g * (tau_c + theta + tau))
    k_c = tau / (g * (tau_c + theta))  # log beta per nat
    kp = target * k_c
    return {"tau_c": tau_c, "k": k, "kp": kp, "ki": kp / min(tau, 4 * (tau_c + theta))}


def simulate(
    controller,
    level: float,
    g: float,
    tau: float,
    theta: int,
    seed: int,
    batches: int = 150,
    noise: float = 0.15,
) -> np.ndarray:
    """The batch KL of ``controller`` steering the fitted model, one value per batch.

    The model: the KL moves ``1 / tau`` of the way per batch towards
    ``level - g ln(beta / 0.1)`` for the beta of ``theta`` batches before, and each batch
    measures it with a scatter of ``noise`` times its value (at least ``noise / 2`` nats).
    Updates count 32 samples, the configs' batch.
    """
    rng = np.random.default_rng(seed)
    betas, x, kl = [controller.value], 0.0, []
    for _ in range(batches):
        beta = betas[max(0, len(betas) - 1 - theta)]
        x += (max(0.0, level - g * math.log(beta / BETAS[0])) - x) / tau
        kl.append(max(0.0, x + noise * max(x, 0.5) * rng.standard_normal()))
        betas.append(controller.update(kl[-1], 32))
    return np.array(kl)


def calibrate(out: Path, batches: int = 150) -> dict[float, Path]:
    """Run the two fixed-beta runs (two processes, one thread each) unless their events exist."""
    dirs = {beta: out / f"fixed_{beta:g}" / f"seed{SEED}" for beta in BETAS}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = []
    for beta, log_dir in dirs.items():
        if any(log_dir.glob("events.out.tfevents.*")):
            continue
        args = [sys.executable, str(ROOT / "train.py"), "fit"]
        args += ["--config", str(ROOT / "configs" / "ppo_fixed.yaml")]
        args += [f"--seed_everything={SEED}", f"--data.init_args.seed={SEED}"]
        args += [
            f"--model.init_args.penalty.init_coef={beta}",
            f"--trainer.max_steps={batches * 16}",
        ]
        args += ["--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
        args += [f"--trainer.logger.init_args.save_dir={out}"]
        args += [f"--trainer.logger.init_args.name=fixed_{beta:g}"]
        args += [f"--trainer.logger.init_args.version=seed{SEED}"]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL))
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a calibration run failed: {proc.args}")
    return dirs


def main() -> None:
    """Fit the plant on the calibration runs and print it with the gains."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/rlkl_law_calibration"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from rlkl_lightning.compare.events import overshoot, read_curves, settle_batch
    from rlkl_lightning.config_files import compose
    from rlkl_lightning.kl.settings import KLSettings

    fits = {}
    for beta, log_dir in calibrate(args.out).items():
        kl = read_curves(log_dir).kl
        fits[beta] = fit_lag(kl)
        level, tau, theta = fits[beta]
        print(
            f"beta {beta:g}: KL level {level:.2f} nats, lag {tau:g} batches after {theta:g}; "
            f"batch-to-batch scatter over the last 50 batches {kl[-50:].std():.2f} nats"
        )
    (hi, tau_hi, theta_hi), (lo, tau_lo, theta_lo) = (fits[b] for b in BETAS)
    g = (lo - hi) / math.log(BETAS[0] / BETAS[1])
    # The laws act once per batch: the dead time is a whole number of batches.
    tau, theta = (tau_hi + tau_lo) / 2, round((theta_hi + theta_lo) / 2)
    beta_at_target = BETAS[0] * math.exp(-(TARGET - hi) / g)
    print(f"g = {g:.2f} nats per unit of log beta; tau = {tau:g}, theta = {theta:g} batches")
    print(f"beta that holds the target of {TARGET:g} nats on this model: {beta_at_target:.3f}")
    found = gains(g, tau, theta)
    print(
        f"tau_c = {found['tau_c']:g} batches: exponential k = {found['k']:.2g} per nat; "
        f"PI kp = {found['kp']:.2g}, ki = {found['ki']:.2g}"
    )
    print("predicted on this model (20 seeds), with the configs' gains:")
    for law in ("fixed", "adaptive", "exponential", "pi"):
        config = compose(ROOT / "configs" / f"ppo_{law}.yaml")["kl"]
        settings = KLSettings(**config)
        runs = [
            simulate(settings.kl_controller(BETAS[0]), hi, g, tau, theta, seed)
            for seed in range(20)
        ]
        settle = [settle_batch(kl, TARGET) for kl in runs]
        settled = [b for b in settle if b is not None]
        when = f"median {np.median(settled):g}" if settled else "never"
        print(
            f"  {law:12s} settle batch {when} ({len(settled)} of 20 settled); overshoot "
            f"{np.mean([overshoot(kl, TARGET) for kl in runs]):.2f} nats"
        )


if __name__ == "__main__":
    main()
