"""A run resumed with another number of processes (DDP on CPU, gloo): what carries over.

``RecordingPPO`` runs of 12 prompts, ``data.batch_size`` 2 per process, the adaptive law: 2
batches with one number of processes, then ``--ckpt_path`` of the last checkpoint with the other
for 2 more. The resumed run takes the epoch's order on from the prompt where the first stopped
(global batches of ``batch_size x processes``, none repeated or skipped), its counters and the
controller's sample count go on in global samples, beta goes on from the saved value and each
update of the adaptive law weighs the new global batch, and the fresh random streams are said
once.
"""

from __future__ import annotations

import pytest
import yaml
from helpers.ddp_runs import PER_RANK, PROMPTS, SEED, TARGET, config, records, train_py
from helpers.tiny_models import make_tiny_lm

from rlkl_lightning.data.samplers import EpochShuffleSampler

pytestmark = pytest.mark.dist  # several processes: make test-dist

HORIZON = 40.0  # samples: a batch of 4 moves beta by up to 2%, one of 2 by up to 1%
ORDER = [PROMPTS[i] for i in EpochShuffleSampler(len(PROMPTS), SEED)]
WARNING = "RNG states of {} processes but this run has {}"


def processes(n: int) -> list[str]:
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2"]
    return ddp if n == 2 else ["--trainer.devices", "1"]


def adaptive_beta(beta: float, kl: float, samples: int) -> float:
    error = min(max(kl / TARGET - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * samples / HORIZON)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_a_run_resumed_with_another_number_of_processes_continues_in_global_samples(
    tmp_path, tiny_lm_dir, before, after
):
    lms = (tiny_lm_dir, make_tiny_lm(tmp_path / "reference", seed=1))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    path = config(tmp_path, lms, prompts, "run", "", PER_RANK)
    cfg = yaml.safe_load(path.read_text())
    del cfg["trainer"]["limit_train_batches"]
    cfg["trainer"]["callbacks"] = [
        {
            "class_path": "rlkl_lightning.checkpoints.AfterLoggingCheckpoint",
            "init_args": {
                "dirpath": str(tmp_path / "ckpt"),
                "every_n_train_steps": 1,  # one optimizer step a batch
                "save_last": True,
            },
        }
    ]
    cfg["kl"]["controller"] = {
        "class_path": "AdaptiveKLController",
        "init_args": {"horizon": HORIZON},
    }
    path.write_text(yaml.safe_dump(cfg))

    first_err = train_py(path, tmp_path, "--trainer.max_steps", "2", *processes(before))
    (first, *_), _ = records(tmp_path / "run", before)
    err = train_py(
        path,
        tmp_path,
        "--trainer.max_steps",
        "4",
        "--ckpt_path",
        str(tmp_path / "ckpt" / "last.ckpt"),
        # RecordingPPO's own arguments are not PPOModule's groups, which its checkpoint holds:
        # the resume check would list them as changed (nothing else changes).
        "--resume_with_changes",
        "true",
        *processes(after),
    )
    resumed, _ = records(tmp_path / "run", after)

    # The data: the epoch's order on from prompt 4 x before, in global batches of 2 x after.
    trained = 2 * PER_RANK * before
    size = PER_RANK * after
    expected = [ORDER[i : i + size] for i in (trained, trained + size)]
    for rank, record in enumerate(resumed):
        assert [b["prompts"] for b in record["batches"]] == [e[rank::after] for e in expected]
    assert [b["prompts"] for b in first["batches"]] == [
        ORDER[i : i + PER_RANK * before][0::before] for i in (0, PER_RANK * before)
    ]

    # The counters and the controller's sample count go on in global samples.
    total = trained + 2 * size
    last = resumed[0]
    assert (first["batches_seen"], first["samples_seen"]) == (2, trained)
    assert (last["batches_seen"], last["samples_seen"]) == (4, total)
    assert first["controller"]["n_samples"] == trained
    assert (last["controller"]["n_batches"], last["controller"]["n_samples"]) == (4, total)
    assert all(r["controller"] == last["controller"] for r in resumed)

    # Beta goes on from the saved value; each update weighs its own run's global batch.
    assert last["batches"][0]["beta_used"] == first["kl_coef"]
    for record, samples in ((first, trained // 2), (last, size)):
        beta = record["batches"][0]["beta_used"]
        for batch in record["batches"]:
            assert batch["beta_used"] == beta
            metrics = batch["metrics"]
            beta = adaptive_beta(beta, metrics["objective/kl"], samples)
            assert metrics["objective/kl_coef"] == pytest.approx(beta, rel=1e-6)
    assert last["kl_coef"] == pytest.approx(beta, rel=1e-6)

    # Fresh random streams, said once; nothing said in the first run.
    assert err.count(WARNING.format(before, after)) == 1, err[-3000:]
    assert "RNG states of" not in first_err
