"""The figures of a step's row from known times, bytes and peaks (exact numbers, not the code's formula)."""

import dataclasses

import pytest

from hal.apps.weightsync.figures import publish_seconds, raw_figures, step_row, summary
from hal.apps.weightsync.messages import Checked, Concluded, Received, Sent, Trained


def received(rank: int, started: float, applied: float, error: str | None = None, within: bool = True) -> Received:
    memory = {"mode": "atomic", "judged_by": {"within": within, "bound_bytes": 900}}
    return Received(rank=rank, served_step=3, error=error, receive_s=applied - started, copied_bytes=40,
                    started_at=started, applied_at=applied, held_bytes=80, peak_host_bytes=700, memory=memory,
                    memory_bound_bytes=900)


def test_publish_seconds_run_from_when_everyone_was_in_the_update_to_the_last_apply():
    sent = Sent(t0=100.0, send_s=1.5)
    assert publish_seconds(sent, [received(1, 100.25, 101.5), received(2, 99.5, 102.0)]) == 1.75
    assert publish_seconds(Sent(t0=101.0, send_s=1.0), [received(1, 100.5, 101.5)]) == 0.5


def test_raw_figures_are_the_mean_of_two_broadcasts_against_the_publish():
    figures = raw_figures(2_000_000_000, 2.0, [0.5, 1.5])
    assert figures == {"raw_s": 1.0, "raw_s_each": [0.5, 1.5], "raw_gbps": 2.0, "ratio_vs_raw": 0.5}
    assert raw_figures(1000, 2.0, None) == {"raw_s": None, "raw_gbps": None, "ratio_vs_raw": None}


def test_a_step_row_from_known_parts():
    trained = Trained(global_steps=3, loss=2.5, train_s=1.0, offload_s=0.25, tensor_home={"model": "cpu"}, stage_s=0.5)
    concluded = Concluded(onload_s=0.125, peak_device_bytes=0, peak_host_bytes=1000,
                          memory={"bound_bytes": 1200, "within": True})
    row = step_row(trained, Sent(t0=10.0, send_s=0.75), [received(1, 10.0, 10.5), received(2, 10.25, 11.25, "boom")],
                   [Checked(tokens=[1, 2]), Checked(error="decode differs")], [concluded], 4_000_000_000, 26, [1, 2])
    assert (row["global_steps"], row["loss"], row["send_s"], row["publish_s"], row["gbps"]) == (3, 2.5, 0.75, 1.0, 4.0)
    assert (row["bytes"], row["tensors"], row["tokens"], row["memory_bound_bytes"]) == (4_000_000_000, 26, [1, 2], 1200)
    assert row["ratio_vs_raw"] is None and row["onload_s"] == 0.125
    first, second = row["rollouts"]
    assert first["error"] is None and first["tokens"] == [1, 2] and "started_at" not in first
    assert second["error"] == "boom"  # the transfer's error stays the one reported
    assert "node_ip" not in first and first["peak_host_bytes"] == 700
    assert "trainer_ranks" not in row


def test_a_sharded_trainers_row_reports_every_rank_and_the_tightest_at_the_top():
    trained = Trained(global_steps=1, loss=2.5, train_s=1.0, offload_s=0.0, tensor_home={}, stage_s=0.5)
    ranks = [Concluded(onload_s=0.0, peak_device_bytes=0, peak_host_bytes=peak,
                       memory={"peak_bytes": peak, "bound_bytes": bound, "within": peak <= bound})
             for peak, bound in ((900, 1000), (1100, 1000), (500, 1000))]
    row = step_row(trained, Sent(t0=10.0, send_s=0.75), [received(3, 10.0, 10.5)], [Checked()], ranks, 100, 2, None)
    assert [t["rank"] for t in row["trainer_ranks"]] == [0, 1, 2]
    assert [t["peak_host_bytes"] for t in row["trainer_ranks"]] == [900, 1100, 500]
    assert row["peak_host_bytes"] == 1100 and row["memory"]["within"] is False  # rank 1, over its bound
    assert summary([row])["memory_within"] is False
    row["memory"]["within"] = True  # the rank list is judged too, not only the row's top
    assert summary([row])["memory_within"] is False


def test_summary_takes_the_smallest_ratio_and_every_bound():
    rows = [{"ratio_vs_raw": 0.8, "memory": {"within": True},
             "rollouts": [{"rank": 1, "memory": {"judged_by": {"within": True}}}]},
            {"ratio_vs_raw": 0.6, "memory": {"within": True},
             "rollouts": [{"rank": 1, "memory": {"judged_by": {"within": False}}}]}]
    assert summary(rows) == {"ratio_vs_raw_min": 0.6, "memory_within": False}
    assert summary([{"rollouts": [{"memory": None}]}]) == {"ratio_vs_raw_min": None, "memory_within": None}
    assert summary(rows[:1]) == {"ratio_vs_raw_min": 0.8, "memory_within": True}


