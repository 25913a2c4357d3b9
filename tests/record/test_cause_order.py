"""record.by_cause: an anomaly that names its cause in an earlier step lends it its severity for
the order, so the cause is the headline; found again in a saved record, repeats folded in."""

from diffusion_debug.record import Anomaly, by_cause, cause_reference, headline, load_run


def _anomaly(kind, severity, step, component="model", module="", **details):
    return Anomaly(kind, severity, f"{kind} message", component, module, step=step, details=details)


def test_a_warning_that_caused_a_later_error_comes_first_along_a_chain():
    jump = _anomaly("lr_spike", "warning", 5, component="optimizer")
    gradients = _anomaly("nonfinite", "error", 6, module="up", cause=cause_reference(jump))
    loss = _anomaly("nonfinite_loss", "error", 7, cause=cause_reference(gradients))
    other = _anomaly("loss_spike", "warning", 2)
    assert [a.kind for a in by_cause([loss, other, gradients, jump])] == [
        "lr_spike",
        "nonfinite",
        "nonfinite_loss",
        "loss_spike",
    ]
    assert headline([loss, other, gradients, jump]) == {
        "kind": "lr_spike",
        "severity": "warning",
        "where": "optimizer, step 5",
        "message": "lr_spike message",
        "consequences": {"count": 2, "kinds": {"nonfinite": 1, "nonfinite_loss": 1}},  # the chain, folded
    }
    assert headline([]) is None
    # a run of several ranks names the rank of its headline, rank 0 too
    assert headline([jump], world_size=2)["where"] == "optimizer, step 5, rank 0"


def test_a_cause_folded_into_an_earlier_repeat_is_still_found():
    first = _anomaly("lr_spike", "warning", 3, component="optimizer", count=3, last_step=5)
    repeat_at_5 = _anomaly("lr_spike", "warning", 5, component="optimizer")
    loss = _anomaly("nonfinite_loss", "error", 6, cause=cause_reference(repeat_at_5))
    assert [a.kind for a in by_cause([loss, first])] == ["lr_spike", "nonfinite_loss"]


def test_a_cause_not_in_the_list_changes_nothing():
    gone = _anomaly("lr_spike", "warning", 5, component="optimizer")
    loss = _anomaly("nonfinite_loss", "error", 6, cause=cause_reference(gone))
    spike = _anomaly("loss_spike", "warning", 1)
    assert by_cause([spike, loss]) == [loss, spike]


def test_the_order_holds_in_a_saved_record(tmp_path):
    from diffusion_debug import DebugConfig
    from diffusion_debug.record import RunRecord, make_anomaly

    record = RunRecord(DebugConfig(output_dir=str(tmp_path)), kind="training")
    jump = make_anomaly(
        "lr_spike",
        component="optimizer",
        step=5,
        details={"reason": "lr_jump", "lr_before": 1e-4, "lr": 100.0, "factor": 1e6},
    )
    details = {"loss": float("nan"), "cause": cause_reference(jump)}
    record.add_anomaly(make_anomaly("nonfinite_loss", component="model", step=6, details=details))
    record.add_anomaly(jump)
    record.close()
    run = load_run(record.run_dir)  # a killed run: rebuilt from events.jsonl
    assert [a.kind for a in by_cause(run.anomalies)] == ["lr_spike", "nonfinite_loss"]


def test_a_reports_by_cause_and_headline_lead_with_the_cause(tmp_path):
    from diffusion_debug import DebugConfig
    from diffusion_debug.core import DebugReport
    from diffusion_debug.record import RunRecord

    jump = _anomaly("lr_spike", "warning", 5, component="optimizer")
    loss = _anomaly("nonfinite_loss", "error", 6, cause=cause_reference(jump))
    other = _anomaly("loss_spike", "warning", 2)
    record = RunRecord(DebugConfig(output_dir=str(tmp_path)), kind="training")
    report = DebugReport(record.run_dir, {}, [other, jump, loss], [], record=record)
    assert [a.kind for a in report.by_cause()] == ["lr_spike", "nonfinite_loss", "loss_spike"]
    assert report.headline is jump and [a.kind for a in report.anomalies] == [
        "loss_spike",
        "lr_spike",
        "nonfinite_loss",
    ]
    assert DebugReport(record.run_dir, {}, [], [], record=record).headline is None
    record.close()


def test_a_rank_that_received_a_nan_through_the_reduction_comes_after_the_rank_that_made_it(tmp_path):
    # rank 0's copy follows rank 1's (ranks.origin): by_cause, the report's headline and the summary's agree on rank 1
    from diffusion_debug import DebugConfig
    from diffusion_debug.core import DebugReport
    from diffusion_debug.record import RunRecord

    received = Anomaly("nonfinite", "error", "got", "model", step=12, rank=0)
    received.details["follows"] = {"kind": "nonfinite", "rank": 1}
    made = Anomaly("nonfinite", "error", "made", "model", step=12, rank=1)
    later = Anomaly("nonfinite_loss", "error", "loss", "model", step=12, rank=0)  # no link: its own place
    spike = _anomaly("loss_spike", "warning", 3)
    anomalies = [spike, received, later, made]
    assert [(a.kind, a.rank) for a in by_cause(anomalies)] == [
        ("nonfinite_loss", 0),
        ("nonfinite", 1),
        ("nonfinite", 0),
        ("loss_spike", 0),
    ]
    record = RunRecord(DebugConfig(output_dir=str(tmp_path)), kind="training")
    report = DebugReport(record.run_dir, {}, [received, made], [], record=record)
    assert report.headline is made
    assert headline([received, made], world_size=2)["where"] == "model, step 12, rank 1"
    record.close()


def test_a_cause_of_a_kind_told_apart_by_its_details_is_found_by_them():
    """Two ``not_learning`` of one rank at one place and step, each of its own optimizer (``stalled_optimizer``,
    the kind's ``distinct_by``): a reference to one names that one, not the other."""
    from diffusion_debug.record import is_cause

    generator, critic = (
        _anomaly("not_learning", "warning", 7, component="optimizer", stalled_optimizer=f"SGD holding {name}.0.weight")
        for name in ("generator", "critic")
    )
    assert [is_cause(a, cause_reference(critic)) for a in (generator, critic)] == [False, True]
    assert cause_reference(critic)["distinct"] == {"stalled_optimizer": "SGD holding critic.0.weight"}
    assert "distinct" not in cause_reference(_anomaly("lr_spike", "warning", 5, component="optimizer"))