def test_a_rollout_row_drops_unset_fields():
    from hal.apps.weightsync.messages import rollout_row

    bare = Received(rank=1, served_step=None, error="TransferError: x", receive_s=0.5, copied_bytes=0,
                    started_at=1.0, applied_at=1.5, held_bytes=8)
    assert rollout_row(bare, Checked()) == {"rank": 1, "served_step": None, "error": "TransferError: x",
                                            "receive_s": 0.5, "copied_bytes": 0, "tokens": None,
                                            "tokens_equal": None, "logits_max_diff": None, "verify_s": 0.0}
    assert pytest.approx(0.5) == bare.receive_s


def test_a_peak_over_its_bound_fails_the_step_and_the_run():
    """A rank over its stated bound is a failed step (ok False, named in errors, not verified), as a wrong
    checksum is; the job's `verified` and the CLI's exit status follow."""
    from hal.apps.weightsync.figures import memory_failures, row_ok
    from hal.apps.weightsync.loop import JobResult

    trained = Trained(global_steps=1, loss=2.5, train_s=1.0, offload_s=0.0, tensor_home={}, stage_s=0.5)
    over = Concluded(onload_s=0.0, peak_device_bytes=0, peak_host_bytes=19_110_000_000,
                     memory={"peak_bytes": 19_110_000_000, "bound_bytes": 18_490_000_000, "within": False,
                             "form": "model + optimizer + constant"})
    row = step_row(trained, Sent(t0=10.0, send_s=0.75), [received(1, 10.0, 10.5)], [Checked()], [over], 100, 2, None)
    assert memory_failures(row) == ["trainer: peak 19.11 GB over its bound 18.49 GB (model + optimizer + constant)"]
    assert row_ok(row) is False
    report = JobResult(warmup={}, rows=[row]).report(1)
    assert report["verified"] is False and report["rows"][0]["ok"] is False
    assert report["errors"] == ["step 1, trainer: peak 19.11 GB over its bound 18.49 GB (model + optimizer + "
                                "constant)"]
    over_rollout = received(2, 10.0, 10.5, within=False)
    over_rollout.memory["judged_by"].update(peak_bytes=1000, form="2 x model + 2 buckets + constant")
    row = step_row(trained, Sent(t0=10.0, send_s=0.75), [over_rollout], [Checked()],
                   [dataclasses.replace(over, memory={**over.memory, "within": True})], 100, 2, None)
    assert memory_failures(row) == ["rollout rank 2: peak 0.00 GB over its bound 0.00 GB (2 x model + 2 buckets + "
                                    "constant)"]
    within = step_row(trained, Sent(t0=10.0, send_s=0.75), [received(1, 10.0, 10.5)], [Checked()],
                      [dataclasses.replace(over, memory={**over.memory, "within": True})], 100, 2, None)
    assert row_ok(within) and JobResult(warmup={}, rows=[within]).report(1)["verified"] is True


def test_hal_sync_exits_1_and_says_so_when_a_peak_is_over_its_bound(monkeypatch, capsys):
    from hal.apps.cli import sync

    row = {"global_steps": 1, "loss": 2.5, "bytes": 100, "publish_s": 1.0, "gbps": 1e-7, "ratio_vs_raw": None,
           "offload_s": 0.0, "onload_s": 0.0, "peak_host_bytes": 1900, "memory_bound_bytes": 1800,
           "memory": {"peak_bytes": 1900, "bound_bytes": 1800, "within": False, "form": "model + constant"},
           "rollouts": [{"rank": 1, "error": None, "served_step": 1}], "tensors": 2}
    result = {"rows": [row], "model": "m", "device": "cpu", "engine": "collective", "offload": "none",
              "rollout_apply": "atomic", "wall_s": 1.0, "verified": False,
              "errors": ["step 1, trainer: peak 0.00 GB over its bound 0.00 GB (model + constant)"]}
    monkeypatch.setattr(sync, "execute", lambda args: result)
    assert sync.run(sync.Sync(model="qwen2.5-tiny")) == 1
    out, err = capsys.readouterr()
    assert "NO" in out and "yes" not in out.split("┃ ok")[-1] and "verification failed" in out
    assert "failed: step 1, trainer: peak" in out and "1 failure(s)" in err
